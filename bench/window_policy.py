"""CPU benchmark of the adaptive window in model_min on the shipped tiny model.

    python -m bench.window_policy [--out bench/results/cpu/window_policy.json] [--quick]

Two parts, every figure a CPU measurement (fp32, one torch thread, ``time.perf_counter``,
one warm-up call, then the median of ``--repeats`` calls):

- ``row_cost``: the row budget of ``wedlm_kernels.window_policy.ROW_BUDGETS["cpu"]``. One
  sequence decoded with fixed windows ``W`` of 1 to 64 (temperature 1, 128 tokens): wall
  time per decode step against the live rows the steps fed on average. ``over_smallest`` is
  each step time over the smallest window's.
- ``decode``: AR, the fixed window ``W = 16`` and the adaptive window (``window_policy=
  "adaptive"``) on two workloads at concurrency (``max_batch`` and requests) 1, 4 and 16:
  ``low_entropy`` (greedy on the pattern task's prompts, ``count: n``, which the tiny model
  continues predictably) and ``high_entropy`` (temperature 1 on random-word prompts). Per
  case: output tokens per second over the whole ``generate`` call, forwards, live rows
  fed, and the ratios ``adaptive_over_ar`` and ``adaptive_over_fixed``.

These run model_min directly, not served through vLLM (the issue's served figures are
pending on the plugin side of the policy).
"""

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "cpu" / "window_policy.json"
WORDS = ("the a cat dog sat ran on under blue red fast slow house tree river stone light "
         "green old new small big").split()


def load():
    from model_min import load_model, load_tokenizer

    folder = ROOT / "model_min" / "tiny_wedlm"
    return load_model(folder, device="cpu", dtype=torch.float32), load_tokenizer(folder)


def timed(generator, prompts, params, mode, repeats):
    generator.generate(prompts, params, mode=mode)
    times, results = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        results = generator.generate(prompts, params, mode=mode)
        times.append(time.perf_counter() - start)
    return statistics.median(times), results


def row_cost(model, tokenizer, windows, repeats) -> list[dict]:
    from model_min import Generator, SamplingParams

    cases = []
    for window in windows:
        generator = Generator(model, window=window, tokenizer=tokenizer, max_batch=1)
        params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=1)
        seconds, [result] = timed(generator, ["the cat sat on the "], params, "streaming",
                                  repeats)
        cases.append({"window": window, "step_ms": round(1000 * seconds / result.forwards, 3),
                      "rows_per_step": round(result.rows / result.forwards, 2)})
    smallest = cases[0]["step_ms"]
    for case in cases:
        case["over_smallest"] = round(case["step_ms"] / smallest, 3)
    return cases


def workloads(count: int) -> dict:
    rng = random.Random(count)
    return {
        "low_entropy": ([f"count: {rng.randrange(1, 60)} " for _ in range(count)], 0.0),
        "high_entropy": ([" ".join(rng.choice(WORDS) for _ in range(6)) + " "
                          for _ in range(count)], 1.0),
    }


def decode(model, tokenizer, concurrencies, max_new, repeats) -> list[dict]:
    from model_min import Generator, SamplingParams

    cases = []
    for concurrency in concurrencies:
        for workload, (prompts, temperature) in workloads(concurrency).items():
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=1)
            case = {"workload": workload, "concurrency": concurrency}
            for name, mode, policy in (("ar", "ar", "fixed"), ("fixed", "streaming", "fixed"),
                                       ("adaptive", "streaming", "adaptive")):
                generator = Generator(model, window=16, tokenizer=tokenizer,
                                      max_batch=concurrency, window_policy=policy)
                seconds, results = timed(generator, prompts, params, mode, repeats)
                tokens = sum(len(r.token_ids) for r in results)
                case[name] = {"output_tok_per_s": round(tokens / seconds, 1),
                              "forwards": sum(r.forwards for r in results),
                              "rows": sum(r.rows for r in results), "tokens": tokens}
            case["adaptive_over_ar"] = round(case["adaptive"]["output_tok_per_s"]
                                             / case["ar"]["output_tok_per_s"], 3)
            case["adaptive_over_fixed"] = round(case["adaptive"]["output_tok_per_s"]
                                                / case["fixed"]["output_tok_per_s"], 3)
            print(f"window_policy: {case}", flush=True)
            cases.append(case)
    return cases


def write_markdown(report: dict, path: Path) -> None:
    from bench.common import markdown_table

    rows = [[str(c["window"]), f"{c['rows_per_step']:.1f}", f"{c['step_ms']:.2f}",
             f"{c['over_smallest']:.2f}"] for c in report["row_cost"]]
    decode_rows = [[c["workload"], str(c["concurrency"]),
                    *(f"{c[n]['output_tok_per_s']:.0f} ({c[n]['forwards']} fw, "
                      f"{c[n]['rows']} rows)" for n in ("ar", "fixed", "adaptive")),
                    f"{c['adaptive_over_ar']:.2f}", f"{c['adaptive_over_fixed']:.2f}"]
                   for c in report["decode"]]
    lines = [
        "# The adaptive window in model_min (CPU measurement)", "",
        f"{report['date']}, `{report['command']}`; {report['machine']}.",
        f"versions: {report['versions']}", "",
        "How each figure is measured: the docstring of `bench/window_policy.py`.", "",
        "## Summary", "", *(f"- `{k}`: {v}" for k, v in report["summary"].items()), "",
        "## Step time against rows (one sequence, fixed windows)", "",
        *markdown_table(["W", "rows per step", "ms per step", "over the smallest"], rows), "",
        "## AR, fixed W = 16 and adaptive (output tokens per second)", "",
        *markdown_table(["workload", "concurrency", "AR", "fixed 16", "adaptive",
                         "adaptive / AR", "adaptive / fixed"], decode_rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from bench.common import command_line, utc_now, versions, write_json

    torch.set_num_threads(1)
    model, tokenizer = load()
    quick = args.quick
    windows = (1, 16) if quick else (1, 2, 4, 8, 16, 32, 64)
    costs = row_cost(model, tokenizer, windows, 1 if quick else args.repeats)
    cases = decode(model, tokenizer, (1, 4) if quick else (1, 4, 16), 24 if quick else 96,
                   1 if quick else args.repeats)
    summary = {
        "adaptive_over_ar_min": min(c["adaptive_over_ar"] for c in cases),
        "adaptive_over_fixed_low_entropy_min": min(
            c["adaptive_over_fixed"] for c in cases if c["workload"] == "low_entropy"),
        "adaptive_over_fixed_high_entropy_min": min(
            c["adaptive_over_fixed"] for c in cases if c["workload"] == "high_entropy"),
        "rows_at_1_5x_smallest_step": max(c["rows_per_step"] for c in costs
                                          if c["over_smallest"] <= 1.5),
    }
    report = {
        "benchmark": "bench.window_policy", "label": "CPU measurement", "quick": quick,
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "summary": summary, "row_cost": costs, "decode": cases, "versions": versions(),
        "command": command_line("bench.window_policy", argv), "date": utc_now(),
    }
    write_json(args.out, report)
    write_markdown(report, args.out.with_suffix(".md"))
    print(f"window_policy: wrote {args.out} and .md; summary {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
