"""Smoke tests of ``bench.ops_window`` (CPU code path).

The GPU figures themselves can only be produced on a GPU; these tests pin what can be
checked without one: the no-GPU exit, the report plumbing (bytes models, GB/s, fractions,
speed-ups, the restore subtraction of commit_window), the unfused baseline, and the commands
the GPU script would run.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import common
from bench import ops_window as ow
from bench.common import Timing
from tests.plot_checks import assert_png, hide_matplotlib, needs_matplotlib

REPO = Path(__file__).resolve().parent.parent


def load(out_dir: Path) -> tuple[dict, str]:
    return (json.loads((out_dir / "ops_window.json").read_text()),
            (out_dir / "ops_window.md").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("smoke")
    status = ow.main(["--cpu-smoke", "--out-dir", str(out_dir)])
    report, markdown = load(out_dir)
    return status, report, markdown, out_dir


def test_default_mode_without_gpu_says_so_exits_0_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.ops_window", "--out-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA GPU present: GPU benchmarks skipped"
    assert not (tmp_path / "out").exists()


def test_cpu_smoke_measures_every_case_of_every_op(smoke):
    status, report, _, out_dir = smoke
    assert status == 0, ow.failures(report)
    assert report["mode"] == "cpu-smoke" and report["complete"]
    assert report["command"] == f"python -m bench.ops_window --cpu-smoke --out-dir {out_dir}"
    # the summary's figures are graph-mode (GPU) figures: none from a CPU run
    assert set(report["summary"]) == {f"{op}_{figure}" for op in report["ops"]
                                      for figure in ("max_copy_bw_fraction",
                                                     "min_speedup_over_torch")}
    assert all(value is None for value in report["summary"].values())
    sizes = ow.SMOKE
    counts = {"rope_kv_append": len(sizes.tokens) * len(sizes.page_sizes),
              "reorder_window": len(sizes.batches) * len(sizes.page_sizes),
              "commit_window": len(sizes.batches)}
    for op, count in counts.items():
        result = report["ops"][op]
        assert len(result["cases"]) == count, result.get("case_errors")
        assert "PyTorch implementations only" in result["triton"]
        for case in result["cases"]:
            assert "triton" not in case["timings"] and case["speedup"] == {}
            expected = {"torch", "unfused"} if op == "rope_kv_append" else {"torch"}
            assert expected <= set(case["timings"])
            for impl in expected:
                timing = case["timings"][impl]["cpu"]
                assert timing["samples"] >= 3 and timing["mode"] == "cpu"


def test_cpu_smoke_derived_figures_follow_from_the_medians(smoke):
    _, report, _, _ = smoke
    copy = report["copy_bandwidth"]
    assert copy["bytes_read_plus_written"] == 2 * copy["bytes_copied"]
    assert copy["gb_per_s"] == pytest.approx(
        copy["bytes_read_plus_written"] / (copy["timing"]["median_us"] * 1e3))
    for result in report["ops"].values():
        for case in result["cases"]:
            assert case["bytes"]["total"] == sum(case["bytes"]["breakdown"].values()) > 0
            for impl, modes in case["gb_per_s"].items():
                rate = modes["cpu"]
                microseconds = case["timings"][impl]["cpu"]["median_us"]
                assert rate == pytest.approx(case["bytes"]["total"] / (microseconds * 1e3))
                assert case["fraction_of_copy_bandwidth"][impl]["cpu"] == pytest.approx(
                    rate / copy["gb_per_s"])


def test_cpu_smoke_markdown_has_a_table_per_op_and_no_gpu_figure(smoke):
    _, report, markdown, _ = smoke
    assert "CPU smoke run" in markdown and "no GPU figure" in markdown
    for op in ow.OPS:
        assert f"## {op}" in markdown
    case = report["ops"]["rope_kv_append"]["cases"][0]
    torch_us = case["timings"]["torch"]["cpu"]["median_us"]
    assert f"| {case['params']['tokens']} | {case['params']['page_size']} |" in markdown
    assert f"{torch_us:.1f}" in markdown


@needs_matplotlib
def test_cpu_smoke_plot_is_a_png_named_in_the_report(smoke):
    _, report, markdown, out_dir = smoke
    assert report["plot"] == "ops_window.png"
    assert_png(out_dir / "ops_window.png", size=(12 * 110, 9 * 110))
    assert "- **plot**: ops_window.png" in markdown


def test_without_matplotlib_a_run_completes_and_names_why_there_is_no_plot(tmp_path,
                                                                          monkeypatch):
    """As on the GPU machine of bench/gpu_check.sh, which has no matplotlib."""
    hide_matplotlib(monkeypatch)
    assert ow.main(["--cpu-smoke", "--quick", "--out-dir", str(tmp_path)]) == 0
    report, markdown = load(tmp_path)
    assert report["complete"] and report["plot"] == common.NO_MATPLOTLIB
    assert "summary" in report and f"- **plot**: {common.NO_MATPLOTLIB}" in markdown
    assert not (tmp_path / "ops_window.png").exists()


def test_rope_bytes_model_counts_each_input_once_and_each_output_once():
    tokens, q_heads, kv_heads, head_dim = 2, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    inputs = {
        "q": q.view(tokens, q_heads, head_dim), "k": k.view(tokens, kv_heads, head_dim),
        "v": v.view(tokens, kv_heads, head_dim), "positions": torch.tensor([5, 5]),
        "k_cache": torch.zeros(3, 4, kv_heads, head_dim, dtype=torch.float16),
        "q_norm_weight": torch.ones(head_dim),
    }
    model = ow.rope_bytes(inputs)
    # fp32 activations (4 bytes), fp16 cache (2 bytes), one distinct position
    assert model == {
        "read q": 2 * 4 * 16 * 4, "read k": 2 * 2 * 16 * 4, "read v": 2 * 2 * 16 * 4,
        "read positions": 16, "read slot_mapping": 16, "read cos_sin rows": 1 * 16 * 4,
        "read norm weights": 2 * 16 * 4, "write q_out": 2 * 4 * 16 * 4,
        "write k_cache rows": 2 * 2 * 16 * 2, "write v_cache rows": 2 * 2 * 16 * 2,
    }


def test_reorder_bytes_model_reads_the_pages_of_the_live_rows_only():
    state = {
        "win_tokens": torch.zeros(2, 8, dtype=torch.int64),
        "win_len": torch.tensor([5, 0], dtype=torch.int32),
        "ctx_len": torch.tensor([14, 3], dtype=torch.int32),
    }
    model = ow.reorder_bytes(state, page_size=4)
    # sequence 0: positions 14..18 lie on pages 3 and 4; sequence 1 has no live row
    assert model["read block_table entries"] == 2 * 4
    assert model["read win_tokens (live slots)"] == 5 * 8
    assert model["read win_mask (live slots)"] == 5
    # the packed outputs: one row per live slot, plus query_start [B+1] and n_filled [B]
    assert model["write input_ids, positions, slot_mapping"] == 3 * 5 * 8
    assert model["write order"] == 5 * 4 and model["write query_start, n_filled"] == 5 * 4


@pytest.mark.parametrize("seed", range(3))
def test_unfused_baseline_computes_rope_kv_append_in_fp32(seed):
    from wedlm_kernels.ops.rope import rope_kv_append_torch

    inputs = ow.rope_inputs(ow.SMOKE, 8, 4, torch.device("cpu"), seed)
    fused = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
    unfused = {**inputs, "k_cache": inputs["k_cache"].clone(),
               "v_cache": inputs["v_cache"].clone()}
    expected = rope_kv_append_torch(**fused)
    got = ow.rope_kv_append_unfused(**unfused)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unfused["k_cache"], fused["k_cache"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unfused["v_cache"], fused["v_cache"], rtol=0, atol=0)
    assert not torch.equal(unfused["k_cache"], inputs["k_cache"])  # the slots were written


def test_rope_inputs_use_distinct_valid_slots_and_strided_views():
    inputs = ow.rope_inputs(ow.SMOKE, 8, 4, torch.device("cpu"), 0)
    slots = inputs["slot_mapping"]
    num_slots = inputs["k_cache"].shape[0] * inputs["k_cache"].shape[1]
    assert slots.unique().numel() == slots.numel()
    assert bool(((slots >= 0) & (slots < num_slots)).all())
    assert inputs["q"].stride(0) == inputs["k"].stride(0) == inputs["v"].stride(0) == (
        (ow.SMOKE.q_heads + 2 * ow.SMOKE.kv_heads) * ow.SMOKE.head_dim)
    assert int(inputs["positions"].max()) < inputs["cos_sin"].shape[0]


def test_packed_state_views_are_contiguous_and_restore_undoes_writes():
    state = {
        "win_tokens": torch.randint(0, 100, (3, 8)),
        "win_mask": torch.rand(3, 8) < 0.5,
        "win_len": torch.randint(0, 9, (3,), dtype=torch.int32),
        "finished": torch.tensor([True, False, True]),
    }
    packed = ow.PackedState(state, torch.device("cpu"))
    for name, view in packed.views.items():
        assert view.is_contiguous() and view.dtype == state[name].dtype
        assert torch.equal(view, state[name])
    for view in packed.views.values():
        view.fill_(1)
    packed.restore()
    for name, view in packed.views.items():
        assert torch.equal(view, state[name])


def fake_gpu_timers(monkeypatch, launch_triton):
    """Run the report code with the two GPU modes, each timed on the CPU, and a stand-in
    Triton launcher per op (``--interpret`` keeps it; the environment is restored after)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(ow.Timer.MODES, "cpu", ("eager", "graph"))
    monkeypatch.setattr(common, "time_eager_cuda", lambda fn, warmup_ms, rep_ms: Timing(
        common.time_cpu(fn, 2).median_us, 3, "eager"))
    monkeypatch.setattr(common, "time_graph_cuda", lambda fn, replays, estimate_us=None: Timing(
        common.time_cpu(fn, 2).median_us, replays, "graph", 10))
    load = ow.load_launchers

    def with_triton(ops):
        launchers = load(ops)
        for op in launchers:
            launchers[op]["triton"] = launch_triton(launchers[op]["torch"])
        return launchers

    monkeypatch.setattr(ow, "load_launchers", with_triton)


def test_two_mode_report_divides_medians_and_subtracts_the_restore(monkeypatch, tmp_path):
    # a stand-in "Triton launcher" (the PyTorch implementation) to exercise the speed-ups
    fake_gpu_timers(monkeypatch, lambda torch_impl: torch_impl)
    status = ow.main(["--cpu-smoke", "--interpret", "--out-dir", str(tmp_path)])
    report, markdown = load(tmp_path)
    assert status == 0, ow.failures(report)
    for op, result in report["ops"].items():
        for case in result["cases"]:
            for mode in ("eager", "graph"):
                triton_us = case["timings"]["triton"][mode]["median_us"]
                for baseline, speedup in case["speedup"].items():
                    other = baseline.removeprefix("triton_over_")
                    assert speedup[mode] == pytest.approx(
                        case["timings"][other][mode]["median_us"] / triton_us)
                if op == "commit_window":
                    timing = case["timings"]["triton"][mode]
                    assert timing["median_us"] == pytest.approx(
                        timing["with_restore_us"] - case["timings"]["restore"][mode]["median_us"])
            assert all(check["ok"] for check in case["check"].values())
        assert set(case["speedup"]) == (
            {"triton_over_torch", "triton_over_unfused"} if op == "rope_kv_append"
            else {"triton_over_torch"})
    assert markdown.count("Mode `eager`") == 3 and markdown.count("Mode `graph`") == 3
    assert "× over unfused" in markdown and "restore µs" in markdown


def test_a_failing_launcher_is_reported_and_the_run_exits_1(monkeypatch, tmp_path):
    def broken(torch_impl):
        def launch(*args, **kwargs):
            raise RuntimeError("kernel exploded")
        return launch

    fake_gpu_timers(monkeypatch, broken)
    status = ow.main(["--cpu-smoke", "--interpret", "--ops", "reorder_window",
                      "--out-dir", str(tmp_path)])
    report, markdown = load(tmp_path)
    assert status == 1
    assert ow.failures(report) and all("kernel exploded" in f for f in ow.failures(report))
    assert "kernel exploded" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
def test_interpreted_triton_launcher_matches_the_pytorch_implementation(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status = ow.main(["--cpu-smoke", "--interpret", "--ops", "reorder_window",
                      "--out-dir", str(tmp_path)])
    report, _ = load(tmp_path)
    result = report["ops"]["reorder_window"]
    if result["triton"] == ow.NO_TRITON:
        pytest.skip("reorder_window has no Triton launcher")
    assert status == 0, ow.failures(report)
    for case in result["cases"]:
        assert case["check"]["triton_vs_torch"]["ok"]
        assert math.isfinite(case["speedup"]["triton_over_torch"]["cpu"])
