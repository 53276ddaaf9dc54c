"""Generates ``bench/REPORT.md`` from every ``bench/results/*/*.json``.

    python -m bench.report            # rewrite bench/REPORT.md and the sweep plots (.png)
    python -m bench.report --check    # exit 1 when either is out of date with the JSON
    python -m bench.report --results DIR --out FILE

One section per result file: date, device and whether its figures are CPU or GPU
measurements, versions, the command that produced it, its methods, and its figures in
tables, formatted but never computed anew (unit changes only: bytes to MB, fractions to
percent). Known layouts: the op microbenchmarks (cases with ``timings`` per implementation
and mode), per-case result lists such as ``bench.decoder_cpu``'s, and ``bench.sweep``; any
other JSON becomes a flattened key/value table. Each ``bench.sweep`` result also gets a
PNG plot next to its JSON (tokens per forward and p_cache against the threshold, one series
per mode; drawn with matplotlib through ``bench.common.save_plot``, the ``bench`` extra).
The output depends only on the files read, so ``--check`` can tell whether the committed
report is current: REPORT.md is compared as text, and a sweep plot by the digest of its
JSON and of the plot code that the PNG carries (:func:`sweep_plot_digest`), so the check
needs no matplotlib. A plot already current is not redrawn; one that is stale or missing
is, which needs matplotlib (without it the report is still written, the plot is not, and
the command exits 1).
"""

import argparse
import hashlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import fmt, fmt_rate, markdown_table, png_text, save_plot

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS = BENCH_DIR / "results"
DEFAULT_OUT = BENCH_DIR / "REPORT.md"
COMMAND = "python -m bench.report"
DASH = "—"

# Top-level keys every layout renders in the section header.
HEADER_KEYS = ("benchmark", "label", "date", "device", "machine", "versions", "command",
               "methods", "quick", "complete", "plot", "mode", "modes")

# ---------------------------------------------------------------------------- formatting


def num(value) -> str:
    """A JSON value as text: floats with 4 significant digits, lists joined, None a dash."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(num(v) for v in value) + "]"
    if isinstance(value, dict):
        return ", ".join(f"{k} {num(v)}" for k, v in value.items())
    return str(value)


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def percent(value) -> str:
    return DASH if value is None else f"{100 * value:.2f}%"


def times(value) -> str:
    return DASH if value is None else f"{value:.2f}×"


def fixed(digits: int) -> Callable[[float | None], str]:
    return lambda value: fmt(value, digits)


def flatten(node, prefix: str = "", skip: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(dotted key, text)`` of every leaf; lists of plain values stay one entry."""
    if isinstance(node, dict):
        items = []
        for key, value in node.items():
            if key in skip:
                continue
            items += flatten(value, f"{prefix}.{key}" if prefix else str(key), skip)
        return items
    if isinstance(node, list) and any(isinstance(v, (dict, list)) for v in node):
        items = []
        for index, value in enumerate(node):
            items += flatten(value, f"{prefix}[{index}]", skip)
        return items
    return [(prefix, num(node))]


def key_value_table(node, skip: Sequence[str] = ()) -> list[str]:
    rows = [[cell(k), cell(v)] for k, v in flatten(node, skip=skip)]
    return markdown_table(["key", "value"], rows) if rows else []


# ---------------------------------------------------------------------------- section header


def measurement(data: dict) -> str:
    """"GPU measurement", "CPU measurement", "compile facts" (a kernel compiled for a GPU on
    a machine without one: nothing timed), loads counted in the interpreter, or "device not
    recorded"."""
    if data.get("benchmark") == "compile_facts":
        return "compile facts, no measurement"
    if data.get("benchmark") == "vocabulary_passes":
        return "loads counted in Triton's interpreter, nothing timed"
    device = data.get("device")
    kind = device.get("type") if isinstance(device, dict) else None
    kind = kind or data.get("mode")
    if kind == "cuda":
        return "GPU measurement"
    label = data.get("label") or (data.get("machine") or {}).get("label") or ""
    if kind == "cpu" or "cpu" in str(label).lower():
        return "CPU measurement"
    return "device not recorded"


def device_text(data: dict) -> str:
    device, machine = data.get("device"), data.get("machine")
    if isinstance(device, dict) and device.get("type") == "cuda":
        extra = [f"compute capability {device['compute_capability']}"
                 if device.get("compute_capability") else "",
                 f"{device['memory_gib']} GiB" if device.get("memory_gib") else ""]
        return ", ".join([str(device.get("name", DASH)), *filter(None, extra)])
    if isinstance(machine, dict):
        parts = [str(machine.get("processor") or machine.get("platform") or "CPU")]
        if machine.get("cpu_count"):
            parts.append(f"{machine['cpu_count']} CPUs")
        if machine.get("torch_threads"):
            parts.append(f"{machine['torch_threads']} torch thread(s)")
        return ", ".join(parts)
    if isinstance(device, dict):
        return str(device.get("name", DASH))
    if data.get("target"):  # compile facts: the target compiled for
        return str(data["target"])
    return DASH


def methods_lines(methods) -> list[str]:
    if not methods:
        return []
    if isinstance(methods, dict):
        body = [f"- {name}: {text}" for name, text in methods.items()]
    else:
        body = [str(methods)]
    return ["<details><summary>How each figure is measured</summary>", "", *body, "",
            "</details>", ""]


def header_lines(data: dict, links: list[str]) -> list[str]:
    versions = data.get("versions")
    lines = [
        f"- Date: {data.get('date', DASH)}",
        f"- Device: {device_text(data)}: **{measurement(data)}**"
        + (f" ({data['label']})" if data.get("label") else ""),
        f"- Versions: {num(versions) if isinstance(versions, dict) else DASH}",
        f"- Command: `{data.get('command', DASH)}`",
    ]
    if "quick" in data:
        lines.append(f"- Quick (smoke) configuration: {num(data['quick'])}")
    if "complete" in data:
        lines.append(f"- Complete run: {num(data['complete'])}")
    if links:
        lines.append("- Files: " + ", ".join(links))
    return [*lines, "", *methods_lines(data.get("methods"))]


# ---------------------------------------------------------------------------- op benchmarks

CONTAINER_KEYS = ("ops", "parameters")
IMPL_METRICS = {  # per-case key -> (column suffix, formatter)
    "gb_per_s": ("GB/s", fmt_rate),
    "fraction_of_copy_bandwidth": ("% copy BW", percent),
    "tflops": ("TFLOP/s", fixed(1)),
    "fraction_of_matmul_tflops": ("% matmul", percent),
    "added_us": ("added µs", fixed(1)),  # bench.select_tokens' rules: with rules - plain
    "added_over_plain": ("added / plain", percent),
}


def case_groups(data: dict) -> list[tuple[list[str], dict]]:
    """``(path, node)`` of every dict holding a ``cases`` list of timed cases."""
    groups = []

    def walk(node, path):
        if not isinstance(node, dict):
            return
        cases = node.get("cases")
        if isinstance(cases, list) and cases and all(
            isinstance(c, dict) and isinstance(c.get("timings"), dict) for c in cases
        ):
            groups.append((path, node))
        for key, value in node.items():
            if key != "cases":
                walk(value, [*path, key])

    walk(data, [])
    return groups


def is_impl_mode_figures(value) -> bool:
    """``{impl: {mode: number or None}}``."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(modes, dict) and all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
            for v in modes.values())
        for modes in value.values())


def ordered_union(lists) -> list:
    """The distinct items of all lists, in order of first appearance."""
    seen = []
    for items in lists:
        for item in items:
            if item not in seen:
                seen.append(item)
    return seen


def check_text(case: dict) -> str:
    check = case.get("check")
    if not isinstance(check, dict) or not check:
        return DASH
    failed = [name for name, result in check.items()
              if not (isinstance(result, dict) and result.get("ok") is True)]
    return "ok" if not failed else "FAIL: " + ", ".join(failed)


def timing_cell(case: dict, impl: str, mode: str) -> str:
    timing = case["timings"].get(impl, {}).get(mode)
    if not isinstance(timing, dict):
        return DASH
    if "error" in timing:
        return "error"
    return fmt(timing.get("median_us"), 1)


CASE_FIGURE_KEYS = ("params", "bytes", "check", "timings", "speedup", "flops", "kind")


def case_settings(cases: list[dict]) -> tuple[dict, list[str]]:
    """Other per-case entries (e.g. a kernel schedule): those equal in every case, and the
    names of those that vary (shown as table columns)."""
    keys = ordered_union(
        [k for k, v in c.items() if k not in CASE_FIGURE_KEYS and k not in IMPL_METRICS
         and not is_impl_mode_figures(v)] for c in cases)
    constant, varying = {}, []
    for key in keys:
        texts = [num(c.get(key)) for c in cases]
        if len(set(texts)) == 1:
            constant[key] = cases[0].get(key)
        else:
            varying.append(key)
    return constant, varying


def mode_table(cases: list[dict], mode: str) -> list[str]:
    """One row per case: parameters, bytes, every implementation's µs and derived figures."""
    params = ordered_union((c.get("params") or {}).keys() for c in cases)
    impls = ordered_union(c["timings"].keys() for c in cases)
    metrics = ordered_union(
        [k for k, v in c.items() if k in IMPL_METRICS and is_impl_mode_figures(v)]
        for c in cases)
    metric_impls = {m: ordered_union(c.get(m, {}).keys() for c in cases) for m in metrics}
    speedups = ordered_union((c.get("speedup") or {}).keys() for c in cases)
    has_bytes = any(isinstance(c.get("bytes"), dict) and "total" in c["bytes"] for c in cases)
    has_flops = any(isinstance(c.get("flops"), (int, float)) for c in cases)
    _, settings = case_settings(cases)
    headers = [*params, *settings]
    headers += ["MB moved"] if has_bytes else []
    headers += ["GFLOP"] if has_flops else []
    headers += [f"{impl} µs" for impl in impls]
    for metric in metrics:
        headers += [f"{impl} {IMPL_METRICS[metric][0]}" for impl in metric_impls[metric]]
    headers += [f"× {name.replace('_over_', ' over ')}" for name in speedups]
    headers.append("check")
    rows = []
    for case in cases:
        row = [cell(num((case.get("params") or {}).get(p))) for p in params]
        row += [cell(num(case.get(key))) for key in settings]
        if has_bytes:
            total = (case.get("bytes") or {}).get("total")
            row.append(DASH if total is None else f"{total / 1e6:.3f}")
        if has_flops:
            flops = case.get("flops")
            row.append(DASH if flops is None else f"{flops / 1e9:.3f}")
        row += [timing_cell(case, impl, mode) for impl in impls]
        for metric in metrics:
            label, formatter = IMPL_METRICS[metric]
            row += [formatter((case.get(metric) or {}).get(impl, {}).get(mode))
                    for impl in metric_impls[metric]]
        row += [times((case.get("speedup") or {}).get(name, {}).get(mode)) for name in speedups]
        row.append(check_text(case))
        rows.append(row)
    return markdown_table(headers, rows)


def timing_errors(cases: list[dict]) -> list[str]:
    errors = []
    for index, case in enumerate(cases):
        for impl, modes in case["timings"].items():
            for mode, timing in modes.items():
                if isinstance(timing, dict) and "error" in timing:
                    errors.append(f"- case {index} ({num(case.get('params'))}), {impl} "
                                  f"`{mode}`: {timing['error']}")
    return errors


def ceilings(data: dict) -> tuple[list[str], list[str]]:
    """Table of the top-level reference measurements (copy bandwidth, matmul), and their
    keys."""
    keys = [k for k, v in data.items() if isinstance(v, dict)
            and isinstance(v.get("timing"), dict) and "median_us" in v["timing"]]
    rows = []
    for key in keys:
        entry = data[key]
        figures = []
        if "gb_per_s" in entry:
            figures.append(f"{fmt_rate(entry['gb_per_s'])} GB/s")
        if "tflops" in entry:
            figures.append(f"{fmt(entry['tflops'], 1)} TFLOP/s")
        details = {k: v for k, v in entry.items() if k not in ("timing", "gb_per_s", "tflops")}
        timing = entry["timing"]
        rows.append([key, fmt(timing.get("median_us"), 1), num(timing.get("samples")),
                     ", ".join(figures) or DASH, cell(num(details))])
    if not rows:
        return [], keys
    table = markdown_table(["reference measured in the same run", "median µs", "samples",
                            "figure", "details"], rows)
    return ["### Ceilings", "", *table, ""], keys


def kernel_body(data: dict, groups: list[tuple[list[str], dict]]) -> list[str]:
    lines, consumed = ceilings(data)
    consumed = {*consumed, *(path[0] if path else "cases" for path, _ in groups)}
    all_modes = data.get("modes") if isinstance(data.get("modes"), list) else []
    for path, node in groups:
        title = " / ".join(p for p in path if p not in CONTAINER_KEYS) or str(
            data.get("benchmark", "cases"))
        cases = node["cases"]
        kinds = ordered_union([[c.get("kind")] for c in cases])
        for kind in kinds:
            subset = [c for c in cases if c.get("kind") == kind]
            heading = title if kind is None else f"{title}: {kind}"
            lines += [f"### {heading}", ""]
            notes = {k: v for k, v in node.items() if path
                     and k not in ("cases", "case_errors", "error") and not isinstance(v, list)}
            notes.update(case_settings(subset)[0])
            if notes:
                lines += ["Settings: " + "; ".join(f"{k}: {num(v)}" for k, v in notes.items())
                          + ".", ""]
            modes = ordered_union([all_modes] + [list(timing.keys()) for c in subset
                                                 for timing in c["timings"].values()])
            for mode in modes:
                lines += [f"Mode `{mode}` ({measurement(data)}):", "",
                          *mode_table(subset, mode), ""]
            errors = timing_errors(subset)
            if errors:
                lines += ["Timing errors:", "", *errors, ""]
        for error in node.get("case_errors") or []:
            lines += [f"- case error: {error}"]
        if node.get("error"):
            lines += [f"- group error: {node['error']}"]
        if node.get("case_errors") or node.get("error"):
            lines.append("")
    rest = {k: v for k, v in data.items() if k not in HEADER_KEYS and k not in consumed}
    if rest:
        lines += ["### Run details", "", *key_value_table(rest), ""]
    return lines


# ---------------------------------------------------------------------------- per-case lists


def case_label(case: dict, index: int) -> str:
    for key, short in (("window", "W"), ("name", ""), ("batch", "B")):
        if key in case and not isinstance(case[key], (dict, list)):
            return f"{short}={case[key]}" if short else str(case[key])
    return f"case {index}"


def case_list_body(data: dict) -> list[str]:
    """A figure x case table of every per-case value (raw ``samples`` lists left out)."""
    cases = data["cases"]
    flat = [dict(flatten(c, skip=("samples",))) for c in cases]
    keys = ordered_union(f.keys() for f in flat)
    rows = [[cell(key), *[cell(f.get(key, DASH)) for f in flat]] for key in keys]
    headers = [measurement(data), *[case_label(c, i) for i, c in enumerate(cases)]]
    lines = ["### Per-case figures", "",
             "Every value of each case (medians; the raw samples are in the JSON).", "",
             *markdown_table(headers, rows), ""]
    rest = {k: v for k, v in data.items() if k not in HEADER_KEYS and k != "cases"}
    if rest:
        lines += ["### Run details", "", *key_value_table(rest), ""]
    return lines


# ---------------------------------------------------------------------------- sweep

SWEEP_HEADERS = ["mode", "B", "W", "threshold", "penalty", "tokens", "forwards",
                 "forwards / request", "tokens / forward", "p_cache", "wall s (median)",
                 "tok/s", "× over AR", "finish stop/length"]


def sweep_row(case: dict) -> list[str]:
    wall = (case.get("wall_seconds") or {}).get("median")
    reasons = case.get("finish_reasons") or {}
    threshold = case.get("threshold")
    if case.get("mode") != "ar" and threshold is None:
        threshold = "none"
    return [
        str(case.get("mode")), num(case.get("batch")), num(case.get("window")),
        num(threshold), num(case.get("penalty")), num(case.get("tokens")),
        num(case.get("forwards")), fmt(case.get("forwards_per_request"), 1),
        fmt(case.get("tokens_per_forward"), 2), fmt(case.get("p_cache"), 3),
        DASH if wall is None else f"{wall:.4g}", fmt(case.get("tokens_per_second"), 1),
        times(case.get("speedup_over_ar")),
        f"{reasons.get('stop', 0)}/{reasons.get('length', 0)}",
    ]


def model_text(model: dict) -> str:
    parts = [f"`{model.get('path', DASH)}`", str(model.get("model_type", DASH)),
             f"{model.get('num_layers', DASH)} layers", f"hidden {model.get('hidden_size', DASH)}",
             f"vocab {model.get('vocab_size', DASH)}", str(model.get("dtype", DASH))]
    if model.get("checkpoint_sha256"):
        parts.append(f"safetensors sha256 {model['checkpoint_sha256'][:16]}…")
    training = model.get("training")
    if isinstance(training, dict) and "steps" in training:
        parts.append(f"trained {training['steps']} steps")
    return ", ".join(parts)


def sweep_body(data: dict, plot_link: str | None) -> list[str]:
    params, cases = data.get("params") or {}, data["cases"]
    kind = measurement(data)
    lines = [
        f"Model: {model_text(data.get('model') or {})}.",
        "",
        f"Batch of B = the {len(data.get('prompts') or [])} prompts cycled to B; greedy; "
        f"max_new_tokens {num(params.get('max_new_tokens'))}; stop ids "
        f"{num(params.get('stop_token_ids'))}; page size {num(params.get('page_size'))}; "
        f"{num(params.get('warmup'))} warm-up + median of {num(params.get('repeats'))} "
        f"run(s); CUDA graphs {num(params.get('cuda_graph'))}; torch threads "
        f"{num(params.get('threads'))}.",
        "",
    ]
    prompts = data.get("prompts") or []
    if prompts:
        lines += ["<details><summary>Prompts</summary>", "",
                  *[f"{i}. `{p}`" for i, p in enumerate(prompts, 1)], "", "</details>", ""]
    lines += [f"Full grid ({kind}; wall time and tok/s are {kind}s):", "",
              *markdown_table(SWEEP_HEADERS, [[cell(v) for v in sweep_row(c)] for c in cases]),
              ""]
    unequal = [c for c in cases if c.get("outputs_equal_across_runs") is False]
    if unequal:
        lines += ["Points whose tokens differed between runs: " + "; ".join(
            f"{c['mode']} B={c['batch']} W={c.get('window')} threshold={c.get('threshold')}"
            for c in unequal) + ".", ""]
    policy = data.get("window_policy") or []
    if policy:
        rows = [[str(r["mode"]), num(r["batch"]), num(r["threshold"]), num(r["penalty"]),
                 num(r["best_window"]), fmt(r["best_tokens_per_second"], 1),
                 num(r["auto_window"]), fmt(r["auto_tokens_per_second"], 1),
                 times(r["auto_over_best"])] for r in policy]
        lines += [f"Window policy (`model_min.auto_window`) against the best swept window "
                  f"({kind}):", "",
                  *markdown_table(["mode", "B", "threshold", "penalty", "best W",
                                   "best tok/s", "auto W", "auto tok/s", "auto / best"],
                                  [[cell(v) for v in row] for row in rows]), ""]
    if plot_link:
        lines += [f"![tokens per forward and p_cache per mode and threshold ({kind})]"
                  f"({plot_link})", ""]
    return lines


def sweep_markdown(data: dict, plot_link: str | None = None) -> str:
    """The stand-alone Markdown file ``bench.sweep`` writes next to its JSON; it shows the
    plot next to it (``sweep_<model>.png``, drawn by ``bench.sweep`` where matplotlib is
    installed, else by ``python -m bench.report``)."""
    name = (data.get("model") or {}).get("name", "model")
    plot_link = plot_link or f"sweep_{name}.png"
    lines = [f"# Throughput sweep of model_min.Generator: {name} ({measurement(data)})", "",
             *header_lines(data, []), *sweep_body(data, plot_link)]
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------- sweep plot

SERIES_COLORS = {"streaming": "#1f77b4", "blockwise": "#d62728", "ar": "#555555"}
EXTRA_COLORS = ("#2ca02c", "#9467bd", "#8c564b")
# (case key, label, decimals of the value printed at each point: those of the table)
PLOT_METRICS = (("tokens_per_forward", "tokens / forward", 2), ("p_cache", "p_cache", 3))
PLOT_DPI = 110
# The PNG text chunk that names what a sweep plot was drawn from (sweep_plot_digest).
PLOT_DIGEST_KEY = "bench.report sweep plot sha256"


def mode_color(mode: str, modes: list[str]) -> str:
    if mode in SERIES_COLORS:
        return SERIES_COLORS[mode]
    others = [m for m in modes if m not in SERIES_COLORS]
    return EXTRA_COLORS[others.index(mode) % len(EXTRA_COLORS)]


def threshold_label(threshold) -> str:
    return "none" if threshold is None else f"{threshold:g}"


def sweep_plot_slice(data: dict) -> dict:
    """The points the plot shows: the largest batch, one penalty (0.02 when swept)."""
    cases = data["cases"]
    batch = max(c["batch"] for c in cases)
    windowed = [c for c in cases if c["mode"] != "ar" and c["batch"] == batch]
    penalties = ordered_union([[c["penalty"] for c in windowed]])
    penalty = 0.02 if 0.02 in penalties else (penalties[0] if penalties else None)
    windowed = [c for c in windowed if c["penalty"] == penalty]
    return {
        "batch": batch,
        "penalty": penalty,
        "windows": sorted({c["window"] for c in windowed}),
        "thresholds": sorted({c["threshold"] for c in windowed},
                             key=lambda t: (t is not None, t or 0.0)),
        "modes": ordered_union([[c["mode"] for c in cases]]),
        "windowed": windowed,
        "ar": [c for c in cases if c["mode"] == "ar" and c["batch"] == batch],
    }


def sweep_plot_size(data: dict) -> tuple[float, float]:
    """Inches: a 4.2 x 3.4 panel per window and metric, plus the titles."""
    windows = max(1, len(sweep_plot_slice(data)["windows"]))
    return 0.8 + 4.2 * windows, 1.0 + 3.4 * len(PLOT_METRICS)


def draw_sweep(figure, data: dict) -> None:
    """Tokens per forward and p_cache against the threshold: one row of panels per metric
    (a shared y axis from 0), one column per window, one series per mode (a line with a
    marker and the value at each threshold; AR, which has no threshold, a dashed line with
    its value)."""
    view = sweep_plot_slice(data)
    windows = view["windows"] or [None]
    thresholds = view["thresholds"] or [None]
    axes = figure.subplots(len(PLOT_METRICS), len(windows), squeeze=False, sharey="row")
    for row, (metric, label, digits) in enumerate(PLOT_METRICS):
        values = [c[metric] for c in view["windowed"] + view["ar"] if c.get(metric) is not None]
        top = 1.15 * max(values or [1.0])
        for col, window in enumerate(windows):
            axis = axes[row][col]
            series = {}  # mode -> [(threshold index, value)]
            for mode in view["modes"]:
                color = mode_color(mode, view["modes"])
                if mode == "ar":
                    for case in view["ar"]:
                        if case.get(metric) is None:
                            continue
                        axis.axhline(case[metric], color=color, linestyle="--", linewidth=2,
                                     label="ar (no threshold)")
                        axis.annotate(f"ar {case[metric]:.{digits}f}",
                                      (len(thresholds) - 0.5, case[metric]),
                                      textcoords="offset points", xytext=(-3, 3), ha="right",
                                      fontsize=7, color=color)
                    continue
                points = []
                for index, threshold in enumerate(thresholds):
                    case = next((c for c in view["windowed"] if c["mode"] == mode
                                 and c["window"] == window and c["threshold"] == threshold),
                                None)
                    if case is not None and case.get(metric) is not None:
                        points.append((index, case[metric]))
                if points:
                    series[mode] = points
                    axis.plot(*zip(*points), color=color, marker="o", linewidth=2, label=mode)
            # each value beside its marker: the highest at a threshold above it, others below
            for mode, points in series.items():
                for x, y in points:
                    highest = max((v for p in series.values() for i, v in p if i == x))
                    first = next(m for m, p in series.items() if (x, highest) in p)
                    above = y == highest and mode == first
                    axis.annotate(f"{y:.{digits}f}", (x, y), textcoords="offset points",
                                  xytext=(0, 6 if above else -11), ha="center", fontsize=7,
                                  color=mode_color(mode, view["modes"]))
            axis.set_title(f"{label}, W={window}" if window is not None else label,
                           fontsize=10)
            axis.set_xticks(range(len(thresholds)), [threshold_label(t) for t in thresholds])
            axis.set_xlim(-0.5, len(thresholds) - 0.5)
            axis.set_ylim(0, top)
            axis.set_xlabel("entropy threshold (nats)")
            axis.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="best")
    name = (data.get("model") or {}).get("name", "model")
    figure.suptitle(f"{name}: batch {view['batch']}, penalty {num(view['penalty'])}\n"
                    f"{measurement(data)}, {data.get('date', DASH)}", fontsize=11)


# What a sweep plot is drawn by: a change to any of these makes every sweep plot stale.
SWEEP_PLOT_CODE = (SERIES_COLORS, EXTRA_COLORS, PLOT_METRICS, PLOT_DPI, mode_color,
                   threshold_label, sweep_plot_slice, sweep_plot_size, draw_sweep)


def sweep_plot_digest(data: dict) -> str:
    """SHA-256 of the sweep result and of the code that draws its plot: stored in the PNG
    (:data:`PLOT_DIGEST_KEY`), so ``--check`` tells a current plot from a stale one without
    matplotlib, and whatever matplotlib release drew it."""
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode())
    for part in SWEEP_PLOT_CODE:
        digest.update((inspect.getsource(part) if callable(part) else repr(part)).encode())
    return digest.hexdigest()


def write_sweep_plot(data: dict, path: Path) -> Path | str:
    """The sweep's plot as a PNG at ``path`` (``common.save_plot``): ``path``, or the
    reason there is none (e.g. ``common.NO_MATPLOTLIB``)."""
    return save_plot(lambda figure: draw_sweep(figure, data), path,
                     size=sweep_plot_size(data), dpi=PLOT_DPI,
                     metadata={PLOT_DIGEST_KEY: sweep_plot_digest(data)})


def sweep_plot_is_current(data: dict, path: Path) -> bool:
    """Whether ``path`` is a PNG drawn from ``data`` by the current plot code."""
    try:
        return png_text(path).get(PLOT_DIGEST_KEY) == sweep_plot_digest(data)
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------- the report


def is_sweep(data) -> bool:
    return isinstance(data, dict) and data.get("benchmark") == "bench.sweep"


def relative(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path, out.parent)).as_posix()


def plot_files(path: Path, data, plots: dict[Path, dict]) -> list[Path]:
    """Plots that belong to a result file: its ``plot`` entry and the same-stem PNG
    (existing ones, or a sweep plot of this report)."""
    names = [path.with_suffix(".png").name]
    if isinstance(data.get("plot"), str):
        names.insert(0, Path(data["plot"]).name)
    candidates = [path.parent / name for name in ordered_union([names])]
    return [p for p in candidates if p.exists() or p in plots]


def is_pytest_benchmark(data) -> bool:
    """A pytest-benchmark JSON file (``--benchmark-json``, e.g. bench/host_time.py's)."""
    return (isinstance(data, dict) and isinstance(data.get("benchmarks"), list)
            and "machine_info" in data)


def pytest_benchmark_body(data: dict) -> list[str]:
    """One row per benchmark: its parameters, median and rounds (machine_info and the
    other statistics stay in the JSON)."""
    rows = []
    for entry in data["benchmarks"]:
        stats = entry.get("stats") or {}
        median = stats.get("median")
        rows.append([cell(num(entry.get("params") or entry.get("name", DASH))),
                     fmt(median * 1e6, 1) if isinstance(median, (int, float)) else DASH,
                     num(stats.get("rounds"))])
    lines = ["### Benchmarks", "", *markdown_table(["benchmark", "median µs", "rounds"], rows), ""]
    if isinstance(data.get("summary"), dict):
        lines += ["### Summary", "", *key_value_table(data["summary"]), ""]
    return lines


def benchmark_name(data: dict) -> str:
    if "benchmark" in data:
        return data["benchmark"]
    return "bench.eval_served" if is_eval_served(data) else "unknown benchmark"


def is_eval_served(data) -> bool:
    return isinstance(data, dict) and str(data.get("name", "")).startswith("eval_served")


def eval_served_body(data: dict) -> list[str]:
    """bench.eval_served: per task, one row per setting (its greedy run, its seeds' spread)."""
    plan = data["plan"]
    lines = ["### Figures", "",
             f"Sampled at temperature {plan['temperature']}, seeds {plan['seeds']}.", ""]
    for task in plan["tasks"]:
        rows = []
        for row in (row for row in data["rows"] if row["task"] == task):
            greedy, sampled = row.get("greedy") or {}, row["sampled"]
            rows.append([cell(row["setting"]),
                         f"{fmt(greedy.get('value'), 3)} ± {fmt(greedy.get('stderr'), 3)}",
                         f"{fmt(sampled['mean'], 3)} ({fmt(sampled['min'], 3)}–"
                         f"{fmt(sampled['max'], 3)})",
                         fmt(row["tokens_per_forward"], 2), fmt(row["wall_vs_ar_greedy"], 2),
                         fmt(row["wall_vs_ar_sampled"], 2)])
        metric = next((row["metric"] for row in data["rows"] if row["task"] == task), "?")
        lines += [f"Task {task} ({plan['items'][task]} items), metric `{metric}`:", "",
                  *markdown_table([measurement(data), "greedy ± stderr",
                                   "sampled mean (min–max)", "tokens / forward",
                                   "wall / AR greedy", "wall / AR sampled"],
                                  rows), ""]
    return lines + [data.get("checks_note", ""), ""]


def body_lines(data: dict, plot_link: str | None) -> list[str]:
    if data.get("benchmark") == "compile_facts" and isinstance(data.get("cases"), list):
        # schedules per shape and configuration: too many for one table here
        return ["### Summary", "", *key_value_table({"summary": data.get("summary", {})}), "",
                f"Every schedule and compiled variant: `{data.get('op')}.md` beside the JSON.",
                ""]
    if is_sweep(data):
        return sweep_body(data, plot_link)
    if is_eval_served(data):
        return eval_served_body(data)
    if is_pytest_benchmark(data):
        return pytest_benchmark_body(data)
    groups = case_groups(data)
    if groups:
        return kernel_body(data, groups)
    cases = data.get("cases")
    if isinstance(cases, list) and cases and all(isinstance(c, dict) for c in cases):
        return case_list_body(data)
    rest = {k: v for k, v in data.items() if k not in HEADER_KEYS}
    return ["### Figures", "", *key_value_table(rest), ""]


def section(path: Path, data, error: str | None, out: Path,
            sweep_plots: dict[Path, dict]) -> tuple[list[str], list[Path]]:
    """A result file's section and the plots it links."""
    name = relative(path, out)
    title = f"## {path.parent.name}/{path.name}"
    if error is not None or not isinstance(data, dict):
        reason = error or f"top level is a {type(data).__name__}, not an object"
        lines = [title, "", f"[JSON]({name}) could not be rendered as a result: {reason}.", ""]
        if error is None:
            lines += key_value_table({"value": data}) + [""]
        return lines, []
    plots = plot_files(path, data, sweep_plots)
    links = [f"[JSON]({name})"]
    if path.with_suffix(".md").exists():
        links.append(f"[Markdown]({relative(path.with_suffix('.md'), out)})")
    links += [f"[plot]({relative(p, out)})" for p in plots]
    lines = [f"{title}: {benchmark_name(data)}", "",
             *header_lines(data, links)]
    try:
        lines += body_lines(data, None)
    except Exception as exc:  # noqa: BLE001 - an unexpected shape falls back, never crashes
        rest = {k: v for k, v in data.items() if k not in HEADER_KEYS}
        lines += [f"(layout not recognised: {type(exc).__name__}: {exc}; flattened)", "",
                  *key_value_table(rest), ""]
    lines += [f"![{p.name} ({measurement(data)})]({relative(p, out)})" for p in plots]
    return [*lines, ""], plots


def render(results: Path, out: Path) -> tuple[str, dict[Path, dict]]:
    """REPORT.md's text, and the sweep plots it shows (``{png path: sweep result}``), from
    ``results/*/*.json``. Needs no matplotlib: the plots are drawn by :func:`main`."""
    files = sorted(results.glob("*/*.json"))
    loaded, sweep_plots = [], {}
    for path in files:
        try:
            data, error = json.loads(path.read_text()), None
        except (OSError, ValueError) as exc:
            data, error = None, f"{type(exc).__name__}: {exc}"
        loaded.append((path, data, error))
        if is_sweep(data):
            try:
                sweep_plot_slice(data)
            except Exception:  # noqa: BLE001 - no plot for a sweep file of another shape
                continue
            sweep_plots[path.with_suffix(".png")] = data
    lines = [
        "# Benchmark report",
        "",
        f"Generated by `{COMMAND}` from every `bench/results/<device>/*.json`; do not edit "
        f"by hand. `{COMMAND} --check` fails when this file is out of date. Every figure "
        "is copied from a result file (formatted, never recomputed) and labelled a CPU or "
        "GPU measurement.",
        "",
    ]
    index = []
    for path, data, _ in loaded:
        ok = isinstance(data, dict)
        index.append([f"[{path.parent.name}/{path.name}](#{anchor(path, data)})",
                      cell(data.get("benchmark", DASH)) if ok else DASH,
                      cell(device_text(data)) if ok else DASH,
                      measurement(data) if ok else DASH,
                      cell(data.get("date", DASH)) if ok else DASH])
    lines += [*markdown_table(["result file", "benchmark", "device", "measurement", "date"],
                              index), ""]
    linked = set(sweep_plots)
    for path, data, error in loaded:
        body, plots = section(path, data, error, out, sweep_plots)
        lines += body
        linked.update(plots)
    others = sorted(p for p in results.glob("*/*.png") if p not in linked)
    if others:
        lines += ["## Other plots", "",
                  *[f"- [{p.parent.name}/{p.name}]({relative(p, out)})" for p in others], ""]
    return "\n".join(lines).rstrip("\n") + "\n", sweep_plots


def anchor(path: Path, data) -> str:
    """GitHub's anchor of the section heading of ``path``."""
    heading = f"{path.parent.name}/{path.name}"
    if isinstance(data, dict):
        heading += f": {benchmark_name(data)}"
    text = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="folder of <device>/*.json result files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the report to write")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the report or a plot is out of date")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    text, sweep_plots = render(args.results, args.out)
    stale_plots = [path for path, data in sweep_plots.items()
                   if not sweep_plot_is_current(data, path)]
    if args.check:
        stale = [path for path in [args.out] if not path.exists() or path.read_text() != text]
        stale += stale_plots
        for path in stale:
            print(f"out of date: {path}")
        if stale:
            print(f"run `{COMMAND}` to regenerate")
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.write_text(text)
    missing = []
    for path in stale_plots:
        outcome = write_sweep_plot(sweep_plots[path], path)
        if isinstance(outcome, str):
            missing.append(path)
            print(f"{path} not written: {outcome}")
    drawn = len(stale_plots) - len(missing)
    print(f"wrote {args.out}" + (f" and {drawn} plot(s)" if drawn else ""))
    if missing:
        print("the report shows plots that are missing or stale: install the bench extra "
              "(pip install -c constraints.txt -e \".[bench]\") and run it again")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
