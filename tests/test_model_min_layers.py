"""model_min.layers: the RMSNorm (with the residual add folded in) and the MLP activation
have Hugging Face Qwen's numerics on every path; on CUDA the whole forward is compared with
transformers' Qwen3 in bf16."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from bench.tiny_models import build_tiny_model, hf_logits, save_checkpoint
from model_min import Generator, SamplingParams, layers, load_model


def _hf_norm(weight: torch.Tensor, eps: float) -> Qwen3RMSNorm:
    norm = Qwen3RMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_add_rms_norm_equal_hugging_face_bit_for_bit_on_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 3, 48, generator=g) * 3).to(dtype).unbind(1)[:2]
    weight = (torch.rand(48, generator=g) + 0.5).to(dtype)
    hf = _hf_norm(weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(layers.rms_norm(x, weight, 1e-6), hf(x))
        normed, total = layers.add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(total, residual + x)
        assert torch.equal(normed, hf(residual + x))


def test_silu_mul_equals_the_hugging_face_mlp_activation():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 2 * 24, generator=g).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(layers.silu_mul(gate_up), F.silu(gate) * up)


def test_cpu_tensors_never_take_the_liger_path(monkeypatch):
    def forbidden(*args):
        raise AssertionError("Liger called for a CPU tensor")

    fake = type("Fake", (), {"apply": staticmethod(forbidden)})
    monkeypatch.setattr(layers, "liger_functions", lambda: (fake, fake))
    x = torch.randn(2, 8)
    layers.rms_norm(x, torch.ones(8), 1e-6)
    layers.add_rms_norm(x, x, torch.ones(8), 1e-6)


def test_liger_functions_come_from_their_modules_not_the_redirectable_package(
        tmp_path, monkeypatch):
    """``liger_kernel.ops`` re-exports its Function classes and may replace them with another
    implementation (LIGER_KERNEL_IMPL); model_min takes the ones of the rms_norm and
    fused_add_rms_norm modules. A stand-in package exports impostors from ``ops``."""
    ops = tmp_path / "liger_kernel" / "ops"
    ops.mkdir(parents=True)
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text(
        "LigerRMSNormFunction = 'redirected'\nLigerFusedAddRMSNormFunction = 'redirected'\n")
    (ops / "rms_norm.py").write_text("LigerRMSNormFunction = 'rms_norm module'\n")
    (ops / "fused_add_rms_norm.py").write_text(
        "LigerFusedAddRMSNormFunction = 'fused_add_rms_norm module'\n")
    for name in [name for name in sys.modules if name.split(".")[0] == "liger_kernel"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    layers.liger_functions.cache_clear()
    try:
        assert layers.liger_functions() == ("rms_norm module", "fused_add_rms_norm module")
    finally:
        layers.liger_functions.cache_clear()
        for name in [name for name in sys.modules if name.split(".")[0] == "liger_kernel"]:
            del sys.modules[name]  # the stand-ins; monkeypatch restores a real Liger


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("use_liger", [True, False])
def test_cuda_bf16_forward_tracks_transformers_qwen3(tmp_path, monkeypatch, use_liger):
    """The Generator's window logits on CUDA in bf16 (fused norms when Liger is installed,
    else PyTorch) against transformers' Qwen3 in bf16 on the same window. bf16 rounds at
    every layer in different orders on both sides, so the logits agree to bf16 precision,
    relative to their spread."""
    if use_liger and layers.liger_functions() is None:
        if os.environ.get("MODEL_MIN_REQUIRE_LIGER") == "1":  # set by bench/gpu_check.sh
            pytest.fail("liger-kernel is not importable and MODEL_MIN_REQUIRE_LIGER=1")
        pytest.skip("liger-kernel is not installed")
    monkeypatch.setattr(layers, "USE_LIGER", use_liger)
    hf = build_tiny_model("qwen3", seed=5)
    model = load_model(save_checkpoint(hf, tmp_path), device="cuda", dtype=torch.bfloat16)
    hf = hf.to("cuda", torch.bfloat16)
    generator = Generator(model, window=4, page_size=4, max_batch=1)
    generator.trace = []
    prompt = [3, 1, 4, 1, 5, 9, 2]
    generator.generate([prompt], SamplingParams(max_new_tokens=4, threshold=None))
    first = generator.trace[0]
    expected = hf_logits(hf, torch.tensor(prompt + [299] * 4, device="cuda"),
                         torch.arange(11, device="cuda"))[7:11].float()
    actual = first["logits"][:4].float()
    spread = expected.std().item()
    assert (actual - expected).abs().max().item() < 0.1 * spread
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
