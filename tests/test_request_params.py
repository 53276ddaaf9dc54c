"""wedlm_kernels.requests.params: the one definition of a request's parameters that
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
from wedlm_kernels.requests import params as rp
from wedlm_kernels.requests.params import ParameterError, ParameterTypeError

ROOT = Path(__file__).resolve().parents[1]
INF, NAN = math.inf, math.nan
VOCAB = 1000
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
        "window_policy": lambda v: rp.window_policy(v, "O"),
        "entropy_threshold": lambda v: rp.entropy_threshold(v, "T"),
        "distance_penalty": lambda v: rp.distance_penalty(v, "P"),
        "temperature": lambda v: rp.sampling(v, 0, 1.0, ("X", "K", "Q"))[0],
        "top_k": lambda v: rp.sampling(1.0, v, 1.0, ("X", "K", "Q"))[1],
        "top_p": lambda v: rp.sampling(1.0, 0, v, ("X", "K", "Q"))[2],
        "seed": lambda v: rp.seed(v, "S"),
        "max_tokens": lambda v: rp.max_tokens(v, "N"),
        "stop_token_ids": lambda v: rp.stop_token_ids(v, "I", **context),
        "presence_penalty": lambda v: rp.penalties(v, 0.0, 1.0, ("A", "F", "R"))[0],
        "frequency_penalty": lambda v: rp.penalties(0.0, v, 1.0, ("A", "F", "R"))[1],
        "repetition_penalty": lambda v: rp.penalties(0.0, 0.0, v, ("A", "F", "R"))[2],
        "min_p": lambda v: rp.min_p(v, "Y", 1.0),
        "min_tokens": lambda v: rp.min_tokens(v, "Z", context.get("max_tokens")),
        # (the two id lists are checked within a vocabulary of VOCAB unless told otherwise)
        "logit_bias": lambda v: rp.logit_bias(v, "B", context.get("vocab_size", VOCAB)),
        "allowed_token_ids": lambda v: rp.allowed_token_ids(v, "L",
                                                            context.get("vocab_size", VOCAB)),
        "n": lambda v: rp.n(v, "C"),
        "logprobs": lambda v: rp.logprobs(v, "G", context.get("vocab_size", VOCAB)),
        "bad_words_token_ids": lambda v: rp.bad_words_token_ids(
            v, "D", context.get("vocab_size", VOCAB)),
        "logprob_token_ids": lambda v: rp.logprob_token_ids(
            v, "H", context.get("vocab_size", VOCAB), context.get("logprobs")),
    }
    try:
        return checks[field](value)
    except ParameterError as error:
        return error


def stores_in(dtype: str, value) -> None:
    """Store ``value`` in a buffer of ``dtype`` as the front ends do (a fill, and a tensor
    from a list); raises if it does not fit."""
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # logit_bias
        stores_in("int64", tuple(token for token, _ in value))
        stores_in("float32", tuple(bias for _, bias in value))
        return
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
        assert result.parameter in "WMOTPXKQSNIAFRYZBLCGDH"
        assert str(result).startswith(result.parameter)
    elif dtype is not None and result is not None:
        if field == "bad_words_token_ids":  # stored as the words' ids, -1 padded
            result = tuple(token for word in result for token in word)
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
        if field == "allowed_token_ids":  # stored as the bitmask of a vocabulary holding them
            result = tuple(rp.allowed_bitmask(result, VOCAB))
        if field == "bad_words_token_ids":
            result = tuple(token for word in result for token in word)
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


def test_penalties_follow_vllms_bounds():
    assert rp.penalties(-2, 2.0, 1e-3, ("A", "F", "R")) == (-2.0, 2.0, 1e-3)
    for bad in (2.01, -2.01, INF, NAN, True, "0"):
        assert checked("presence_penalty", bad).parameter == "A"
        assert checked("frequency_penalty", bad).parameter == "F"
    # repetition: finite and > 0, and not a positive value float32 holds as 0 (x / 0)
    for bad in (0, -0.0, -1, INF, NAN, 1e-50, 3.5e38, True):
        assert checked("repetition_penalty", bad).parameter == "R"
    assert rp.penalties(-0.0, -0.0, 3.4e38, ("A", "F", "R")) == (0.0, 0.0, 3.4e38)
    assert math.copysign(1, rp.penalties(-0.0, 0.0, 1.0, ("A", "F", "R"))[0]) == 1


def test_min_p_min_tokens_n_follow_vllms_rules():
    assert rp.min_p(0.5, "Y", 1.0) == 0.5 and rp.min_p(1, "Y", 0.3) == 1.0
    assert rp.min_p(0.5, "Y", 0.0) == 0.0  # greedy: off, once the range check passed
    for bad in (-0.1, 1.1, NAN, True):
        assert checked("min_p", bad).parameter == "Y"
        assert isinstance(checked("min_p", bad), ParameterError)
    with pytest.raises(ParameterError, match="Y must be a number from 0 to 1"):
        rp.min_p(2, "Y", 0.0)  # greedy requests are range-checked too
    assert rp.min_tokens(0, "Z", 5) == 0 and rp.min_tokens(5, "Z", 5) == 5
    assert rp.min_tokens(2**31 - 1, "Z", None) == 2**31 - 1
    for bad in (-1, 6, 2.0, True, None):
        assert checked("min_tokens", bad, max_tokens=5).parameter == "Z"
    assert rp.n(1, "C") == 1 and rp.n(64, "C") == 64
    for bad in (0, -1, 1.0, True, None):
        assert checked("n", bad).parameter == "C"


def test_logit_bias_and_allowed_token_ids_are_ids_in_the_vocabulary():
    assert rp.logit_bias(None, "B") == () and rp.logit_bias({}, "B") == ()
    assert rp.logit_bias({9: 1, 2: -0.5}, "B", 10) == ((2, -0.5), (9, 1.0))
    assert "outside the vocabulary [0, 10)" in str(checked("logit_bias", {10: 1.0},
                                                           vocab_size=10))
    for bad in ({-1: 1.0}, {1: NAN}, {1: INF}, {1: 3.5e38}, {1: "2"}, {True: 1.0},
                {"1": 1.0}, [(1, 1.0)], 3):
        assert checked("logit_bias", bad).parameter == "B", bad
    assert rp.logit_bias({1: -3.4e38}, "B") == ((1, -3.4e38),)
    assert len(rp.logit_bias({i: 1.0 for i in range(300)}, "B", 1000)) == 300
    assert "at most 300" in str(checked("logit_bias", {i: 1.0 for i in range(301)}))
    assert rp.allowed_token_ids(None, "L") is None
    assert rp.allowed_token_ids([5, 3, 5], "L", 10) == (5, 3)
    for bad in ([], [10], [-1], [1.0], [True], "12", {1: 2}, 7):
        assert checked("allowed_token_ids", bad, vocab_size=10).parameter == "L", bad
    # bit v % 32 of word v // 32; bit 31 is the int32's sign
    assert rp.allowed_bitmask([0, 31, 32, 99], 100) == [1 + 2**31 - 2**32, 1, 0, 8]


@pytest.mark.parametrize("field, sampling_field", [
    ("max_tokens", "max_new_tokens"), ("temperature", "temperature"), ("top_k", "top_k"),
    ("top_p", "top_p"), ("entropy_threshold", "threshold"), ("distance_penalty", "penalty"),
    ("seed", "seed"), ("stop_token_ids", "stop_token_ids"),
    ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"), ("min_p", "min_p"),
    ("min_tokens", "min_tokens"), ("allowed_token_ids", "allowed_token_ids"),
    ("logprob_token_ids", "logprob_token_ids"),
])
@pytest.mark.parametrize("value", EDGE_VALUES, ids=[repr(v)[:20] for v in EDGE_VALUES])
def test_model_min_sampling_params_accept_and_store_what_the_definition_does(
        field, sampling_field, value):
    # top_k, top_p and min_p are checked with a sampled temperature: greedy sets them to off
    base = {"temperature": 1.0} if field in ("top_k", "top_p", "min_p") else {}
    # model_min checks the ids against the model's vocabulary later (Generator.generate)
    # (and min_tokens against SamplingParams' default max_new_tokens, 256)
    expected = checked(field, value, **({"vocab_size": None} if field in (
                                            "allowed_token_ids", "logprob_token_ids")
                                        else {"max_tokens": 256} if field == "min_tokens"
                                        else {}))
    try:
        stored = getattr(SamplingParams(**base, **{sampling_field: value}), sampling_field)
    except ParameterError as error:
        assert isinstance(expected, ParameterError), (value, error)
        assert error.parameter == f"SamplingParams.{sampling_field}"
        return
    assert not isinstance(expected, ParameterError), (value, stored)
    assert stored == expected or (isinstance(stored, float) and math.isnan(stored))


def test_the_request_page_states_every_field_its_buffer_and_its_rule():
    rows = [line for line in (ROOT / "docs" / "requests.md").read_text().splitlines()
            if line.startswith("| ")]
    for field, (dtype, rule) in rp.FIELDS.items():
        [row] = [line for line in rows if line.startswith(f"| {field} |")]
        assert row.endswith(f"| {dtype or '-'} | {rule} |"), (field, row)


def test_bad_words_are_token_id_lists_within_vllms_bounds():
    assert rp.bad_words_token_ids([[5, 6], [7], [5, 6]], "D", 10) == ((5, 6), (7,))
    assert rp.bad_words_token_ids([], "D") is None
    for bad, message in [([[]], "empty"), ([[1] * 17], "17 tokens"), ([[10]], "outside"),
                         ([[i] for i in range(129)], "129 words"),
                         ([[i] * 16 for i in range(65)], "1040 tokens"),
                         ("ab", "list of words"), ([1, 2], "list of words"),
                         ([[1.0]], "token ids"), ([[True]], "token ids")]:
        error = checked("bad_words_token_ids", bad, vocab_size=10 if message == "outside"
                        else 1000)
        assert isinstance(error, ParameterError) and message in str(error), (bad, error)


def test_logprob_token_ids_are_at_most_128_ids_in_the_vocabulary_repeats_kept():
    assert rp.MAX_LOGPROB_TOKEN_IDS == 128
    assert rp.logprob_token_ids([5, 3, 5], "H", 10) == (5, 3, 5)  # order and repeats kept
    assert rp.logprob_token_ids(None, "H") is None and rp.logprob_token_ids([], "H") is None
    assert rp.logprob_token_ids(range(128), "H", 1000) == tuple(range(128))
    assert rp.logprob_token_ids([0, 999], "H", 1000) == (0, 999)
    assert rp.logprob_token_ids([2**63 - 1], "H") == (2**63 - 1,)  # vocabulary not known
    for bad, message in [(list(range(129)), "may hold at most 128 token ids, got 129"),
                         ([1000], r"has token ids outside the vocabulary \[0, 1000\): \[1000\]"),
                         ([3, -1], r"has token ids outside the vocabulary \[0, 1000\): \[-1\]")]:
        with pytest.raises(ParameterError, match=f"^H {message}") as error:
            rp.logprob_token_ids(bad, "H", 1000)
        assert error.value.parameter == "H"
    with pytest.raises(ParameterError, match=r"outside \[0, 2\*\*63\)"):
        rp.logprob_token_ids([2**63], "H")


def test_logprob_token_ids_are_integers_not_bools_and_numpy_integers_pass():
    np = pytest.importorskip("numpy")
    stored = rp.logprob_token_ids(np.array([4, 2], dtype=np.int32), "H", 10)
    assert stored == (4, 2) and all(type(t) is int for t in stored)
    assert rp.logprob_token_ids([np.int64(7)], "H", 10) == (7,)
    for bad in ([True], [1.0], [None], [[1]], "12", b"12", {1: 2}, 7, 1.5):
        error = checked("logprob_token_ids", bad)
        assert isinstance(error, ParameterTypeError), bad
        assert error.parameter == "H" and str(error).startswith("H must be")


@pytest.mark.parametrize("logprobs, ids, accepted", [
    (3, [1, 2, 3], True), (True, [4], True), (0, [], True), (None, [1, 2], True),
    (2, [1, 2, 3], False), (4, [1, 2, 3], False), (-1, [1, 2], False), (3, [], False),
    (1.0, [1], False), (False, [1], False)])
def test_logprobs_beside_logprob_token_ids_must_be_their_count(logprobs, ids, accepted):
    """vLLM's rule (SamplingParams._validate_logprobs): with both set, logprobs equals
    len(logprob_token_ids), the empty list's 0 included; the error names the ids."""
    result = checked("logprob_token_ids", ids, logprobs=logprobs)
    if accepted:
        assert result == (tuple(ids) or None)
    else:
        assert isinstance(result, ParameterError) and result.parameter == "H"
        assert str(result).startswith("H: when logprobs is set beside it, logprobs must "
                                      f"equal its length {len(ids)}")


def test_model_min_checks_logprob_token_ids_by_name_beside_logprobs():
    assert SamplingParams(logprob_token_ids=[9, 9]).logprob_token_ids == (9, 9)
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None
    assert SamplingParams(logprobs=True, logprob_token_ids=[3]).logprobs == 1
    with pytest.raises(ParameterError, match="^SamplingParams.logprob_token_ids: when "
                       "logprobs is set beside it") as error:
        SamplingParams(logprobs=2, logprob_token_ids=[1, 2, 3])
    assert error.value.parameter == "SamplingParams.logprob_token_ids"
    with pytest.raises(ParameterError, match="^SamplingParams.logprob_token_ids may hold at "
                       "most 128"):
        SamplingParams(logprob_token_ids=[1] * 129)
