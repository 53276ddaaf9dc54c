"""The PyTorch (CPU) path of paged_attention at prefill sizes: time against SDPA on the same
K/V stored contiguously, and the extra memory of one call at a Qwen3-8B layer's shape.

    python -m bench.attention_cpu [--quick] [--out-dir DIR]   # bench/results/cpu/

Two cases, each a CPU measurement:

- ``tiny_prefill``: the demo model's attention shape (4 query heads, 2 KV heads, head size
  32), one sequence of ``PREFILL_TOKENS`` rows on an empty cache (pages of 16), fp32:
  median time of ``wk.paged_attention`` over ``REPEATS`` calls against
  ``F.scaled_dot_product_attention(is_causal=True)`` on the same keys and values in one
  contiguous tensor, in the same run (and one call of the static-shape path, which CPU
  tensors took before 0.2.0). Goal: within 2x of SDPA.
- ``qwen3_8b_prefill``: one layer of Qwen3-8B's attention shape (32 query heads, 8 KV
  heads, head size 128), 1024 rows on an empty cache, fp32, in a child process: its peak
  resident memory during the call minus its resident memory before it. Goal: under 2 GB
  of extra memory.

The summary holds ``tiny_prefill_over_sdpa`` and ``qwen3_8b_prefill_extra_gb``.
"""

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import (
    CPU_LABEL,
    RESULTS_ROOT,
    command_line,
    device_info,
    fmt,
    time_cpu,
    utc_now,
    versions,
    write_json,
)

PREFILL_TOKENS = 2048
QWEN3_8B_TOKENS = 1024
PAGE_SIZE = 16
REPEATS = 5


def prefill_inputs(tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                   seed: int = 0) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """``paged_attention`` arguments of one sequence of ``tokens`` rows on an empty cache
    (its own rows' K/V already appended, pages in a shuffled order), and the same keys and
    values as contiguous ``[tokens, Hkv, D]`` tensors."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // PAGE_SIZE)
    q = torch.randn(tokens, q_heads, head_dim, generator=g)
    keys = torch.randn(tokens, kv_heads, head_dim, generator=g)
    values = torch.randn(tokens, kv_heads, head_dim, generator=g)
    order = torch.randperm(pages, generator=g)
    k_cache = torch.zeros(pages, PAGE_SIZE, kv_heads, head_dim)
    v_cache = torch.zeros(pages, PAGE_SIZE, kv_heads, head_dim)
    padded = pages * PAGE_SIZE
    k_cache[order] = F.pad(keys, (0, 0, 0, 0, 0, padded - tokens)).view(pages, PAGE_SIZE,
                                                                          kv_heads, head_dim)
    v_cache[order] = F.pad(values, (0, 0, 0, 0, 0, padded - tokens)).view(pages, PAGE_SIZE,
                                                                            kv_heads, head_dim)
    args = (q, k_cache, v_cache, order.to(torch.int32)[None],
            torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            head_dim ** -0.5)
    return args, keys, values


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of ``q [N, Hq, D]`` over contiguous ``[N, Hkv, D]`` keys and values."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True,
        scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(0, 1)


def median_ms(fn, repeats: int) -> float:
    """Median of ``repeats`` timed calls after one warm-up (:func:`bench.common.time_cpu`)."""
    return time_cpu(fn, rep_ms=0.0, min_samples=repeats, max_samples=repeats).median_us / 1e3


def tiny_prefill(tokens: int, repeats: int) -> dict:
    import wedlm_kernels as wk
    from wedlm_kernels.ops.attention import paged_attention_torch_gathered

    args, keys, values = prefill_inputs(tokens, 4, 2, 32)
    paged = wk.paged_attention(*args)
    dense = sdpa(args[0], keys, values)
    error = float((paged - dense).abs().max())
    paged_ms = median_ms(lambda: wk.paged_attention(*args), repeats)
    sdpa_ms = median_ms(lambda: sdpa(args[0], keys, values), repeats)
    # the static-shape path (a gather of every addressable position per row), which CPU
    # tensors took before: one timed call after the warm-up
    gathered_ms = median_ms(lambda: paged_attention_torch_gathered(*args), 1)
    return {"tokens": tokens, "heads": [4, 2, 32], "paged_attention_ms": paged_ms,
            "sdpa_ms": sdpa_ms, "over_sdpa": paged_ms / sdpa_ms,
            "static_shape_path_ms": gathered_ms, "max_abs_difference": error,
            "repeats": repeats}


def qwen3_8b_prefill(tokens: int) -> dict:
    """Peak extra resident memory of one call, in a child process: its resident set sampled
    every 0.2 ms during the call, minus the resident set just before it (with
    ``MALLOC_MMAP_THRESHOLD_`` low, large blocks are mapped and unmapped, so what the
    inputs' construction freed is not counted)."""
    child = r"""
import json, os, sys, threading, time
import torch
from bench.attention_cpu import prefill_inputs
import wedlm_kernels as wk
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
args, _, _ = prefill_inputs(int(sys.argv[1]), 32, 8, 128)
before, peak, done = resident(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], resident())
        time.sleep(0.0002)
sampler = threading.Thread(target=sample)
sampler.start()
start = time.perf_counter()
out = wk.paged_attention(*args)
took = time.perf_counter() - start
done.set()
sampler.join()
peak[0] = max(peak[0], resident())
print(json.dumps({"extra_gb": (peak[0] - before) / 1e9, "ms": took * 1e3,
                  "finite": bool(out.isfinite().all())}))
"""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", child, str(tokens)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tokens": tokens, "heads": [32, 8, 128], "memory": "peak resident set during "
            "the call minus the resident set before it (sampled every 0.2 ms)", **result}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="256 and 128 tokens, 2 repeats (a smoke run, not the goal's sizes)")
    args = parser.parse_args(argv)
    tiny_tokens, big_tokens = (256, 128) if args.quick else (PREFILL_TOKENS, QWEN3_8B_TOKENS)
    tiny = tiny_prefill(tiny_tokens, 2 if args.quick else REPEATS)
    big = qwen3_8b_prefill(big_tokens)
    report = {
        "benchmark": "attention_cpu", "date": utc_now(), "label": CPU_LABEL,
        "device": device_info(torch.device("cpu")), "versions": versions(),
        "command": command_line("bench.attention_cpu", argv), "threads": torch.get_num_threads(),
        "tiny_prefill": tiny, "qwen3_8b_prefill": big,
        "summary": {"tiny_prefill_over_sdpa": tiny["over_sdpa"],
                    "qwen3_8b_prefill_extra_gb": big["extra_gb"]},
    }
    out_dir = args.out_dir or RESULTS_ROOT / "cpu"
    write_json(out_dir / "attention_cpu.json", report)
    print(f"[CPU measurement] paged_attention prefill of {tiny_tokens} tokens (tiny heads): "
          f"{fmt(tiny['paged_attention_ms'], 2)} ms, SDPA {fmt(tiny['sdpa_ms'], 2)} ms "
          f"({fmt(tiny['over_sdpa'], 2)}x; static-shape path "
          f"{fmt(tiny['static_shape_path_ms'], 0)} ms); Qwen3-8B layer, {big_tokens} tokens: "
          f"{fmt(big['extra_gb'], 2)} GB extra, {fmt(big['ms'], 0)} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
