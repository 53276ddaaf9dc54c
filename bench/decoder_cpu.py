"""CPU benchmark of the model_min decoder against the no-cache reference decoder.

    python -m bench.decoder_cpu [--out bench/results/cpu/decoder_cpu.json] [--quick]
                                [--threshold NATS] [--threads N] [--repeats N]

One run, one tiny random Qwen3 checkpoint (``bench/tiny_models.py``, fp32, built in a
temporary directory, no downloads), one batch of prompts of mixed lengths, the same
``SamplingParams`` (greedy, an entropy threshold that commits several tokens per forward),
windows 8 and 16. Per window it measures:

(a) ``Generator``: wall time of ``generate`` over the batch divided by the number of batch
    decode steps it ran (prefill, admission and the host's polls included), and the wall
    time of the decode step alone;
(b) the reference decoder (``reference.decoder.decode``, one prompt after the other, no KV
    cache: every forward recomputes prompt + committed + window) driven by the Hugging Face
    ``Qwen3ForCausalLM`` fp32 forward of the same weights: wall time per forward, and the
    part of it spent inside the HF forward;
(c) the host-side time of a ``Generator`` step: the step's wall time with the tensor math
    made negligible, i.e. the same Generator, batch, prompts, params and window on a
    checkpoint of the same architecture and layer count whose every size is shrunk to a
    minimum (hidden 8, head_dim 4, MLP 8, vocabulary 32). The step issues the same op calls
    with the same static shapes up to those sizes, so what remains is Python, argument
    validation, op dispatch and allocation: the time the host needs to issue one step. It is
    an upper bound (a little arithmetic is left) and is compared with the full model's step
    at the same batch size, because the two models finish requests at different steps.

The tokens, finish reasons, forwards and tokens per forward of every request must be equal
between the Generator and the reference decoder; the run fails otherwise. Timing uses
``time.perf_counter``, one warm-up run, then the median of the repeats. On CPU every op is
synchronous, so wall time around a step is its full cost. Every figure is a CPU
measurement; results go to JSON plus a Markdown table next to it.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench.common import CPU_LABEL
from bench.tiny_models import MASK_TOKEN_ID, build_tiny_model, hf_logits, save_checkpoint
from model_min import Generator, SamplingParams, load_model
from model_min.run_info import versions as run_versions
from reference.decoder import Params, decode

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "decoder_cpu.json"

# Mixed prompt lengths (2, 7, 12, 24 tokens); every id < 31 so they fit both vocabularies.
PROMPTS = [
    [6, 5],
    [3, 1, 4, 1, 5, 9, 2],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [(7 * i + 3) % 30 + 1 for i in range(24)],
]
THRESHOLD = 3.5  # entropy threshold in nats (default of --threshold)
PENALTY = 0.02
SEED = 0

MINIMAL_VOCAB = 32  # the host-side model; its mask token is the last row


def build_minimal_model(seed: int) -> Qwen3ForCausalLM:
    """A Qwen3 checkpoint with the tiny model's layer count and flavour (q/k norm, untied
    head) but every size at a minimum, so a decode step's arithmetic is negligible."""
    config = Qwen3Config(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=8,
        vocab_size=MINIMAL_VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager",
    )
    config.mask_token_id = MINIMAL_VOCAB - 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).to(torch.float32).eval()


class StepTimer:
    """Wall time and batch size of every decode step a Generator runs (wraps the step
    method on the instance; CPU ops are synchronous, so the wall time is the full cost)."""

    def __init__(self, generator: Generator) -> None:
        self.durations: list[float] = []
        self.batch_sizes: list[int] = []
        step = generator._step

        def timed_step(state, *args, **kwargs):
            start = time.perf_counter()
            step(state, *args, **kwargs)
            self.durations.append(time.perf_counter() - start)
            self.batch_sizes.append(state.size)

        generator._step = timed_step

    def reset(self) -> None:
        self.durations.clear()
        self.batch_sizes.clear()


def median_of(samples: list[float]) -> dict:
    """Median and all samples, in milliseconds."""
    samples_ms = [round(s * 1e3, 4) for s in samples]
    return {"median": statistics.median(samples_ms), "samples": samples_ms}


class GeneratorRuns:
    """(a) and (c): one ``generate`` over the batch per call."""

    def __init__(self, model, prompts, params, window) -> None:
        self.generator = Generator(model, window=window, max_batch=len(prompts), seed=SEED)
        self.timer = StepTimer(self.generator)
        self.prompts, self.params = prompts, params
        self.totals, self.per_step, self.step_only, self.outside_steps = [], [], [], []
        self.full_batch_steps = []
        self.results, self.steps = None, 0

    def __call__(self, record: bool) -> None:
        self.timer.reset()
        start = time.perf_counter()
        self.results = self.generator.generate(self.prompts, self.params)
        total = time.perf_counter() - start
        if not record:
            return
        durations = self.timer.durations
        self.steps = len(durations)
        self.totals.append(total)
        self.per_step.append(total / self.steps)
        self.step_only.append(sum(durations) / self.steps)
        self.outside_steps.append((total - sum(durations)) / self.steps)
        self.full_batch_steps += [
            d for d, size in zip(durations, self.timer.batch_sizes) if size == len(self.prompts)
        ]

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "generate_total_cpu_ms": median_of(self.totals),
            "generate_per_step_cpu_ms": median_of(self.per_step),
            "step_only_per_step_cpu_ms": median_of(self.step_only),
            "outside_steps_per_step_cpu_ms": median_of(self.outside_steps),
            "full_batch_step_cpu_ms": median_of(self.full_batch_steps),
        }


class ReferenceRuns:
    """(b): the reference decoder over all prompts, one after the other, per call."""

    def __init__(self, hf_model, prompts, params: SamplingParams, window, mask_id) -> None:
        self.hf_model, self.prompts, self.window, self.mask_id = hf_model, prompts, window, mask_id
        self.params = Params(
            max_new_tokens=params.max_new_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, threshold=params.threshold,
            penalty=params.penalty, seed=params.seed, stop_token_ids=params.stop_token_ids,
        )
        self.forward_seconds = 0.0
        self.per_forward, self.forward_only, self.totals = [], [], []
        self.results, self.forwards = None, 0

    def forward(self, input_ids, position_ids):
        start = time.perf_counter()
        logits = hf_logits(self.hf_model, input_ids, position_ids)
        self.forward_seconds += time.perf_counter() - start
        return logits

    def __call__(self, record: bool) -> None:
        self.forward_seconds = 0.0
        start = time.perf_counter()
        self.results = [
            decode(self.forward, prompt, self.params, "streaming", self.window, self.mask_id)
            for prompt in self.prompts
        ]
        total = time.perf_counter() - start
        if not record:
            return
        self.forwards = sum(r.forwards for r in self.results)
        self.per_forward.append(total / self.forwards)
        self.forward_only.append(self.forward_seconds / self.forwards)
        self.totals.append(total)

    def summary(self) -> dict:
        return {
            "forwards": self.forwards,
            "per_forward_cpu_ms": median_of(self.per_forward),
            "hf_forward_only_per_forward_cpu_ms": median_of(self.forward_only),
            "total_cpu_ms": median_of(self.totals),
        }


def check_same_decoding(generated, expected) -> None:
    """Generator and reference decoder must agree request by request."""
    for index, (ours, theirs) in enumerate(zip(generated, expected, strict=True)):
        mismatch = [
            name for name in ("token_ids", "finish_reason", "forwards", "rows",
                              "tokens_per_forward")
            if getattr(ours, name) != getattr(theirs, name)
        ]
        if mismatch:
            raise AssertionError(
                f"prompt {index}: Generator and reference decoder differ in {mismatch}: "
                f"{[getattr(ours, n) for n in mismatch]} vs {[getattr(theirs, n) for n in mismatch]}"
            )


def op_calls_per_step(model, prompts, params, window) -> dict:
    """ATen / wedlm op calls inside the decode steps of one generate run under
    torch.profiler (not timed), per step: the calls the step issues itself, and all calls
    (nested ones included)."""
    generator = Generator(model, window=window, max_batch=len(prompts), seed=SEED)
    step, steps = generator._step, [0]

    def labelled_step(state, *args, **kwargs):
        steps[0] += 1
        with torch.profiler.record_function("decode_step"):
            step(state, *args, **kwargs)

    generator._step = labelled_step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        generator.generate(prompts, params)
    direct = every = 0
    for event in profile.events():
        if not event.name.startswith(("aten::", "wedlm::")):
            continue
        parent, depth = event.cpu_parent, 0
        while parent is not None and parent.name != "decode_step":
            parent, depth = parent.cpu_parent, depth + 1
        if parent is not None:
            every += 1
            direct += depth == 0
    return {
        "steps": steps[0],
        "direct_per_step": round(direct / steps[0], 1),
        "all_per_step": round(every / steps[0], 1),
    }


def run_window(models, prompts, params, window, warmup, repeats) -> dict:
    """All measurements of one window, their repeats interleaved so that a change in the
    machine's load hits every figure alike."""
    generator_runs = GeneratorRuns(models["full"], prompts, params, window)
    reference_runs = ReferenceRuns(models["hf"], prompts, params, window, MASK_TOKEN_ID)
    host_runs = GeneratorRuns(models["minimal"], prompts, params, window)
    for repeat in range(warmup + repeats):
        for runs in (generator_runs, reference_runs, host_runs):
            runs(record=repeat >= warmup)
    generated, results = generator_runs.results, reference_runs.results
    check_same_decoding(generated, results)
    generator, reference, host = (
        generator_runs.summary(), reference_runs.summary(), host_runs.summary()
    )

    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(r.forwards for r in results)
    gen_step = generator["generate_per_step_cpu_ms"]["median"]
    full_batch = generator["full_batch_step_cpu_ms"]["median"]
    host_step = host["full_batch_step_cpu_ms"]["median"]
    return {
        "window": window,
        "device": "cpu",
        "tokens_generated": tokens,
        "tokens_per_forward": {
            "generator": [r.tokens_per_forward for r in generated],
            "reference": [r.tokens_per_forward for r in results],
            "overall": tokens / forwards,
            "equal": True,  # check_same_decoding raised otherwise
        },
        "sequence_forwards": forwards,
        "generator_batch_steps": generator["steps"],
        "generator": generator,
        "reference": reference,
        "host": {
            "batch_size": len(prompts),
            "host_step_cpu_ms": host["full_batch_step_cpu_ms"],
            "full_step_cpu_ms": generator["full_batch_step_cpu_ms"],
            "minimal_model_generate_per_step_cpu_ms": host["generate_per_step_cpu_ms"],
            "op_calls_per_step": op_calls_per_step(models["full"], prompts, params, window),
        },
        "ratios": {
            "reference_forward_over_generator_step":
                reference["per_forward_cpu_ms"]["median"] / gen_step,
            "reference_total_over_generator_total":
                reference["total_cpu_ms"]["median"]
                / generator["generate_total_cpu_ms"]["median"],
            "host_over_generator_step": host_step / full_batch,
        },
    }


def machine() -> dict:
    return {
        "label": CPU_LABEL,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def versions() -> dict:
    return {**run_versions(), "transformers": transformers.__version__}


def model_summary(model) -> dict:
    c = model.config
    return {
        "model_type": c.model_type, "hidden_size": c.hidden_size, "num_layers": c.num_layers,
        "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
        "mask_token_id": c.mask_token_id, "dtype": str(model.dtype).replace("torch.", ""),
    }


METHODS = {
    "generator_step": (
        "Generator.generate wall time over the whole batch divided by the number of batch "
        "decode steps it ran (prefill, admission and host polls included; a batch step "
        "advances every live request); step_only: the decode step's own wall time; "
        "full_batch_step: median of single steps while all requests are in the batch."
    ),
    "reference_forward": (
        "reference.decoder.decode (no KV cache, one prompt after the other) with the Hugging "
        "Face Qwen3ForCausalLM fp32 forward of the same weights (bench.tiny_models.hf_logits): "
        "wall time over all prompts divided by the forwards; hf_forward_only: the part spent "
        "inside the HF forward (the rest is the reference decoder's Python entropy, "
        "selection and sampling)."
    ),
    "host_step": (
        "Median wall time of one Generator decode step at the full batch size on a Qwen3 "
        "checkpoint of the same layer count and flavour with every size at a minimum "
        "(hidden 8, head_dim 4, MLP 8, vocab 32), same prompts, params and window: the same "
        "op calls on near-empty tensors, so the time is Python, validation, op dispatch and "
        "allocation (an upper bound: a little arithmetic remains). ratios.host_over_generator_step "
        "divides it by the full model's step at the same batch size."
    ),
    "op_calls_per_step": (
        "ATen and wedlm op calls recorded by torch.profiler in one untimed generate run, "
        "counting the calls inside the decode steps, divided by the steps: the calls the step "
        "issues itself, and all calls (nested ones included)."
    ),
}


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# model_min decoder vs the no-cache reference decoder (CPU measurement)",
        "",
        f"{report['date']}, {report['machine']['label']}: {report['machine']['platform']}, "
        f"{report['machine']['cpu_count']} CPUs, {report['machine']['torch_threads']} torch "
        f"thread(s); torch {report['versions']['torch']}, transformers "
        f"{report['versions']['transformers']}.",
        "",
        f"Command: `{report['command']}`. Model: tiny random Qwen3 "
        f"({report['model']['num_layers']} layers, hidden {report['model']['hidden_size']}, "
        f"vocab {report['model']['vocab_size']}, fp32). Batch of {len(report['prompts'])} "
        f"prompts (lengths {[len(p) for p in report['prompts']]}), greedy, threshold "
        f"{report['params']['threshold']}, max_new_tokens {report['params']['max_new_tokens']}; "
        f"median of {report['repeats']} runs after {report['warmup']} warm-up.",
        "",
        "| CPU measurement | " + " | ".join(f"W={c['window']}" for c in report["cases"]) + " |",
        "|---|" + "---:|" * len(report["cases"]),
    ]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    cases = report["cases"]
    row("tokens / forward (Generator = reference)",
        [f"{c['tokens_per_forward']['overall']:.2f}" for c in cases])
    row("sequence forwards / Generator batch steps",
        [f"{c['sequence_forwards']} / {c['generator_batch_steps']}" for c in cases])
    row("Generator: generate time / batch step (ms, CPU)",
        [f"{c['generator']['generate_per_step_cpu_ms']['median']:.2f}" for c in cases])
    row("Generator: decode step alone (ms, CPU)",
        [f"{c['generator']['step_only_per_step_cpu_ms']['median']:.2f}" for c in cases])
    row("reference decoder: time / forward (ms, CPU)",
        [f"{c['reference']['per_forward_cpu_ms']['median']:.2f}" for c in cases])
    row("  of which inside the HF forward (ms, CPU)",
        [f"{c['reference']['hf_forward_only_per_forward_cpu_ms']['median']:.2f}"
         for c in cases])
    row("**ratio** reference time per forward / Generator time per step",
        [f"**{c['ratios']['reference_forward_over_generator_step']:.2f}**" for c in cases])
    row("ratio reference total / Generator total (same tokens)",
        [f"{c['ratios']['reference_total_over_generator_total']:.2f}" for c in cases])
    row(f"Generator step at batch {report['cases'][0]['host']['batch_size']}: full model "
        "(ms, CPU)", [f"{c['host']['full_step_cpu_ms']['median']:.2f}" for c in cases])
    row("host-side time per step (minimal model, ms, CPU)",
        [f"{c['host']['host_step_cpu_ms']['median']:.2f}" for c in cases])
    row("**ratio** host-side / full step",
        [f"**{c['ratios']['host_over_generator_step']:.2f}**" for c in cases])
    row("op calls per decode step (issued by the step / all)",
        [f"{c['host']['op_calls_per_step']['direct_per_step']:.0f} / "
         f"{c['host']['op_calls_per_step']['all_per_step']:.0f}" for c in cases])
    lines += ["", "How each figure is measured:", ""]
    lines += [f"- {name}: {text}" for name, text in report["methods"].items()]
    lines.append("")
    path.write_text("\n".join(lines))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="JSON output; the Markdown table goes next to it (.md)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny configuration for a smoke test (seconds)")
    parser.add_argument("--threshold", type=float, default=THRESHOLD,
                        help="entropy threshold of every request (nats)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs after the warm-up (default 5, --quick 2)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warmup = 1
    repeats = args.repeats or (2 if args.quick else 5)
    windows = (8,) if args.quick else (8, 16)
    max_new_tokens = 8 if args.quick else 64
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            threshold=args.threshold, penalty=PENALTY, seed=SEED)
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as directory:
        hf_model = build_tiny_model("qwen3", seed=SEED)
        full = load_model(save_checkpoint(hf_model, Path(directory) / "tiny"), "cpu",
                          torch.float32)
        minimal = load_model(
            save_checkpoint(build_minimal_model(SEED), Path(directory) / "minimal"), "cpu",
            torch.float32,
        )
    models = {"full": full, "minimal": minimal, "hf": hf_model}

    cases = []
    for window in windows:
        case = run_window(models, prompts, params, window, warmup, repeats)
        cases.append(case)
        print(
            f"[CPU] W={window}: tokens/forward {case['tokens_per_forward']['overall']:.2f} "
            f"(Generator = reference), Generator {case['generator']['generate_per_step_cpu_ms']['median']:.2f} "
            f"ms/batch step, reference {case['reference']['per_forward_cpu_ms']['median']:.2f} "
            f"ms/forward, ratio {case['ratios']['reference_forward_over_generator_step']:.2f}; "
            f"same work: ratio {case['ratios']['reference_total_over_generator_total']:.2f}; "
            f"host-side {case['host']['host_step_cpu_ms']['median']:.2f} ms of "
            f"{case['host']['full_step_cpu_ms']['median']:.2f} ms per step at batch "
            f"{len(prompts)} ({case['ratios']['host_over_generator_step']:.0%})",
            flush=True,
        )

    report = {
        "benchmark": "bench.decoder_cpu",
        "label": CPU_LABEL,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "command": "python -m bench.decoder_cpu" + "".join(" " + shlex.quote(a) for a in argv),
        "quick": args.quick,
        "warmup": warmup,
        "repeats": repeats,
        "model": model_summary(full),
        "host_model": model_summary(minimal),
        "prompts": prompts,
        "params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                   "threshold": args.threshold, "penalty": PENALTY, "seed": SEED,
                   "mode": "streaming", "batch": len(prompts)},
        "methods": METHODS,
        "cases": cases,
        "wall_seconds": None,
    }
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    markdown = args.out.with_suffix(".md")
    write_markdown(report, markdown)
    print(f"[CPU] wrote {args.out} and {markdown} ({report['wall_seconds']} s)")
    return report


if __name__ == "__main__":
    main()
