"""WeDLM's decoding settings in vLLM: per engine, per request, and the request check.

Per engine (``LLM(..., additional_config={"wedlm": {...}})``, CLI ``--additional-config
'{"wedlm": {...}}'``), with the reference engine's defaults::

    window            16     W: live mask slots per request (the canvas is 2W rows)
    entropy_threshold 0.4    nats; null or <= 0: one token per step
    distance_penalty  0.02   per slot of distance from the leftmost mask
    mode              "streaming" or "blockwise"
    canvas            "live"   the rows each decode step schedules a request: "live", the
                             W + p' its window needs (sized from the previous step's
                             output; vLLM's asynchronous scheduling falls back to "fixed"),
                             or "fixed", the window's capacity 2W (docs/vllm.md, "Rows fed")
    window_policy     "fixed"  how a streaming window is sized step by step: "fixed" (W
                             masks) or "adaptive" (1 .. W, from what the request commits;
                             wedlm_kernels.window_policy, docs/algorithm.md)
    min_window        null     the adaptive window's floor, 1 .. W; null: derived from the
                             device's row budget and max_num_seqs (AdaptiveWindow.for_device)

Per request (``SamplingParams(extra_args={...})``; the OpenAI server's ``vllm_xargs``):
``wedlm_window`` (1 .. the engine's window), ``wedlm_entropy_threshold``,
``wedlm_distance_penalty``, ``wedlm_mode``, ``wedlm_window_policy`` (null: the engine's).
Every value, these and vLLM's own sampling fields, is checked by
:mod:`wedlm_kernels.requests.params`, the definition model_min's ``SamplingParams`` uses too.
This module imports no vLLM.
"""

import copy
from dataclasses import dataclass
from typing import Any

from wedlm_kernels.requests import params as rp
from wedlm_kernels.requests.params import ParameterError

MODES = rp.MODES
REQUEST_KEYS = {
    "wedlm_window": "window",
    "wedlm_entropy_threshold": "entropy_threshold",
    "wedlm_distance_penalty": "distance_penalty",
    "wedlm_mode": "mode",
    "wedlm_window_policy": "window_policy",
}
CANVASES = ("live", "fixed")  # engine only: a request cannot choose its rows (nor min_window)
SettingsError = ParameterError  # a bad setting or request value; ``parameter`` names it


@dataclass(frozen=True)
class WeDLMSettings:
    """A request's (or the engine's) WeDLM settings, as stored: ``entropy_threshold`` is the
    threshold ``select_tokens`` takes (-inf: one token per step)."""

    window: int = 16
    entropy_threshold: float = 0.4
    distance_penalty: float = 0.02
    mode: str = "streaming"
    canvas: str = "live"
    window_policy: str = "fixed"
    min_window: int | None = None

    @property
    def canvas_length(self) -> int:
        """Query rows per request per decode step: the window slot capacity 2W."""
        return 2 * self.window


def _checked(values: dict[str, Any], names: dict[str, str], most_window: int | None,
             engine_policy: str = "fixed") -> WeDLMSettings:
    """The settings ``values`` (field -> value) as stored; ``names`` maps a field to the name
    the user gave it (for the error); a window policy of None is ``engine_policy``."""
    window = rp.window(values["window"], names["window"], most_window)
    min_window = values["min_window"]  # (an engine setting, checked with the engine's)
    if min_window is not None and most_window is None:
        min_window = rp.window(min_window, names["min_window"], window)
    return WeDLMSettings(
        window=window,
        entropy_threshold=rp.entropy_threshold(values["entropy_threshold"],
                                               names["entropy_threshold"]),
        distance_penalty=rp.distance_penalty(values["distance_penalty"],
                                             names["distance_penalty"]),
        mode=rp.mode(values["mode"], names["mode"]),
        canvas=_canvas(values["canvas"], names.get("canvas", "canvas")),
        window_policy=rp.window_policy(values["window_policy"], names["window_policy"])
        or engine_policy,
        min_window=min_window,
    )


def _canvas(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in CANVASES:
        raise SettingsError(f"{name} must be one of {list(CANVASES)}, got {value!r:.80}", name)
    return value


def engine_settings(additional_config: Any) -> WeDLMSettings:
    """The engine's settings from vLLM's ``additional_config`` (its ``"wedlm"`` entry)."""
    section = (additional_config or {}).get("wedlm", {}) if isinstance(
        additional_config, dict) else {}
    if not isinstance(section, dict):
        raise SettingsError(f'additional_config["wedlm"] must be an object, got {section!r}',
                            "additional_config")
    defaults = WeDLMSettings().__dict__
    unknown = sorted(set(section) - set(defaults))
    if unknown:
        raise SettingsError(f'additional_config["wedlm"] has unknown keys {unknown}; known: '
                            f"{sorted(defaults)}", "additional_config")
    names = {name: f'additional_config["wedlm"]["{name}"]' for name in defaults}
    return _checked({**defaults, **section}, names, None)


def request_settings(engine: WeDLMSettings, extra_args: dict | None) -> WeDLMSettings:
    """A request's settings: the engine's, overridden by its ``wedlm_*`` extra_args."""
    extra = extra_args or {}
    values = {**engine.__dict__, **{field: extra[key] for key, field in REQUEST_KEYS.items()
                                    if key in extra}}
    names = {field: f"extra_args[{key!r}]" for key, field in REQUEST_KEYS.items()}
    return _checked(values, names, engine.window, engine.window_policy)


@dataclass(frozen=True)
class RequestValues:
    """What a request stores on the device, each value within its buffer's bounds
    (:mod:`wedlm_kernels.requests.params`); ``seed`` None: draw one, ``max_tokens`` None:
    up to ``max_model_len``."""

    settings: WeDLMSettings
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    max_tokens: int | None
    # the logit rules (wedlm_kernels.process_logits)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None


def request_values(engine: WeDLMSettings, params: Any, max_model_len: int | None = None
                   ) -> RequestValues:
    """The stored values of a vLLM ``SamplingParams`` (duck-typed). Raises
    :class:`ParameterError` naming the parameter; for a request :func:`check_request` has
    passed, it cannot raise (the worker reads a request this way). With ``max_model_len``,
    ``max_tokens`` is at most ``2**31 - 1 - max_model_len`` (:func:`check_request`)."""
    temperature, top_k, top_p = rp.sampling(params.temperature, params.top_k, params.top_p,
                                            ("temperature", "top_k", "top_p"))
    most_tokens = rp.INT32_MAX if max_model_len is None else rp.INT32_MAX - max_model_len
    max_tokens = rp.max_tokens(params.max_tokens, "max_tokens", most_tokens)
    presence, frequency, repetition = rp.penalties(
        getattr(params, "presence_penalty", 0.0), getattr(params, "frequency_penalty", 0.0),
        getattr(params, "repetition_penalty", 1.0),
        ("presence_penalty", "frequency_penalty", "repetition_penalty"))
    return RequestValues(
        settings=request_settings(engine, params.extra_args),
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=rp.seed(params.seed, "seed"),
        max_tokens=max_tokens,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        min_p=rp.min_p(getattr(params, "min_p", 0.0), "min_p", temperature),
        min_tokens=rp.min_tokens(getattr(params, "min_tokens", 0), "min_tokens", max_tokens),
        logit_bias=rp.logit_bias(getattr(params, "logit_bias", None), "logit_bias"),
        allowed_token_ids=rp.allowed_token_ids(getattr(params, "allowed_token_ids", None),
                                               "allowed_token_ids"),
    )


def check_request(engine: WeDLMSettings, params: Any, vocab_size: int | None,
                  max_model_len: int | None = None, eos_ids: tuple[int, ...] = ()) -> None:
    """The frontend's check of a request, before it is admitted: every value it carries
    fits the buffer that holds it. Raises :class:`ParameterError` naming the parameter.

    With ``max_model_len``, ``max_tokens`` is also bounded by ``2**31 - 1 - max_model_len``:
    vLLM's Model Runner V2 stores ``prompt_len + max_tokens`` in an int32 buffer
    (``RequestState.max_seq_len``), and a request past it stops the engine. ``eos_ids``:
    the checkpoint's (:func:`checkpoint_eos_ids`), which the stop id count leaves out."""
    values = request_values(engine, params, max_model_len)
    rp.stop_token_ids(params.stop_token_ids, "stop_token_ids", vocab_size, eos_ids)
    rp.logit_bias(getattr(params, "logit_bias", None), "logit_bias", vocab_size)
    rp.allowed_token_ids(getattr(params, "allowed_token_ids", None), "allowed_token_ids",
                         vocab_size)
    rp.logprobs(getattr(params, "logprobs", None), "logprobs", vocab_size)
    rp.logprob_token_ids(getattr(params, "logprob_token_ids", None), "logprob_token_ids",
                         vocab_size, getattr(params, "logprobs", None))
    children, seed = rp.n(getattr(params, "n", 1), "n"), values.seed
    # vLLM gives child i of an n > 1 request the seed seed + i (parallel_sampling.py),
    # after this check: each must be an int64 too
    if seed is not None and children > 1 and seed + children - 1 > rp.INT64_MAX:
        raise ParameterError(f"seed must leave room for the seeds vLLM gives the n = "
                             f"{children} sequences (seed + n - 1 <= 2**63 - 1), got {seed}",
                             "seed")
    # ... and none of them -1, which vLLM reads as "no seed" (that child would not repeat)
    if seed is not None and children > 1 and seed < -1 <= seed + children - 1:
        raise ParameterError(f"seed must not give one of the n = {children} sequences the "
                             f"seed -1 (vLLM seeds child i with seed + i, and -1 is no "
                             f"seed), got {seed}", "seed")


def bad_words_token_ids(params: Any, tokenizer: Any, vocab_size: int | None
                        ) -> tuple[tuple[int, ...], ...] | None:
    """The request's ``bad_words`` as vLLM will tokenize them (each word with and without a
    leading space, ``SamplingParams.update_from_tokenizer``, run on a copy), checked by
    :func:`wedlm_kernels.requests.params.bad_words_token_ids`. Raises
    :class:`ParameterError` (or vLLM's own validation error) naming ``bad_words``."""
    words = getattr(params, "bad_words", None)
    if not words:
        return None
    if isinstance(words, (str, bytes)) or not all(isinstance(w, str) for w in words):
        raise rp.ParameterTypeError(f"bad_words must be a list of strings, got {words!r:.80}",
                                    "bad_words")
    if tokenizer is None:
        raise ParameterError("bad_words needs the engine's tokenizer to find the words' "
                             "tokens (the engine runs without one)", "bad_words")
    probe = copy.copy(params)
    probe.update_from_tokenizer(tokenizer)
    return rp.bad_words_token_ids(probe.bad_words_token_ids, "bad_words", vocab_size)


def checkpoint_eos_ids(hf_eos: Any, generation_eos: Any) -> tuple[int, ...]:
    """The checkpoint's eos ids as model_min reads them: config.json's ``eos_token_id``
    (one id, a list, or None), then generation_config.json's, without repeats."""
    ids: list[int] = []
    for source in (hf_eos, generation_eos):
        for token in [] if source is None else [source] if isinstance(source, int) else source:
            if not (isinstance(token, int) and 0 <= token <= rp.INT64_MAX):
                raise ValueError(f"the checkpoint's eos_token_id must be token ids, got "
                                 f"{source!r:.80}")
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def unsupported_parameters(params: Any) -> list[tuple[str, str]]:
    """``(parameter, why)`` for every field of a vLLM ``SamplingParams`` that WeDLM decoding
    does not serve (duck-typed: this module imports no vLLM)."""
    found = []

    def check(name: str, refused: bool, why: str) -> None:
        if refused:
            found.append((name, why))

    check("prompt_logprobs", getattr(params, "prompt_logprobs", None) is not None,
          "no prompt logprobs: a WeDLM checkpoint's logits at prompt positions do not "
          "predict the next token (docs/vllm.md)")
    # (vLLM has made a numpy array of prompt_logprob_token_ids by now: not a truth value)
    check("prompt_logprob_token_ids",
          getattr(params, "prompt_logprob_token_ids", None) is not None,
          "no prompt logprobs (docs/vllm.md)")
    check("bad_words", bool(getattr(params, "bad_words", None))
          and getattr(params, "structured_outputs", None) is not None,
          "cannot be combined with structured outputs (a grammar may force a token a bad "
          "word bans; docs/vllm.md)")
    extra = getattr(params, "extra_args", None) or {}
    for key in sorted(extra):
        if key.startswith("diffusion_"):
            found.append((f"extra_args[{key!r}]", "a DiffusionGemma setting; WeDLM's are "
                          f"{sorted(REQUEST_KEYS)}"))
        elif key.startswith("wedlm_") and key not in REQUEST_KEYS:
            found.append((f"extra_args[{key!r}]", f"unknown; WeDLM's are "
                          f"{sorted(REQUEST_KEYS)}"))
    return found


def stop_ids_of(params: Any) -> list[int]:
    """The token ids that end a request on the device: its eos (unless ``ignore_eos``) and
    its ``stop_token_ids``, the ids vLLM's host stops on."""
    ids = []
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        ids.append(int(eos))
    ids += [int(t) for t in (getattr(params, "stop_token_ids", None) or ()) if int(t) not in ids]
    return ids
