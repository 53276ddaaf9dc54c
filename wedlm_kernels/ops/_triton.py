"""Small shared pieces for the Triton kernels.

``KernelVariant`` describes one specialisation a launcher can produce (argument types and
constexpr values). Every op module with a kernel lists its variants in ``kernel_variants()``
(all of them, or for a kernel specialised on a model's sizes, such as paged_attention's page
size and GQA group, every tile configuration at sampled sizes); the test suite compiles each
one for an sm_90 target on a CPU-only machine, which catches what Triton's interpreter
accepts but the GPU compiler rejects.
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


def _specialisation(value) -> object:
    """What Triton specialises a launch on for one argument: a tensor's dtype and 16-byte
    alignment; an int's 32- or 64-bit range, divisibility by 16 and equality to 1; a
    float's type; anything else its value (constexprs)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63
    if isinstance(value, float):
        return float
    return value


class CachedLaunch:
    """Launches of one ``@triton.jit`` kernel on CUDA tensors through the compiled handle of
    each specialisation, skipping Triton's argument binding and cache lookup (tens of
    microseconds of host time a launch). The first launch of a specialisation goes through
    Triton and keeps the handle it returns; the key (:func:`_specialisation` of every
    argument, the constexprs' values, the launch options and the current device, on which
    Triton compiles, loads and launches) is at least as fine as Triton's, so a handle is
    never reused for a launch Triton would compile differently. ``WEDLM_KERNELS_DEBUG=1``
    asks Triton for its choice at every launch and checks it is the kept handle. CPU tensors
    (Triton's interpreter) always go through Triton."""

    def __init__(self, kernel) -> None:
        import inspect

        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)
        self.parameters = list(inspect.signature(fn).parameters)
        self.handles: dict[tuple, object] = {}

    def __call__(self, grid: tuple, *args, num_warps: int, **constexprs_and_options):
        launch = self.kernel[grid]
        if not args[0].is_cuda:
            return launch(*args, num_warps=num_warps, **constexprs_and_options)
        constexprs = [constexprs_and_options[name] for name in self.parameters[len(args):]]
        key = (torch.cuda.current_device(), num_warps, *map(_specialisation, args),
               *constexprs,  # (by value, as Triton compiles them)
               tuple(sorted((name, value) for name, value in constexprs_and_options.items()
                            if name not in self.parameters)))
        handle = self.handles.get(key)
        if handle is None:
            self.handles[key] = launch(*args, num_warps=num_warps, **constexprs_and_options)
            return None
        from .. import _backend

        if _backend.DEBUG:
            chosen = self.kernel.warmup(*args, grid=grid, num_warps=num_warps,
                                        **constexprs_and_options)
            if chosen is not handle:
                raise AssertionError(f"{self.parameters}: the kept handle of {key} is not the "
                                     "kernel Triton picks")
        # (Triton's own launch pads the grid to three dimensions; a compiled handle reads
        # all three)
        handle[(*grid, *(1,) * (3 - len(grid)))](*args, *constexprs)
        return None
