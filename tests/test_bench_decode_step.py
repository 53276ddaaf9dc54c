"""bench/decode_step.py and bench/host_overhead.py: the CPU smoke modes run end to end and
write what the GPU runs would; the pieces that feed the GPU figures are checked by hand."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import decode_step, host_overhead
from model_min.model import Model

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_every_case_and_the_summary(tmp_path):
    assert decode_step.main(["--cpu-smoke", "--batches", "1", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_step.json").read_text())
    assert report["label"].startswith("CPU only")
    cases = {(c["mode"], c["logits"]): c for c in report["cases"]}
    assert set(cases) == {(m, k) for m in decode_step.MODES for k in decode_step.LOGITS}
    for case in cases.values():
        assert case["batch"] == 1 and case["graphs"] is False and case["step_ms"] > 0
        assert case["runs"]["long"]["steps"] > case["runs"]["short"]["steps"]
    # flat logits: one token per forward; peaked: whole windows in streaming, one in AR
    for mode in decode_step.MODES:
        assert cases[(mode, "flat")]["tokens_per_forward"] == 1.0
    assert cases[("ar", "peaked")]["tokens_per_forward"] == 1.0
    assert cases[("streaming", "peaked")]["tokens_per_forward"] > 8
    summary = report["summary"]
    assert summary["ar_b1_step_over_floor"] > 0 and summary["streaming_b1_over_ar_b1"] > 0
    assert "CPU measurement" in (tmp_path / "decode_step.md").read_text()


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
    for name in ("_rope_kv_append_kernel", "_reorder_window_kernel", "_select_filter_kernel",
                 "_select_partials_kernel", "_commit_window_kernel"):
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


def test_host_overhead_cpu_smoke_reports_every_public_op(tmp_path):
    assert host_overhead.main(["--cpu-smoke", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "host_overhead.json").read_text())
    import wedlm_kernels as wk

    assert set(report["result"]["ops"]) == {
        name for name in wk.__all__ if name not in ("BACKEND", "DEBUG", "rope_cache")}
    assert report["summary"]["max_public_op_host_us"] == max(
        op["public_us"] for op in report["result"]["ops"].values())
    assert report["label"].startswith("CPU only")


def test_gpu_modes_without_a_gpu_say_so_and_exit_0():
    if torch.cuda.is_available():
        return
    for module in ("bench.decode_step", "bench.host_overhead"):
        done = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "no CUDA GPU" in done.stdout, done.stderr
