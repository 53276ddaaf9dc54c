"""bench/host_time.py and bench/test_host_time.py: the pytest-benchmark host-time
benchmarks run (CI: few rounds, and once each with timing off, so they cannot fail on
time), cover every public op, and their JSON carries the summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import host_time
from bench.report import render

ROOT = Path(__file__).resolve().parents[1]


def _plain_env() -> dict:
    return {key: value for key, value in os.environ.items()
            if key not in ("TRITON_INTERPRET", "WEDLM_KERNELS_BACKEND")}


def test_host_time_benchmarks_pass_as_plain_tests_with_timing_disabled():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
         "bench/test_host_time.py"], cwd=ROOT, env=_plain_env(), capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if not torch.cuda.is_available():  # public and torch.ops per op; launchers need CUDA
        assert f"{2 * len(host_time.public_ops())} passed" in done.stdout


def test_quick_run_writes_every_public_op_and_the_summary(tmp_path):
    out_dir = tmp_path / "cpu"
    assert host_time.main(["--quick", "--out-dir", str(out_dir)]) == 0
    report = json.loads((out_dir / "host_time.json").read_text())
    timed = {(b["params"]["device"], b["params"]["op"], b["params"]["entry"])
             for b in report["benchmarks"]}
    for op in host_time.public_ops():
        assert ("cpu", op, "public") in timed and ("cpu", op, "torch.ops") in timed
    public = [b["stats"]["median"] * 1e6 for b in report["benchmarks"]
              if b["params"] == {"device": "cpu", "op": b["params"]["op"], "entry": "public"}]
    assert report["summary"]["max_public_op_host_us_cpu"] == max(public)
    assert all(b["stats"]["rounds"] == 5 for b in report["benchmarks"])
    assert report["label"].startswith("CPU only")
    assert "| cpu | `select_tokens` |" in (out_dir / "host_time.md").read_text()
    # REPORT.md shows a pytest-benchmark file as one row per benchmark, and its summary
    text, _ = render(tmp_path, tmp_path / "REPORT.md")
    assert "| device cpu, op select_tokens, entry public |" in text
    assert "max_public_op_host_us_cpu" in text and "machine_info" not in text
