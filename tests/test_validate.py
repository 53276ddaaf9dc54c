"""The argument checks shared by every public op."""

import pytest
import torch

import wedlm_kernels as wk
from wedlm_kernels import _backend
from wedlm_kernels.ops import _validate
from wedlm_kernels.ops._validate import (
    Dims,
    check_float,
    check_int,
    check_same_device,
    check_tensor,
)


def test_non_tensor_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="`ctx_len` must be a torch.Tensor, got list"):
        check_tensor("ctx_len", [1, 2], torch.int32, ("B",), Dims())


def test_wrong_dtype_names_argument_expected_and_actual():
    with pytest.raises(TypeError, match=r"`ctx_len` must have dtype int32, got int64"):
        check_tensor("ctx_len", torch.zeros(3, dtype=torch.int64), torch.int32, ("B",), Dims())


def test_wrong_rank_is_a_value_error():
    with pytest.raises(ValueError, match=r"`win_mask` must be 2-D \[B, S\], got shape \[4\]"):
        check_tensor("win_mask", torch.zeros(4, dtype=torch.bool), torch.bool, ("B", "S"), Dims())


def test_mismatched_symbol_names_both_arguments():
    dims = Dims()
    check_tensor("win_tokens", torch.zeros(3, 8, dtype=torch.int64), torch.int64, ("B", "S"), dims)
    with pytest.raises(ValueError, match=r"`win_len` has size 2 .* B = 3 \(from `win_tokens`\)"):
        check_tensor("win_len", torch.zeros(2, dtype=torch.int32), torch.int32, ("B",), dims)


def test_symbol_with_offset_checks_b_plus_one():
    dims = Dims()
    check_tensor("seed", torch.zeros(3, dtype=torch.int64), torch.int64, ("B",), dims)
    check_tensor("cu_rows", torch.zeros(4, dtype=torch.int32), torch.int32, ("B+1",), dims)
    with pytest.raises(ValueError, match="`cu_rows`"):
        check_tensor("cu_rows", torch.zeros(3, dtype=torch.int32), torch.int32, ("B+1",), dims)


def test_contiguity_and_unit_last_stride():
    t = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="`out_tokens` must be contiguous"):
        check_tensor("out_tokens", t, torch.float32, (4, 3), contiguous=True)
    with pytest.raises(ValueError, match="`q` must have stride 1 in its last dimension"):
        check_tensor("q", t, torch.float32, (4, 3), unit_last_stride=True)
    check_tensor("q", torch.zeros(4, 6)[:, :3], torch.float32, (4, 3), unit_last_stride=True)


def test_devices_must_agree():
    a = torch.zeros(2)
    b = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="`b` is on meta but `a` is on cpu"):
        check_same_device(a=a, b=b, c=None)


def test_scalar_checks():
    with pytest.raises(ValueError, match="`page_size` must be >= 1, got 0"):
        check_int("page_size", 0, minimum=1)
    with pytest.raises(TypeError, match="`page_size` must be an int"):
        check_int("page_size", 16.0)
    with pytest.raises(TypeError, match="`window` must be an int"):
        check_int("window", True)
    with pytest.raises(ValueError, match="`scale` must be finite"):
        check_float("scale", float("nan"))
    with pytest.raises(ValueError, match="`eps` must be > 0"):
        check_float("eps", 0.0, positive=True)


def test_setting_wedlm_kernels_debug_switches_the_value_checks(monkeypatch):
    """The package attribute is the setting the checks read at every call, not a copy."""
    monkeypatch.setattr(_backend, "DEBUG", False)
    decreasing = torch.tensor([0, 2, 1], dtype=torch.int32)
    args = (torch.zeros(2, 5), decreasing, torch.tensor([3, 4]), torch.zeros(2),
            torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2), torch.zeros(2),
            torch.zeros(2, dtype=torch.int64))
    assert wk.DEBUG is False
    wk.select_tokens(*args)  # defined behaviour without debug checks
    wk.DEBUG = True
    assert _backend.DEBUG is True and wk.DEBUG is True
    with pytest.raises(ValueError, match="cu_rows must be non-decreasing"):
        wk.select_tokens(*args)
    wk.DEBUG = False
    wk.select_tokens(*args)
    with pytest.raises(TypeError, match="wedlm_kernels.DEBUG must be a bool, got str"):
        wk.DEBUG = "1"


def test_debug_checks_only_run_in_debug_mode(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", False)
    _validate.debug_check(torch.tensor([False]), "never raised")
    monkeypatch.setattr(_backend, "DEBUG", True)
    _validate.debug_check(torch.tensor([True, True]), "fine")
    with pytest.raises(ValueError, match="win_len exceeds"):
        _validate.debug_check(torch.tensor([True, False]), "win_len exceeds S")
