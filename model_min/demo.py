"""``python -m model_min demo`` (or ``make demo``): the shipped tiny model decoded in every mode.

For each prompt the demo decodes greedily with one :class:`Generator` in four ways:
``streaming`` (entropy threshold), ``one-per-step`` (streaming with threshold None: one
token per step), ``blockwise`` (the stop-and-wait block baseline) and ``ar`` (one token per
forward). It prints the streaming text and a table of forwards, tokens, tokens per forward,
p_cache and wall time (measured on the device the demo ran on), says whether the streaming
output equals the one-token-per-step output, and ends with a summary over the prompts.
Progress goes to stderr; ``--json PATH`` also writes the numbers.
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .generator import Generator, SamplingParams, parse_threshold
from .loader import load_model
from .run_info import device_info, utc_now, versions, write_json
from .tokenizer import load_tokenizer

DEMO_MODEL_DIR = Path(__file__).parent / "tiny_wedlm"
DEMO_PROMPTS = (
    "count: 41 42 43 ",
    "table of 7: 7x1=7, 7x2=14, ",
    "days: monday, tuesday, ",
    "repeat: old red fox | old red fox | ",
    "letters: a b c d ",
    "the old king sees ",
)
# (label, Generator mode, use the threshold: False means threshold None, one token per step)
RUNS = (("streaming", "streaming", True), ("one-per-step", "streaming", False),
        ("blockwise", "blockwise", True), ("ar", "ar", True))
PENALTY = 0.02
COLUMNS = ("mode", "forwards", "tokens", "tokens/forward", "p_cache", "wall ms")


def compare_modes(
    generator: Generator, prompt: str, max_new_tokens: int = 64, threshold: float | None = 0.4,
    penalty: float = PENALTY, on_run: Callable[[str, str], None] | None = None,
) -> dict:
    """Decode ``prompt`` greedily in every run of :data:`RUNS`; returns the per-mode numbers
    (``wall_ms`` is ``time.perf_counter`` around each ``generate`` call)."""
    stop_ids = generator.model.config.eos_token_ids
    modes: dict[str, dict] = {}
    for label, mode, thresholded in RUNS:
        if on_run is not None:
            on_run(prompt, label)
        params = SamplingParams(max_new_tokens=max_new_tokens, threshold=threshold if thresholded
                                else None, penalty=penalty, seed=0, stop_token_ids=stop_ids)
        start = time.perf_counter()
        [result] = generator.generate([prompt], params, mode=mode)
        if generator.model.device.type == "cuda":
            torch.cuda.synchronize(generator.model.device)
        wall_ms = (time.perf_counter() - start) * 1e3
        modes[label] = {
            "mode": mode, "threshold": threshold if thresholded else None,
            "forwards": result.forwards,
            "tokens": len(result.token_ids), "tokens_per_forward": result.tokens_per_forward,
            "p_cache": result.p_cache, "wall_ms": wall_ms, "finish_reason": result.finish_reason,
            "token_ids": result.token_ids, "text": result.text,
        }
    equal = modes["streaming"]["token_ids"] == modes["one-per-step"]["token_ids"]
    return {"prompt": prompt, "text": modes["streaming"]["text"], "modes": modes,
            "streaming_equals_one_per_step": equal}


def run_demo(generator: Generator, prompts: Sequence[str], max_new_tokens: int = 64,
             threshold: float | None = 0.4, penalty: float = PENALTY,
             on_run: Callable[[str, str], None] | None = None) -> list[dict]:
    """:func:`compare_modes` for every prompt, after one untimed warm-up run per mode."""
    for mode in ("streaming", "blockwise", "ar") if prompts else ():
        warm_up = SamplingParams(max_new_tokens=generator.window + 1)
        generator.generate([prompts[0]], warm_up, mode=mode)
    return [compare_modes(generator, p, max_new_tokens, threshold, penalty, on_run)
            for p in prompts]


def aligned_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table padded to column width (first column left, others right)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    cells = [[c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
             for row in rows]
    rule = [":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]
    return ["| " + " | ".join(row) + " |" for row in [cells[0], rule, *cells[1:]]]


def print_report(data: list[dict], device: str) -> None:
    header = [*COLUMNS[:-1], f"wall ms ({device})"]
    for item in data:
        print(f"\nprompt:    {item['prompt']!r}\nstreaming: {item['text']!r}")
        rows = [[label, str(m["forwards"]), str(m["tokens"]), f"{m['tokens_per_forward']:.2f}",
                 f"{m['p_cache']:.3f}", f"{m['wall_ms']:.1f}"]
                for label, m in item["modes"].items()]
        print("\n".join(aligned_table([header, *rows])))
        equal = "yes" if item["streaming_equals_one_per_step"] else "no"
        print(f"streaming == one token per step: {equal}")
    print(f"\nsummary over {len(data)} prompts (wall time measured on {device})")
    rows = [["mode", "mean tokens/forward", "mean p_cache", f"total wall ms ({device})"]]
    for label, *_ in RUNS:
        runs = [item["modes"][label] for item in data]
        rows.append([label, f"{sum(r['tokens_per_forward'] for r in runs) / len(runs):.2f}",
                     f"{sum(r['p_cache'] for r in runs) / len(runs):.3f}",
                     f"{sum(r['wall_ms'] for r in runs):.1f}"])
    print("\n".join(aligned_table(rows)))
    same = sum(item["streaming_equals_one_per_step"] for item in data)
    print(f"streaming == one token per step: {same} of {len(data)} prompts")


class Progress:
    """``[3/24] count: 41 42 43 ... blockwise`` on stderr: one line rewritten in place on a
    terminal, one line per run otherwise."""

    def __init__(self, total: int, stream=None) -> None:
        stream = stream if stream is not None else sys.stderr  # as it is now (tests swap it)
        self.total, self.done, self.stream = total, 0, stream
        self.in_place = stream.isatty()
        self.width = 0

    def __call__(self, prompt: str, label: str) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {prompt[:24].strip()} ... {label}"
        if self.in_place:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = max(self.width, len(line))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.in_place and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR,
                        help="checkpoint directory with tokenizer.json (default: the shipped one)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; replaces the "
                        "default prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--threshold", type=parse_threshold, default=0.4,
                        help="entropy threshold in nats, or 'none' for one token per step")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the tiny model's matrices are too small to "
                        "gain from more, and extra threads collide with other jobs)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    """The ``demo`` subcommand; returns the exit code."""
    if not (args.model / "tokenizer.json").is_file():
        print(f"error: {args.model} is not a model directory with tokenizer.json",
              file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device}, but no CUDA device is available", file=sys.stderr)
        return 1
    if device.type == "cpu":
        torch.set_num_threads(max(1, args.threads))
    prompts = tuple(args.prompt) if args.prompt else DEMO_PROMPTS
    progress = Progress(len(prompts) * len(RUNS))
    try:
        model = load_model(args.model, device=device)
        generator = Generator(model, window=args.window, max_batch=1,
                              tokenizer=load_tokenizer(args.model))
        threads = f" ({torch.get_num_threads()} thread(s))" if device.type == "cpu" else ""
        print(f"model_min demo: {args.model} on {device}{threads}, window {args.window}, threshold "
              f"{args.threshold}, penalty {PENALTY}, greedy, up to {args.max_new_tokens} new tokens")
        data = run_demo(generator, prompts, args.max_new_tokens, args.threshold,
                        on_run=None if args.no_progress else progress)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        progress.clear()
    print_report(data, device.type)
    if args.json is not None:
        write_report(args, device, model.config.eos_token_ids, data)
    return 0


def write_report(args: argparse.Namespace, device: torch.device, stop_ids: Sequence[int],
                 data: list[dict]) -> None:
    """The numbers as JSON, in the layout of the ``bench/`` results."""
    prompts = "".join(f" --prompt {p!r}" for p in args.prompt or ())
    command = (f"python -m model_min demo --model {args.model} --max-new-tokens "
               f"{args.max_new_tokens} --window {args.window} --threshold {args.threshold} "
               f"--device {args.device}{prompts}")
    write_json(args.json, {
        "benchmark": "model_min_demo", "label": f"model_min demo ({device.type})",
        "date": utc_now(), "device": device_info(device), "versions": versions(),
        "command": command, "wall_time": f"time.perf_counter per generate call, {device.type}",
        "settings": {"model": str(args.model), "window": args.window, "penalty": PENALTY,
                     "threshold": args.threshold, "max_new_tokens": args.max_new_tokens,
                     "temperature": 0.0, "stop_token_ids": list(stop_ids)},
        "prompts": data,
    })
