"""Host time of one eager call of every public op, measured with pytest-benchmark.

    python -m bench.host_time [--quick] [--ops OP ...] [--out-dir DIR]
                                              # bench/results/<device>/host_time.*
    pytest bench/test_host_time.py --benchmark-only [--benchmark-json FILE]
    pytest bench/test_host_time.py --benchmark-disable     # each call once, as a test (CI)

In eager mode the host issues a decode step op by op, so the time it spends in each call
(argument checks, dispatch, the launcher's Python, the kernel launches) is paid on every op
of every layer whenever the step is not captured in a CUDA graph. ``bench/test_host_time.py``
has one benchmark per public op and entry point (the public function ``wk.<op>``, the
``torch.library`` dispatcher ``torch.ops.wedlm.<op>``, and on CUDA the Triton launcher
alone), on CPU tensors and, when a GPU is present, on CUDA tensors, at batch-1 decode shapes
(:func:`decode_inputs`: Qwen3-8B's on CUDA, one sequence, a window of 19 live rows in 32
slots, 512 positions of context; tiny ones on the CPU). ``select_tokens`` is also timed
with ``sampling="greedy"`` through the public function under each select kernel setting
(``WEDLM_KERNELS_SELECT_KERNEL``: ``three_launch``, ``one_launch``; the setting is read at
import, so the benchmark sets ``wedlm_kernels._backend.SELECT_KERNEL``, which the launcher
reads on every call). On CPU tensors the PyTorch implementation runs whatever the setting.

On CUDA every round synchronises the device first (pytest-benchmark's ``setup``, not
timed) and then times one call: the call returns once its kernels are queued, so the figure
is the host time of the call, not the device's. On the CPU the ops run the PyTorch
implementations, so a CPU figure is the whole call (labelled a CPU measurement).

``python -m bench.host_time`` runs the benchmarks (``--quick``: few rounds; ``--ops``: only
those of the ops named, e.g. ``--ops select_tokens``, written to
``host_time_select_tokens.*``) and writes pytest-benchmark's JSON with a top-level
``"summary"`` and a Markdown table beside it. The summary (medians, µs):

- ``max_public_op_host_us_<device>``: the slowest public op's (runs of every op only);
- ``select_host_us_eager``: the public ``select_tokens(..., sampling="greedy")`` call under
  the ``one_launch`` setting on CUDA tensors (None without a GPU);
- ``select_greedy_host_us_<device>_<setting>``: that call per device and setting
  (``..._cpu_...``: CPU measurements, the PyTorch implementation).
"""

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import (
    CPU_LABEL,
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

# timed rounds per benchmark (one call each); HOST_TIME_ROUNDS overrides (--quick: 5)
ROUNDS = 200
WARMUP_ROUNDS = 10
# the WEDLM_KERNELS_SELECT_KERNEL settings (wedlm_kernels/_backend.py)
SELECT_KERNELS = ("three_launch", "one_launch")


def public_ops() -> list[str]:
    """The custom ops wedlm_kernels exports (not its settings, the RoPE table helper or the
    plain-PyTorch helpers around the ops), in export order."""
    import wedlm_kernels as wk
    from wedlm_kernels.ops._library import OPS

    return [name for name in wk.__all__ if name in OPS]


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
        # the penalties (the widest per-token state), in the op's positional order
        "process_logits": (randn(rows, vocab), cu_rows, row_pos, torch.tensor([context], **i32),
                           torch.ones(1, **f32), None, None, None, None, None,
                           torch.randint(0, 3, (1, vocab), generator=g).to(**i32),
                           torch.rand(1, vocab, generator=g).lt(0.1).to(device),
                           torch.full((1,), 0.5, **f32), torch.full((1,), 0.2, **f32),
                           torch.full((1,), 1.1, **f32), None, None),
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


def summarise(benchmarks: list[dict], every_op: bool = True) -> dict:
    """The summary (module docstring) of pytest-benchmark's ``benchmarks``; ``every_op``:
    whether the run timed every public op (else no ``max_public_op_host_us_<device>``)."""
    medians: dict[str, list[float]] = {}
    select: dict[tuple[str, str], float] = {}
    for entry in benchmarks:
        params = entry.get("params") or {}
        median_us = entry["stats"]["median"] * 1e6
        if params.get("entry") == "public":
            medians.setdefault(params["device"], []).append(median_us)
        elif "kernel" in params:
            select[params["device"], params["kernel"]] = median_us
    summary = {f"max_public_op_host_us_{device}": max(values)
               for device, values in medians.items()} if every_op else {}
    summary["select_host_us_eager"] = select.get(("cuda", "one_launch"))
    summary.update({f"select_greedy_host_us_{device}_{kernel}": median_us
                    for (device, kernel), median_us in sorted(select.items())})
    return summary


def write_markdown(report: dict, path: Path) -> None:
    table: dict[tuple[str, str], dict[str, str]] = {}
    select: dict[str, dict[str, str]] = {}
    for entry in report["benchmarks"]:
        params, median = entry["params"], fmt(entry["stats"]["median"] * 1e6)
        if "kernel" in params:
            select.setdefault(params["device"], {})[params["kernel"]] = median
        else:
            table.setdefault((params["device"], params["op"]), {})[params["entry"]] = median
    rows = [[device, f"`{op}`", *(cells.get(e, "-") for e in ("public", "torch.ops", "launcher"))]
            for (device, op), cells in sorted(table.items())]
    select_rows = [[device, *(cells.get(kernel, "-") for kernel in SELECT_KERNELS)]
                   for device, cells in sorted(select.items())]
    lines = [
        "# Host time per eager op call (median, us)",
        "",
        f"{report['device']['name']}, {report['date']}, `{report['command']}`",
        f"versions: {report['versions']}",
        "",
        *markdown_table(["device", "op", "public", "torch.ops", "launcher"], rows),
        "",
    ]
    if select_rows:
        lines += [
            "`select_tokens(..., sampling=\"greedy\")`, public call, per select kernel setting "
            "(WEDLM_KERNELS_SELECT_KERNEL):",
            "",
            *markdown_table(["device", *SELECT_KERNELS], select_rows),
            "",
        ]
    lines += [
        "summary: " + ", ".join(f"`{k}` {fmt(v, 2)}" for k, v in report["summary"].items()),
        "",
        "CUDA rows: host time of one call (the device synchronised before each, untimed). "
        f"CPU rows: {CPU_LABEL}, the whole call (the PyTorch implementations, whatever the "
        "select kernel setting).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="5 rounds per benchmark")
    parser.add_argument("--ops", nargs="+", choices=public_ops(), default=None,
                        help="time these ops only (default: every public op)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or RESULTS_ROOT / (
        device_slug() if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    # a run of a few ops has files of its own (host_time_select_tokens.json): a later run of
    # every op in the same folder (bench/gpu_check.py runs both) leaves them as they are
    stem = "_".join(["host_time", *(args.ops or [])])
    json_path = out_dir / f"{stem}.json"
    json_path.unlink(missing_ok=True)  # an earlier run's file is not this run's result
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "WEDLM_KERNELS_BACKEND")}
    if args.quick:
        env["HOST_TIME_ROUNDS"] = "5"
    root = Path(__file__).resolve().parents[1]
    # (a benchmark's id names its op: test_select_tokens_host_time_per_select_kernel's too)
    only = ["-k", " or ".join(args.ops)] if args.ops else []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-only",
         f"--benchmark-json={json_path}", *only, "bench/test_host_time.py"], cwd=root, env=env)
    if not json_path.exists():
        print(f"host_time: pytest wrote no benchmark JSON (exit {done.returncode})")
        return done.returncode or 1
    report = json.loads(json_path.read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report.update(
        benchmark="host_time", date=utc_now(), device=device_info(device),
        command=command_line("bench.host_time", argv), versions=versions(),
        label=None if device.type == "cuda" else CPU_LABEL,
        summary=summarise(report["benchmarks"], every_op=not args.ops))
    write_json(json_path, report)
    write_markdown(report, out_dir / f"{stem}.md")
    print((out_dir / f"{stem}.md").read_text())
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
