"""bench/gpu_check.sh: the plan's order and limits, the budget, and results kept as the run
goes. The steps run as stand-ins (GPU_CHECK_STUB) on the CPU: what is checked is the
orchestration (verdicts, packing, time limits), not the GPU steps themselves."""

import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
# select_tokens' kernels first after the probe (their tests, the race stress, the benchmark
# of both kernels in one run, the host time of the call), then the rest
SELECT_STEPS = [
    "select_tokens kernel tests (three launches, one launch)", "select_tokens race stress",
    "bench.select_tokens --quick (three launches vs one)", "bench.host_time --ops select_tokens",
]
ISSUE_ORDER = [
    "probe", *SELECT_STEPS,
    "paged_attention kernel tests", "rope, reorder, commit, silu, process_logits kernel tests",
    "model_min cuda tests (Liger required)",
    "bench.decode_step --quick (B 1, 16, 64)", "bench.paged_attention --quick",
    "bench.host_time --quick", "bench.sweep peaked", "bench.sweep flat",
]


def _env(tmp_path: Path, **extra) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path / "out"), TMPDIR=str(tmp_path), **extra)
    return env


def _results(out: Path) -> dict[str, str]:
    with tarfile.open(out / "gpu_results.tar.gz") as tar:
        return {member.name: tar.extractfile(member).read().decode()
                for member in tar.getmembers() if member.isfile()}


def test_dry_run_prints_the_plan_in_order_with_limits_and_runs_nothing(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    headers = [line for line in done.stdout.splitlines() if line[:2].isdigit()]
    assert [line.split(" ", 1)[1].rsplit(" (limit", 1)[0] for line in headers] == ISSUE_ORDER
    assert all(line.endswith(" s)") for line in headers)
    assert "budget 500 s" in done.stdout and not (tmp_path / "out").exists()
    assert "MODEL_MIN_REQUIRE_LIGER=1" in done.stdout
    budget = subprocess.run(["bash", str(SCRIPT), "--dry-run"],
                            env=_env(tmp_path, GPU_CHECK_BUDGET_S="300"),
                            capture_output=True, text=True, timeout=60)
    assert "budget 300 s" in budget.stdout


def test_stubbed_run_writes_a_verdict_per_step_and_every_result(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT)], env=_env(tmp_path, GPU_CHECK_STUB="0.05"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(": ")[0] for line in lines[:-1]] == [
        f"{index:02d} {name}" for index, name in enumerate(ISSUE_ORDER, 1)]
    assert all(": ok, " in line for line in lines[:-1])
    assert lines[-1].startswith("gpu_check: all checks passed")
    results = _results(out)
    for index in range(1, len(ISSUE_ORDER) + 1):
        assert '"complete": true' in results[f"bench/results/stub-device/step{index:02d}.json"]
        assert f"bench/results/stub-device/gpu_check/{index:02d}.log" in results
    assert "stub: probe" in (out / "gpu_check.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.log", "gpu_results.tar.gz", "summary.txt"]
    assert not list(tmp_path.glob("gpu_check_*"))  # the staging folder is removed


def test_a_run_killed_midway_keeps_the_finished_steps_results(tmp_path):
    """SIGKILL to the whole run (as a device time limit does) after three steps: their
    verdicts and results are in $OUT, the step running then is not."""
    process = subprocess.Popen(["bash", str(SCRIPT)], env=_env(tmp_path, GPU_CHECK_STUB="1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    summary = tmp_path / "out" / "summary.txt"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if summary.exists() and len(summary.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    lines = summary.read_text().splitlines()
    assert 3 <= len(lines) < len(ISSUE_ORDER), lines
    assert [line.split(": ")[0] for line in lines] == [
        f"{index:02d} {name}" for index, name in enumerate(ISSUE_ORDER[:len(lines)], 1)]
    results = _results(tmp_path / "out")
    for index in range(1, len(lines) + 1):
        assert '"complete": true' in results[f"bench/results/stub-device/step{index:02d}.json"]
    assert not any(line.startswith("gpu_check:") for line in lines)


def test_steps_are_capped_by_the_budget_and_later_ones_skipped(tmp_path):
    """A budget of 22 s keeps 15 s for packing: the first step gets what is left of 7 s and
    is stopped (it would sleep 60 s), and every later one is skipped. The run fails."""
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT)],
                          env=_env(tmp_path, GPU_CHECK_STUB="60", GPU_CHECK_BUDGET_S="22"),
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 22
    assert done.returncode == 1
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("01 probe: TIMED OUT after "), lines[0]
    assert all(line.endswith("skipped (no time left)") for line in lines[1:-1])
    assert lines[-1].startswith("gpu_check: SOME CHECKS FAILED")


def test_the_probe_fails_without_a_gpu_and_names_the_problem():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--probe"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    import torch

    if not torch.cuda.is_available():
        assert done.returncode == 1
        assert "SLUG=no-gpu" in done.stdout and "PROBLEM: no CUDA GPU" in done.stdout


def test_pytest_tally_reads_the_closing_line():
    output = "....F\n=== short test summary ===\nFAILED x\n3 failed, 60 passed, 2 skipped in 9.5s\n"
    assert gpu_check.pytest_tally(output) == "3 failed, 60 passed, 2 skipped"
    assert gpu_check.pytest_tally("no tests ran in 0.01s") == ""


def test_every_test_a_step_names_exists():
    """A renamed test file or test would fail its step on the GPU only: caught here."""
    for step in gpu_check.plan():
        for word in step.command:
            if word.startswith("tests/"):
                file, _, test = word.partition("::")
                assert (ROOT / file).is_file(), f"{step.name}: {file}"
                if test:
                    assert re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M), word


def test_the_select_tokens_benchmark_step_runs_it_quick_with_its_rules_cases():
    [step] = [s for s in gpu_check.plan() if "bench.select_tokens" in s.command]
    assert step.command == ["-m", "bench.select_tokens", "--quick", "--out-dir", "{results}"]
    from bench import select_tokens

    # the quick run holds every rows the summary's process_logits figures name
    assert set(select_tokens.RULES_SUMMARY_ROWS) <= set(select_tokens.QUICK.rows)
    # and times the one-launch kernel beside the three launches (greedy, temperature)
    assert "triton_one_launch" in select_tokens.IMPLS
    assert [p.name for p in select_tokens.PARAMS if select_tokens.one_launch_mode(p)] == [
        "greedy", "temperature"]


def test_the_select_steps_come_first_after_the_probe_within_six_minutes():
    """The select kernel tests (both kernels' files), the race stress, the benchmark of
    both kernels and the host time of the select call: their limits add up to 6 minutes."""
    steps = gpu_check.plan()[1:1 + len(SELECT_STEPS)]
    assert [step.name for step in steps] == SELECT_STEPS
    assert sum(step.limit_s for step in steps) == gpu_check.SELECT_STEPS_S == 360
    tests, race, benchmark, host = (step.command for step in steps)
    assert {"tests/test_select_tokens_kernel.py", "tests/test_select_one_launch.py"} <= set(tests)
    assert "tests/test_select_tokens_race.py" in race
    assert benchmark[:2] == ["-m", "bench.select_tokens"]
    assert host == ["-m", "bench.host_time", "--ops", "select_tokens", "--out-dir", "{results}"]


def test_every_cuda_marked_test_runs_in_some_step():
    """A test file with cuda-marked tests runs whole in a pytest step, or with ``-m cuda``,
    or its cuda-marked tests are named one by one."""
    steps = [step.command for step in gpu_check.plan() if step.pytest]
    whole = {word for command in steps if "-m" not in command[2:] for word in command
             if word.startswith("tests/")}
    marked = {word for command in steps if "cuda" in command for word in command
              if word.startswith("tests/")}
    named = {word for command in steps for word in command if "::" in word}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        tests = re.findall(r"@pytest\.mark\.cuda\n(?:@.*\n)*def (test_\w+)", text)
        if not tests:
            continue
        file = f"tests/{path.name}"
        if file in whole or file in marked:
            continue
        for test in tests:
            assert f"{file}::{test}" in named, f"{file}::{test} runs in no step"
