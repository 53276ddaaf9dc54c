"""Helpers for testing Triton kernels without a GPU.

- ``guarded``: an output tensor that lives inside a larger buffer whose borders hold a
  sentinel, so a kernel writing out of bounds is caught (the interpreter does not detect
  out-of-bounds accesses).
- ``compile_sm90`` and ``ptxas_resources`` (from ``bench/sm90_compile.py``): compile a
  ``KernelVariant`` for an sm_90 GPU target with Triton's own ptxas, on a machine without a
  GPU, and read its registers and spills.
"""

from dataclasses import dataclass

import torch

from bench.sm90_compile import compile_sm90, ptxas_resources

__all__ = ["GUARD", "Guarded", "compile_sm90", "guarded", "ptxas_resources"]

GUARD = 67  # elements on each side; odd, so misaligned overruns land in it too


@dataclass
class Guarded:
    buffer: torch.Tensor
    tensor: torch.Tensor  # the contiguous view handed to the kernel
    sentinel: object

    def check(self, name: str = "output") -> None:
        flat = self.buffer
        for band in (flat[:GUARD], flat[GUARD + self.tensor.numel():]):
            if self.tensor.dtype.is_floating_point and isinstance(self.sentinel, float) and (
                self.sentinel != self.sentinel
            ):
                intact = torch.isnan(band).all()
            else:
                intact = (band == self.sentinel).all()
            assert bool(intact), f"{name}: a kernel wrote outside the tensor (guard band changed)"


def guarded(source: torch.Tensor, sentinel=None) -> Guarded:
    """A contiguous copy of ``source`` placed between two guard bands of ``sentinel``."""
    if sentinel is None:
        sentinel = {torch.bool: True, torch.int32: -123457, torch.int64: -987654321}.get(
            source.dtype, float("nan")
        )
    buffer = torch.empty(source.numel() + 2 * GUARD, dtype=source.dtype, device=source.device)
    buffer.fill_(sentinel)
    tensor = buffer[GUARD: GUARD + source.numel()].view(source.shape)
    tensor.copy_(source)
    return Guarded(buffer, tensor, sentinel)
