"""wedlm_kernels.request_params: the one definition of a request's parameters that
model_min's SamplingParams and the vLLM plugin's request check share. Every accepted value
is stored in its buffer's dtype without an error, every refused one names its field, the
documented mappings hold, and docs/contracts.md states every rule."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_min import SamplingParams
from wedlm_kernels import request_params as rp
from wedlm_kernels.request_params import ParameterError, ParameterTypeError

ROOT = Path(__file__).resolve().parents[1]
INF, NAN = math.inf, math.nan
DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}

# The values the issue asks every field to be fuzzed with, and a few of each kind more.
EDGE_VALUES = [INF, -INF, NAN, 1e300, -1e300, 3.5e38, -3.5e38, 3.4028235e38, 2**31,
               2**31 - 1, -(2**31), 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64, -0.0,
               0.0, 0, 1, -1, 0.005, 0.4, 1.5, 2, 2.5, True, False, "4", "", "none",
               [1, 2], [], None, {"a": 1}]


def checked(field: str, value, **context):
    """The stored value of ``value`` for ``field``, or the ParameterError it raises."""
    checks = {
        "window": lambda v: rp.window(v, "W", **context),
        "mode": lambda v: rp.mode(v, "M"),
        "entropy_threshold": lambda v: rp.entropy_threshold(v, "T"),
        "distance_penalty": lambda v: rp.distance_penalty(v, "P"),
        "temperature": lambda v: rp.sampling(v, 0, 1.0, ("X", "K", "Q"))[0],
        "top_k": lambda v: rp.sampling(1.0, v, 1.0, ("X", "K", "Q"))[1],
        "top_p": lambda v: rp.sampling(1.0, 0, v, ("X", "K", "Q"))[2],
        "seed": lambda v: rp.seed(v, "S"),
        "max_tokens": lambda v: rp.max_tokens(v, "N"),
        "stop_token_ids": lambda v: rp.stop_token_ids(v, "I", **context),
    }
    try:
        return checks[field](value)
    except ParameterError as error:
        return error


def stores_in(dtype: str, value) -> None:
    """Store ``value`` in a buffer of ``dtype`` as the front ends do (a fill, and a tensor
    from a list); raises if it does not fit."""
    buffer = torch.zeros(max(1, len(value)) if isinstance(value, tuple) else 1,
                         dtype=DTYPES[dtype])
    if isinstance(value, tuple):
        if value:
            buffer[: len(value)] = torch.tensor(value, dtype=DTYPES[dtype])
    else:
        buffer.fill_(value)
        torch.tensor([value], dtype=DTYPES[dtype])


@pytest.mark.parametrize("field", sorted(rp.FIELDS))
@pytest.mark.parametrize("value", EDGE_VALUES, ids=[repr(v)[:20] for v in EDGE_VALUES])
def test_every_accepted_value_fits_its_buffer_and_every_refusal_names_the_field(field, value):
    result = checked(field, value)
    dtype = rp.FIELDS[field][0]
    if isinstance(result, ParameterError):
        assert result.parameter in "WMTPXKQSNI" and str(result).startswith(result.parameter)
    elif dtype is not None and result is not None:
        stores_in(dtype, result)


NUMBERS = (st.floats(allow_nan=True, allow_infinity=True)
           | st.integers(min_value=-(2**70), max_value=2**70) | st.booleans() | st.none()
           | st.text(max_size=3))


@given(field=st.sampled_from(sorted(rp.FIELDS)),
       value=NUMBERS | st.lists(NUMBERS, max_size=30))
def test_any_value_is_refused_by_name_or_stored_without_an_error(field, value):
    result = checked(field, value)
    dtype = rp.FIELDS[field][0]
    if not isinstance(result, ParameterError) and dtype is not None and result is not None:
        stores_in(dtype, result)


def test_threshold_mappings_one_token_per_step_and_every_mask():
    # (1e-300 and 7e-46 are positive, but float32 holds them as 0: nothing passes them)
    for one_token_per_step in (None, 0, -0.0, -0.5, -INF, -1e300, 1e-300, 7e-46):
        assert rp.entropy_threshold(one_token_per_step, "T") == -INF
    assert rp.entropy_threshold(1e-45, "T") == 1e-45  # float32's smallest positive
    for every_mask in (INF, 1e300, 3.5e38):
        assert rp.entropy_threshold(every_mask, "T") == INF
    assert rp.entropy_threshold(0.4, "T") == 0.4
    assert rp.entropy_threshold(3.4e38, "T") == 3.4e38  # in range: kept
    for bad in (NAN, True, "0.4", [0.4]):
        assert isinstance(checked("entropy_threshold", bad), ParameterError)


def test_a_negative_distance_penalty_is_refused_and_minus_zero_is_zero():
    assert isinstance(checked("distance_penalty", -0.01), ParameterError)
    stored = rp.distance_penalty(-0.0, "P")
    assert stored == 0 and math.copysign(1, stored) == 1
    assert rp.distance_penalty(rp.FLOAT32_MAX, "P") == rp.FLOAT32_MAX
    assert isinstance(checked("distance_penalty", 3.5e38), ParameterError)


def test_sampling_follows_vllms_rules():
    # a small positive temperature is raised to 0.01; above 2 is refused
    assert rp.sampling(1e-40, 0, 1.0, ("X", "K", "Q")) == (0.01, 0, 1.0)
    assert rp.sampling(2, 5, 0.5, ("X", "K", "Q")) == (2.0, 5, 0.5)
    for bad in (2.01, -0.001, INF, NAN):
        assert checked("temperature", bad).parameter == "X"
    # greedy: top_k and top_p are set to off once they pass their range checks
    assert rp.sampling(0, True, 0.5, ("X", "K", "Q")) == (0.0, 0, 1.0)
    assert rp.sampling(0, 2**40, True, ("X", "K", "Q")) == (0.0, 0, 1.0)
    with pytest.raises(ParameterError, match="K must be an integer >= -1"):
        rp.sampling(0, -2, 1.0, ("X", "K", "Q"))
    with pytest.raises(ParameterError, match=r"Q must be a number in \(0, 1\]"):
        rp.sampling(0, 0, 0.0, ("X", "K", "Q"))
    # sampled: top_k off below 1 and above int32; a bool is not a number
    assert [rp.sampling(1.0, k, 1.0, ("X", "K", "Q"))[1] for k in (-1, 0, 7, 2**31 - 1, 2**31)
            ] == [0, 0, 7, 2**31 - 1, 0]
    for field in ("top_k", "top_p", "temperature"):
        assert isinstance(checked(field, True), ParameterTypeError)


def test_seed_is_an_int64_and_minus_one_means_none():
    assert rp.seed(-1, "S") is None and rp.seed(None, "S") is None
    assert rp.seed(2**63 - 1, "S") == 2**63 - 1 and rp.seed(-(2**63), "S") == -(2**63)
    for bad in (2**63, -(2**63) - 1, True, 3.0, "7"):
        assert checked("seed", bad).parameter == "S"


def test_stop_token_ids_are_distinct_ids_within_the_vocabulary():
    assert rp.stop_token_ids(None, "I") == () and rp.stop_token_ids([], "I") == ()
    assert rp.stop_token_ids([7, 3, 7, 3.0], "I") == (7, 3)  # repeats dropped first, as vLLM
    assert rp.stop_token_ids(range(24), "I", eos_ids=()) == tuple(range(24))
    assert "at most 24" in str(checked("stop_token_ids", list(range(25)), eos_ids=()))
    # the checkpoint's eos ids are not counted (vLLM adds them beside the request's)
    assert rp.stop_token_ids(range(26), "I", eos_ids=(3, 7)) == tuple(range(26))
    assert rp.stop_token_ids(range(1000), "I") == tuple(range(1000))  # counted in context
    assert rp.stop_token_ids([263], "I", vocab_size=264) == (263,)
    assert "outside the vocabulary [0, 264)" in str(checked("stop_token_ids", [264],
                                                           vocab_size=264))
    for bad in ([-1], [True], [1.5], "17", 17, [[1]], [2**63]):
        assert checked("stop_token_ids", bad).parameter == "I"


def test_window_and_mode():
    assert rp.window(8, "W", most=8) == 8 and rp.window(4096, "W") == 4096
    assert "from 1 to 8 (the engine's window)" in str(checked("window", 9, most=8))
    for bad in (0, 4097, True, 2.0, "4", None):
        assert checked("window", bad).parameter == "W"
    assert rp.mode("blockwise", "M") == "blockwise"
    for bad in ("ar", "STREAMING", 1, None, ["streaming"]):
        assert checked("mode", bad).parameter == "M"


@pytest.mark.parametrize("field, sampling_field", [
    ("max_tokens", "max_new_tokens"), ("temperature", "temperature"), ("top_k", "top_k"),
    ("top_p", "top_p"), ("entropy_threshold", "threshold"), ("distance_penalty", "penalty"),
    ("seed", "seed"), ("stop_token_ids", "stop_token_ids"),
])
@pytest.mark.parametrize("value", EDGE_VALUES, ids=[repr(v)[:20] for v in EDGE_VALUES])
def test_model_min_sampling_params_accept_and_store_what_the_definition_does(
        field, sampling_field, value):
    # top_k and top_p are checked with a sampled temperature: greedy sets them to off
    base = {"temperature": 1.0} if field in ("top_k", "top_p") else {}
    expected = checked(field, value)
    try:
        stored = getattr(SamplingParams(**base, **{sampling_field: value}), sampling_field)
    except ParameterError as error:
        assert isinstance(expected, ParameterError), (value, error)
        assert error.parameter == f"SamplingParams.{sampling_field}"
        return
    assert not isinstance(expected, ParameterError), (value, stored)
    assert stored == expected or (isinstance(stored, float) and math.isnan(stored))


def test_contracts_state_every_field_its_buffer_and_its_rule():
    rows = [line for line in (ROOT / "docs" / "contracts.md").read_text().splitlines()
            if line.startswith("| ")]
    for field, (dtype, rule) in rp.FIELDS.items():
        [row] = [line for line in rows if line.startswith(f"| {field} |")]
        assert row.endswith(f"| {dtype or '-'} | {rule} |"), (field, row)
