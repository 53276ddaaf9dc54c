"""Throughput and parallelism sweep of ``model_min.Generator`` on any checkpoint.

    python -m bench.sweep [--model model_min/tiny_wedlm | random:SHAPE-LOGITS] [--out-dir DIR] [--quick]
        [--batch-sizes 1 8 16] [--windows 8 16] [--thresholds 0.1 0.4 1.0]
        [--penalties 0.02] [--modes streaming blockwise ar] [--max-new-tokens 32]
        [--prompts FILE] [--repeats 3] [--device auto|cpu|cuda] [--threads 1]
        [--dtype auto] [--cuda-graph] [--ignore-eos]

The throughput tables the WeDLM paper leaves out: for every batch size B, window W, entropy
threshold and position penalty, streaming and block-wise decoding of the same batch, with
AR decoding of the same engine and weights at the same batch size as the baseline. The
batch is the prompt list (``--prompts``, one prompt per line, or a built-in mix of low- and
high-entropy prompts for the tiny model) cycled to B prompts, decoded greedily in one
``Generator.generate`` call with ``max_batch = B``.

Per point: tokens generated, decode forwards (sum over requests and mean per request),
tokens per forward, p_cache, wall seconds (median of ``--repeats`` after one warm-up),
tokens per second and the speed-up over AR at the same batch size (ratio of tokens per
second). A threshold of ``none`` selects one token per step. ``--quick`` shrinks the grid to
batch sizes 1 and 4, window 8, thresholds 0.4 and none, 16 new tokens and one timed run
(explicit grid options still win). Results: ``sweep_<model>.json``, a Markdown table
``sweep_<model>.md`` and a plot ``sweep_<model>.png`` (where matplotlib is installed; else
``python -m bench.report`` draws it from the JSON later) in ``--out-dir`` (default
``bench/results/<device-slug>/``). On CPU every figure is labelled a CPU measurement.
``python -m bench.report`` then folds the JSON into ``bench/REPORT.md``.

``--model random:SHAPE-LOGITS`` decodes a model built on the device with random weights
instead of a checkpoint: SHAPE ``qwen3-8b`` (the sizes of Qwen3-8B, bf16 on CUDA) or ``tiny``,
LOGITS ``flat`` (about one token per forward) or ``peaked`` (whole windows), the two
lm_head scales of ``bench/decode_step.py``; prompts are 64 random sequences of 128 tokens.

Window policy check: for every windowed mode, threshold, penalty and batch size, the JSON's
``window_policy`` lists the window with the most tokens per second among those swept and
the one ``model_min.auto_window`` picks for that batch; the ``"summary"`` holds the lowest
ratio of the policy's tokens per second to the best one
(``auto_window_over_best_toks_min``; None when the policy's window was not swept).
"""

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from bench import common, decode_step
from bench.report import sweep_markdown, write_sweep_plot
from model_min import Generator, SamplingParams, auto_window, load_model, load_tokenizer
from model_min.generator import parse_threshold
from model_min.loader import checkpoint_files

DEFAULT_MODEL = "model_min/tiny_wedlm"
WINDOW_MODES = ("streaming", "blockwise")
MODES = (*WINDOW_MODES, "ar")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SEED = 0
PAGE_SIZE = 16
HASHED_CHECKPOINT_BYTES = 64 * 2**20  # checkpoints up to this size get a sha256 in the JSON

# Low-entropy pattern headers (their continuation is determined) alternating with the
# beginnings of higher-entropy sentences, in the families the tiny model is trained on.
BUILTIN_PROMPTS = (
    "count: 41 42 43",
    "the quick fox sees a small dog",
    "table of 7: 7x1=7, 7x2=14, 7x3=21",
    "the old king finds",
    "days: monday, tuesday, wednesday",
    "the happy child paints a",
    "repeat: old red fox | old red fox | ",
    "the bright moon",
    "count by 5: 10 15 20",
    "the tall farmer watches a quiet horse",
    "sums: 3+4=7; 4+4=8; 5+4=9",
    "the little bird",
    "months: march, april, may",
    "the cold river carries",
    "letters: abcdefg",
    "the green garden",
)

FULL_GRID = {"batch_sizes": [1, 8, 16], "windows": [8, 16], "thresholds": [0.1, 0.4, 1.0],
             "penalties": [0.02], "max_new_tokens": 32, "repeats": 3}
QUICK_GRID = {"batch_sizes": [1, 4], "windows": [8], "thresholds": [0.4, None],
              "penalties": [0.02], "max_new_tokens": 16, "repeats": 1}

METHODS = {
    "batch": (
        "the prompt list cycled to B prompts, admitted at once (Generator max_batch = B), "
        "greedy (temperature 0), the same SamplingParams for every request; every mode "
        "decodes the same batch with the same weights."
    ),
    "tokens": "generated tokens summed over the batch's requests (a stop token counts).",
    "forwards": (
        "decode forwards each request took part in (prefill excluded), summed over the "
        "requests; forwards_per_request is their mean."
    ),
    "tokens_per_forward": "tokens / forwards, over the whole batch.",
    "p_cache": (
        "tokens / rows, where rows are the window rows the requests fed to decode forwards "
        "(recomputation included, padding excluded; paper Eq. 4); 1 for AR."
    ),
    "wall_seconds": (
        "time.perf_counter around one Generator.generate call over the whole batch "
        "(admission, prefill, decode steps and the host's polls; on CUDA synchronised "
        "before and after): one warm-up call (it also captures CUDA graphs), then the "
        "median of the repeats."
    ),
    "tokens_per_second": "tokens / median wall seconds.",
    "speedup_over_ar": (
        "tokens_per_second / tokens_per_second of AR decoding at the same batch size; a "
        "throughput ratio: the modes may generate different tokens (and stop at different "
        "points)."
    ),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="results folder (default bench/results/<device-slug>/)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="text file, one prompt per line (default: built-in prompts)")
    parser.add_argument("--quick", action="store_true", help="a small grid for smoke tests")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None,
                        help="default 1 8 16 (--quick: 1 4)")
    parser.add_argument("--windows", nargs="+", type=int, default=None,
                        help="default 8 16 (--quick: 8)")
    parser.add_argument("--thresholds", nargs="+", type=parse_threshold, default=None,
                        help="entropy thresholds in nats, 'none' = one token per step; "
                             "default 0.1 0.4 1.0 (--quick: 0.4 none)")
    parser.add_argument("--penalties", nargs="+", type=float, default=None,
                        help="position penalties; default 0.02")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="streaming and blockwise run at every grid point, ar once "
                             "per batch size (the speed-up baseline)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default 32 (--quick: 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per point after one warm-up; default 3 (--quick: 1)")
    parser.add_argument("--ignore-eos", action="store_true", help="no stop tokens")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the decode step in CUDA graphs (CUDA only)")
    args = parser.parse_args(argv)
    grid = QUICK_GRID if args.quick else FULL_GRID
    for name, default in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


RANDOM_PREFIX = "random:"
RANDOM_SHAPES = {"qwen3-8b": decode_step.QWEN3_8B, "tiny": decode_step.TINY}
RANDOM_PROMPTS = 64


def random_spec(spec: str) -> tuple[str, str]:
    """``"random:qwen3-8b-flat"`` -> ``("qwen3-8b", "flat")``; ValueError naming the choices."""
    shape, _, logits = spec.removeprefix(RANDOM_PREFIX).rpartition("-")
    if shape not in RANDOM_SHAPES or logits not in decode_step.LOGITS:
        raise ValueError(f"--model {spec!r}: expected random:SHAPE-LOGITS with SHAPE in "
                         f"{sorted(RANDOM_SHAPES)} and LOGITS in {sorted(decode_step.LOGITS)}")
    return shape, logits


def random_model(spec: str, device: torch.device, dtype: torch.dtype | None):
    shape, logits = random_spec(spec)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = decode_step.random_model(RANDOM_SHAPES[shape], device, dtype)
    decode_step.with_logits(model, model.lm_head, logits)
    return model


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(BUILTIN_PROMPTS)
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def encode_prompts(prompts: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt; without a tokenizer, its UTF-8 bytes (the byte-level
    convention of the tiny model)."""
    if tokenizer is not None:
        return [tokenizer.encode(p) for p in prompts]
    encoded = [list(p.encode("utf-8")) for p in prompts]
    if any(t >= vocab_size for ids in encoded for t in ids):
        raise ValueError("the checkpoint has no tokenizer.json and a vocabulary too small "
                         "for byte-level prompts")
    return encoded


def cycled(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]


def model_name(path: str) -> str:
    if path.startswith(RANDOM_PREFIX):
        return "random-" + "-".join(random_spec(path))
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(path).resolve().name) or "model"


def describe_model(path: str, model) -> dict:
    c = model.config
    description = {
        "path": path, "name": model_name(path), "model_type": c.model_type,
        "hidden_size": c.hidden_size, "num_layers": c.num_layers, "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
        "mask_token_id": c.mask_token_id, "eos_token_ids": list(c.eos_token_ids),
        "dtype": str(model.dtype).replace("torch.", ""),
    }
    if path.startswith(RANDOM_PREFIX):
        shape, logits = random_spec(path)
        return {**description, "shape": shape,
                "weights": "random (bench.decode_step.random_model, seed 0)",
                "logits": logits, "lm_head_scale": decode_step.LOGITS[logits],
                "checkpoint_bytes": None, "checkpoint_sha256": None, "training": None}
    config_file = json.loads((Path(path) / "config.json").read_text())
    files = checkpoint_files(Path(path))
    size = sum(f.stat().st_size for f in files)
    digest = None
    if size <= HASHED_CHECKPOINT_BYTES:
        hasher = hashlib.sha256()
        for file in files:
            hasher.update(file.read_bytes())
        digest = hasher.hexdigest()
    return {**description, "checkpoint_bytes": size, "checkpoint_sha256": digest,
            "training": config_file.get("training")}


def machine(device: torch.device) -> dict:
    return {
        "label": common.CPU_LABEL if device.type == "cpu" else f"GPU measurement on "
                 f"{torch.cuda.get_device_name(device)}",
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


class Runner:
    """Times ``generate`` calls; one Generator per (batch size, window), reused across
    modes, thresholds and penalties (they are per-request values)."""

    def __init__(self, model, tokenizer, prompts: list[list[int]], args) -> None:
        self.model, self.tokenizer, self.prompts, self.args = model, tokenizer, prompts, args
        self.generators: dict[tuple[int, int], Generator] = {}
        self.stop_ids = () if args.ignore_eos else tuple(model.config.eos_token_ids)

    def generator(self, batch: int, window: int) -> Generator:
        key = (batch, window)
        if key not in self.generators:
            longest = max(len(p) for p in self.prompts)
            per_request = longest + self.args.max_new_tokens + window + PAGE_SIZE
            self.generators = {}  # one at a time: free the previous KV cache
            self.generators[key] = Generator(
                self.model, window=window, page_size=PAGE_SIZE, max_batch=batch,
                tokenizer=self.tokenizer, max_cache_tokens=batch * per_request, seed=SEED,
                cuda_graph=self.args.cuda_graph,
            )
        return self.generators[key]

    def run(self, mode: str, batch: int, window: int, threshold, penalty) -> dict:
        generator = self.generator(batch, window)
        params = SamplingParams(
            max_new_tokens=self.args.max_new_tokens, temperature=0.0, threshold=threshold,
            penalty=0.0 if penalty is None else penalty, seed=SEED,
            stop_token_ids=self.stop_ids,
        )
        prompts = cycled(self.prompts, batch)
        cuda = self.model.device.type == "cuda"
        samples, outputs = [], []
        for repeat in range(1 + self.args.repeats):
            if cuda:
                torch.cuda.synchronize(self.model.device)
            start = time.perf_counter()
            results = generator.generate(prompts, params, mode=mode)
            if cuda:
                torch.cuda.synchronize(self.model.device)
            seconds = time.perf_counter() - start
            outputs.append([r.token_ids for r in results])
            if repeat > 0:
                samples.append(seconds)
        return point(mode, batch, window, threshold, penalty, results, samples,
                     all(o == outputs[0] for o in outputs))


def point(mode, batch, window, threshold, penalty, results, samples, repeats_agree) -> dict:
    """One grid point's figures from the last run's results and the timed samples."""
    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(r.forwards for r in results)
    rows = sum(r.rows for r in results)
    wall = statistics.median(samples)
    ar = mode == "ar"
    return {
        "mode": mode,
        "batch": batch,
        "window": None if ar else window,
        "threshold": None if ar else threshold,
        "penalty": None if ar else penalty,
        "tokens": tokens,
        "forwards": forwards,
        "forwards_per_request": forwards / len(results),
        "rows": rows,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "p_cache": tokens / rows if rows else None,
        "finish_reasons": dict(sorted(Counter(r.finish_reason for r in results).items())),
        "wall_seconds": {"median": wall, "samples": samples},
        "tokens_per_second": tokens / wall if wall > 0 else None,
        "speedup_over_ar": None,
        "outputs_equal_across_runs": repeats_agree,
    }


def grid(args) -> list[tuple[str, int, int, float | None, float | None]]:
    """``(mode, batch, window, threshold, penalty)`` of every point, AR first per batch."""
    windowed = [m for m in WINDOW_MODES if m in args.modes]
    points = []
    for batch in args.batch_sizes:
        if "ar" in args.modes:
            points.append(("ar", batch, min(args.windows), None, None))
        for window in args.windows:
            for threshold in args.thresholds:
                for penalty in args.penalties:
                    points += [(mode, batch, window, threshold, penalty) for mode in windowed]
    return points


def add_speedups(cases: list[dict]) -> None:
    ar_rate = {c["batch"]: c["tokens_per_second"] for c in cases if c["mode"] == "ar"}
    for case in cases:
        baseline = ar_rate.get(case["batch"])
        case["speedup_over_ar"] = common.ratio(case["tokens_per_second"], baseline)


def window_policy(cases: list[dict]) -> list[dict]:
    """Per windowed mode, threshold, penalty and batch size: the swept window with the most
    tokens per second, and the window auto_window picks for that batch size."""
    groups: dict[tuple, list[dict]] = {}
    for case in cases:
        if case["mode"] != "ar":
            key = (case["mode"], case["threshold"], case["penalty"], case["batch"])
            groups.setdefault(key, []).append(case)
    rows = []
    for (mode, threshold, penalty, batch), group in groups.items():
        rates = {c["window"]: c["tokens_per_second"] for c in group}
        best = max(rates, key=lambda w: rates[w] or 0.0)
        chosen = auto_window(batch)
        rows.append({
            "mode": mode, "threshold": threshold, "penalty": penalty, "batch": batch,
            "best_window": best, "best_tokens_per_second": rates[best],
            "auto_window": chosen, "auto_tokens_per_second": rates.get(chosen),
            "auto_over_best": common.ratio(rates.get(chosen), rates[best]),
        })
    return rows


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU present")
    return torch.device(choice)


def write_outputs(report: dict, json_path: Path) -> Path | str:
    """The JSON, its Markdown table (.md) and its plot (.png), side by side; returns the
    plot's path, or why it was not drawn (``common.save_plot``; the Markdown links the PNG
    all the same, which ``python -m bench.report`` draws from the JSON)."""
    common.write_json(json_path, report)
    json_path.with_suffix(".md").write_text(sweep_markdown(report))
    return write_sweep_plot(report, json_path.with_suffix(".png"))


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.cuda_graph and device.type != "cuda":
        raise ValueError("--cuda-graph needs a CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    if args.model.startswith(RANDOM_PREFIX):
        model, tokenizer = random_model(args.model, device, dtype), None
        prompt_ids = decode_step.prompts_for(RANDOM_PROMPTS, model.config, seed=0)
        prompts = [f"{RANDOM_PROMPTS} random prompts of {len(prompt_ids[0])} tokens (seed 0)"]
    else:
        model = load_model(args.model, device, dtype)
        tokenizer = load_tokenizer(args.model)
        prompts = load_prompts(args.prompts)
        prompt_ids = encode_prompts(prompts, tokenizer, model.config.vocab_size)
    runner = Runner(model, tokenizer, prompt_ids, args)
    slug = "cpu" if device.type == "cpu" else common.slugify(torch.cuda.get_device_name(device))
    out_dir = args.out_dir or common.RESULTS_ROOT / slug
    json_path = out_dir / f"sweep_{model_name(args.model)}.json"
    tag = "[CPU measurement]" if device.type == "cpu" else f"[{slug}]"

    cases = []

    def report_of(complete: bool) -> dict:
        """The report of the cases so far; the window policy and summary once complete."""
        policy = window_policy(cases) if complete else []
        ratios = [row["auto_over_best"] for row in policy]
        return {
            "benchmark": "bench.sweep",
            "label": machine(device)["label"],
            "date": common.utc_now(),
            "device": common.device_info(device),
            "machine": machine(device),
            "versions": common.versions(),
            "command": common.command_line("bench.sweep", argv),
            "quick": args.quick,
            "complete": complete,
            "model": describe_model(args.model, model),
            "prompts": prompts,
            "params": {
                "batch_sizes": args.batch_sizes, "windows": args.windows,
                "thresholds": args.thresholds, "penalties": args.penalties,
                "modes": args.modes, "max_new_tokens": args.max_new_tokens,
                "temperature": 0.0, "seed": SEED, "stop_token_ids": list(runner.stop_ids),
                "page_size": PAGE_SIZE, "warmup": 1, "repeats": args.repeats,
                "cuda_graph": args.cuda_graph,
                "threads": torch.get_num_threads() if device.type == "cpu" else None,
            },
            "methods": METHODS,
            "cases": cases,
            "window_policy": policy,
            "summary": {"auto_window_over_best_toks_min":
                        None if not ratios or None in ratios else min(ratios)},
            "wall_seconds": round(time.perf_counter() - started, 1),
        }

    for mode, batch, window, threshold, penalty in grid(args):
        case = runner.run(mode, batch, window, threshold, penalty)
        cases.append(case)
        print(f"{tag} {mode} B={batch} W={case['window']} threshold={threshold} "
              f"penalty={penalty}: {case['tokens']} tokens, tok/fwd "
              f"{common.fmt(case['tokens_per_forward'], 2)}, p_cache "
              f"{common.fmt(case['p_cache'], 3)}, "
              f"{common.fmt(case['tokens_per_second'], 1)} tok/s", flush=True)
        common.write_json(json_path, report_of(complete=False))  # kept if the run is cut
    add_speedups(cases)
    report = report_of(complete=True)
    plot = write_outputs(report, json_path)
    drawn = ".png" if isinstance(plot, Path) else f"no .png: {plot}"
    print(f"{tag} wrote {json_path} (+ .md, {drawn}) in {report['wall_seconds']} s")
    return report


if __name__ == "__main__":
    main()
