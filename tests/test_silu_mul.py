"""silu_mul (the public op; the PyTorch implementation on CPU) against reference/layers.py
and PyTorch's own ``F.silu(gate) * up``."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import layers as ref
from tests.numerics import SILU_MUL_TOLERANCE

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@given(
    rows=st.integers(0, 9), intermediate=st.integers(1, 70), dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.1, 1.0, 8.0]), padded_rows=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=1, intermediate=1, dtype=torch.float32, scale=1.0, padded_rows=False, seed=0)
@example(rows=9, intermediate=70, dtype=torch.bfloat16, scale=8.0, padded_rows=True, seed=1)
def test_matches_reference_and_pytorch(rows, intermediate, dtype, scale, padded_rows, seed):
    g = torch.Generator().manual_seed(seed)
    width = 2 * intermediate + (3 if padded_rows else 0)  # extra columns: a row stride
    storage = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    gate_up = storage[:, : 2 * intermediate]
    out = wk.silu_mul(gate_up)
    assert out.shape == (rows, intermediate) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref.silu_mul(gate_up), **SILU_MUL_TOLERANCE[dtype])


def test_values_by_hand_and_non_finite_entries():
    inf, nan = float("inf"), float("nan")
    gate_up = torch.tensor([[0.0, 2.0, -1000.0, inf, -inf, nan,
                             7.0, 5.0, 3.0, 2.0, 1.0, 1.0]])
    out = wk.silu_mul(gate_up)[0]
    expected = [0.0, 2.0 / (1 + torch.exp(torch.tensor(-2.0)).item()) * 5.0, -0.0, inf, nan,
                nan]
    torch.testing.assert_close(out, torch.tensor(expected), equal_nan=True)
    torch.testing.assert_close(ref.silu_mul(gate_up)[0], torch.tensor(expected).double(),
                               equal_nan=True)


@pytest.mark.parametrize("bad,error,message", [
    (torch.zeros(2, 4, dtype=torch.int32), TypeError, "`gate_up` must have dtype"),
    (torch.zeros(2, 4, dtype=torch.float64), TypeError, "`gate_up` must have dtype"),
    (torch.zeros(2, 3), ValueError, "`gate_up` must have an even last dimension"),
    (torch.zeros(2, 2, 4), ValueError, "`gate_up` must be 2-D"),
    (torch.zeros(4, 2).t(), ValueError, "`gate_up` must have stride 1"),
    ([[0.0, 1.0]], TypeError, "`gate_up` must be a torch.Tensor"),
])
def test_bad_arguments_raise_naming_gate_up(bad, error, message):
    with pytest.raises(error, match=message):
        wk.silu_mul(bad)
