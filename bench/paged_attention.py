"""Microbenchmark of paged_attention: the Triton kernel against PyTorch SDPA on a dense copy.

    python -m bench.paged_attention [--out-dir bench/results/<device>/] [--quick]
    python -m bench.paged_attention --cpu-smoke [--interpret] [--out-dir DIR]

On a CUDA GPU, at Qwen3-8B attention shapes (32 q heads, 8 KV heads, head_dim 128, bf16),
pages of ``--page-size`` positions (default 16) in a scattered page table:

- decode windows: B in {1, 16, 64} sequences, q_len 16 and 32 window rows after a context
  of 512 .. 16384 committed positions (the same context for every sequence, so that the dense
  baseline has one shape); row j sees positions 0 .. context + j;
- prefill: one prompt of 1024 .. 8192 tokens (context 0, plain causal).

Each case times ``paged_attention_triton`` (the schedule it picks is recorded: split-KV chunks
for decode windows, query tiles otherwise), the same launcher under the FA2 split rule
(``triton_fa2``, ``WEDLM_KERNELS_ATTENTION_SPLITS=fa2``; its schedule in ``schedule_fa2``;
the summary's ``fa2_over_measured_decode_min``/``_max``: the measured rule's time over the
FA2 rule's, > 1 where FA2's is faster), the launcher merging split partials in its one launch
(``triton_merged``, ``WEDLM_KERNELS_ATTENTION_MERGE=last_program``; the summary's
``merged_over_combine_decode_min``/``_max``: the two-launch time over the one-launch time)
prefills starting their heaviest query tiles first (``triton_heaviest_first``,
``WEDLM_KERNELS_ATTENTION_ORDER=heaviest_first``; ``heaviest_first_over_forward_prefill_min``)
and ``torch.nn.functional.scaled_dot_product_attention``
on a dense ``[B, Hkv, context + q_len, D]`` copy of the same keys and values (GQA through
``enable_gqa`` when SDPA supports it with the bottom-right causal mask, else with the KV heads
repeated; the report names the variant), in the modes of ``bench/common.py`` (``eager``: one
call on a cold L2; ``graph``: calls captured in a CUDA graph). Figures: median microseconds,
for decode the achieved bandwidth (bytes of K, V, q and out over the time) and its fraction of
the device-to-device copy bandwidth measured in the same run; for prefill the achieved TFLOP/s
(4 * Hq * D * visible (query, key) pairs) and its fraction of a large bf16 matmul's TFLOP/s
measured in the same run; and the speed-up of the Triton kernel over SDPA. Before timing, each
case checks the kernel's output against SDPA's.

Results: ``paged_attention.json``, ``paged_attention.md`` and ``paged_attention.png`` (when
matplotlib is installed) in ``--out-dir`` (default ``bench/results/<device-name-slug>/``).
Without a CUDA GPU the default mode prints that GPU benchmarks are skipped and exits 0;
``--cpu-smoke`` runs the whole code path on CPU tensors at tiny shapes with the PyTorch
implementation in place of the kernel (``--interpret`` adds the Triton launcher through
Triton's interpreter), writing to a temporary folder unless ``--out-dir`` is given.
"""

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common
from bench.common import Timer, add_derived, fmt, fmt_rate, markdown_table

# triton: the kernel as configured by default; triton_fa2: under the FA2 split rule
# (WEDLM_KERNELS_ATTENTION_SPLITS=fa2); triton_merged: merging split partials in its own
# launch (WEDLM_KERNELS_ATTENTION_MERGE=last_program); triton_heaviest_first: starting the
# query tiles that see the most keys first (WEDLM_KERNELS_ATTENTION_ORDER=heaviest_first,
# prefill only); timed side by side on a GPU
IMPL_ORDER = ("triton", "triton_fa2", "triton_merged", "triton_heaviest_first", "torch",
              "sdpa")


def with_setting(launcher: Callable, setting: str, value: str) -> Callable:
    """``launcher`` run with ``wedlm_kernels._backend.<setting>`` set to ``value`` (the
    setting the launcher reads)."""
    from wedlm_kernels import _backend

    def launch(*args):
        saved = getattr(_backend, setting)
        setattr(_backend, setting, value)
        try:
            return launcher(*args)
        finally:
            setattr(_backend, setting, saved)

    return launch


@dataclass(frozen=True)
class Sizes:
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    batches: tuple[int, ...]
    window_rows: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    page_size: int
    matmul_size: int  # n of the n x n x n matmul that gives the TFLOP/s ceiling
    copy_bytes: int


QWEN3_8B = Sizes(32, 8, 128, torch.bfloat16, (1, 16, 64), (16, 32),
                 (512, 1024, 2048, 4096, 8192, 16384), (1024, 2048, 4096, 8192), 16, 8192,
                 2**30)
QUICK = Sizes(32, 8, 128, torch.bfloat16, (1, 64), (16,), (512, 4096, 16384), (1024, 8192), 16,
              8192, 2**30)
SMOKE = Sizes(4, 2, 16, torch.float32, (1, 2), (4,), (8, 40), (24,), 4, 64, 8 * 2**20)

METHODS = {
    "eager": "one call per sample on a cold L2 (`triton.testing.do_bench`, L2 flushed before "
             "each call), median of all samples",
    "graph": "calls captured back to back in one CUDA graph (warm L2, no launch overhead), "
             "median per-call time over the replays",
    "cpu": "`time.perf_counter` around single calls on CPU tensors (smoke run only)",
}


# ------------------------------------------------------------------------------- inputs


def make_inputs(sizes: Sizes, batch: int, rows: int, context: int, device: torch.device,
                seed: int) -> dict:
    """q, the paged caches (scattered pages, random page order), the page table, the lengths
    and the dense ``[B, Hkv, L, D]`` K/V of the same positions (``L = context + rows``)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    length = context + rows
    page_size = sizes.page_size
    pages_per_sequence = math.ceil(length / page_size)
    num_pages = batch * pages_per_sequence
    shape = (batch, length, sizes.kv_heads, sizes.head_dim)
    dense_k = torch.randn(shape, generator=generator, device=device, dtype=sizes.dtype)
    dense_v = torch.randn(shape, generator=generator, device=device, dtype=sizes.dtype)
    block_table = torch.randperm(num_pages, generator=generator, device=device)
    block_table = block_table.view(batch, pages_per_sequence).to(torch.int32)
    position = torch.arange(length, device=device)
    slots = (block_table.long()[:, position // page_size] * page_size + position % page_size)
    caches = []
    for dense in (dense_k, dense_v):
        cache = torch.zeros(num_pages * page_size, sizes.kv_heads, sizes.head_dim,
                            dtype=sizes.dtype, device=device)
        cache[slots.reshape(-1)] = dense.reshape(-1, sizes.kv_heads, sizes.head_dim)
        caches.append(cache.view(num_pages, page_size, sizes.kv_heads, sizes.head_dim))
    q = torch.randn(batch, rows, sizes.q_heads, sizes.head_dim, generator=generator,
                    device=device, dtype=sizes.dtype)
    return {
        "q": q.view(batch * rows, sizes.q_heads, sizes.head_dim),  # packed: rows back to back
        "q_padded": q,  # [B, S, Hq, D], for SDPA
        "k_cache": caches[0], "v_cache": caches[1], "block_table": block_table,
        "query_start": torch.arange(batch + 1, dtype=torch.int32, device=device) * rows,
        "ctx_len": torch.full((batch,), context, dtype=torch.int32, device=device),
        "scale": sizes.head_dim**-0.5,
        "dense_k": dense_k.transpose(1, 2).contiguous(),  # [B, Hkv, L, D]
        "dense_v": dense_v.transpose(1, 2).contiguous(),
    }


def kernel_args(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in
                 ("q", "k_cache", "v_cache", "block_table", "query_start", "ctx_len", "scale"))


# ------------------------------------------------------------------------------- models


def attention_bytes(sizes: Sizes, batch: int, rows: int, context: int) -> dict:
    """Bytes a call must move at least: every visible K and V row once per KV head, q read,
    out written, the page-table entries in use and the two length vectors."""
    element = torch.empty((), dtype=sizes.dtype).element_size()
    length = context + rows
    kv = 2 * batch * length * sizes.kv_heads * sizes.head_dim * element
    q_out = 2 * batch * rows * sizes.q_heads * sizes.head_dim * element
    table = batch * math.ceil(length / sizes.page_size) * 4 + 2 * batch * 4
    return common.with_total({"k_and_v": kv, "q_and_out": q_out, "page_table_and_lengths": table})


def attention_flops(sizes: Sizes, batch: int, rows: int, context: int) -> int:
    """4 * Hq * D per visible (query row, key) pair: q.k and p.v, a multiply and an add each.
    Row j sees context + j + 1 keys."""
    pairs = rows * (context + 1) + rows * (rows - 1) // 2
    return 4 * batch * sizes.q_heads * sizes.head_dim * pairs


def tflops(flops: int, microseconds: float | None) -> float | None:
    if microseconds is None or microseconds <= 0:
        return None
    return flops / (microseconds * 1e-6) / 1e12


# ------------------------------------------------------------------------------- baselines


def sdpa_variants(inputs: dict, rows: int, length: int) -> list[tuple[str, Callable]]:
    """SDPA calls on the dense K/V with the bottom-right causal mask (row j sees keys
    0 .. length - rows + j), most efficient first; returns ``[B, S, Hq, D]``."""
    from torch.nn.attention.bias import causal_lower_right

    q = inputs["q_padded"].transpose(1, 2)  # [B, Hq, S, D]
    keys, values, scale = inputs["dense_k"], inputs["dense_v"], inputs["scale"]
    group = q.shape[1] // keys.shape[1]
    bias = causal_lower_right(rows, length)
    mask = (torch.arange(length, device=q.device)[None, :]
            <= length - rows + torch.arange(rows, device=q.device)[:, None])

    def gqa_lower_right():
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    def gqa_boolean_mask():
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    repeated = {}

    def repeated_lower_right():
        if not repeated:  # built once, outside the timed calls after the first
            repeated["k"] = keys.repeat_interleave(group, dim=1)
            repeated["v"] = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, repeated["k"], repeated["v"], attn_mask=bias,
                                             scale=scale)
        return out.transpose(1, 2)

    return [("enable_gqa, causal_lower_right", gqa_lower_right),
            ("enable_gqa, boolean mask", gqa_boolean_mask),
            ("KV heads repeated, causal_lower_right", repeated_lower_right)]


def first_working_sdpa(inputs: dict, rows: int, length: int) -> tuple[str, Callable, torch.Tensor,
                                                                        list[str]]:
    """The first SDPA variant that runs here, its output, and why the others before it did
    not."""
    skipped = []
    for name, call in sdpa_variants(inputs, rows, length):
        try:
            out = call()
        except Exception as error:  # noqa: BLE001 - recorded, the next variant is tried
            skipped.append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
            continue
        return name, call, out, skipped
    raise RuntimeError("no SDPA variant runs: " + "; ".join(skipped))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


# ------------------------------------------------------------------------------- cases


def run_case(kind: str, sizes: Sizes, launchers: dict, batch: int, rows: int, context: int,
             timer: Timer, seed: int) -> dict:
    from wedlm_kernels.ops import attention

    device = timer.device
    inputs = make_inputs(sizes, batch, rows, context, device, seed)
    args = kernel_args(inputs)
    length = context + rows
    case = {
        "kind": kind,
        "params": {"batch": batch, "q_len": rows, "context": context,
                   "page_size": sizes.page_size},
        "bytes": attention_bytes(sizes, batch, rows, context),
        "flops": attention_flops(sizes, batch, rows, context),
        "check": {},
        "timings": {},
    }
    config, splits = attention.schedule(
        sizes.dtype, batch * rows, batch, sizes.kv_heads, sizes.q_heads // sizes.kv_heads,
        sizes.head_dim, inputs["block_table"].shape[1] * sizes.page_size,
        attention._multiprocessors(device))
    case["schedule"] = {
        "kind": "split-KV" if splits > 1 else "query tiles", "num_splits": splits,
        "block_m": config.block_m, "block_n": config.block_n, "num_warps": config.num_warps,
    }
    if "triton_fa2" in launchers:
        config, splits = attention.schedule(
            sizes.dtype, batch * rows, batch, sizes.kv_heads, sizes.q_heads // sizes.kv_heads,
            sizes.head_dim, inputs["block_table"].shape[1] * sizes.page_size,
            attention._multiprocessors(device), "fa2")
        case["schedule_fa2"] = {"num_splits": splits, "block_m": config.block_m,
                                "block_n": config.block_n, "num_warps": config.num_warps}
    sdpa_name, sdpa_call, expected, skipped = first_working_sdpa(inputs, rows, length)
    case["sdpa_variant"] = sdpa_name
    if skipped:
        case["sdpa_variants_not_run"] = skipped
    calls = {"sdpa": sdpa_call}
    for impl in ("triton", "triton_fa2", "triton_merged", "triton_heaviest_first", "torch"):
        launcher = launchers.get(impl)
        if launcher is None or (impl == "triton_heaviest_first" and kind != "prefill"):
            continue
        calls[impl] = lambda launcher=launcher: launcher(*args)
        error = relative_error(calls[impl]().view(expected.shape), expected)
        tolerance = 2e-2 if sizes.dtype == torch.bfloat16 else 1e-3
        case["check"][f"{impl}_vs_sdpa"] = {"max_relative_error": error, "tolerance": tolerance,
                                            "ok": error <= tolerance}
    timer.check_context()
    for impl in IMPL_ORDER:
        if impl in calls:
            case["timings"][impl] = timer.all_modes(calls[impl])
    return case


def add_rates(case: dict, copy_gb_per_s: float | None, matmul_tflops: float | None) -> None:
    """GB/s, fractions of the copy bandwidth and speed-ups (``common.add_derived``), plus
    TFLOP/s and their fraction of the matmul ceiling."""
    add_derived(case, copy_gb_per_s)
    case["tflops"], case["fraction_of_matmul_tflops"] = {}, {}
    for impl, modes in case["timings"].items():
        case["tflops"][impl], case["fraction_of_matmul_tflops"][impl] = {}, {}
        for mode, timing in modes.items():
            rate = tflops(case["flops"], timing.get("median_us"))
            case["tflops"][impl][mode] = rate
            case["fraction_of_matmul_tflops"][impl][mode] = common.ratio(rate, matmul_tflops)


def matmul_ceiling(sizes: Sizes, timer: Timer) -> dict:
    n = sizes.matmul_size
    dtype = sizes.dtype if timer.cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=timer.device)
    b = torch.randn(n, n, dtype=dtype, device=timer.device)
    timing = timer.once(lambda: a @ b)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "timing": timing.to_json(),
            "tflops": tflops(2 * n**3, timing.median_us)}


# ------------------------------------------------------------------------------- report


def case_rows(report: dict, kind: str, mode: str) -> list[str]:
    cases = [c for c in report["cases"] if c["kind"] == kind]
    if not cases:
        return []
    impls = [name for name in IMPL_ORDER if any(name in c["timings"] for c in cases)]
    primary = "triton" if "triton" in impls else "torch"
    if kind == "decode":
        headers = ["B", "q_len", "context", "schedule", "MB moved"]
    else:
        headers = ["tokens", "schedule", "GFLOP"]
    headers += [f"{name} µs" for name in impls]
    if kind == "decode":
        headers += [f"{primary} GB/s", f"{primary} % copy BW", "SDPA GB/s"]
    else:
        headers += [f"{primary} TFLOP/s", f"{primary} % matmul", "SDPA TFLOP/s"]
    headers += [f"× over SDPA ({primary})", "check"]
    rows = []
    for case in cases:
        params, schedule = case["params"], case["schedule"]
        label = ("query tiles" if schedule["num_splits"] == 1
                 else f"split-KV × {schedule['num_splits']}")
        if kind == "decode":
            row = [str(params["batch"]), str(params["q_len"]), str(params["context"]), label,
                   fmt(case["bytes"]["total"] / 1e6, 2)]
        else:
            row = [str(params["q_len"]), label, fmt(case["flops"] / 1e9, 1)]
        for name in impls:
            timing = case["timings"].get(name, {}).get(mode, {})
            row.append("error" if "error" in timing else fmt(timing.get("median_us"), 1))
        if kind == "decode":
            fraction = case["fraction_of_copy_bandwidth"].get(primary, {}).get(mode)
            row += [fmt_rate(case["gb_per_s"].get(primary, {}).get(mode)),
                    fmt(None if fraction is None else 100 * fraction, 1, "%"),
                    fmt_rate(case["gb_per_s"].get("sdpa", {}).get(mode))]
        else:
            fraction = case["fraction_of_matmul_tflops"].get(primary, {}).get(mode)
            row += [fmt(case["tflops"].get(primary, {}).get(mode), 1),
                    fmt(None if fraction is None else 100 * fraction, 1, "%"),
                    fmt(case["tflops"].get("sdpa", {}).get(mode), 1)]
        speedup = common.ratio(common.median_us(case, "sdpa", mode),
                               common.median_us(case, primary, mode))
        checks = case["check"].values()
        row += [fmt(speedup, 2, "×"),
                "—" if not checks else ("ok" if all(c["ok"] for c in checks) else "MISMATCH")]
        rows.append(row)
    return markdown_table(headers, rows)


def write_markdown(report: dict, path: Path) -> None:
    device, versions, shapes = report["device"], report["versions"], report["shapes"]
    copy, matmul = report["copy_bandwidth"], report["matmul"]
    lines = [
        "# paged_attention microbenchmark",
        "",
        f"{report['date']} on **{device['name']}**; torch {versions['torch']}, triton "
        f"{versions['triton']}, CUDA {versions['cuda']}, Python {versions['python']}.",
        f"Command: `{report['command']}`.",
        "",
    ]
    if report["mode"] == "cpu-smoke":
        lines += ["CPU smoke run: tiny shapes, CPU tensors, every figure a CPU time "
                  "(no GPU figure).", ""]
    lines += [
        f"Shapes: {shapes['q_heads']} q heads, {shapes['kv_heads']} KV heads, head_dim "
        f"{shapes['head_dim']}, {shapes['dtype']}, pages of {shapes['page_size']} positions "
        f"(scattered). Triton: {report['triton']}.",
        f"Ceilings (same run): copy bandwidth **{fmt(copy['gb_per_s'], 0)} GB/s** "
        f"({copy['bytes_copied'] / 2**20:.0f} MiB copied, bytes read + written); "
        f"{matmul['n']}³ {matmul['dtype']} matmul **{fmt(matmul['tflops'], 1)} TFLOP/s**.",
        "",
    ]
    for message in report.get("case_errors", []):
        lines += [f"**Case failed:** {message}", ""]
    if report.get("error"):
        lines += [f"**Error:** {report['error']}", ""]
    variants = sorted({c["sdpa_variant"] for c in report["cases"]})
    if variants:
        lines += [f"SDPA baseline: {', '.join(variants)}.", ""]
    for kind, title in (("decode", "Decode windows"), ("prefill", "Prefill")):
        for mode in report["modes"]:
            table = case_rows(report, kind, mode)
            if table:
                lines += [f"## {title}, mode `{mode}`", "", METHODS[mode] + ".", ""]
                lines += table + [""]
    lines += [
        "## How it is measured", "",
        "- **bytes moved** (decode): every visible K and V row once per KV head, q read, out "
        "written, page-table entries and lengths; GB/s = bytes / median time.",
        "- **FLOP** (prefill): 4 · Hq · D per visible (query row, key) pair.",
        "- **schedule**: what `paged_attention_triton` picks from the shapes (split-KV "
        "chunks for decode windows that underfill the GPU, query tiles otherwise).",
    ]
    lines += [f"- **{name}**: {text}" for name, text in METHODS.items()]
    lines += [f"- **plot**: {report['plot']}", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> Path | str:
    """Decode GB/s against the context and prefill TFLOP/s against the tokens
    (``common.save_plot``)."""
    return common.save_plot(lambda figure: draw_plot(figure, report), path, size=(13, 5))


def draw_plot(figure, report: dict) -> None:
    mode = report["modes"][0]
    decode_axis, prefill_axis = figure.subplots(1, 2)
    decode = [c for c in report["cases"] if c["kind"] == "decode"]
    keys = sorted({(c["params"]["batch"], c["params"]["q_len"]) for c in decode})
    for index, (batch, rows) in enumerate(keys):
        chosen = [c for c in decode if (c["params"]["batch"], c["params"]["q_len"]) == (batch, rows)]
        for impl, line in (("triton", "-"), ("torch", "-."), ("sdpa", ":")):
            points = [(c["params"]["context"], c["gb_per_s"].get(impl, {}).get(mode))
                      for c in chosen]
            points = [(x, y) for x, y in points if y]
            if points:
                decode_axis.plot(*zip(*points), line, color=f"C{index}", marker="o",
                                 label=f"{impl} B={batch} q_len={rows}")
    if report["copy_bandwidth"]["gb_per_s"]:
        decode_axis.axhline(report["copy_bandwidth"]["gb_per_s"], color="k", linestyle="--",
                            label="device copy")
    decode_axis.set(title=f"decode windows ({mode})", xlabel="context", ylabel="GB/s")
    prefill = [c for c in report["cases"] if c["kind"] == "prefill"]
    for impl, color in (("triton", "C0"), ("torch", "C2"), ("sdpa", "C1")):
        points = [(c["params"]["q_len"], c["tflops"].get(impl, {}).get(mode)) for c in prefill]
        points = [(x, y) for x, y in points if y]
        if points:
            prefill_axis.plot(*zip(*points), "-", color=color, marker="o", label=impl)
    if report["matmul"]["tflops"]:
        prefill_axis.axhline(report["matmul"]["tflops"], color="k", linestyle="--",
                             label="matmul")
    prefill_axis.set(title=f"prefill ({mode})", xlabel="tokens", ylabel="TFLOP/s")
    for axis in (decode_axis, prefill_axis):
        axis.set_xscale("log", base=2)
        if axis.lines:
            axis.legend(fontsize=7)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(f"{report['device']['name']}: paged_attention, {report['date']}")


def summarise(report: dict) -> dict:
    """Headline figures of the triton kernel, graph mode: one decode call at B=1, 32 rows,
    512 positions of context; its lowest speed-up over SDPA on decode cases with B <= 4; its
    highest decode fraction of copy bandwidth; its lowest prefill speed-up over SDPA. None
    where a case needed did not run."""
    cases = report.get("cases", [])
    decode = [c for c in cases if c["kind"] == "decode"]
    prefill = [c for c in cases if c["kind"] == "prefill"]
    probe = [c for c in decode
             if (c["params"]["batch"], c["params"]["q_len"], c["params"]["context"]) == (1, 32, 512)]
    return {
        "b1_q32_ctx512_us": common.figure(probe[0] if probe else None,
                                          "timings", "triton", "graph", "median_us"),
        "decode_b_le_4_min_speedup_over_sdpa": common.extreme(
            [common.figure(c, "speedup", "triton_over_sdpa", "graph")
             for c in decode if c["params"]["batch"] <= 4], min),
        "decode_max_copy_bw_fraction": common.extreme(
            [common.figure(c, "fraction_of_copy_bandwidth", "triton", "graph") for c in decode],
            max),
        "prefill_min_speedup_over_sdpa": common.extreme(
            [common.figure(c, "speedup", "triton_over_sdpa", "graph") for c in prefill], min),
        # the FA2 split rule against the measured one (> 1: FA2's is faster), decode cases
        "fa2_over_measured_decode_min": speedup_over_default("triton_fa2", decode, min),
        "fa2_over_measured_decode_max": speedup_over_default("triton_fa2", decode, max),
        # the one-launch merge against the combine launch (> 1: one launch is faster)
        "merged_over_combine_decode_min": speedup_over_default("triton_merged", decode, min),
        "merged_over_combine_decode_max": speedup_over_default("triton_merged", decode, max),
        # the heaviest query tiles first against the forward order (> 1: faster), prefill
        "heaviest_first_over_forward_prefill_min": speedup_over_default(
            "triton_heaviest_first", prefill, min),
    }


def speedup_over_default(impl: str, cases: list[dict], pick: Callable) -> float | None:
    """``pick`` (min or max) over ``cases`` of the default kernel's graph-mode time over
    ``impl``'s (> 1: ``impl`` is faster); None where a case lacks either."""
    return common.extreme([common.ratio(common.median_us(c, "triton", "graph"),
                                        common.median_us(c, impl, "graph")) for c in cases],
                          pick)


def write_outputs(run: common.OpRun, report: dict, final: bool) -> None:
    run.write(report, final, write_markdown, write_plot, summarise)


# ------------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.op_parser("bench.paged_attention", __doc__.split("\n\n")[0],
                              "tiny shapes on CPU tensors, PyTorch implementation only")
    parser.add_argument("--page-size", type=int, default=None,
                        help="positions per page (default 16; 4 in --cpu-smoke)")
    args = common.parse_op_args(parser, argv)
    if args.page_size is not None and args.page_size < 1:
        parser.error("--page-size must be >= 1")
    return args


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = SMOKE if args.cpu_smoke else QUICK if args.quick else QWEN3_8B
    if args.page_size is not None:
        sizes = Sizes(**{**sizes.__dict__, "page_size": args.page_size})
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny tensors: spinning OpenMP threads only add noise
    bench = common.start_op_run("paged_attention", args, argv, sizes.copy_bytes)
    from wedlm_kernels.ops.attention import paged_attention_torch, paged_attention_triton

    launchers = {
        "triton": paged_attention_triton,
        "triton_fa2": with_setting(paged_attention_triton, "ATTENTION_SPLITS", "fa2"),
        "triton_merged": with_setting(paged_attention_triton, "ATTENTION_MERGE", "last_program"),
        "triton_heaviest_first": with_setting(paged_attention_triton, "ATTENTION_ORDER",
                                              "heaviest_first"),
    }
    if args.cpu_smoke:  # the PyTorch implementation stands in for (or beside) the kernel
        launchers = {"torch": paged_attention_torch}
        if bench.with_triton:
            launchers["triton"] = paged_attention_triton
            launchers["triton_merged"] = with_setting(paged_attention_triton,
                                                      "ATTENTION_MERGE", "last_program")
            launchers["triton_heaviest_first"] = with_setting(
                paged_attention_triton, "ATTENTION_ORDER", "heaviest_first")
    matmul = matmul_ceiling(sizes, bench.timer)
    print(f"copy bandwidth: {fmt(bench.copy['gb_per_s'], 0)} GB/s; matmul: "
          f"{fmt(matmul['tflops'], 1)} TFLOP/s", flush=True)
    report = bench.report(
        triton=bench.triton_state("paged_attention_triton", "PyTorch implementation only"),
        shapes={
            "q_heads": sizes.q_heads, "kv_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
            "dtype": str(sizes.dtype).replace("torch.", ""), "page_size": sizes.page_size,
            "batches": list(sizes.batches), "window_rows": list(sizes.window_rows),
            "contexts": list(sizes.contexts), "prefill_tokens": list(sizes.prefill_tokens),
        },
        matmul=matmul, methods=METHODS, cases=[],
    )

    plan = [("decode", batch, rows, context) for batch in sizes.batches
            for rows in sizes.window_rows for context in sizes.contexts]
    plan += [("prefill", 1, tokens, 0) for tokens in sizes.prefill_tokens]
    cases = [(f"{kind} B={batch} q_len={rows} context={context}",
              lambda kind=kind, batch=batch, rows=rows, context=context: run_case(
                  kind, sizes, launchers, batch, rows, context, bench.timer, args.seed))
             for kind, batch, rows, context in plan]
    bench.run_group(
        report, cases, lambda case: add_rates(case, bench.copy["gb_per_s"], matmul["tflops"]),
        lambda final: write_outputs(bench, report, final))
    report["complete"] = "error" not in report
    write_outputs(bench, report, final=True)
    report["out_dir"] = str(bench.out_dir)
    return report


def failures(report: dict) -> list[str]:
    """Errors and mismatches of a finished report (the exit status is 1 if any)."""
    return common.group_failures(report, "",
                                 lambda case: f"{case['kind']} {case['params']}")


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(argv, parse_args, run, failures, "paged_attention.md")


if __name__ == "__main__":
    sys.exit(main())
