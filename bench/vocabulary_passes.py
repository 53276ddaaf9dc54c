"""Passes over the vocabulary that select_tokens' kernels make, counted in Triton's interpreter.

    python -m bench.vocabulary_passes [--rows 16] [--vocab 151936] [--out-dir DIR]

Writes ``select_tokens_passes.json`` and ``.md`` (default ``bench/results/interpreter/``).
Nothing is timed and no GPU is needed: the kernels run in Triton's interpreter on the
benchmark's own inputs (``bench/select_tokens.make_inputs``: logits ``2 N(0, 1)`` with eight
peaks per row, sequences of 16 rows, rounded to bf16 and held in fp32, since the
interpreter's bf16 loads are not the GPU's), and every element the kernels load from the
logits is counted.

- ``loads_per_logit``: elements loaded from the logits / (R x V), every load counted.
- ``passes``: the same count less the loads a cache serves: a load of an element that the
  same program (the interpreter runs programs one after another) loaded among its last
  :data:`CACHE_WINDOW` logit loads is a re-read of data still on chip (a sub-tile re-read
  right after its tile, a search over a few candidate granules), not a pass over memory.
  ``CACHE_WINDOW`` logits are 64 KB at bf16, a quarter of an sm_90 multiprocessor's L1.
  Greedy's one streaming read is 1.0 by construction of the kernels, and the issue's bar for
  sampling is greedy plus one.
- the sets: ``greedy``, ``temperature`` (one-launch and three-launch kernels), ``top_k``,
  ``top_p``, ``top_k_top_p`` (the three launches: the only kernels with those filters), and
  ``top_k_large`` (top-k 8192: more candidate granules than the filter lists, so the filter
  searches the whole row: the fallback path, shown for what it costs).
- ``paths``: per row, the filter's path (1 candidate granules, 2 whole row, 3 the scan's
  draws checked; 0 no filter).
"""

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

# (bench.common and bench.select_tokens import triton: main() imports them after it has
# asked for the interpreter)
VOCAB = 151936
OUT_DIR = Path(__file__).resolve().parent / "results" / "interpreter"
CACHE_WINDOW = 32768  # logits: 64 KB at bf16
LARGE_TOP_K = ("top_k_large", 0.7, 8192, 1.0)  # name, temperature, top-k, top-p


class LogitReads:
    """Counts the elements Triton's interpreter loads from one tensor while active."""

    def __init__(self, tensor: torch.Tensor, cache_window: int = CACHE_WINDOW) -> None:
        self.start = tensor.data_ptr()
        self.element_size = tensor.element_size()
        self.numel = tensor.numel()
        self.cache_window = cache_window
        self.last_load = np.full(self.numel, -(2**62), dtype=np.int64)
        self.loads = 0  # every element loaded
        self.misses = 0  # elements not loaded within the last cache_window loads

    def record(self, pointers: np.ndarray, mask: np.ndarray) -> None:
        offset = pointers.astype(np.int64) - self.start
        inside = np.broadcast_to(mask.astype(bool), offset.shape) & (offset >= 0) & (
            offset < self.numel * self.element_size)
        elements = (offset[inside] // self.element_size).ravel()
        if elements.size == 0:
            return
        cached = self.last_load[elements] >= self.loads - self.cache_window
        self.misses += int(np.count_nonzero(~cached))
        self.last_load[elements] = self.loads
        self.loads += int(elements.size)

    @contextmanager
    def counting(self):
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        original = builder.create_masked_load
        reads = self

        def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
            reads.record(ptrs.data, mask.data)
            return original(self, ptrs, mask, other, *args, **kwargs)

        builder.create_masked_load = create_masked_load
        try:
            yield self
        finally:
            builder.create_masked_load = original


def count_passes(sizes, params, rows: int, kernel: str, seed: int = 0) -> dict:
    """Loads and passes per logit of one select_tokens call in the interpreter
    (``sizes``, ``params``: ``bench.select_tokens.Sizes`` and ``Params``)."""
    from bench.select_tokens import make_inputs
    from wedlm_kernels.ops import select, select_one_launch

    arguments = list(make_inputs(sizes, params, rows, torch.device("cpu"), seed))
    arguments[0] = arguments[0].to(torch.bfloat16).float().contiguous()
    filtered = params.top_k > 0 or params.top_p < 1
    sampling = "any" if filtered else ("greedy" if params.temperature <= 0 else "temperature")
    module = select_one_launch if kernel == "one_launch" else select
    splits, _ = module.split_plan(rows, sizes.vocab, torch.device("cpu"), None)
    workspace = None
    if kernel == "three_launch":
        workspace = select.SelectWorkspace.empty(rows, sizes.vocab, splits, torch.device("cpu"))
        workspace.path.zero_()
    reads = LogitReads(arguments[0])
    with reads.counting():
        select.select_tokens_triton(*arguments, sampling, kernel=kernel, num_splits=splits,
                                    workspace=workspace)
    total = arguments[0].numel()
    return {"set": params.name, "kernel": kernel, "rows": rows, "vocab": sizes.vocab,
            "splits": splits, "loads_per_logit": round(reads.loads / total, 4),
            "passes": round(reads.misses / total, 4),
            "paths": workspace.path.tolist() if filtered else []}


def run(rows: int, vocab: int) -> list[dict]:
    from bench.select_tokens import FULL, PARAMS, Params

    sizes = replace(FULL, vocab=vocab, rows=(rows,), dtype=torch.float32)
    cases = []
    for params in (*PARAMS, Params(*LARGE_TOP_K)):
        filtered = params.top_k > 0 or params.top_p < 1
        for kernel in ("three_launch",) if filtered else ("one_launch", "three_launch"):
            cases.append(count_passes(sizes, params, rows, kernel))
            print(f"vocabulary_passes: {cases[-1]}", flush=True)
    return cases


def summarise(cases: list[dict]) -> dict:
    passes = {(case["set"], case["kernel"]): case["passes"] for case in cases}
    greedy = max(passes[("greedy", kernel)] for kernel in ("one_launch", "three_launch"))
    sampling = {key: value for key, value in passes.items()
                if key[0] not in ("greedy", "top_k_large")}
    summary = {f"passes_{name}_{kernel}": value for (name, kernel), value in passes.items()}
    summary["greedy_passes"] = greedy
    summary["sampling_passes_max"] = max(sampling.values())
    summary["sampling_passes_over_greedy_max"] = round(max(sampling.values()) - greedy, 4)
    return summary


def write_markdown(report: dict, path: Path) -> None:
    from bench.common import markdown_table

    rows = [[case["set"], case["kernel"], str(case["splits"]), f"{case['loads_per_logit']:.3f}",
             f"{case['passes']:.3f}",
             " ".join(str(p) for p in case["paths"]) or "—"] for case in report["cases"]]
    lines = [
        "# select_tokens: passes over the vocabulary (Triton's interpreter)",
        "",
        f"{report['date']}, `{report['command']}`; {report['target']}.",
        f"versions: {report['versions']}",
        "",
        "How each figure is counted: the docstring of `bench/vocabulary_passes.py`. A pass "
        "reads every logit of the rows once from memory; a re-read of an element the same "
        f"program loaded among its last {report['cache_window']} logit loads is served by "
        "the cache and not counted as a pass (`loads per logit` counts every load).",
        "",
        "## Summary",
        "",
        *(f"- `{key}`: {value}" for key, value in report["summary"].items()),
        "",
        f"## Sets (R = {report['rows']}, vocabulary {report['vocab']})",
        "",
        *markdown_table(["set", "kernel", "splits", "loads per logit", "passes",
                         "filter path per row"], rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from bench.common import command_line, utc_now, versions, write_json
    cases = run(args.rows, args.vocab)
    report = {
        "benchmark": "vocabulary_passes", "op": "select_tokens",
        "target": "Triton's interpreter on a CPU machine",
        "rows": args.rows, "vocab": args.vocab, "cache_window": CACHE_WINDOW,
        "summary": summarise(cases), "cases": cases,
        "versions": versions(), "command": command_line("bench.vocabulary_passes", argv),
        "date": utc_now(),
    }
    write_json(args.out_dir / "select_tokens_passes.json", report)
    write_markdown(report, args.out_dir / "select_tokens_passes.md")
    print(f"vocabulary_passes: wrote {args.out_dir}/select_tokens_passes.{{json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
