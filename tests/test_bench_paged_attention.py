"""Smoke tests of ``bench.paged_attention`` (its CPU code path).

The GPU figures can only be produced on a GPU; these tests pin what can be checked without
one: the no-GPU exit, the inputs (the paged cache holds the dense K/V the SDPA baseline
reads), the bytes and FLOP models, the derived rates, the correctness check against SDPA, and
the report files.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import common
from bench import paged_attention as pa
from bench.common import Timer
from tests.plot_checks import assert_png, hide_matplotlib, needs_matplotlib

REPO = Path(__file__).resolve().parent.parent


# The kernel runs through Triton's interpreter where there is no GPU (conftest sets
# TRITON_INTERPRET before triton is imported); on a GPU machine the kernel module is already
# compiled for the GPU, so the in-process smoke run leaves the kernel out.
INTERPRET = not torch.cuda.is_available()
SMOKE_ARGS = ["--cpu-smoke"] + (["--interpret"] if INTERPRET else [])
# with the interpreter: the kernel as configured, with its one-launch merge and (prefill)
# its heaviest query tiles first, beside the PyTorch implementation and SDPA
IMPLS = {"triton", "triton_merged", "torch", "sdpa"} if INTERPRET else {"torch", "sdpa"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("smoke")
    status = pa.main([*SMOKE_ARGS, "--out-dir", str(out_dir)])
    report = json.loads((out_dir / "paged_attention.json").read_text())
    markdown = (out_dir / "paged_attention.md").read_text()
    return status, report, markdown, out_dir


def test_default_mode_without_gpu_says_so_exits_0_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.paged_attention", "--out-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA GPU present: GPU benchmarks skipped"
    assert not (tmp_path / "out").exists()


def test_cpu_smoke_runs_every_case_with_both_implementations_and_sdpa(smoke):
    status, report, markdown, out_dir = smoke
    assert status == 0, pa.failures(report)
    assert report["mode"] == "cpu-smoke" and report["complete"]
    assert report["command"] == (
        f"python -m bench.paged_attention {' '.join(SMOKE_ARGS)} --out-dir {out_dir}")
    # the summary's figures are graph-mode (GPU) figures: none from a CPU run
    assert report["summary"] and all(v is None for v in report["summary"].values())
    sizes = pa.SMOKE
    decode = [(c["params"]["batch"], c["params"]["q_len"], c["params"]["context"])
              for c in report["cases"] if c["kind"] == "decode"]
    assert decode == [(b, r, c) for b in sizes.batches for r in sizes.window_rows
                      for c in sizes.contexts]
    prefill = [c["params"]["q_len"] for c in report["cases"] if c["kind"] == "prefill"]
    assert prefill == list(sizes.prefill_tokens)
    for case in report["cases"]:
        impls = IMPLS | ({"triton_heaviest_first"}
                         if INTERPRET and case["kind"] == "prefill" else set())
        assert set(case["timings"]) == impls
        assert all(check["ok"] for check in case["check"].values())
        assert set(case["check"]) == {f"{impl}_vs_sdpa" for impl in impls - {"sdpa"}}
    assert "## Decode windows, mode `cpu`" in markdown and "## Prefill, mode `cpu`" in markdown
    assert "no GPU figure" in markdown


@needs_matplotlib
def test_cpu_smoke_plot_is_a_png_named_in_the_report(smoke):
    _, report, markdown, out_dir = smoke
    assert report["plot"] == "paged_attention.png"
    assert_png(out_dir / "paged_attention.png", size=(13 * 110, 5 * 110))
    assert "- **plot**: paged_attention.png" in markdown


def test_plot_without_matplotlib_is_the_reason_not_an_error(smoke, tmp_path, monkeypatch):
    _, report, _, _ = smoke
    hide_matplotlib(monkeypatch)
    assert pa.write_plot(report, tmp_path / "paged_attention.png") == common.NO_MATPLOTLIB
    assert not (tmp_path / "paged_attention.png").exists()


def test_derived_rates_follow_from_the_models_and_the_medians(smoke):
    _, report, _, _ = smoke
    copy = report["copy_bandwidth"]["gb_per_s"]
    matmul = report["matmul"]["tflops"]
    for case in report["cases"]:
        for impl, modes in case["timings"].items():
            microseconds = modes["cpu"]["median_us"]
            rate = case["bytes"]["total"] / (microseconds * 1e-6) / 1e9
            assert case["gb_per_s"][impl]["cpu"] == pytest.approx(rate)
            assert case["fraction_of_copy_bandwidth"][impl]["cpu"] == pytest.approx(rate / copy)
            flops_rate = case["flops"] / (microseconds * 1e-6) / 1e12
            assert case["tflops"][impl]["cpu"] == pytest.approx(flops_rate)
            assert case["fraction_of_matmul_tflops"][impl]["cpu"] == pytest.approx(
                flops_rate / matmul)
        if "triton" in case["timings"]:
            speedup = case["speedup"]["triton_over_sdpa"]["cpu"]
            assert speedup == pytest.approx(case["timings"]["sdpa"]["cpu"]["median_us"]
                                            / case["timings"]["triton"]["cpu"]["median_us"])


def test_bytes_model_by_hand():
    # B=2, 4 rows after 8 positions: 12 positions of K and V, 2 KV heads x 16 fp32
    moved = pa.attention_bytes(pa.SMOKE, batch=2, rows=4, context=8)
    assert moved["breakdown"] == {
        "k_and_v": 2 * 2 * 12 * 2 * 16 * 4,
        "q_and_out": 2 * 2 * 4 * 4 * 16 * 4,
        "page_table_and_lengths": 2 * 3 * 4 + 2 * 2 * 4,  # 3 pages of 4 per sequence
    }
    assert moved["total"] == 6144 + 4096 + 40


def test_flop_model_counts_visible_query_key_pairs():
    # 3 rows after 2 positions see 3, 4 and 5 keys
    assert pa.attention_flops(pa.SMOKE, batch=2, rows=3, context=2) == 4 * 2 * 4 * 16 * 12
    # prefill of 5 tokens: 1 + 2 + 3 + 4 + 5 pairs
    assert pa.attention_flops(pa.SMOKE, batch=1, rows=5, context=0) == 4 * 4 * 16 * 15


def test_paged_cache_holds_the_dense_keys_and_values_at_their_positions():
    inputs = pa.make_inputs(pa.SMOKE, batch=2, rows=3, context=6, device=torch.device("cpu"),
                            seed=1)
    page_size = pa.SMOKE.page_size
    assert inputs["block_table"].unique().numel() == inputs["block_table"].numel()
    for b in range(2):
        for pos in range(9):
            page = int(inputs["block_table"][b, pos // page_size])
            for cache, dense in (("k_cache", "dense_k"), ("v_cache", "dense_v")):
                assert torch.equal(inputs[cache][page, pos % page_size],
                                   inputs[dense][b, :, pos])


def test_a_wrong_kernel_output_is_reported_as_a_mismatch():
    timer = Timer(torch.device("cpu"), quick=True)

    def wrong(q, *rest):
        return torch.zeros_like(q)

    case = pa.run_case("decode", pa.SMOKE, {"triton": wrong}, 1, 4, 8, timer, seed=0)
    assert not case["check"]["triton_vs_sdpa"]["ok"]
    report = {"cases": [case]}
    assert pa.failures(report) and "mismatch" in pa.failures(report)[0]


def test_interpret_needs_cpu_smoke():
    with pytest.raises(SystemExit):
        pa.parse_args(["--interpret"])


def test_cpu_prefill_benchmark_quick_run_writes_both_goals(tmp_path):
    """bench.attention_cpu --quick (small sizes): the PyTorch path's prefill against SDPA
    (equal to fp32 rounding) and the Qwen3-8B-shaped memory probe, both in the summary."""
    from bench import attention_cpu

    assert attention_cpu.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert report["label"].startswith("CPU only")
    assert report["tiny_prefill"]["max_abs_difference"] < 1e-4
    assert report["qwen3_8b_prefill"]["finite"]
    assert set(report["summary"]) == {"tiny_prefill_over_sdpa", "qwen3_8b_prefill_extra_gb"}
