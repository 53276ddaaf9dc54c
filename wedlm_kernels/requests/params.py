"""The parameters of one decoding request, defined once: types, bounds and meanings.

``model_min.SamplingParams`` and the vLLM plugin's request check
(:mod:`wedlm_kernels.integrations.vllm.settings`) both check a request with the functions
here, so the two front ends accept and refuse the same values and store the same thing.
Each function takes the value and the name the caller knows it by (for the error) and
returns the value as it is stored in the device buffer that holds it
(``docs/requests.md``, "Request parameters", has the table)::

    field              stored as  accepted                         mapped before it is stored
    window             int32      integer 1 .. min(engine's, 4096)
    mode               -          "streaming" or "blockwise"
    entropy_threshold  float32    number or None, not NaN          None, <= 0 or rounding to
                                                                   0 in float32: -inf (one
                                                                   token per step); above the
                                                                   float32 range: +inf (every
                                                                   mask)
    distance_penalty   float32    number 0 .. 3.4028235e38
    temperature        float32    number 0 .. 2                    (0, 0.01): 0.01
    top_k              int32      integer >= -1                    -1 and 0: 0 (off); above
                                                                   2**31 - 1: 0 (off)
    top_p              float32    number in (0, 1]
    seed               int64      None or integer in int64         -1: None (a drawn seed)
    max_tokens         int32      integer 1 .. 2**31 - 1, or None  None: as many as the context
                                                                   has room for
    stop_token_ids     int64      ids in [0, vocabulary), at most  None: no stop ids
                                  24 distinct ones besides the
                                  checkpoint's eos ids
    presence_penalty   float32    number -2 .. 2
    frequency_penalty  float32    number -2 .. 2
    repetition_penalty float32    number > 0, finite
    min_p              float32    number 0 .. 1                    greedy: 0 (off)
    min_tokens         int32      integer 0 .. max_tokens
    logit_bias         int64 +    None or {token id: number}, ids  None and {}: no bias
                       float32    in the vocabulary, values finite,
                                  at most 300 entries
    allowed_token_ids  bitmask    None or a non-empty list of ids  None: every token
                                  in the vocabulary
    n                  -          integer >= 1 (vLLM: > 1 needs a
                                  temperature > 0)
    bad_words_token_ids int64     None or at most 128 words of 1   None and []: no word;
                                  .. 16 ids in the vocabulary,     repeated words kept once
                                  1024 ids in all
    logprobs           -          None or integer 0 .. min(64,     -1: the vocabulary (when it
                                  vocabulary)                      has at most 64 tokens);
                                                                   True: 1 (vLLM's reading)
    logprob_token_ids  int64      None or 1 .. 128 ids in the      None and []: none;
                                  vocabulary (repeats kept); with  repeated ids kept
                                  logprobs set, logprobs must be
                                  their count

A boolean is never a number here (``True`` is not the integer 1), with one exception
that follows vLLM's order of checks: a greedy request (temperature 0) ignores ``top_k``,
``top_p`` and ``min_p`` once they pass their range checks (-1 or more; (0, 1]; [0, 1];
there ``True`` counts as 1), and stores them as off. The module imports nothing but the
standard library, so every front end (and its tests) can use it.
"""

import math
import numbers
import struct
from collections.abc import Iterable
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max

MODES = ("streaming", "blockwise")
# How a streaming window is sized step by step (wedlm_kernels.window_policy): "fixed" keeps
# W slots, "adaptive" follows what the sequence commits (docs/algorithm.md).
WINDOW_POLICIES = ("fixed", "adaptive")
# The largest window any front end takes: a window's state is 2W slots per request and a
# step feeds up to 2W rows per request; WeDLM decodes with windows of 4 to 32.
MAX_WINDOW = 4096
MAX_TEMPERATURE = 2.0
# A positive temperature below this is raised to it (vLLM's rule: logits / T in float32
# stays finite); temperature 0 is greedy.
MIN_SAMPLING_TEMPERATURE = 0.01
# Distinct stop_token_ids a request may ask for besides the checkpoint's eos ids.
MAX_STOP_TOKEN_IDS = 24
# Entries of logit_bias a request may hold (the vLLM plugin keeps them in a fixed buffer per
# request slot; a bias over more tokens is better said with allowed_token_ids).
MAX_LOGIT_BIAS = 300
# vLLM's bounds of its presence and frequency penalties.
MAX_ADDITIVE_PENALTY = 2.0

# What each field is stored as, and its rule in words; docs/contracts.md repeats every rule
# (tests/test_request_params.py checks that it does).
FIELDS = {
    "window": ("int32", "an integer from 1 to the engine's window (at most 4096)"),
    "mode": (None, 'one of "streaming" and "blockwise"'),
    "window_policy": (None, 'None (the engine\'s setting), "fixed" or "adaptive"'),
    "entropy_threshold": ("float32", "a number, not NaN, or None; None, any value <= 0 and "
                          "any positive value float32 rounds to 0 (below about 7e-46) mean "
                          "one token per step (stored as -inf), a value above 3.4028235e38 "
                          "means every mask (stored as +inf)"),
    "distance_penalty": ("float32", "a number from 0 to 3.4028235e38 (-0.0 is 0)"),
    "temperature": ("float32", "a number from 0 to 2; 0 is greedy, a value in (0, 0.01) "
                    "is raised to 0.01"),
    "top_k": ("int32", "an integer >= -1; -1, 0 and any value above 2**31 - 1 mean off "
              "(stored as 0)"),
    "top_p": ("float32", "a number in (0, 1]"),
    "seed": ("int64", "None or an integer from -2**63 to 2**63 - 1; -1 means None (a "
             "seed drawn for the request)"),
    "max_tokens": ("int32", "an integer from 1 to 2**31 - 1, or None (as many tokens as "
                   "the context has room for)"),
    "stop_token_ids": ("int64", "None or a list of token ids, each in [0, vocabulary), at "
                       "most 24 distinct ones besides the checkpoint's eos ids"),
    "presence_penalty": ("float32", "a number from -2 to 2 (0: off)"),
    "frequency_penalty": ("float32", "a number from -2 to 2 (0: off)"),
    "repetition_penalty": ("float32", "a finite number > 0 (1: off)"),
    "min_p": ("float32", "a number from 0 to 1 (0: off); a greedy request stores 0"),
    "min_tokens": ("int32", "an integer from 0 to max_tokens"),
    "logit_bias": ("int64", "None or a mapping of token ids in [0, vocabulary) to finite "
                   "numbers (float32), at most 300 entries"),
    "allowed_token_ids": ("int32", "None or a non-empty list of token ids in [0, vocabulary) "
                          "(stored as a bitmask of 32 tokens a word)"),
    "n": (None, "an integer >= 1 (sequences per request; vLLM needs a temperature > 0 for "
          "n > 1)"),
    "bad_words_token_ids": ("int64", "None or at most 128 words (vLLM tokenizes each "
                            "bad_words entry with and without a leading space), each a "
                            "non-empty list of at most 16 token ids in [0, vocabulary), "
                            "1024 ids in all"),
    "logprobs": (None, "None or an integer from 0 to 64 and at most the vocabulary (the "
                 "alternatives listed per token); -1 means the whole vocabulary when it has "
                 "at most 64 tokens, True means 1 (vLLM's readings)"),
    "logprob_token_ids": ("int64", "None or a list of at most 128 token ids, each in [0, "
                          "vocabulary), repeats kept (listed per token beside the committed "
                          "token, in their order); an empty list means None; with logprobs "
                          "also set, logprobs must equal the list's length (vLLM's rule)"),
}


class ParameterError(ValueError):
    """A request parameter that cannot be served; ``parameter`` names it as the caller
    gave it (``SamplingParams.top_k``, ``extra_args['wedlm_window']``, ...)."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


class ParameterTypeError(ParameterError, TypeError):
    """A request parameter of the wrong type (also a ``TypeError``)."""


def is_integer(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: Any, name: str, what: str) -> int:
    if not is_integer(value):
        raise ParameterTypeError(f"{name} must be {what}, got {value!r:.80}", name)
    return int(value)


def _number(value: Any, name: str, what: str) -> float:
    if not is_number(value):
        raise ParameterTypeError(f"{name} must be {what}, got {value!r:.80}", name)
    return float(value)


def _fail(name: str, what: str, value: Any) -> None:
    raise ParameterError(f"{name} must be {what}, got {value!r:.80}", name)


def window(value: Any, name: str, most: int | None = None) -> int:
    """The decode window ``W``: an integer 1 .. ``most`` (the engine's window) and 4096."""
    most = MAX_WINDOW if most is None else min(most, MAX_WINDOW)
    what = f"an integer from 1 to {most}" + (" (the engine's window)" if most < MAX_WINDOW
                                             else "")
    result = _integer(value, name, what)
    if not 1 <= result <= most:
        _fail(name, what, value)
    return result


def mode(value: Any, name: str) -> str:
    """``"streaming"`` or ``"blockwise"``."""
    if not isinstance(value, str) or value not in MODES:
        _fail(name, f"one of {MODES}", value)
    return value


def window_policy(value: Any, name: str) -> str | None:
    """``None`` (the engine's setting), ``"fixed"`` or ``"adaptive"``."""
    if value is not None and (not isinstance(value, str) or value not in WINDOW_POLICIES):
        _fail(name, f"None or one of {WINDOW_POLICIES}", value)
    return value


def _float32(value: float) -> float:
    """``value`` (at most FLOAT32_MAX in magnitude) rounded to float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def entropy_threshold(value: Any, name: str) -> float:
    """The threshold as stored: -inf for None and any value float32 holds as 0 or below (no
    entropy is below it, so one token per step), +inf above the float32 range (every mask),
    else the value."""
    if value is None:
        return -math.inf
    what = "a number of nats (<= 0 or None: one token per step)"
    result = _number(value, name, what)
    if math.isnan(result):
        _fail(name, what + ", not NaN", value)
    if result > FLOAT32_MAX:
        return math.inf
    return -math.inf if _float32(result) <= 0 else result


def distance_penalty(value: Any, name: str) -> float:
    """The penalty per slot of distance from the leftmost mask: 0 .. the float32 maximum
    (a negative penalty would favour the masks furthest from the committed text)."""
    what = f"a number from 0 to {FLOAT32_MAX:.8g}"
    result = _number(value, name, what)
    if not 0 <= result <= FLOAT32_MAX:
        _fail(name, what, value)
    return result + 0.0  # -0.0 is 0


def sampling(temperature: Any, top_k: Any, top_p: Any, names: tuple[str, str, str]
             ) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` as stored, checked in vLLM's order: the range checks
    first (a bool passes them as an int, as in vLLM), then a greedy request's top_k and top_p
    are set to off, then the types and the buffers' bounds. ``names`` name the three."""
    temperature_name, top_k_name, top_p_name = names
    if isinstance(temperature, numbers.Real) and 0 < temperature < MIN_SAMPLING_TEMPERATURE:
        temperature = MIN_SAMPLING_TEMPERATURE
    what = f"a number from 0 to {MAX_TEMPERATURE:g} (0: greedy)"
    top_p_what = "a number in (0, 1]"
    top_k_what = "an integer >= -1 (-1 or 0: off)"
    for value, name, kind, description in ((temperature, temperature_name, numbers.Real, what),
                                           (top_p, top_p_name, numbers.Real, top_p_what),
                                           (top_k, top_k_name, numbers.Integral, top_k_what)):
        if not isinstance(value, kind):
            raise ParameterTypeError(f"{name} must be {description}, got {value!r:.80}", name)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        _fail(temperature_name, what, temperature)
    if not 0 < top_p <= 1:
        _fail(top_p_name, top_p_what, top_p)
    if top_k < -1:
        _fail(top_k_name, top_k_what, top_k)
    if temperature == 0:
        top_k, top_p = 0, 1.0
    temperature = _number(temperature, temperature_name, what) + 0.0
    top_p = _number(top_p, top_p_name, top_p_what)
    top_k = _integer(top_k, top_k_name, top_k_what)
    return temperature, (top_k if 0 < top_k <= INT32_MAX else 0), top_p


def seed(value: Any, name: str) -> int | None:
    """None (the front end draws one) or an int64; -1 means None, as in vLLM."""
    if value is None or (isinstance(value, numbers.Real) and value == -1):
        return None
    what = "None or an integer from -2**63 to 2**63 - 1"
    result = _integer(value, name, what)
    if not INT64_MIN <= result <= INT64_MAX:
        _fail(name, what, value)
    return result


def max_tokens(value: Any, name: str, most: int = INT32_MAX) -> int | None:
    """The most tokens a request generates: 1 .. 2**31 - 1 (or the ``most`` an engine's
    context allows), or None (as many as the context has room for)."""
    if value is None:
        return None
    what = f"an integer from 1 to {'2**31 - 1' if most == INT32_MAX else most} or None"
    result = _integer(value, name, what)
    if not 1 <= result <= min(most, INT32_MAX):
        _fail(name, what, value)
    return result


def stop_token_ids(values: Any, name: str, vocab_size: int | None = None,
                   eos_ids: Iterable[int] | None = None) -> tuple[int, ...]:
    """Token ids, each in ``[0, vocab_size)`` (``[0, 2**63)`` while the vocabulary is not
    known), at most 24 distinct ones besides the checkpoint's ``eos_ids`` (counted once
    those are known); None is none. Repeats are dropped first, as vLLM does."""
    if values is None:
        return ()
    # (vLLM's rule: any iterable, repeats dropped, then each must be an integer; so "" is
    # no stop ids, and "17" is refused for its characters)
    if not isinstance(values, Iterable):
        raise ParameterTypeError(f"{name} must be a list of token ids, got {values!r:.80}",
                                 name)
    distinct = _distinct_ids(values, name, vocab_size)
    if eos_ids is not None:
        eos = set(eos_ids)
        counted = [t for t in distinct if t not in eos]
        if len(counted) > MAX_STOP_TOKEN_IDS:
            raise ParameterError(f"{name} may hold at most {MAX_STOP_TOKEN_IDS} distinct token "
                                 f"ids besides the checkpoint's eos ids, got {len(counted)}",
                                 name)
    return distinct


def _distinct_ids(values: Iterable, name: str, vocab_size: int | None) -> tuple[int, ...]:
    """``values`` (an iterable) without repeats, each an integer id in ``[0, vocab_size)``
    (``[0, 2**63)`` while the vocabulary is not known), in their first order."""
    try:
        distinct = list(dict.fromkeys(values))
    except TypeError:  # an unhashable element: not a token id
        raise ParameterTypeError(f"{name} must be a list of token ids, got {values!r:.80}",
                                 name) from None
    bad = [t for t in distinct if not is_integer(t)]
    if bad:
        raise ParameterTypeError(f"{name} must be a list of integer token ids, got "
                                 f"{bad[0]!r:.80} in it", name)
    end = INT64_MAX + 1 if vocab_size is None else vocab_size
    outside = [int(t) for t in distinct if not 0 <= t < end]
    if outside:
        bound = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
        raise ParameterError(f"{name} has token ids outside {bound}: {outside[:5]}", name)
    return tuple(int(t) for t in distinct)


# The groups of wedlm_kernels.process_logits a request can turn on.
LOGIT_RULES = ("penalties", "min_p", "min_tokens", "bias", "allowed")


def logit_rules_used(values: Any) -> dict[str, bool]:
    """Which of :data:`LOGIT_RULES` a request's stored values turn on (duck-typed: any
    object with the fields ``presence_penalty``, ``frequency_penalty``,
    ``repetition_penalty``, ``min_p``, ``min_tokens``, ``logit_bias`` and
    ``allowed_token_ids`` as this module stores them). A rule no request of a step uses is
    not run: the front ends pass ``None`` for its group."""
    return {
        "penalties": (values.presence_penalty, values.frequency_penalty,
                      values.repetition_penalty) != (0.0, 0.0, 1.0),
        "min_p": values.min_p > 0,
        "min_tokens": values.min_tokens > 0,
        "bias": bool(values.logit_bias),
        "allowed": values.allowed_token_ids is not None,
    }


def penalties(presence: Any, frequency: Any, repetition: Any, names: tuple[str, str, str]
              ) -> tuple[float, float, float]:
    """``(presence_penalty, frequency_penalty, repetition_penalty)`` as stored: the first two
    from -2 to 2 (vLLM's bounds), the third a finite number > 0. ``names`` name the three.
    (docs/contracts.md, "process_logits": the tokens they count are the committed ones.)"""
    stored = []
    for value, name in ((presence, names[0]), (frequency, names[1])):
        what = f"a number from {-MAX_ADDITIVE_PENALTY:g} to {MAX_ADDITIVE_PENALTY:g}"
        result = _number(value, name, what)
        if not -MAX_ADDITIVE_PENALTY <= result <= MAX_ADDITIVE_PENALTY:
            _fail(name, what, value)
        stored.append(result + 0.0)
    what = "a finite number > 0 (1: off)"
    result = _number(repetition, names[2], what)
    if not 0 < result <= FLOAT32_MAX or _float32(result) <= 0:
        _fail(names[2], what, repetition)
    return stored[0], stored[1], result


def min_p(value: Any, name: str, temperature: float) -> float:
    """min_p as stored: a number from 0 to 1; a greedy request (``temperature`` 0, as
    :func:`sampling` stores it) stores 0, as vLLM sets it, once the range check passed
    (there ``True`` counts as 1)."""
    what = "a number from 0 to 1 (0: off)"
    # vLLM's order, as for top_k and top_p: the range check (a bool passes it as 0 or 1),
    # then a greedy request's min_p is set to off, then the type
    if temperature == 0 and isinstance(value, numbers.Real) and 0 <= value <= 1:
        return 0.0
    result = _number(value, name, what)
    if not 0 <= result <= 1:
        _fail(name, what, value)
    return result + 0.0


def min_tokens(value: Any, name: str, max_tokens_value: int | None) -> int:
    """min_tokens: an integer from 0 to ``max_tokens`` (as :func:`max_tokens` stores it;
    None: the int32 bound)."""
    most = INT32_MAX if max_tokens_value is None else max_tokens_value
    what = f"an integer from 0 to {'2**31 - 1' if most == INT32_MAX else most} (max_tokens)"
    result = _integer(value, name, what)
    if not 0 <= result <= most:
        _fail(name, what, value)
    return result


def logit_bias(value: Any, name: str, vocab_size: int | None = None
               ) -> tuple[tuple[int, float], ...]:
    """logit_bias as stored: ``((token id, bias), ...)`` in increasing id order, each id in
    ``[0, vocab_size)`` (``[0, 2**63)`` while the vocabulary is not known), each bias a
    finite number that float32 holds; at most :data:`MAX_LOGIT_BIAS` entries; None and an
    empty mapping are no bias."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ParameterTypeError(f"{name} must be a mapping of token ids to numbers, got "
                                 f"{value!r:.80}", name)
    if len(value) > MAX_LOGIT_BIAS:
        raise ParameterError(f"{name} may hold at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(value)}", name)
    end = INT64_MAX + 1 if vocab_size is None else vocab_size
    entries = []
    for token, bias in value.items():
        if not is_integer(token):
            raise ParameterTypeError(f"{name} must map integer token ids to numbers, got the "
                                     f"key {token!r:.80}", name)
        if not 0 <= token < end:
            bound = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
            raise ParameterError(f"{name} has token id {int(token)} outside {bound}", name)
        what = (f"a finite number from {-FLOAT32_MAX:.8g} to {FLOAT32_MAX:.8g} (the bias of "
                f"token {int(token)})")
        number = _number(bias, name, what)
        if not -FLOAT32_MAX <= number <= FLOAT32_MAX:
            _fail(name, what, bias)
        entries.append((int(token), number + 0.0))
    if len({token for token, _ in entries}) != len(entries):  # 1 and 1.0-like numpy keys
        raise ParameterError(f"{name} names a token id twice", name)
    return tuple(sorted(entries))


def allowed_token_ids(values: Any, name: str, vocab_size: int | None = None
                      ) -> tuple[int, ...] | None:
    """allowed_token_ids as stored: None (every token) or the distinct ids, each in
    ``[0, vocab_size)``, at least one (vLLM refuses an empty list)."""
    if values is None:
        return None
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ParameterTypeError(f"{name} must be a list of token ids, got {values!r:.80}",
                                 name)
    distinct = _distinct_ids(values, name, vocab_size)
    if not distinct:
        raise ParameterError(f"{name} must hold at least one token id (None: every token)",
                             name)
    return distinct


def n(value: Any, name: str) -> int:
    """Sequences per request: an integer >= 1 (vLLM fans them out as requests of their own)."""
    what = "an integer >= 1"
    result = _integer(value, name, what)
    if result < 1:
        _fail(name, what, value)
    return result


# bad_words after tokenization (vLLM tokenizes each word with and without a leading
# space): at most vLLM's 128 words (VLLM_MAX_NUM_BAD_WORDS) and 1024 tokens in all
# (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS), each word at most 16 tokens (a window slot's ban
# compares rows x words x L x L tokens; wedlm_kernels.requests.bad_words).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 16
MAX_BAD_WORDS_TOTAL_TOKENS = 1024


def bad_words_token_ids(values: Any, name: str, vocab_size: int | None = None
                        ) -> tuple[tuple[int, ...], ...] | None:
    """Bad words as token id lists (vLLM's ``bad_words`` after its tokenization): None (or
    no word) or at most 128 non-empty words of at most 16 ids each, 1024 ids in all, each
    id in ``[0, vocab_size)``; repeated words are kept once."""
    if values is None:
        return None
    what = "a list of words, each a non-empty list of token ids"
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ParameterTypeError(f"{name} must be {what}, got {values!r:.80}", name)
    words: list[tuple[int, ...]] = []
    for word in values:
        if isinstance(word, (str, bytes, dict)) or not isinstance(word, Iterable):
            raise ParameterTypeError(f"{name} must be {what}, got {word!r:.80} in it", name)
        word = list(word)
        if not word:
            raise ParameterError(f"{name} must be {what}: a word is empty", name)
        if len(word) > MAX_BAD_WORD_TOKENS:
            raise ParameterError(f"{name}: a word has {len(word)} tokens, more than "
                                 f"{MAX_BAD_WORD_TOKENS}", name)
        bad = [t for t in word if not is_integer(t)]
        if bad:
            raise ParameterTypeError(f"{name} must be {what}, got {bad[0]!r:.80} in a word",
                                     name)
        end = INT64_MAX + 1 if vocab_size is None else vocab_size
        outside = [int(t) for t in word if not 0 <= t < end]
        if outside:
            bound = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
            raise ParameterError(f"{name} has token ids outside {bound}: {outside[:5]}", name)
        word = tuple(int(t) for t in word)
        if word not in words:
            words.append(word)
    if len(words) > MAX_BAD_WORDS:
        raise ParameterError(f"{name} has {len(words)} words, more than {MAX_BAD_WORDS}",
                             name)
    total = sum(map(len, words))
    if total > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise ParameterError(f"{name} has {total} tokens in all, more than "
                             f"{MAX_BAD_WORDS_TOTAL_TOKENS}", name)
    return tuple(words) or None


# The most alternatives a request's logprobs may ask for (wedlm_kernels.requests.logprobs keeps a
# record of 1 + this many columns per window slot until the slot commits).
MAX_LOGPROBS = 64


def logprobs(value: Any, name: str, vocab_size: int | None = None) -> int | None:
    """The alternatives a request's logprobs return per token: None (no logprobs) or an
    integer from 0 (the chosen token's only) to 64 and the vocabulary size. vLLM's ``-1``
    (the whole vocabulary) is refused unless the vocabulary has at most 64 tokens (without
    ``vocab_size`` it is returned as -1, to be checked once the vocabulary is known);
    ``True`` is 1, as vLLM reads it."""
    if value is None:
        return None
    if value is True:  # vLLM's SamplingParams reads True as 1
        return 1
    most = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
    what = f"None or an integer from 0 to {most}"
    result = _integer(value, name, what)
    if result == -1:  # vLLM's "the whole vocabulary"
        if vocab_size is None:
            return -1  # mapped when the vocabulary is known
        if vocab_size <= MAX_LOGPROBS:
            return vocab_size
        _fail(name, what + f" (-1, the whole vocabulary, is more than the {MAX_LOGPROBS} "
              "alternatives a window slot keeps)", value)
    if not 0 <= result <= most:
        _fail(name, what, value)
    return result


# The most token ids a request's logprob_token_ids may name (vLLM's MAX_LOGPROB_TOKEN_IDS;
# wedlm_kernels.requests.logprobs keeps their columns in a slot's record instead of the top-K).
MAX_LOGPROB_TOKEN_IDS = 128


def logprob_token_ids(values: Any, name: str, vocab_size: int | None = None,
                      logprobs: Any = None) -> tuple[int, ...] | None:
    """The token ids whose log-probabilities a request's logprobs list per token, beside
    the committed token's (vLLM's ``SamplingParams.logprob_token_ids``, in place of the
    top-K): None, or 1 to :data:`MAX_LOGPROB_TOKEN_IDS` integer ids, in their order,
    repeats kept (vLLM keeps them).

    Parameters
    ----------
    values : Any
        None or an iterable of integer token ids (Python's or numpy's; a bool is not an
        id). An empty one means None.
    name : str
        The field's name as the caller gave it, for the error.
    vocab_size : int or None
        Every id must be in ``[0, vocab_size)``; ``[0, 2**63)`` while the vocabulary is not
        known.
    logprobs : Any
        The request's ``logprobs`` as the caller gave it (None: not set). When set it must
        equal the number of ids, the empty list's 0 included (vLLM's
        ``SamplingParams._validate_logprobs``).

    Returns
    -------
    tuple of int or None
        The ids as given, or None for None and an empty list. A request's ``num_logprobs``
        (the alternatives listed per token) is then their count.

    Raises
    ------
    ParameterTypeError
        ``values`` is not a list of integers.
    ParameterError
        More than 128 ids, an id outside the vocabulary, or ``logprobs`` that is not their
        count. The message starts with ``name`` and ``parameter`` is ``name``.

    Examples
    --------
    >>> logprob_token_ids([5, 3, 5], "logprob_token_ids", 10)
    (5, 3, 5)
    >>> logprob_token_ids([], "logprob_token_ids") is None
    True
    """
    if values is None:
        return None
    what = "None or a list of integer token ids"
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ParameterTypeError(f"{name} must be {what}, got {values!r:.80}", name)
    ids = list(values)
    bad = [t for t in ids if not is_integer(t)]
    if bad:
        raise ParameterTypeError(f"{name} must be {what}, got {bad[0]!r:.80} in it", name)
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise ParameterError(f"{name} may hold at most {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                             f"{len(ids)}", name)
    end = INT64_MAX + 1 if vocab_size is None else vocab_size
    outside = [int(t) for t in ids if not 0 <= t < end]
    if outside:
        bound = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
        raise ParameterError(f"{name} has token ids outside {bound}: {outside[:5]}", name)
    if logprobs is not None and (not is_integer(logprobs) and logprobs is not True
                                 or logprobs != len(ids)):
        raise ParameterError(f"{name}: when logprobs is set beside it, logprobs must equal "
                             f"its length {len(ids)}, got logprobs={logprobs!r:.80}", name)
    return tuple(int(t) for t in ids) or None


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over ``vocab_size`` tokens (32 tokens a word)."""
    return -(-vocab_size // 32)


def allowed_bitmask(token_ids: Iterable[int], vocab_size: int) -> list[int]:
    """allowed_token_ids as they are stored: the bitmask words (int32 values) with bit
    ``v % 32`` of word ``v // 32`` set iff ``v`` is allowed (xgrammar's layout, the one
    ``wedlm_kernels.process_logits`` reads); ids outside ``[0, vocab_size)`` are ignored.

    >>> allowed_bitmask([0, 2, 33, 63], 64)
    [5, -2147483646]
    """
    words = [0] * bitmask_words(vocab_size)
    for token in token_ids:
        if 0 <= token < vocab_size:
            words[token // 32] |= 1 << (token % 32)
    return [word - (1 << 32) if word >= 1 << 31 else word for word in words]
