"""Small shared pieces for the Triton kernels.

``KernelVariant`` describes one specialisation a launcher can produce (argument types and
constexpr values). Every op module with a kernel lists all of its variants in
``kernel_variants()``; the test suite compiles each one for an sm_90 target on a CPU-only
machine, which catches what Triton's interpreter accepts but the GPU compiler rejects.
"""

import os
from dataclasses import dataclass, field

import torch

# Triton pointer type names of the torch dtypes the kernels take.
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.bool: "*i1",
}


@dataclass(frozen=True)
class KernelVariant:
    """One compiled specialisation of a ``@triton.jit`` kernel.

    ``signature`` maps every kernel argument to a Triton type string (``"*fp32"``,
    ``"i32"``, ``"i64"``, ``"fp32"``, ``"constexpr"``); ``constexprs`` gives the value of
    each ``constexpr`` argument.
    """

    name: str
    kernel: object
    signature: dict[str, str]
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    # integer arguments the launcher passes as multiples of 16 in the usual calls (Triton
    # specialises on that, as on 16-byte aligned pointers; the sm_90 compile of the tests
    # assumes both, like a launch with typical arguments)
    divisible_by_16: tuple[str, ...] = ()
    # False where the launcher passes enable_fp_fusion=False (no contraction of a * b + c
    # into one fused multiply-add, so the kernel rounds like the PyTorch path)
    enable_fp_fusion: bool = True


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _interpreter_masks_as_bool() -> None:
    """Interpreter-only shim: Triton's interpreter computes ``tensor & scalar`` of boolean
    values as int32 data (typed int1), and from Triton 3.9 its loads and stores reject such a
    mask ("mask has unsupported dtype"). Give them the mask as bool data; compiled kernels
    are not concerned (the shim only runs under ``TRITON_INTERPRET=1``)."""
    import dataclasses

    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_masks_as_bool", False):
        return

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return dataclasses.replace(mask, data=mask.data.astype(np.bool_))

    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, *rest):
        return masked_load(self, ptrs, as_bool(mask), *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        return masked_store(self, ptrs, value, as_bool(mask), *rest)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder._masks_as_bool = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_masks_as_bool()
