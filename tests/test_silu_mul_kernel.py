"""The Triton kernel of silu_mul through its launcher (Triton's interpreter when there is no
GPU) against the PyTorch implementation and reference/layers.py, output between guard
bands. bf16 only on the GPU (the interpreter truncates fp32 -> bf16 casts)."""

import inspect

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from reference import layers as ref
from tests.kernel_harness import guarded
from tests.numerics import (
    SILU_MUL_KERNEL_TOLERANCE,
    SILU_MUL_KERNEL_VS_TORCH_TOLERANCE,
    assert_close,
)
from wedlm_kernels.ops import silu_mul as silu_mul_ops
from wedlm_kernels.ops._triton import POINTER_TYPES
from wedlm_kernels.ops.silu_mul import kernel_variants, silu_mul_into, silu_mul_torch

# the interpreter evaluates exp and products of non-finite entries with numpy, which warns
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
OUT_SENTINEL = 4321.0


def run_kernel(gate_up):
    rows, width = gate_up.shape
    out = guarded(torch.full((rows, width // 2), OUT_SENTINEL, dtype=gate_up.dtype,
                             device=gate_up.device))
    silu_mul_into(out.tensor, gate_up)
    out.check("out")
    return out.tensor


@given(
    rows=st.integers(1, 5), intermediate=st.integers(1, 2100), dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.1, 1.0, 12.0]), padded_rows=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=1, intermediate=1, dtype=torch.float32, scale=1.0, padded_rows=False, seed=0)
@example(rows=3, intermediate=1024, dtype=torch.float16, scale=12.0, padded_rows=True, seed=1)
@example(rows=2, intermediate=2049, dtype=torch.float32, scale=1.0, padded_rows=True, seed=2)
def test_kernel_matches_pytorch_and_reference(rows, intermediate, dtype, scale, padded_rows,
                                              seed):
    g = torch.Generator().manual_seed(seed)
    width = 2 * intermediate + (5 if padded_rows else 0)
    storage = (torch.randn(rows, width, generator=g) * scale).to(dtype).to(DEVICE)
    gate_up = storage[:, : 2 * intermediate]
    out = run_kernel(gate_up)
    torch.testing.assert_close(out, silu_mul_torch(gate_up),
                               **SILU_MUL_KERNEL_VS_TORCH_TOLERANCE[dtype])
    assert_close(out, ref.silu_mul(gate_up.cpu()), SILU_MUL_KERNEL_TOLERANCE, dtype)


def test_non_finite_entries_follow_pytorch():
    inf, nan = float("inf"), float("nan")
    gate_up = torch.tensor([[0.0, 2.0, -1000.0, inf, -inf, nan, 1e30, -1e30,
                             7.0, 5.0, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    torch.testing.assert_close(run_kernel(gate_up), silu_mul_torch(gate_up), equal_nan=True)


def test_zero_rows_launch_nothing(monkeypatch):
    class Unlaunchable:
        def __getitem__(self, grid):
            raise AssertionError(f"launched with grid {grid}")

    monkeypatch.setattr(silu_mul_ops, "_silu_mul_kernel", Unlaunchable())
    assert silu_mul_ops.silu_mul_triton(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)


def test_kernel_variants_list_every_specialisation_the_launcher_produces(monkeypatch):
    variants = kernel_variants()
    launches = []

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, num_warps, **constexprs):
                types = tuple(POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor) else "i32"
                              for a in args)
                launches.append((types, tuple(sorted(constexprs.items())), num_warps))
            return launch

    monkeypatch.setattr(silu_mul_ops, "_silu_mul_kernel", Recording())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, width in ((1, 2), (3, 24576), (64, 2 * 1024 + 6)):
            silu_mul_ops.silu_mul_triton(torch.zeros(rows, width, dtype=dtype)[:, :width // 2 * 2])
    for variant in variants:
        assert list(variant.signature) == list(inspect.signature(variant.kernel.fn).parameters)
    listed = {(tuple(t for t in v.signature.values() if t != "constexpr"),
               tuple(sorted(v.constexprs.items())), v.num_warps) for v in variants}
    assert launches and all(launch in listed for launch in launches)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qwen3_8b_decode_shape_matches_pytorch_on_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    gate_up = torch.randn(64, 2 * 12288, generator=g, device="cuda").to(dtype) * 4
    torch.testing.assert_close(run_kernel(gate_up), silu_mul_torch(gate_up),
                               **SILU_MUL_KERNEL_VS_TORCH_TOLERANCE[dtype])
