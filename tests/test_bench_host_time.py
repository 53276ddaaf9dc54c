"""bench/host_time.py and bench/test_host_time.py: the pytest-benchmark host-time
benchmarks run (CI: few rounds, and once each with timing off, so they cannot fail on
time), cover every public op and select_tokens' greedy call under each select kernel
setting, and their JSON carries the summary."""

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
        count = 2 * len(host_time.public_ops()) + len(host_time.SELECT_KERNELS)
        assert f"{count} passed" in done.stdout


def test_quick_run_writes_every_public_op_and_the_summary(tmp_path):
    out_dir = tmp_path / "cpu"
    assert host_time.main(["--quick", "--out-dir", str(out_dir)]) == 0
    report = json.loads((out_dir / "host_time.json").read_text())
    timed = {(b["params"]["device"], b["params"]["op"], b["params"]["entry"])
             for b in report["benchmarks"] if "op" in b["params"]}
    for op in host_time.public_ops():
        assert ("cpu", op, "public") in timed and ("cpu", op, "torch.ops") in timed
    public = [b["stats"]["median"] * 1e6 for b in report["benchmarks"]
              if b["params"] == {"device": "cpu", "op": b["params"].get("op"), "entry": "public"}]
    assert report["summary"]["max_public_op_host_us_cpu"] == max(public)
    select = {b["params"]["kernel"]: b["stats"]["median"] * 1e6 for b in report["benchmarks"]
              if b["params"].get("device") == "cpu" and "kernel" in b["params"]}
    assert set(select) == set(host_time.SELECT_KERNELS)
    for kernel, median_us in select.items():  # CPU figures, labelled so
        assert report["summary"][f"select_greedy_host_us_cpu_{kernel}"] == median_us
    assert report["summary"]["select_host_us_eager"] is None  # a CUDA figure: no GPU here
    assert all(b["stats"]["rounds"] == 5 for b in report["benchmarks"])
    assert report["label"].startswith("CPU only")
    markdown = (out_dir / "host_time.md").read_text()
    assert "| cpu | `select_tokens` |" in markdown
    assert "| device | three_launch | one_launch |" in markdown
    # REPORT.md shows a pytest-benchmark file as one row per benchmark, and its summary
    text, _ = render(tmp_path, tmp_path / "REPORT.md")
    assert "| device cpu, op select_tokens, entry public |" in text
    assert "max_public_op_host_us_cpu" in text and "machine_info" not in text


def test_ops_option_times_only_the_ops_named(tmp_path):
    """``--ops select_tokens`` (the GPU run's select step): the op's entry points and its
    greedy call per select kernel setting, in files of their own, and no slowest-public-op
    figure (not every op ran)."""
    out_dir = tmp_path / "select"
    assert host_time.main(["--quick", "--ops", "select_tokens", "--out-dir", str(out_dir)]) == 0
    assert sorted(path.name for path in out_dir.iterdir()) == [
        "host_time_select_tokens.json", "host_time_select_tokens.md"]
    report = json.loads((out_dir / "host_time_select_tokens.json").read_text())
    timed = {tuple(sorted(b["params"].items())) for b in report["benchmarks"]}
    assert timed == {(("device", "cpu"), ("entry", entry), ("op", "select_tokens"))
                     for entry in ("public", "torch.ops")} | {
        (("device", "cpu"), ("kernel", kernel)) for kernel in host_time.SELECT_KERNELS}
    assert set(report["summary"]) == {"select_host_us_eager"} | {
        f"select_greedy_host_us_cpu_{kernel}" for kernel in host_time.SELECT_KERNELS}
    assert report["command"] == "python -m bench.host_time --quick --ops select_tokens " \
        f"--out-dir {out_dir}"


def test_summary_reads_the_one_launch_cuda_median_as_the_select_host_time():
    def entry(median_s, **params):
        return {"params": params, "stats": {"median": median_s}}

    benchmarks = [entry(30e-6, device="cuda", op="select_tokens", entry="public"),
                  entry(9e-6, device="cuda", op="silu_mul", entry="public"),
                  entry(25e-6, device="cuda", kernel="one_launch"),
                  entry(41e-6, device="cuda", kernel="three_launch"),
                  entry(500e-6, device="cpu", kernel="one_launch")]
    summary = host_time.summarise(benchmarks)
    assert summary["max_public_op_host_us_cuda"] == 30e-6 * 1e6
    assert summary["select_host_us_eager"] == 25e-6 * 1e6
    assert summary["select_greedy_host_us_cuda_three_launch"] == 41e-6 * 1e6
    assert summary["select_greedy_host_us_cpu_one_launch"] == 500e-6 * 1e6
    assert "max_public_op_host_us_cuda" not in host_time.summarise(benchmarks, every_op=False)
