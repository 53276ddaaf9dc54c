"""Small shared pieces for the Triton kernels.

``KernelVariant`` describes one specialisation a launcher can produce (argument types and
constexpr values). Every op module with a kernel lists all of its variants in
``kernel_variants()``; the test suite compiles each one for an sm_90 target on a CPU-only
machine, which catches what Triton's interpreter accepts but the GPU compiler rejects.
"""

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


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
