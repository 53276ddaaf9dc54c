"""Microbenchmark of select_tokens: the fused Triton kernels vs the batched PyTorch
implementation vs the reference engine's per-sequence sampler.

    python -m bench.select_tokens [--out-dir bench/results/<device>/] [--quick]
    python -m bench.select_tokens --cpu-smoke [--interpret] [--out-dir DIR]

On a CUDA GPU, at vocabulary 151936 (bf16 logits) and R in {1, 16, 64, 256, 1024} mask
rows, laid out as decode steps of 16 mask rows per sequence (R = 1: one sequence of one
row; R = 256: 16 sequences x 16 rows), in two parameter sets:

- ``greedy``: temperature 0 (the project's default);
- ``temperature``, ``top_k``, ``top_p``, ``top_k_top_p``: temperature 0.7 alone, with
  top-k 50, with top-p 0.9, with both;

it times three implementations of one decode step's selection:

- ``triton``: ``select_tokens_triton`` (wedlm_kernels.ops.select);
- ``torch``: ``select_tokens_torch``, the batched PyTorch implementation;
- ``engine``: :func:`engine_sampler`, a re-statement of the reference engine's sampler
  (entropy by ``torch.distributions.Categorical`` in the logits' dtype, softmax argmax,
  ``torch.topk`` then a full-vocabulary sort for top-p, ``torch.multinomial``, and the
  threshold selection with ``nonzero``/``argmin``/``.item()``), one sequence at a time in a
  Python loop with its host synchronisations, on the same batch layout (greedy and
  top_k_top_p only).

Timing modes (bench/common.py): ``eager`` (do_bench, L2 flushed before each call) for all
three, ``graph`` (CUDA graph, warm L2) for the two that can be captured (the engine sampler
synchronises with the host), with the graph replays of a slow implementation capped at
about 2 s in all. For every case: median microseconds with the sample count, the
bytes-moved model (the logits read once plus the outputs), GB/s, the fraction of the
device-to-device copy bandwidth measured in the same run, and the speed-up of the Triton
launcher over the two others. Before timing, each case checks the Triton result against the
PyTorch implementation on the same inputs (entropy within 1e-4 relative, greedy tokens and
selection equal, sampled tokens equal on at least 99% of the rows: the rest are fp32
near-ties).

Results: ``select_tokens.json``, ``select_tokens.md`` and ``select_tokens.png`` (when
matplotlib is installed) in ``--out-dir`` (default ``bench/results/<device-name-slug>/``).
Without a CUDA GPU the default mode prints that GPU benchmarks are skipped and exits 0;
``--cpu-smoke`` runs the whole code path on CPU tensors at tiny shapes with the PyTorch
implementation and the engine sampler (``--interpret`` adds the Triton launcher through
Triton's interpreter), writing to a temporary folder unless ``--out-dir`` is given.
"""

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench import common
from bench.common import Timer, add_derived, fmt, fmt_rate, markdown_table

IMPLS = ("triton", "torch", "engine")
GRAPH_CAPTURABLE = ("triton", "torch")


@dataclass(frozen=True)
class Sizes:
    vocab: int
    rows: tuple[int, ...]
    rows_per_sequence: int
    dtype: torch.dtype
    threshold: float = 0.4
    penalty: float = 0.02


@dataclass(frozen=True)
class Params:
    name: str
    temperature: float
    top_k: int
    top_p: float
    engine: bool = False  # also time the reference-engine sampler (slow: a few sets only)


FULL = Sizes(vocab=151936, rows=(1, 16, 64, 256, 1024), rows_per_sequence=16,
             dtype=torch.bfloat16)
QUICK = replace(FULL, rows=(1, 16, 256))
SMOKE = Sizes(vocab=1000, rows=(1, 8), rows_per_sequence=4, dtype=torch.float32)
PARAMS = (
    Params("greedy", 0.0, 0, 1.0, engine=True),
    Params("temperature", 0.7, 0, 1.0),
    Params("top_k", 0.7, 50, 1.0),
    Params("top_p", 0.7, 0, 0.9),
    Params("top_k_top_p", 0.7, 50, 0.9, engine=True),
)

METHODS = {
    "eager": (
        "triton.testing.do_bench, every per-call time kept: the L2 cache is flushed before "
        "each call and device events bracket one call (cold L2). The engine sampler's host "
        "synchronisations are inside the bracket."
    ),
    "graph": (
        "calls_per_sample calls captured back to back in one CUDA graph, sample = replay "
        "time / calls: no launch overhead, warm L2. Not for the engine sampler (it "
        "synchronises with the host, which a graph cannot capture)."
    ),
    "cpu": "time.perf_counter around single calls on CPU tensors after one warm-up.",
    "copy_bandwidth": (
        "a device-to-device torch copy of random bytes, (bytes read + bytes written) / "
        "median time, timed like the eager mode in the same run."
    ),
    "bytes_model": (
        "the logits read once plus the three outputs written once (13 bytes per row); the "
        "sampling path reads each row more than once, so its GB/s is a lower bound on the "
        "traffic."
    ),
    "logits": (
        "N(0, 2^2) per entry plus +6..+12 on 8 random tokens per row (a peaked distribution "
        "like a language model's), rounded to the benchmark dtype."
    ),
    "engine": (
        "bench.select_tokens.engine_sampler: the reference engine's sampler re-stated, one "
        "sequence at a time with its host synchronisations."
    ),
}


# ---------------------------------------------------------------------------- the inputs


def make_inputs(sizes: Sizes, params: Params, num_rows: int, device: torch.device,
                seed: int) -> tuple:
    """One decode step's select_tokens arguments: sequences of ``rows_per_sequence`` mask
    rows (fewer when ``num_rows`` is smaller), each at its own context length."""
    generator = torch.Generator().manual_seed(seed)
    per_sequence = min(sizes.rows_per_sequence, num_rows)
    num_seqs = -(-num_rows // per_sequence)  # the last sequence may be shorter
    logits = torch.randn(num_rows, sizes.vocab, generator=generator) * 2
    peaks = torch.randint(0, sizes.vocab, (num_rows, 8), generator=generator)
    logits.scatter_add_(1, peaks, 6 + 6 * torch.rand(num_rows, 8, generator=generator))
    context = torch.randint(16, 4000, (num_seqs,), generator=generator)
    row = torch.arange(num_rows)
    row_pos = context[row // per_sequence] + row % per_sequence
    cu_rows = torch.tensor([*range(0, num_rows, per_sequence), num_rows], dtype=torch.int32)
    full = torch.full
    return (
        logits.to(sizes.dtype).to(device),
        cu_rows.to(device),
        row_pos.to(device),
        full((num_seqs,), params.temperature, dtype=torch.float32).to(device),
        full((num_seqs,), params.top_k, dtype=torch.int32).to(device),
        full((num_seqs,), params.top_p, dtype=torch.float32).to(device),
        full((num_seqs,), sizes.threshold, dtype=torch.float32).to(device),
        full((num_seqs,), sizes.penalty, dtype=torch.float32).to(device),
        torch.randint(0, 2**62, (num_seqs,), generator=generator).to(device),
    )


def bytes_moved(args: tuple) -> dict:
    logits = args[0]
    num_rows = logits.shape[0]
    breakdown = {"logits": logits.numel() * logits.element_size(),
                 "outputs": num_rows * (8 + 1 + 4)}
    return {"total": sum(breakdown.values()), "breakdown": breakdown}


# -------------------------------------------------------------- the reference engine's sampler


def _engine_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0:
        return logits
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _engine_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Sort the whole vocabulary, drop the tokens after the cumulative probability first
    exceeds top_p (the crossing token kept), scatter the mask back."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    drop = cumulative > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def engine_sampler(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference engine's per-sequence sampler, re-stated with select_tokens' batch
    layout and outputs. Per sequence, as the engine does it per request: its parameters come
    to the host, then Categorical entropy of the mask rows in the logits' dtype, the greedy
    argmax of the softmax, top-k (``torch.topk``), top-p (full sort), ``torch.multinomial``
    on softmax(filtered / T), the distance-penalised threshold selection (``nonzero``, or
    the ``argmin`` fallback) and the chosen tokens read back one ``.item()`` at a time.
    The engine draws from torch's global generator (``seed`` is unused); every row counts as
    valid (the benchmark has no padding rows)."""
    offsets = cu_rows.tolist()
    positions = row_pos.tolist()
    temperatures, top_ks, top_ps = temperature.tolist(), top_k.tolist(), top_p.tolist()
    thresholds, penalties = threshold.tolist(), penalty.tolist()
    token = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    selected = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    entropy = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if end <= start:
            continue
        rows = logits[start:end]
        row_entropy = torch.distributions.Categorical(logits=rows).entropy()
        greedy = torch.softmax(rows, dim=-1).argmax(dim=-1)
        if temperatures[b] == 0:
            sampled = greedy
        else:
            filtered = _engine_top_p(_engine_top_k(rows, int(top_ks[b])), top_ps[b])
            probs = torch.softmax(filtered / temperatures[b], dim=-1)
            sampled = torch.multinomial(probs, num_samples=1).squeeze(-1)
        slots = torch.tensor(positions[start:end], device=logits.device, dtype=torch.float)
        adjusted = row_entropy + (slots - slots[0]) * penalties[b]
        chosen = (adjusted < thresholds[b]).nonzero(as_tuple=True)[0]
        fill = chosen.tolist() if chosen.numel() > 0 else [int(adjusted.argmin().item())]
        tokens = [int(sampled[k].item()) for k in fill]
        for k, value in zip(fill, tokens):
            token[start + k] = value
            selected[start + k] = True
        entropy[start:end] = row_entropy.float()
    return token, selected, entropy


# ------------------------------------------------------------------------------- one case


def check_against_torch(triton_out: tuple, torch_out: tuple, params: Params) -> dict:
    token, selected, entropy = (t.cpu() for t in triton_out)
    torch_token, torch_selected, torch_entropy = (t.cpu() for t in torch_out)
    entropy_error = float(((entropy.double() - torch_entropy.double()).abs()
                           / torch_entropy.double().abs().clamp_min(1e-3)).max())
    same_tokens = float((token == torch_token).double().mean())
    same_selection = bool(torch.equal(selected, torch_selected))
    if params.temperature > 0:
        ok = entropy_error < 1e-4 and same_tokens >= 0.99
    else:
        ok = entropy_error < 1e-4 and same_tokens == 1.0 and same_selection
    return {"ok": ok, "max_relative_entropy_error": entropy_error,
            "fraction_of_equal_tokens": same_tokens, "equal_selection": same_selection}


def filter_paths(args: tuple) -> dict:
    """How the Triton filter kernel drew the top-k / top-p rows of ``args`` (an untimed
    call): rows per path of ``select.PATH_NAMES``."""
    from wedlm_kernels.ops import select

    logits = args[0]
    num_splits, _ = select.split_plan(logits.shape[0], logits.shape[1], logits.device)
    workspace = select.SelectWorkspace.empty(logits.shape[0], logits.shape[1], num_splits,
                                             logits.device)
    workspace.path.zero_()
    select.select_tokens_triton(*args, workspace=workspace)
    path = workspace.path.cpu()
    return {name: int((path == code).sum()) for code, name in select.PATH_NAMES.items()}


def run_case(sizes: Sizes, params: Params, num_rows: int, launchers: dict, timer: Timer,
             seed: int) -> dict:
    args = make_inputs(sizes, params, num_rows, timer.device, seed)
    case = {
        "params": {"rows": num_rows, "sequences": args[1].shape[0] - 1,
                   "rows_per_sequence": min(sizes.rows_per_sequence, num_rows),
                   "parameters": params.name},
        "bytes": bytes_moved(args),
        "timings": {},
        "check": {},
    }
    if launchers.get("triton") is not None:
        case["check"]["triton_vs_torch"] = check_against_torch(
            launchers["triton"](*args), launchers["torch"](*args), params)
        case["filter_paths"] = filter_paths(args)
    for impl in IMPLS:
        launcher = launchers.get(impl)
        if launcher is None or (impl == "engine" and not params.engine):
            continue
        def call(launcher=launcher):
            return launcher(*args)

        if timer.cuda:
            case["timings"][impl] = time_on_gpu(call, timer, impl in GRAPH_CAPTURABLE)
        else:
            case["timings"][impl] = timer.all_modes(call)
    return case


def time_on_gpu(call, timer: Timer, capturable: bool) -> dict:
    """Eager timing, then (if ``capturable``) graph timing with the number of replays
    capped so that one implementation spends about 2 s in graph replays (the slow
    baselines take tens of milliseconds per call)."""
    timings = {}
    try:
        eager = timer.time(call, "eager", None)
        timings["eager"] = eager.to_json()
        if capturable:
            replays = max(3, min(timer.replays, int(2e5 / max(eager.median_us, 1.0))))
            timings["graph"] = common.time_graph_cuda(
                call, replays, estimate_us=eager.median_us).to_json()
    except Exception as error:  # noqa: BLE001 - recorded in the report
        mode = "graph" if "eager" in timings else "eager"
        timings[mode] = {"error": f"{type(error).__name__}: {error}"}
        timer.check_context()
    return timings


# ------------------------------------------------------------------------------ reporting


def case_table(cases: list[dict], mode: str) -> list[str]:
    impls = [impl for impl in IMPLS if any(mode in c["timings"].get(impl, {}) for c in cases)]
    headers = (["rows", "B × rows", "MB moved"] + [f"{impl} µs" for impl in impls]
               + ["triton GB/s", "triton % copy BW"]
               + [f"× over {impl}" for impl in impls if impl != "triton" and "triton" in impls]
               + ["check"])
    lines = []
    for case in cases:
        p = case["params"]
        row = [str(p["rows"]), f"{p['sequences']} × {p['rows_per_sequence']}",
               fmt(case["bytes"]["total"] / 1e6, 2)]
        for impl in impls:
            timing = case["timings"].get(impl, {}).get(mode, {})
            row.append("error" if "error" in timing else fmt(timing.get("median_us"), 1))
        fraction = case["fraction_of_copy_bandwidth"].get("triton", {}).get(mode)
        row += [fmt_rate(case["gb_per_s"].get("triton", {}).get(mode)),
                fmt(None if fraction is None else 100 * fraction, 1, "%")]
        for impl in impls:
            if impl != "triton" and "triton" in impls:
                row.append(fmt(case["speedup"].get(f"triton_over_{impl}", {}).get(mode), 1, "×"))
        check = case["check"].get("triton_vs_torch")
        row.append("—" if check is None else ("ok" if check["ok"] else "MISMATCH"))
        lines.append(row)
    return markdown_table(headers, lines)


def write_markdown(report: dict, path: Path) -> None:
    device, versions, copy = report["device"], report["versions"], report["copy_bandwidth"]
    shapes = report["shapes"]
    lines = [
        "# select_tokens microbenchmark",
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
        f"Vocabulary {shapes['vocab']}, {shapes['dtype']} logits, up to "
        f"{shapes['rows_per_sequence']} mask rows per sequence, threshold "
        f"{shapes['threshold']}, penalty {shapes['penalty']}. Triton launcher: "
        f"{report['triton']}.",
        f"Copy bandwidth (same run): **{fmt(copy['gb_per_s'], 0)} GB/s** "
        f"({copy['bytes_copied'] / 2**20:.0f} MiB copied, bytes read + written over the "
        f"median of {copy['timing']['samples']} copies).",
        "",
    ]
    for name, result in report["parameters"].items():
        p = result["params"]
        lines += [f"## {name}: temperature {p['temperature']}, top-k {p['top_k']}, "
                  f"top-p {p['top_p']}", ""]
        for message in result.get("case_errors", []):
            lines += [f"**Case failed:** {message}", ""]
        if result.get("error"):
            lines += [f"**Error:** {result['error']}", ""]
        for mode in report["modes"]:
            if result["cases"]:
                lines += [f"Mode `{mode}`: {METHODS[mode]}", ""]
                lines += case_table(result["cases"], mode) + [""]
    lines += ["## How it is measured", ""]
    lines += [f"- **{name}**: {text}" for name, text in METHODS.items()]
    lines += [f"- **plot**: {report['plot']}", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> Path | str:
    """µs against the mask rows, one panel per parameter set (``common.save_plot``)."""
    count = len(report["parameters"])
    return common.save_plot(lambda figure: draw_plot(figure, report), path,
                            size=(4.5 * count, 4.5))


def draw_plot(figure, report: dict) -> None:
    mode = report["modes"][0]
    axes = figure.subplots(1, len(report["parameters"]), squeeze=False)[0]
    colors = {"triton": "C0", "torch": "C1", "engine": "C2"}
    for axis, (name, result) in zip(axes, report["parameters"].items()):
        for impl, color in colors.items():
            points = [(c["params"]["rows"], c["timings"].get(impl, {}).get(mode, {})
                       .get("median_us")) for c in result["cases"]]
            points = [(x, y) for x, y in points if y]
            if points:
                axis.plot(*zip(*points), marker="o", color=color, label=impl)
        axis.set(title=f"{name} ({mode})", xlabel="mask rows R", ylabel="µs")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    figure.suptitle(f"{report['device']['name']}: select_tokens, V = "
                    f"{report['shapes']['vocab']}, {report['date']}")


SUMMARY_ROWS = (1, 16, 256, 1024)


def summarise(report: dict) -> dict:
    """Headline figures of the triton kernel (graph mode unless named): the largest ratio of
    a sampling parameter set's time to greedy's at the same rows (rows 1, 16, 256, 1024), the
    slowest sampling set at one row, greedy's lowest fraction of copy bandwidth at 256 rows
    or more, and the eager speed-up over the reference-engine sampler at 16 sequences x 16
    rows with top-k 50 and top-p 0.9. None where a case needed did not run."""
    by_rows = {name: {case["params"]["rows"]: case for case in result.get("cases", [])}
               for name, result in report["parameters"].items()}
    greedy = by_rows.get("greedy", {})
    sampling = [name for name in by_rows if name != "greedy"]

    def graph_us(case):
        return common.figure(case, "timings", "triton", "graph", "median_us")

    engine_set = [name for name in sampling
                  if (report["parameters"][name]["params"]["top_k"],
                      report["parameters"][name]["params"]["top_p"]) == (50, 0.9)]
    engine_case = by_rows[engine_set[0]].get(256) if engine_set else None
    if common.figure(engine_case, "params", "sequences") != 16:
        engine_case = None
    return {
        "max_sampling_over_greedy": common.extreme(
            [common.ratio(graph_us(by_rows[name].get(rows)), graph_us(greedy.get(rows)))
             for name in sampling for rows in SUMMARY_ROWS], max),
        "max_sampling_1row_us": common.extreme(
            [graph_us(by_rows[name].get(1)) for name in sampling], max),
        "greedy_min_copy_bw_fraction_256plus": common.extreme(
            [common.figure(case, "fraction_of_copy_bandwidth", "triton", "graph")
             for rows, case in greedy.items() if rows >= 256], min),
        "speedup_over_engine_16x16": common.figure(
            engine_case, "speedup", "triton_over_engine", "eager"),
    }


def write_outputs(run: common.OpRun, report: dict, final: bool) -> None:
    run.write(report, final, write_markdown, write_plot, summarise)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.op_parser("bench.select_tokens", __doc__.split("\n\n")[0],
                              "tiny shapes on CPU tensors, no Triton unless --interpret")
    return common.parse_op_args(parser, argv)


def load_launchers(with_triton: bool) -> dict:
    from wedlm_kernels.ops import select

    return {"triton": select.select_tokens_triton if with_triton else None,
            "torch": select.select_tokens_torch, "engine": engine_sampler}


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    bench = common.start_op_run("select_tokens", args, argv,
                                8 * 2**20 if args.cpu_smoke else 2**30)
    print(f"copy bandwidth: {fmt(bench.copy['gb_per_s'], 0)} GB/s", flush=True)
    launchers = load_launchers(bench.with_triton)
    report = bench.report(
        triton=bench.triton_state("select_tokens_triton", "PyTorch implementation and the "
                                  "engine sampler only"),
        shapes={"vocab": sizes.vocab, "rows": list(sizes.rows),
                "rows_per_sequence": sizes.rows_per_sequence,
                "dtype": str(sizes.dtype).replace("torch.", ""),
                "threshold": sizes.threshold, "penalty": sizes.penalty},
        methods=METHODS, parameters={},
    )
    context_lost = None
    for params in PARAMS:
        result = {"params": {"temperature": params.temperature, "top_k": params.top_k,
                             "top_p": params.top_p}, "cases": []}
        report["parameters"][params.name] = result
        if context_lost:
            result["error"] = f"not run: the CUDA context was lost ({context_lost})"
            continue
        cases = [(f"R={num_rows}", lambda params=params, num_rows=num_rows: run_case(
            sizes, params, num_rows, launchers, bench.timer, args.seed))
            for num_rows in sizes.rows]
        context_lost = bench.run_group(
            result, cases, lambda case: add_derived(case, bench.copy["gb_per_s"]),
            lambda final: write_outputs(bench, report, final), prefix=f"{params.name} ")
    report["complete"] = context_lost is None
    write_outputs(bench, report, final=True)
    report["out_dir"] = str(bench.out_dir)
    return report


def failures(report: dict) -> list[str]:
    """Errors and mismatches of a finished report (the exit status is 1 if any)."""
    return [failure for name, result in report["parameters"].items()
            for failure in common.group_failures(result, name,
                                                 lambda case: f"R={case['params']['rows']}")]


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(argv, parse_args, run, failures, "select_tokens.md")


if __name__ == "__main__":
    sys.exit(main())
