"""bench/decode_step.py: the CPU smoke mode runs end to end and writes what the GPU runs
would; the pieces that feed the GPU figures are checked by hand."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import decode_step
from model_min.model import Model

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_every_case_and_the_summary(tmp_path):
    assert decode_step.main(["--cpu-smoke", "--batches", "1", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_step.json").read_text())
    assert report["label"].startswith("CPU only")
    # (the adaptive window's streaming cases beside the fixed window's)
    adaptive = {c["logits"]: c for c in report["cases"] if c["window_policy"] == "adaptive"}
    assert set(adaptive) == set(decode_step.LOGITS)
    assert all(c["mode"] == "streaming" for c in adaptive.values())
    cases = {(c["mode"], c["logits"]): c for c in report["cases"]
             if c["window_policy"] == "fixed"}
    assert set(cases) == {(m, k) for m in decode_step.MODES for k in decode_step.LOGITS}
    for case in cases.values():
        assert case["batch"] == 1 and case["graphs"] is False
        short, long = case["runs"]["short"], case["runs"]["long"]
        assert long["steps"] > short["steps"] and short["seconds"] > 0
        # the marginal step: the two runs' difference over their steps. Its sign is not
        # asserted: on a busy CPU the difference of two short runs can be noise.
        assert case["step_ms"] == pytest.approx(
            (long["seconds"] - short["seconds"]) / (long["steps"] - short["steps"]) * 1e3)
    # flat logits: one token per forward; peaked: whole windows in streaming, one in AR
    for mode in decode_step.MODES:
        assert cases[(mode, "flat")]["tokens_per_forward"] == 1.0
    assert cases[("ar", "peaked")]["tokens_per_forward"] == 1.0
    assert cases[("streaming", "peaked")]["tokens_per_forward"] > 8
    summary = report["summary"]
    for name in ("ar_b1_step_over_floor", "streaming_b1_over_ar_b1",
                 "streaming_over_ar_toks_peaked_b1", "adaptive_over_ar_toks_flat_min",
                 "adaptive_over_fixed_toks_peaked_min"):
        assert math.isfinite(summary[name])  # (measured: any sign, as above)
    for name in ("streaming_b16_over_roofline", "streaming_b64_over_roofline",
                 "streaming_over_ar_toks_peaked_b16", "streaming_over_ar_toks_peaked_b64"):
        assert summary[name] is None  # those batches did not run
    # live rows per step: one per sequence in AR, W + p (p: the last committed run) of the
    # 2W slots in streaming, about W + 1 with flat logits
    assert cases[("ar", "flat")]["live_rows_per_step"] == 1.0
    window = decode_step.WINDOW
    assert window - 2 <= cases[("streaming", "flat")]["live_rows_per_step"] <= window + 1
    assert window + 1 < cases[("streaming", "peaked")]["live_rows_per_step"] <= 2 * window
    for case in cases.values():
        assert case["roofline_ms"] >= report["weight_read_floor"]["ms"]
        assert case["step_over_roofline"] == case["step_ms"] / case["roofline_ms"]
    assert report["matmul"]["tflop_per_s"] > 0
    assert "CPU measurement" in (tmp_path / "decode_step.md").read_text()


def test_roofline_is_the_weight_read_or_the_matmul_bound_whichever_is_longer():
    # 1 G parameters, 100 TFLOP/s: 2e9 FLOPs per row = 0.02 ms per row
    assert decode_step.roofline_ms(1.0, 10**9, 10, 100.0) == 1.0  # 0.2 ms of matmul
    assert abs(decode_step.roofline_ms(1.0, 10**9, 200, 100.0) - 4.0) < 1e-12
    assert decode_step.roofline_ms(None, 10**9, 200, 100.0) is None
    model = decode_step.random_model(decode_step.TINY, torch.device("cpu"), torch.float32)
    assert decode_step.non_embedding_parameters(model) * 4 == decode_step.weight_bytes(model)


def test_summary_takes_each_ratio_from_its_own_cases():
    def case(mode, batch, logits, step_ms, tokens_per_s, roofline_ms=None, graphs=True):
        return {"mode": mode, "batch": batch, "logits": logits, "graphs": graphs,
                "step_ms": step_ms, "tokens_per_s": tokens_per_s, "roofline_ms": roofline_ms}

    cases = [
        case("ar", 1, "flat", 8.0, 125.0), case("streaming", 1, "flat", 10.0, 100.0),
        case("streaming", 1, "flat", 30.0, 33.0, graphs=False),
        case("streaming", 16, "flat", 20.0, 800.0, roofline_ms=16.0),
        case("streaming", 64, "flat", 60.0, 1000.0, roofline_ms=40.0),
        case("ar", 16, "peaked", 9.0, 1800.0), case("streaming", 16, "peaked", 40.0, 5400.0),
    ]
    summary = decode_step.summarise(cases, floor_ms=4.0, graphs=True)
    assert summary["ar_b1_step_over_floor"] == 2.0
    assert summary["streaming_b1_over_ar_b1"] == 1.25
    assert summary["eager_over_graph_b1_streaming"] == 3.0
    assert summary["streaming_b16_over_roofline"] == 1.25
    assert summary["streaming_b64_over_roofline"] == 1.5
    assert summary["streaming_over_ar_toks_peaked_b16"] == 3.0
    assert summary["streaming_over_ar_toks_peaked_b1"] is None
    assert summary["streaming_over_ar_toks_peaked_b64"] is None
    # the adaptive window's least ratio over the batches where it ran, each over its own
    # baseline (AR flat; the fixed window peaked), never over another case
    assert summary["adaptive_over_ar_toks_flat_min"] is None
    assert summary["adaptive_over_fixed_toks_peaked_min"] is None
    cases += [
        dict(case("streaming", 1, "flat", 9.0, 150.0), window_policy="adaptive"),
        dict(case("ar", 16, "flat", 9.0, 1500.0)),
        dict(case("streaming", 16, "flat", 9.0, 1200.0), window_policy="adaptive"),
        dict(case("streaming", 16, "peaked", 9.0, 4860.0), window_policy="adaptive"),
    ]
    summary = decode_step.summarise(cases, floor_ms=4.0, graphs=True)
    assert summary["adaptive_over_ar_toks_flat_min"] == 0.8  # min(150 / 125, 1200 / 1500)
    assert summary["adaptive_over_fixed_toks_peaked_min"] == 0.9  # 4860 / 5400
    assert summary["streaming_b1_over_ar_b1"] == 1.25  # (the fixed window's step still)


def test_weight_read_floor_counts_every_weight_but_the_embedding():
    model = decode_step.random_model(decode_step.TINY, torch.device("cpu"), torch.float32)
    assert isinstance(model, Model)
    c = decode_step.TINY
    per_layer = (2 * c.hidden_size + 2 * c.head_dim
                 + (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size
                 + 3 * c.intermediate_size * c.hidden_size)
    expected = 4 * (c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size)
    assert decode_step.weight_bytes(model) == expected


def test_kernel_names_fall_into_their_categories():
    category = decode_step.kernel_category
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert category("nvjet_hsh_192x128_64x4_1x2_h_bz_coopB_NNT") == "gemm"
    assert category("_paged_attention_kernel") == "attention"
    assert category("_combine_splits_kernel") == "attention"
    for name in ("_rope_kv_append_kernel", "_reorder_window_kernel", "_select_scan_kernel",
                 "_select_filter_kernel", "_select_sequences_kernel", "_commit_window_kernel"):
        assert category(name) == "wedlm_ops"
    for name in ("_silu_mul_kernel", "_fused_add_rms_norm_forward_kernel",
                 "void at::native::vectorized_elementwise_kernel<4, ...>"):
        assert category(name) == "elementwise"


def test_peaked_logits_are_sharp_and_flat_ones_are_not():
    model = decode_step.random_model(decode_step.TINY, torch.device("cpu"), torch.float32)
    base = model.lm_head
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, decode_step.TINY.hidden_size, generator=g)
    entropy = {}
    for kind in decode_step.LOGITS:
        decode_step.with_logits(model, base, kind)
        probabilities = torch.softmax(model.logits(hidden), dim=-1)
        entropy[kind] = -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1)
    assert (entropy["flat"] > 4 * decode_step.THRESHOLD).all()  # never passes: 1 per step
    # nearly always passes (two random maxima are sometimes close)
    assert (entropy["peaked"] < decode_step.THRESHOLD / 4).sum() >= 7


def test_gpu_modes_without_a_gpu_say_so_and_exit_0():
    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, "-m", "bench.decode_step"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "no CUDA GPU" in done.stdout, done.stderr
