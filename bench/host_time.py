"""Host time of one eager call of every public op, at batch-1 decode shapes.

    python -m bench.host_overhead [--out-dir DIR]     # CUDA (exits 0 without a GPU)
    python -m bench.host_overhead --cpu-smoke [--out-dir DIR]

In eager mode the host issues a decode step op by op, so the time it spends in each call
(argument checks, dispatch, the launcher's Python, the kernel launches) is paid on every
op of every layer whenever the step is not captured in a CUDA graph. On CUDA each op is
called ``CALLS`` times back to back at Qwen3-8B decode shapes (one sequence, a window of 19
live rows in a capacity of 32 slots, 512 positions of context); the device runs these tiny calls faster than
the host issues them, so the wall time per call is the host time. Three entry points per
op: the public function (``wk.<op>``), the ``torch.library`` dispatcher
(``torch.ops.wedlm.<op>``) and the Triton launcher alone; plus an empty Triton kernel as
the floor of any launch. Median of ``REPEATS`` runs.

``--cpu-smoke`` measures, on CPU tensors, what the public function and the dispatcher add
on top of the implementation: the implementation is replaced by a no-op, so the figure is
argument checking and dispatch alone (labelled a CPU measurement).
"""

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import (
    CPU_LABEL,
    NO_GPU_MESSAGE,
    RESULTS_ROOT,
    command_line,
    device_info,
    device_slug,
    fmt,
    markdown_table,
    utc_now,
    versions,
    write_json,
)

CALLS = 200
REPEATS = 7


def decode_inputs(device: torch.device, small: bool) -> dict[str, tuple]:
    """Arguments of every public op at batch-1 decode shapes (``small``: tiny sizes, for the
    CPU smoke run)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = (4, 2, 16) if small else (32, 8, 128)
    window, page_size, context = 16, 16, (48 if small else 512)
    vocab, intermediate = (64, 32) if small else (151936, 12288)
    dtype = torch.float32 if small else torch.bfloat16
    slots = 2 * window
    pages = (context + slots) // page_size + 1
    i32 = dict(dtype=torch.int32, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    win_tokens = torch.randint(0, vocab - 1, (1, slots), generator=g).to(device)
    win_mask = (torch.arange(slots) >= 3)[None].to(device)
    win_len = torch.tensor([window + 3], **i32)
    ctx_len = torch.tensor([context], **i32)
    block_table = torch.arange(pages, **i32)[None]
    k_cache, v_cache = (randn(pages, page_size, kv_heads, head_dim) for _ in range(2))
    qkv = randn(slots, (heads + 2 * kv_heads) * head_dim)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    rows = window
    cu_rows = torch.tensor([0, rows], **i32)
    row_pos = torch.arange(context + 3, context + 3 + rows, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    import wedlm_kernels as wk

    return {
        "reorder_window": (win_tokens, win_mask, win_len, ctx_len, block_table, page_size,
                           window + 3),
        "rope_kv_append": (q, k, v, torch.arange(slots, device=device) + context,
                           wk.rope_cache(context + slots, head_dim, 1e6, device), k_cache,
                           v_cache, torch.arange(slots, device=device) + context,
                           randn(head_dim), randn(head_dim), 1e-6),
        "paged_attention": (randn(window + 3, heads, head_dim), k_cache, v_cache, block_table,
                            torch.tensor([0, window + 3], **i32), ctx_len, head_dim**-0.5),
        "select_tokens": (randn(rows, vocab), cu_rows, row_pos, torch.zeros(1, **f32),
                          torch.zeros(1, **i32), torch.ones(1, **f32),
                          torch.full((1,), 0.4, **f32), torch.full((1,), 0.02, **f32),
                          torch.zeros(1, dtype=torch.int64, device=device)),
        "commit_window": commit_inputs(device),
        "silu_mul": (randn(slots, 2 * intermediate),),
    }


def commit_inputs(device: torch.device) -> tuple:
    """``commit_window`` arguments of one finished sequence: a call leaves the state as it
    is, so every call does the same work (argument checks, dispatch, one launch)."""
    i32 = dict(dtype=torch.int32, device=device)
    state = dict(
        win_tokens=torch.zeros(1, 32, dtype=torch.int64, device=device),
        win_mask=torch.ones(1, 32, dtype=torch.bool, device=device),
        win_len=torch.zeros(1, **i32), ctx_len=torch.zeros(1, **i32),
        cu_rows=torch.tensor([0, 16], **i32),
        row_pos=torch.arange(16, device=device),
        token=torch.zeros(16, dtype=torch.int64, device=device),
        selected=torch.zeros(16, dtype=torch.bool, device=device),
        out_tokens=torch.zeros(1, 64, dtype=torch.int64, device=device),
        out_len=torch.zeros(1, **i32),
        finished=torch.ones(1, dtype=torch.bool, device=device),
        stop_ids=torch.full((1, 2), -1, dtype=torch.int64, device=device),
        max_new=torch.full((1,), 64, **i32),
    )
    return (*state.values(), 16, 5, False)


def _per_call_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median over REPEATS of (wall time of CALLS back-to-back calls) / CALLS."""
    samples = []
    for repeat in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        elapsed = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.synchronize()
        if repeat:  # the first run warms up
            samples.append(elapsed / CALLS * 1e6)
    return statistics.median(samples)


def measure(device: torch.device, stub_implementations: bool) -> dict:
    """Per op: microseconds per call through each entry point; with
    ``stub_implementations`` the implementation is a no-op (CPU smoke: wrapper cost only)."""
    import wedlm_kernels as wk
    from wedlm_kernels import _dispatch, _library

    inputs = decode_inputs(device, small=device.type != "cuda")
    ops: dict[str, dict] = {}
    saved = {name: dict(table) for name, table in _dispatch.IMPLEMENTATIONS.items()}
    try:
        for name, args in inputs.items():
            if stub_implementations:
                _dispatch.IMPLEMENTATIONS[name][device.type] = lambda *a: None
            public = getattr(wk, name)
            dispatcher = getattr(torch.ops.wedlm, name)
            entry = {
                "public_us": _per_call_us(functools.partial(public, *args), device),
                "dispatcher_us": None if stub_implementations
                else _per_call_us(functools.partial(dispatcher, *args), device),
                "launcher_us": None,
            }
            launcher = _library.triton_launcher(name)
            if device.type == "cuda" and launcher is not None:
                entry["launcher_us"] = _per_call_us(functools.partial(launcher, *args), device)
            ops[name] = entry
    finally:
        for name, table in saved.items():
            _dispatch.IMPLEMENTATIONS[name].update(table)
    result = {"ops": ops, "max_public_op_host_us": max(e["public_us"] for e in ops.values()),
              "empty_launch_us": _empty_launch_us(device)}
    return result


def _empty_launch_us(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr))

    x = torch.zeros(1, device=device)
    return _per_call_us(lambda: empty_kernel[(1,)](x), device)


def write_markdown(report: dict, path: Path) -> None:
    result = report["result"]
    rows = [[f"`{name}`", fmt(e["public_us"]), fmt(e["dispatcher_us"]), fmt(e["launcher_us"])]
            for name, e in result["ops"].items()]
    lines = [
        "# Host time per eager op call" + (" (CPU measurement)" if report.get("label") else ""),
        "",
        f"{report['device']['name']}, {report['date']}, `{report['command']}`",
        f"versions: {report['versions']}",
        "",
        *markdown_table(["op", "public (us)", "torch.ops (us)", "launcher (us)"], rows),
        "",
        f"empty Triton launch: {fmt(result['empty_launch_us'])} us; worst public op: "
        f"{fmt(result['max_public_op_host_us'])} us",
    ]
    if report.get("label"):
        lines += ["", report["label"] + ": the implementation replaced by a no-op, so the "
                  "public column is argument checks and dispatch alone."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    out_dir = args.out_dir or RESULTS_ROOT / ("cpu" if args.cpu_smoke else device_slug())
    report = {
        "benchmark": "host_overhead", "date": utc_now(), "device": device_info(device),
        "versions": versions(), "command": command_line("bench.host_overhead", argv),
        "calls_per_sample": CALLS, "samples": REPEATS,
        "result": measure(device, stub_implementations=args.cpu_smoke),
    }
    if args.cpu_smoke:
        report["label"] = CPU_LABEL
    report["summary"] = {"max_public_op_host_us": report["result"]["max_public_op_host_us"]}
    write_json(out_dir / "host_overhead.json", report)
    write_markdown(report, out_dir / "host_overhead.md")
    print((out_dir / "host_overhead.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
