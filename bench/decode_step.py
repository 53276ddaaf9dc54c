"""End-to-end decode step of model_min on a Qwen3-8B-shaped model with random bf16 weights.

    python -m bench.decode_step [--out-dir DIR] [--quick]     # CUDA (exits 0 without a GPU)
    python -m bench.decode_step --cpu-smoke [--out-dir DIR]   # tiny model on the CPU

The model has the sizes of Qwen3-8B (36 layers, hidden 4096, 32 query and 8 KV heads of
128, MLP 12288, vocabulary 151936) and random weights built on the device, so nothing is
downloaded. Two variants of the output layer set how many tokens a window forward commits:
"flat" logits (a small lm_head scale: every row has an entropy far above the threshold, so
the selection commits one token per forward) and "peaked" logits (a large scale: every mask
row passes the threshold, up to a whole window per forward).

For each mode (AR, streaming, block-wise), batch size, logits variant and CUDA graphs on or
off, the same prompts (128 random tokens each) are decoded twice with two lengths; the
marginal step time is (wall time of the long run - that of the short run) / (decode steps
of the long run - those of the short run), so prefill, admission and graph capture cancel
(each length is run once to warm up, then REPEATS times, twice with ``--quick``; medians). Reported per case: the
step time, tokens per forward, tokens per second (the same difference over tokens), and
for GPU runs the step's kernel time per category from the profiler (the same difference
over two profiled runs): GEMM, attention, the other WeDLM ops, elementwise (norms,
activation, adds, copies), and idle/host (step time minus kernel time).

The weight-read floor is the bytes a forward must read (every layer's weights, the final
norm and lm_head; the embedding is only gathered) over the device's copy bandwidth measured
in the same run. The roofline of a case adds the matmul bound: max(floor, 2 x non-embedding
parameters x live rows per step / the bf16 matmul rate measured in the same run (one
8192^3 GEMM)); live rows per step are the rows the requests fed (``Result.rows``, padding
excluded) over the same step difference. The summary (a top-level ``"summary"`` key of the
JSON) holds: ``ar_b1_step_over_floor``, ``streaming_b1_over_ar_b1``,
``eager_over_graph_b1_streaming``, ``readback_over_no_readback_b1_streaming`` (the B=1
streaming step reading its live rows back, over the step that replays all ``B * 2W`` rows
without a readback: model_min's ``row_readback``), ``streaming_b16_over_roofline``,
``streaming_b64_over_roofline`` (flat logits, graphs on unless stated),
``streaming_over_ar_toks_peaked_b{1,16,64}`` (tokens per second of streaming over AR with
peaked logits), ``adaptive_over_ar_toks_flat_min`` and ``adaptive_over_fixed_toks_peaked_min``
(the adaptive window's tokens per second, ``Generator(window_policy="adaptive")`` with the
floor its ``max_batch`` and the device give, over AR's with flat logits and over the fixed
window's with peaked ones, the least over B = 1, 16, 64 where they ran) and ``paged_attention_b1_q32_ctx512_us`` (one call in a CUDA graph: one
sequence, 32 query rows, 512 positions of context, Qwen3-8B heads, bf16). The JSON is
written after every case (``"complete": false`` until the summary is in). The host time
per op call is ``bench/host_time.py``'s.

``--cpu-smoke`` runs the same measurement on a tiny model (4 layers, hidden 64) on the CPU,
batch 1 and 2, no graphs, no profiler: every figure there is a CPU measurement. ``--quick``
(bench/gpu_check.sh's budget) runs B in {1, 16, 64} with graphs (and B = 1 without), two
repeats.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import (
    CPU_LABEL,
    RESULTS_ROOT,
    bench_main,
    command_line,
    copy_bandwidth,
    device_info,
    device_slug,
    fmt,
    markdown_table,
    ratio,
    time_cpu,
    time_eager_cuda,
    time_graph_cuda,
    utc_now,
    versions,
    write_json,
)
from model_min import Generator, SamplingParams
from model_min.config import ModelConfig
from model_min.model import LayerWeights, Model

QWEN3_8B = ModelConfig(
    model_type="qwen3", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
    qkv_bias=False, o_proj_bias=False, mask_token_id=151665,
)
TINY = ModelConfig(
    model_type="qwen3", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=96, vocab_size=300, rms_norm_eps=1e-6, rope_theta=1e4,
    max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True, qkv_bias=False,
    o_proj_bias=False, mask_token_id=299,
)
MODES = ("ar", "streaming", "blockwise")
WINDOW = 16
PAGE_SIZE = 16
PROMPT_TOKENS = 128
THRESHOLD = 0.4
PENALTY = 0.02
REPEATS = 3
# lm_head scale = the logits' standard deviation (see with_logits): 0.3 keeps every row's
# entropy near log V; at 300 the top logit is ahead of the next by tens of nats in most
# rows (entropy ~0), unless two random maxima happen to be close
LOGITS = {"flat": 0.3, "peaked": 300.0}
# decode steps of the two runs; peaked windows commit up to W tokens per forward
SHORT_STEPS, LONG_STEPS = 8, 24
CATEGORIES = ("gemm", "attention", "wedlm_ops", "elementwise")


@dataclass
class Case:
    mode: str
    batch: int
    logits: str
    graphs: bool
    # model_min's Generator(row_readback=...): "auto" (no live-row readback under graphs
    # while B * 2W <= MEMORY_BOUND_ROWS) or "every_step" (the step before it, for comparison)
    row_readback: str = "auto"
    # model_min's Generator(window_policy=...) of a streaming case: "fixed" or "adaptive"
    window_policy: str = "fixed"


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> Model:
    """A model of ``config``'s sizes with random weights (scaled so activations stay O(1))
    and an lm_head of unit scale (set its scale with :func:`with_logits`)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, columns: int) -> torch.Tensor:
        weight = torch.randn(rows, columns, generator=g, device=device, dtype=torch.float32)
        return weight.mul_(columns**-0.5).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=g, device=device)).to(dtype)

    c = config
    layers = [
        LayerWeights(
            input_norm=norm(c.hidden_size),
            qkv_weight=matrix(c.q_size + 2 * c.kv_size, c.hidden_size),
            qkv_bias=None, q_norm=norm(c.head_dim), k_norm=norm(c.head_dim),
            o_weight=matrix(c.hidden_size, c.q_size), o_bias=None,
            post_attention_norm=norm(c.hidden_size),
            gate_up_weight=matrix(2 * c.intermediate_size, c.hidden_size),
            down_weight=matrix(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    embed = torch.randn(c.vocab_size, c.hidden_size, generator=g, device=device).to(dtype)
    return Model(c, embed, layers, norm(c.hidden_size), matrix(c.vocab_size, c.hidden_size))


def with_logits(model: Model, base_lm_head: torch.Tensor, kind: str) -> None:
    """Scale lm_head for logits of standard deviation ``LOGITS[kind]``: the base matrix has
    entries of variance 1 / hidden and the final norm gives hidden states of unit RMS."""
    model.lm_head = base_lm_head * LOGITS[kind]


def forward_weights(model: Model) -> list[torch.Tensor]:
    """The weights a forward reads in full: every layer's, the final norm and lm_head (the
    embedding is gathered row by row, not read)."""
    tensors = [model.final_norm, model.lm_head]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return tensors


def non_embedding_parameters(model: Model) -> int:
    """Parameters a forward multiplies with: every layer's, the final norm's and lm_head's."""
    return sum(t.numel() for t in forward_weights(model))


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, time_fn) -> dict:
    """One ``size``^3 matmul of random ``dtype`` matrices: 2 size^3 FLOPs over its time."""
    g = torch.Generator(device=device).manual_seed(5)
    operands = [torch.randn(size, size, generator=g, device=device).to(dtype) for _ in range(2)]
    timing = time_fn(lambda: torch.mm(*operands))
    operands.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"size": size, "dtype": str(dtype), "timing": timing.to_json(),
            "tflop_per_s": 2 * size**3 / (timing.median_us * 1e-6) / 1e12}


def roofline_ms(floor_ms: float | None, parameters: int, rows_per_step: float | None,
                tflop_per_s: float | None) -> float | None:
    """max(weight-read floor, 2 x parameters x rows / matmul rate), in ms."""
    if floor_ms is None or rows_per_step is None or not tflop_per_s:
        return None
    return max(floor_ms, 2 * parameters * rows_per_step / (tflop_per_s * 1e12) * 1e3)


def weight_bytes(model: Model) -> int:
    """Bytes a forward reads: :func:`forward_weights`."""
    return sum(t.numel() * t.element_size() for t in forward_weights(model))


class CountingGenerator(Generator):
    """A Generator that counts the decode steps it runs: every step asks for its packed
    rows first (eager or graph replay), and one with no live row (0) runs nothing."""

    steps = 0

    def _rows_for_step(self, state):
        rows = super()._rows_for_step(state)
        if rows != 0:
            self.steps += 1
        return rows


def prompts_for(batch: int, config: ModelConfig, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    high = min(config.vocab_size, config.mask_token_id)
    return torch.randint(0, high, (batch, PROMPT_TOKENS), generator=g).tolist()


def new_tokens(case: Case, steps: int) -> int:
    """max_new_tokens for about ``steps`` decode steps."""
    per_forward = WINDOW if case.logits == "peaked" and case.mode != "ar" else 1
    return steps * per_forward


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _decode(generator: CountingGenerator, prompts, case: Case, max_new: int):
    generator.steps = 0
    params = SamplingParams(max_new_tokens=max_new, threshold=THRESHOLD, penalty=PENALTY,
                            seed=1)
    start = time.perf_counter()
    results = generator.generate(prompts, params, mode=case.mode)
    _synchronize(generator.model.device)
    return time.perf_counter() - start, generator.steps, results


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")):
        return "gemm"
    if "_paged_attention_kernel" in name or "_combine_splits_kernel" in name:
        return "attention"
    if any(key in name for key in ("_rope_kv_append_kernel", "_reorder_window_kernel",
                                   "_select_", "_commit_window_kernel")):
        return "wedlm_ops"
    return "elementwise"


def _kernel_ms(generator, prompts, case: Case, max_new: int) -> dict[str, float]:
    """GPU kernel time per category over one profiled generate call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        _decode(generator, prompts, case, max_new)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[kernel_category(event.name)] += event.device_time / 1e3
    return totals


def run_case(model: Model, case: Case, cuda_graph_ok: bool, profile_it: bool,
             repeats: int = REPEATS) -> dict:
    generator = CountingGenerator(
        model, window=WINDOW, page_size=PAGE_SIZE, max_batch=case.batch,
        max_cache_tokens=case.batch * (PROMPT_TOKENS + new_tokens(case, LONG_STEPS) + 4 * WINDOW),
        cuda_graph=case.graphs and cuda_graph_ok, row_readback=case.row_readback,
        window_policy=case.window_policy,
    )
    prompts = prompts_for(case.batch, model.config, seed=case.batch)
    lengths = {"short": new_tokens(case, SHORT_STEPS), "long": new_tokens(case, LONG_STEPS)}
    runs = {}
    for name, max_new in lengths.items():
        _decode(generator, prompts, case, max_new)  # warm-up: compilation, graph capture
        samples = [_decode(generator, prompts, case, max_new) for _ in range(repeats)]
        seconds = statistics.median(s[0] for s in samples)
        _, steps, results = samples[0]
        runs[name] = {
            "max_new_tokens": max_new, "seconds": seconds, "steps": steps,
            "tokens": sum(len(r.token_ids) for r in results),
            "rows": sum(r.rows for r in results),
            "tokens_per_forward": statistics.mean(r.tokens_per_forward for r in results),
        }
    short, long = runs["short"], runs["long"]
    step_ms = (long["seconds"] - short["seconds"]) / (long["steps"] - short["steps"]) * 1e3
    tokens_per_s = (long["tokens"] - short["tokens"]) / (long["seconds"] - short["seconds"])
    rows_per_step = (long["rows"] - short["rows"]) / (long["steps"] - short["steps"])
    result = {
        **vars(case), "graphs": case.graphs and cuda_graph_ok, "runs": runs,
        "step_ms": step_ms, "live_rows_per_step": rows_per_step,
        "tokens_per_forward": long["tokens_per_forward"],
        "tokens_per_s": tokens_per_s, "breakdown_ms": None,
    }
    if profile_it:
        short_ms = _kernel_ms(generator, prompts, case, short["max_new_tokens"])
        long_ms = _kernel_ms(generator, prompts, case, long["max_new_tokens"])
        steps = long["steps"] - short["steps"]
        breakdown = {k: (long_ms[k] - short_ms[k]) / steps for k in CATEGORIES}
        breakdown["idle_host"] = step_ms - sum(breakdown.values())
        result["breakdown_ms"] = breakdown
    return result


def paged_attention_probe_us(device: torch.device) -> float:
    """One wk.paged_attention call in a CUDA graph: 1 sequence, 32 rows, 512 positions."""
    import wedlm_kernels as wk

    g = torch.Generator(device=device).manual_seed(2)
    heads, kv_heads, head_dim, rows, context = 32, 8, 128, 32, 512
    pages = (context + rows) // PAGE_SIZE + 1
    q = torch.randn(rows, heads, head_dim, generator=g, device=device).bfloat16()
    k_cache, v_cache = (torch.randn(pages, PAGE_SIZE, kv_heads, head_dim, generator=g,
                                    device=device).bfloat16() for _ in range(2))
    args = (q, k_cache, v_cache, torch.arange(pages, dtype=torch.int32, device=device)[None],
            torch.tensor([0, rows], dtype=torch.int32, device=device),
            torch.tensor([context], dtype=torch.int32, device=device), head_dim**-0.5)
    return time_graph_cuda(lambda: wk.paged_attention(*args), replays=50).median_us


def summarise(cases: list[dict], floor_ms: float | None, graphs: bool) -> dict:
    """The headline ratios (``graphs``: of the cases with CUDA graphs; CPU runs have none).
    A ratio whose cases did not run (``--quick``, ``--batches``) is None."""

    def value(key, mode, batch=1, graphs=graphs, logits="flat", readback="auto",
              policy="fixed"):
        for case in cases:
            if (case["mode"], case["batch"], case["graphs"], case["logits"],
                    case.get("row_readback", "auto"), case.get("window_policy", "fixed")
                    ) == (mode, batch, graphs, logits, readback, policy):
                return case[key]
        return None

    def least(ratios):  # the smallest of the ratios whose cases ran (None: none did)
        found = [r for r in ratios if r is not None]
        return min(found) if found else None

    def step(mode, batch=1, graphs=graphs, logits="flat"):
        return value("step_ms", mode, batch, graphs, logits)

    summary = {
        "ar_b1_step_over_floor": ratio(step("ar"), floor_ms),
        "streaming_b1_over_ar_b1": ratio(step("streaming"), step("ar")),
        "eager_over_graph_b1_streaming": ratio(step("streaming", graphs=False),
                                               step("streaming", graphs=True)),
        # the step reading its live rows back over the step without (> 1: the readback
        # cost more than the padding rows; model_min's row_readback="auto")
        "readback_over_no_readback_b1_streaming": ratio(
            value("step_ms", "streaming", readback="every_step"), step("streaming")),
    }
    for batch in (16, 64):
        summary[f"streaming_b{batch}_over_roofline"] = ratio(
            step("streaming", batch), value("roofline_ms", "streaming", batch))
    for batch in (1, 16, 64):
        summary[f"streaming_over_ar_toks_peaked_b{batch}"] = ratio(
            value("tokens_per_s", "streaming", batch, logits="peaked"),
            value("tokens_per_s", "ar", batch, logits="peaked"))
    # the adaptive window (issue figures): over AR with flat logits (one token per forward:
    # its rows should cost AR's) and over the fixed window with peaked ones (whole windows
    # per forward: it should keep them), the least over the batch sizes that ran
    adaptive = {logits: [value("tokens_per_s", "streaming", batch, logits=logits,
                               policy="adaptive") for batch in (1, 16, 64)]
                for logits in LOGITS}
    summary["adaptive_over_ar_toks_flat_min"] = least(
        ratio(toks, value("tokens_per_s", "ar", batch))
        for toks, batch in zip(adaptive["flat"], (1, 16, 64)))
    summary["adaptive_over_fixed_toks_peaked_min"] = least(
        ratio(toks, value("tokens_per_s", "streaming", batch, logits="peaked"))
        for toks, batch in zip(adaptive["peaked"], (1, 16, 64)))
    return summary


def write_markdown(report: dict, path: Path) -> None:
    rows = []
    for case in report["cases"]:
        breakdown = case["breakdown_ms"] or {}
        rows.append([
            case["mode"] + (", adaptive" if case.get("window_policy") == "adaptive" else ""),
            str(case["batch"]), case["logits"],
            ("on" if case["graphs"] else "off")
            + (", rows read back" if case.get("row_readback") == "every_step" else ""),
            fmt(case["step_ms"], 2), fmt(case["live_rows_per_step"], 1),
            fmt(case["roofline_ms"], 2), fmt(case["step_over_roofline"], 2),
            fmt(case["tokens_per_forward"], 2), fmt(case["tokens_per_s"], 0),
            *(fmt(breakdown.get(k), 2) for k in (*CATEGORIES, "idle_host")),
        ])
    floor = report["weight_read_floor"]
    lines = [
        "# Decode step of model_min" + (" (CPU measurement)" if report.get("label") else ""),
        "",
        f"{report['device']['name']}, {report['date']}, `{report['command']}`",
        f"versions: {report['versions']}; model: {report['model']}",
        f"weight-read floor: {fmt(floor['bytes'] / 1e9, 2)} GB at "
        f"{fmt(floor['copy_gb_per_s'], 0)} GB/s = {fmt(floor['ms'], 2)} ms; matmul "
        f"{fmt(report['matmul']['tflop_per_s'], 1)} TFLOP/s ({report['matmul']['size']}^3, "
        f"{report['matmul']['dtype']}), {fmt(report['non_embedding_parameters'] / 1e9, 2)} G "
        f"non-embedding parameters",
        "",
        *markdown_table(
            ["mode", "B", "logits", "graphs", "step ms", "live rows", "roofline ms",
             "x roofline", "tok/fwd", "tok/s", "GEMM ms",
             "attention ms", "WeDLM ops ms", "elementwise ms", "idle/host ms"], rows),
        "",
        "summary: " + ", ".join(f"`{k}` {fmt(v, 2)}" for k, v in report["summary"].items()),
    ]
    if report.get("label"):
        lines += ["", report["label"] + "."]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--quick", action="store_true",
                        help="B in {1, 16, 64}, graphs off only at B=1, 2 repeats "
                             "(bench/gpu_check.sh's budget)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    return parser.parse_args(argv)


def cases_for(args: argparse.Namespace) -> list[Case]:
    batches = args.batches or ([1, 2] if args.cpu_smoke else [1, 16, 64] if args.quick
                               else [1, 4, 16, 64])
    cases = []
    for batch in batches:
        for mode in MODES:
            for logits in LOGITS:
                for graphs in (True, False):
                    if args.cpu_smoke and graphs:
                        continue
                    if args.quick and not graphs and batch != 1:
                        continue
                    cases.append(Case(mode, batch, logits, graphs))
                    if graphs and mode == "streaming" and logits == "flat" and batch == 1:
                        # the same step reading its live rows back, as before
                        cases.append(Case(mode, batch, logits, graphs, "every_step"))
                    if mode == "streaming" and (graphs or args.cpu_smoke):
                        # the adaptive window beside the fixed one (model_min's
                        # window_policy; the floor its max_batch and device give)
                        cases.append(Case(mode, batch, logits, graphs,
                                          window_policy="adaptive"))
    return cases


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    config = TINY if args.cpu_smoke else QWEN3_8B
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    out_dir = args.out_dir or RESULTS_ROOT / ("cpu" if args.cpu_smoke else device_slug())
    model = random_model(config, device, dtype)
    base_lm_head = model.lm_head
    time_fn = ((lambda fn: time_cpu(fn, rep_ms=200)) if args.cpu_smoke
               else (lambda fn: time_eager_cuda(fn, warmup_ms=25, rep_ms=100)))
    copy = copy_bandwidth(device, 2**26 if args.cpu_smoke else 2**30, time_fn)
    matmul = matmul_rate(device, dtype, 256 if args.cpu_smoke else 8192, time_fn)
    floor_bytes = weight_bytes(model)
    floor_ms = floor_bytes / (copy["gb_per_s"] * 1e9) * 1e3 if copy["gb_per_s"] else None
    parameters = non_embedding_parameters(model)
    cases = []
    report = {
        "benchmark": "decode_step", "date": utc_now(), "device": device_info(device),
        "versions": versions(), "command": command_line("bench.decode_step", argv),
        "model": {"shape": "tiny" if args.cpu_smoke else "Qwen3-8B", "dtype": str(dtype),
                  "weights": "random", "window": WINDOW, "page_size": PAGE_SIZE,
                  "prompt_tokens": PROMPT_TOKENS, "threshold": THRESHOLD,
                  "penalty": PENALTY, "lm_head_scales": LOGITS},
        "copy": copy,
        "matmul": matmul,
        "non_embedding_parameters": parameters,
        "weight_read_floor": {"bytes": floor_bytes, "copy_gb_per_s": copy["gb_per_s"],
                              "ms": floor_ms},
        "complete": False,
        "cases": cases,
    }
    for case in cases_for(args):
        print(f"{case.mode} B={case.batch} {case.logits} graphs={case.graphs} "
              f"{case.window_policy}", flush=True)
        with_logits(model, base_lm_head, case.logits)
        profile_it = device.type == "cuda" and case.graphs and case.logits == "flat"
        result = run_case(model, case, device.type == "cuda", profile_it,
                          repeats=2 if args.quick else REPEATS)
        result["roofline_ms"] = roofline_ms(floor_ms, parameters, result["live_rows_per_step"],
                                            matmul["tflop_per_s"])
        result["step_over_roofline"] = ratio(result["step_ms"], result["roofline_ms"])
        cases.append(result)
        write_json(out_dir / "decode_step.json", report)  # kept if the run is cut short
    summary = summarise(cases, floor_ms, graphs=device.type == "cuda")
    if device.type == "cuda":
        del model, base_lm_head
        torch.cuda.empty_cache()
        summary["paged_attention_b1_q32_ctx512_us"] = paged_attention_probe_us(device)
    else:
        report["label"] = CPU_LABEL
    report["complete"] = True
    report["summary"] = summary
    write_json(out_dir / "decode_step.json", report)
    write_markdown(report, out_dir / "decode_step.md")
    report["out_dir"] = str(out_dir)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, lambda report: [], "decode_step.md")


if __name__ == "__main__":
    sys.exit(main())
