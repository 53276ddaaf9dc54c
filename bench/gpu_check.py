"""The GPU run: what must be known first runs first, and its results are kept as it goes.

    bash bench/gpu_check.sh             # on a machine with an NVIDIA GPU, from any directory
    bash bench/gpu_check.sh --dry-run   # the plan, each step's limit; runs nothing
    GPU_CHECK_BUDGET_S=300 bash bench/gpu_check.sh

Made for a lent machine without network whose Python has torch, triton, pytest and
hypothesis (the checkout goes on PYTHONPATH; no install step). Pure-Python wheels the
machine lacks (liger-kernel for model_min's fused norms: ``make gpu-wheels``) are taken
from ``.whl/`` in the repository (carried there with the run) and installed into a staging
folder first.

The steps, in order (:func:`plan`); each has its own limit, capped by what is left of the
whole budget (``GPU_CHECK_BUDGET_S``, default 500 s, less ``PACK_RESERVE_S`` for the last
packing), so the run ends within the budget however the steps fare:

1. probe: versions, Liger importable, ``nvidia-smi`` (a missing GPU or Liger fails it);

then select_tokens' two kernels, first (the select kernel setting's default follows what
this part measures); the limits of steps 2 to 5 add up to 6 minutes (``SELECT_STEPS_S``):

2. the select kernel tests, three launches and one (``tests/test_select_tokens_kernel.py``
   and ``tests/test_select_one_launch.py`` whole, in one process; smoke hypothesis profile);
3. the race stress test of select_tokens (``tests/test_select_tokens_race.py``);
4. ``bench.select_tokens --quick``: the three-launch kernels and the one-launch kernel timed
   side by side in one run (its summary's ``new_over_old_min``), with its logit-rules cases
   (process_logits + select_tokens against select_tokens alone, a few seconds more);
5. ``bench.host_time --ops select_tokens``: the host time of the eager select_tokens call,
   and of its greedy call under each select kernel setting (``host_time_select_tokens.json``,
   summary ``select_host_us_eager``);

then the rest:

6. ``tests/test_paged_attention_kernel.py`` whole;
7. the rope, reorder, commit, silu and process_logits kernel test files, in one process
   (with the other cuda-marked tests one by one: select_tokens' and process_logits' device
   checks);
8. model_min's generator and layer tests ``-m cuda``, with ``MODEL_MIN_REQUIRE_LIGER=1`` (a
   skipped Liger test fails);
9. ``bench.decode_step --quick`` at B 1, 16 and 64 (AR, streaming and block-wise, and the
   adaptive window beside the fixed one);
10. ``bench.paged_attention --quick``; 11. ``bench.host_time --quick`` (pytest-benchmark,
    every op);
12. the window sweeps of a Qwen3-8B-shaped random model, with whatever time is left.

Results, in ``$OUT`` (default ``${TMPDIR:-/tmp}/gpu_check_out``), kept as the run goes:

- ``summary.txt``: one verdict line per step, rewritten (write, then rename) as each ends;
- ``gpu_check.log``: everything the steps print;
- ``gpu_results.tar.gz``: ``bench/results/<device>/`` (the benchmarks' JSON, written after
  every case) and ``bench/results/<device>/gpu_check/`` (each step's log and the pytest
  steps' JUnit XML), re-packed after every step, every ``REPACK_EVERY_S`` seconds during
  one, and when the run is stopped by a signal. Extract it in the repository root.

A run cut short (killed at the device's limit) therefore keeps every finished step's
verdict and results, and the benchmark cases finished before the last repack.

``GPU_CHECK_STUB=<seconds>`` (tests only) replaces every step's command with a stand-in
that writes a result file, sleeps that long and succeeds: ``tests/test_gpu_check.py`` kills
such a run midway and finds the finished steps' results in ``$OUT``.
"""

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 500  # one device command of at most about 520 s
PACK_RESERVE_S = 15  # kept for the last packing
MIN_STEP_S = 5  # a step with less time left than this is skipped
REPACK_EVERY_S = 20
KILL_GRACE_S = 10  # SIGTERM, then SIGKILL after this long
PER_TEST_TIMEOUT_S = 120  # pytest-timeout, where the plugin is installed
SELECT_STEPS_S = 360  # the limits of the select steps after the probe, together
SWEEP_ARGS = ("--batch-sizes 1 4 16 64 --windows 4 8 16 32 --thresholds 0.4 --modes streaming "
              "ar --max-new-tokens 32 --repeats 1 --cuda-graph --ignore-eos")


@dataclass
class Step:
    """One step of the run: a command (``{results}`` in it becomes the results folder)."""

    name: str
    limit_s: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pytest: bool = False  # a pytest run: JUnit XML and a per-test timeout are added


def _pytest(name: str, limit_s: int, *arguments: str, env: dict | None = None) -> Step:
    return Step(name, limit_s, ["-m", "pytest", "-q", "-rfE", "--maxfail=5",
                                "-p", "no:cacheprovider", *arguments],
                env={"HYPOTHESIS_PROFILE": "smoke", **(env or {})}, pytest=True)


def _bench(name: str, limit_s: int, module_and_arguments: str) -> Step:
    return Step(name, limit_s, ["-m", *shlex.split(module_and_arguments),
                                "--out-dir", "{results}"])


def plan() -> list[Step]:
    """The steps in the order they run (see the module docstring)."""
    window_kernels = [f"tests/test_{name}_kernel.py"
                      for name in ("rope_kv_append", "reorder_window", "commit_window", "silu_mul",
                                   "process_logits")]
    # the cuda-marked tests outside the kernel and model_min files (tests/test_gpu_check.py
    # checks that every cuda-marked test is in some step)
    window_kernels += [
        "tests/test_select_tokens.py::test_tensors_on_different_devices_are_rejected",
        "tests/test_process_logits.py::test_tensors_on_different_devices_are_rejected_on_gpu"]
    return [
        Step("probe", 60, ["-m", "bench.gpu_check", "--probe"]),
        # the select steps (SELECT_STEPS_S in all; the three-launch file took 130 s alone)
        _pytest("select_tokens kernel tests (three launches, one launch)", 200,
                "tests/test_select_tokens_kernel.py", "tests/test_select_one_launch.py"),
        _pytest("select_tokens race stress", 40, "tests/test_select_tokens_race.py"),
        _bench("bench.select_tokens --quick (three launches vs one)", 75,
               "bench.select_tokens --quick"),
        _bench("bench.host_time --ops select_tokens", 45,
               "bench.host_time --ops select_tokens"),
        # (the kernel compiles per page size and GQA group: the tests' page sizes and groups
        # add compiles to the 92 s this file took)
        _pytest("paged_attention kernel tests", 180, "tests/test_paged_attention_kernel.py"),
        _pytest("rope, reorder, commit, silu, process_logits kernel tests", 120,
                *window_kernels),
        _pytest("model_min cuda tests (Liger required)", 90, "-m", "cuda",
                "tests/test_model_min_generator.py", "tests/test_model_min_layers.py",
                env={"MODEL_MIN_REQUIRE_LIGER": "1"}),
        # (with the adaptive window's streaming cases beside the fixed window's: issue 52's
        # figures at B 1, 16 and 64)
        _bench("bench.decode_step --quick (B 1, 16, 64)", 300,
               "bench.decode_step --quick --batches 1 16 64"),
        _bench("bench.paged_attention --quick", 60, "bench.paged_attention --quick"),
        _bench("bench.host_time --quick", 45, "bench.host_time --quick"),
        _bench("bench.sweep peaked", 150,
               f"bench.sweep --model random:qwen3-8b-peaked {SWEEP_ARGS}"),
        _bench("bench.sweep flat", 150, f"bench.sweep --model random:qwen3-8b-flat {SWEEP_ARGS}"),
    ]


def probe() -> int:
    """Step 1: versions, the device's results slug (``SLUG=``), Liger, nvidia-smi. Exit 1
    without a GPU or without Liger (model_min's CUDA tests need it)."""
    import torch

    from bench.common import device_slug, versions
    from model_min import layers

    print("SLUG=" + (device_slug() if torch.cuda.is_available() else "no-gpu"))
    print("versions:", versions())
    for name in ("numpy", "pytest", "hypothesis", "transformers", "safetensors",
                 "pytest_benchmark", "pytest_timeout", "liger_kernel"):
        spec = importlib.util.find_spec(name)
        print(f"  {name}: {'present' if spec else 'MISSING'}")
    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA GPU")
    else:
        print("device:", torch.cuda.get_device_name(0))
    if layers.liger_functions() is None:
        problems.append("liger-kernel not importable (make gpu-wheels, carry .whl)")
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        print(smi.stdout + smi.stderr)
    except (OSError, subprocess.TimeoutExpired) as error:
        problems.append(f"nvidia-smi: {error}")
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


_PYTEST_TALLY = re.compile(r"(\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected))")


def pytest_tally(output: str) -> str:
    """The counts of pytest's closing line ("3 failed, 60 passed, 2 skipped"), or ''."""
    for line in reversed(output.splitlines()):
        if re.search(r" in [\d.]+s", line):
            found = _PYTEST_TALLY.findall(line)
            if found:
                return ", ".join(found)
    return ""


class Run:
    """One run of the plan: staging folder, budget, verdicts, packing into ``out``."""

    def __init__(self, out: Path, budget_s: int, stub_s: float | None) -> None:
        self.out, self.budget_s, self.stub_s = out, budget_s, stub_s
        self.started = time.monotonic()
        self.stage = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.slug = "unknown-device"
        self.verdicts: list[str] = []
        self.failed = False
        self.pack_lock = threading.Lock()
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "gpu_check.log", "a", buffering=1)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                        PYTHONPATH=os.pathsep.join(
                            [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.pytest_timeout = importlib.util.find_spec("pytest_timeout") is not None
        self.current: subprocess.Popen | None = None  # the running step

    @property
    def results(self) -> Path:
        return self.stage / "bench" / "results" / self.slug

    def left_s(self) -> float:
        return self.budget_s - PACK_RESERVE_S - (time.monotonic() - self.started)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    # ---- results into $OUT ------------------------------------------------------------
    def _replace(self, name: str, write) -> None:
        """Write ``out/name`` through a temporary file and a rename (never half written)."""
        temporary = self.out / f"{name}.partial"
        write(temporary)
        os.replace(temporary, self.out / name)

    def pack(self) -> None:
        with self.pack_lock:
            def write_tar(path: Path) -> None:
                with tarfile.open(path, "w:gz") as tar:
                    if (self.stage / "bench").exists():
                        tar.add(self.stage / "bench", arcname="bench")
            self._replace("gpu_results.tar.gz", write_tar)
            text = "\n".join(self.verdicts) + "\n"
            self._replace("summary.txt", lambda path: path.write_text(text))

    def _repack_while(self, process: subprocess.Popen) -> None:
        while process.poll() is None:
            time.sleep(REPACK_EVERY_S)
            if process.poll() is None:
                self.pack()

    # ---- one step -----------------------------------------------------------------------
    def command(self, index: int, step: Step) -> list[str]:
        if self.stub_s is not None:
            return [sys.executable, "-c", _STUB, step.name, str(self.results), str(index),
                    str(self.stub_s)]
        words = [word.replace("{results}", str(self.results)) for word in step.command]
        if step.pytest:
            words += [f"--junitxml={self.results / 'gpu_check' / f'{index:02d}.xml'}"]
            if self.pytest_timeout:
                words += [f"--timeout={PER_TEST_TIMEOUT_S}"]
        return [sys.executable, *words]

    def run_step(self, index: int, step: Step) -> None:
        limit = int(min(step.limit_s, self.left_s()))
        header = f"{index:02d} {step.name}"
        if limit < MIN_STEP_S:
            self.say(f"=== {header}: skipped, no time left")
            self.verdicts.append(f"{header}: skipped (no time left)")
            self.failed = True
            self.pack()
            return
        self.say(f"=== {header} (limit {limit} s, at {time.monotonic() - self.started:.0f} s)")
        (self.results / "gpu_check").mkdir(parents=True, exist_ok=True)
        step_log = self.results / "gpu_check" / f"{index:02d}.log"
        start = time.monotonic()
        output: list[str] = []
        with open(step_log, "w", buffering=1) as log:
            process = subprocess.Popen(
                self.command(index, step), cwd=REPO, env={**self.env, **step.env},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)  # its own group: a timeout stops all it started
            self.current = process
            threading.Thread(target=self._repack_while, args=(process,), daemon=True).start()
            reader = threading.Thread(target=self._copy_output,
                                      args=(process, log, output), daemon=True)
            reader.start()
            try:
                status = process.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                _stop(process)
                status, timed_out = process.wait(), True
            reader.join(timeout=KILL_GRACE_S)
        self.current = None
        took = time.monotonic() - start
        text = "".join(output)
        if index == 1:  # the probe names the device's results folder
            self._adopt_slug(text)
        if timed_out:
            verdict = f"TIMED OUT after {took:.0f} s"
        elif status == 0:
            verdict = f"ok, {took:.0f} s"
        else:
            verdict = f"FAILED (exit {status}), {took:.0f} s"
        tally = pytest_tally(text) if step.pytest else ""
        self.failed |= timed_out or status != 0
        self.verdicts.append(f"{header}: {verdict}" + (f" ({tally})" if tally else ""))
        self.say(f"--- {self.verdicts[-1]}")
        self.pack()

    def _copy_output(self, process: subprocess.Popen, log, output: list[str]) -> None:
        for line in process.stdout:
            output.append(line)
            log.write(line)
            self.log.write(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    def _adopt_slug(self, text: str) -> None:
        found = re.findall(r"^SLUG=([\w.-]+)$", text, flags=re.M)
        if found and found[-1] != self.slug:
            with self.pack_lock:
                old, self.slug = self.results, found[-1]
                self.results.parent.mkdir(parents=True, exist_ok=True)
                if old.exists():
                    old.rename(self.results)

    def finish(self) -> int:
        took = time.monotonic() - self.started
        closing = ("gpu_check: SOME CHECKS FAILED" if self.failed
                   else "gpu_check: all checks passed")
        self.verdicts.append(f"{closing} ({took:.0f} s of {self.budget_s} s)")
        self.say("=== summary\n" + "\n".join(self.verdicts))
        self.say(f"results in {self.out}: tar -xzf gpu_results.tar.gz -C <repository root> "
                 f"(bench/results/{self.slug}/)")
        self.pack()
        self.log.close()
        shutil.rmtree(self.stage, ignore_errors=True)
        return 1 if self.failed else 0


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after KILL_GRACE_S."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except ProcessLookupError:
        pass


# A step's stand-in (GPU_CHECK_STUB): the probe's slug line, then a result file written
# before and after its sleep, like a benchmark that writes after every case.
_STUB = r"""
import json, pathlib, sys, time
name, results, index, seconds = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
if index == "1":
    print("SLUG=stub-device", flush=True)
results.mkdir(parents=True, exist_ok=True)
path = results / f"step{int(index):02d}.json"
path.write_text(json.dumps({"step": name, "complete": False}))
print("stub:", name, flush=True)
time.sleep(seconds)
path.write_text(json.dumps({"step": name, "complete": True}))
"""


def _wheels(run: Run) -> None:
    """Pure-Python wheels from .whl/ into the staging folder, first on PYTHONPATH."""
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels or run.stub_s is not None:
        return
    site = run.stage / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
        capture_output=True, text=True, timeout=120)
    run.say(f"=== wheels from .whl/: {', '.join(w.name for w in wheels)}: "
            + ("installed" if done.returncode == 0 else f"FAILED\n{done.stdout}{done.stderr}"))
    if done.returncode == 0:
        run.env["PYTHONPATH"] = os.pathsep.join([str(site), run.env["PYTHONPATH"]])


def dry_run(budget_s: int) -> int:
    print(f"gpu_check plan: budget {budget_s} s (GPU_CHECK_BUDGET_S), {PACK_RESERVE_S} s kept "
          "for packing; each step's limit is capped by what is left")
    for index, step in enumerate(plan(), 1):
        env = " ".join(f"{key}={value}" for key, value in step.env.items())
        print(f"{index:02d} {step.name} (limit {step.limit_s} s)")
        command = shlex.join(step.command).replace("{results}", "bench/results/<device>")
        print(f"     + {env + ' ' if env else ''}python {command}")
    print("results: $OUT/summary.txt, $OUT/gpu_check.log, $OUT/gpu_results.tar.gz "
          "(re-packed after every step)")
    print("gpu_check: dry run, nothing was run")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return probe()
    budget_s = int(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S))
    if args.dry_run:
        return dry_run(budget_s)
    out = Path(os.environ.get("OUT") or Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check_out")
    stub = os.environ.get("GPU_CHECK_STUB")
    run = Run(out, budget_s, float(stub) if stub else None)

    def stopped(signum, frame):  # stop the running step, keep what is finished
        if run.current is not None:
            try:
                os.killpg(run.current.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.verdicts.append(f"gpu_check: stopped by signal {signum}")
        run.pack()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    run.say(f"=== gpu_check {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
            f"repository {REPO}, budget {budget_s} s, results in {out}")
    _wheels(run)
    for index, step in enumerate(plan(), 1):
        run.run_step(index, step)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
