"""The decoder's RMSNorm and MLP activation, each on the fastest path its device has.

- :func:`rms_norm` and :func:`add_rms_norm`: Hugging Face Qwen's RMSNorm (normalise in
  float32, round to the input dtype, multiply by the weight in that dtype); the second folds
  the residual add of the previous block in: ``s = x + residual`` (in the dtype), returns
  ``(rms_norm(s), s)``. On CUDA, when Liger-Kernel is installed (``pip install
  "wedlm_kernels[cuda]"``) and :data:`USE_LIGER` is true, its fused Triton kernels run each
  in one launch, in their "llama" casting mode, which has exactly these roundings; the
  PyTorch path has the same roundings everywhere else.
- :func:`silu_mul`: ``wedlm_kernels.silu_mul`` (a Triton kernel on CUDA) on the fused gate/up
  projection.

Neither path reads a tensor value on the host or allocates data-dependent shapes, so both
can be captured in a CUDA graph.
"""

import functools
import os

import torch

import wedlm_kernels as wk

# Liger-Kernel's fused RMSNorm kernels on CUDA tensors (when importable); set to False, or
# MODEL_MIN_LIGER=0 in the environment, for the PyTorch path everywhere.
USE_LIGER = os.environ.get("MODEL_MIN_LIGER", "1").strip().lower() not in ("0", "false", "no")


@functools.cache
def liger_functions():
    """``(LigerRMSNormFunction, LigerFusedAddRMSNormFunction)``, or None without Liger.

    Imported from their own modules: the names ``liger_kernel.ops`` exports can be replaced
    by another implementation (``LIGER_KERNEL_IMPL``), whose roundings are not the ones
    described above."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return LigerRMSNormFunction, LigerFusedAddRMSNormFunction


def _liger_for(x: torch.Tensor):
    return liger_functions() if USE_LIGER and x.is_cuda else None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * round(x * rsqrt(mean(x^2) + eps))`` over the last dimension of ``x``
    ``[..., H]`` (the rounding to x's dtype; the mean and rsqrt in float32)."""
    liger = _liger_for(x)
    if liger is not None:
        return liger[0].apply(x, weight, eps, 0.0, "llama", False)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` in x's dtype; returns ``(rms_norm(s, weight, eps), s)``, ``s``
    being the new residual stream. ``x`` and ``residual`` are ``[..., H]`` of one dtype."""
    liger = _liger_for(x)
    if liger is not None:
        return liger[1].apply(x, residual, weight, eps, 0.0, "llama", False)
    total = x + residual
    return rms_norm_torch(total, weight, eps), total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection ``gate_up [N, 2I]``."""
    return wk.silu_mul(gate_up)
