"""Helpers for testing Triton kernels without a GPU.

- ``guarded``: an output tensor that lives inside a larger buffer whose borders hold a
  sentinel, so a kernel writing out of bounds is caught (the interpreter does not detect
  out-of-bounds accesses).
- ``compile_sm90``: compiles a ``KernelVariant`` for an sm_90 GPU target with Triton's own
  ptxas, on a machine without a GPU.
"""

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from wedlm_kernels.ops._triton import KernelVariant

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


@contextmanager
def _compilable_jit_functions(module_name: str):
    """Under TRITON_INTERPRET=1 every @triton.jit function, triton.language's own (tl.sum,
    tl.cumsum, tl.cdiv, ...) and a kernel module's helpers, is an InterpretedFunction, which
    the GPU compiler cannot call. Swap them for JITFunctions while compiling."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = [
        module for name, module in list(sys.modules.items())
        if name == "triton.language" or name.startswith("triton.language.")
    ]
    modules.append(sys.modules[module_name])
    swapped, replacements = [], {}
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, InterpretedFunction):
                if id(value) not in replacements:
                    replacements[id(value)] = JITFunction(value.fn)
                swapped.append((module, attr, value))
                setattr(module, attr, replacements[id(value)])
    try:
        yield
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def compile_sm90(variant: KernelVariant):
    """Compile ``variant`` for an NVIDIA sm_90 target; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = variant.kernel
    if not isinstance(kernel, JITFunction):  # an InterpretedFunction under TRITON_INTERPRET
        kernel = JITFunction(kernel.fn)
    source = ASTSource(fn=kernel, signature=variant.signature, constexprs=variant.constexprs)
    with _compilable_jit_functions(kernel.fn.__module__):
        return triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
        )
