"""WeDLM's decoding settings in vLLM: per engine, per request, and the request check.

Per engine (``LLM(..., additional_config={"wedlm": {...}})``, CLI ``--additional-config
'{"wedlm": {...}}'``), with the reference engine's defaults::

    window            16     W: live mask slots per request (the canvas is 2W rows)
    entropy_threshold 0.4    nats; null: one token per step
    distance_penalty  0.02   per slot of distance from the leftmost mask
    mode              "streaming" or "blockwise"

Per request (``SamplingParams(extra_args={...})``; the OpenAI server's ``vllm_xargs``):
``wedlm_window`` (1 .. the engine's window), ``wedlm_entropy_threshold``,
``wedlm_distance_penalty``, ``wedlm_mode``. This module imports no vLLM.
"""

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

MODES = ("streaming", "blockwise")
# Stop ids a request carries on the device (eos and stop_token_ids together), and the
# stop_token_ids a request may ask for (vLLM adds the checkpoint's eos ids after the check).
MAX_STOP_IDS = 32
MAX_REQUEST_STOP_IDS = 24
REQUEST_KEYS = {
    "wedlm_window": "window",
    "wedlm_entropy_threshold": "entropy_threshold",
    "wedlm_distance_penalty": "distance_penalty",
    "wedlm_mode": "mode",
}


class SettingsError(ValueError):
    """A WeDLM setting or request parameter that cannot be served; ``parameter`` names it."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


@dataclass(frozen=True)
class WeDLMSettings:
    window: int = 16
    entropy_threshold: float | None = 0.4
    distance_penalty: float = 0.02
    mode: str = "streaming"

    @property
    def canvas_length(self) -> int:
        """Query rows per request per decode step: the window slot capacity 2W."""
        return 2 * self.window

    @property
    def threshold_value(self) -> float:
        """The threshold as ``select_tokens`` takes it (-inf: one token per step)."""
        return -math.inf if self.entropy_threshold is None else float(self.entropy_threshold)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked(settings: WeDLMSettings, names: dict[str, str], most_window: int | None
             ) -> WeDLMSettings:
    """``settings`` if every field is valid; ``names`` maps a field to the name the user
    gave it (for the error)."""
    window = settings.window
    if not _is_int(window) or window < 1 or (most_window is not None and window > most_window):
        bound = f" and at most the engine's window {most_window}" if most_window else ""
        raise SettingsError(f"{names['window']} must be an integer >= 1{bound}, got "
                            f"{window!r}", names["window"])
    threshold = settings.entropy_threshold
    if threshold is not None and (not _is_number(threshold) or math.isnan(threshold)):
        raise SettingsError(f"{names['entropy_threshold']} must be a number in nats or null "
                            f"(one token per step), got {threshold!r}",
                            names["entropy_threshold"])
    penalty = settings.distance_penalty
    if not _is_number(penalty) or not math.isfinite(penalty):
        raise SettingsError(f"{names['distance_penalty']} must be a finite number, got "
                            f"{penalty!r}", names["distance_penalty"])
    if settings.mode not in MODES:
        raise SettingsError(f"{names['mode']} must be one of {MODES}, got {settings.mode!r}",
                            names["mode"])
    return replace(settings, window=int(window), distance_penalty=float(penalty),
                   entropy_threshold=None if threshold is None else float(threshold))


def engine_settings(additional_config: Any) -> WeDLMSettings:
    """The engine's settings from vLLM's ``additional_config`` (its ``"wedlm"`` entry)."""
    section = (additional_config or {}).get("wedlm", {}) if isinstance(
        additional_config, dict) else {}
    if not isinstance(section, dict):
        raise SettingsError(f'additional_config["wedlm"] must be an object, got {section!r}',
                            "additional_config")
    fields = {"window", "entropy_threshold", "distance_penalty", "mode"}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise SettingsError(f'additional_config["wedlm"] has unknown keys {unknown}; known: '
                            f"{sorted(fields)}", "additional_config")
    names = {name: f'additional_config["wedlm"]["{name}"]' for name in fields}
    return _checked(WeDLMSettings(**section), names, None)


def request_settings(engine: WeDLMSettings, extra_args: dict | None) -> WeDLMSettings:
    """A request's settings: the engine's, overridden by its ``wedlm_*`` extra_args."""
    extra = extra_args or {}
    overrides = {field: extra[key] for key, field in REQUEST_KEYS.items() if key in extra}
    names = {field: f"extra_args[{key!r}]" for key, field in REQUEST_KEYS.items()}
    return _checked(replace(engine, **overrides), names, engine.window)


def unsupported_parameters(params: Any) -> list[tuple[str, str]]:
    """``(parameter, why)`` for every field of a vLLM ``SamplingParams`` that WeDLM decoding
    does not serve (duck-typed: this module imports no vLLM)."""
    found = []

    def check(name: str, refused: bool, why: str) -> None:
        if refused:
            found.append((name, why))

    check("n", getattr(params, "n", 1) != 1, "one sequence per request (n=1)")
    check("logprobs", getattr(params, "logprobs", None) is not None,
          "no logprobs (tokens are committed from a window, not sampled one by one)")
    check("prompt_logprobs", getattr(params, "prompt_logprobs", None) is not None,
          "no prompt logprobs (prefill computes no logits)")
    check("logprob_token_ids", bool(getattr(params, "logprob_token_ids", None)),
          "no logprobs of chosen tokens")
    check("prompt_logprob_token_ids", bool(getattr(params, "prompt_logprob_token_ids", None)),
          "no prompt logprobs (prefill computes no logits)")
    check("presence_penalty", getattr(params, "presence_penalty", 0.0) != 0.0, "no penalties")
    check("frequency_penalty", getattr(params, "frequency_penalty", 0.0) != 0.0,
          "no penalties")
    check("repetition_penalty", getattr(params, "repetition_penalty", 1.0) != 1.0,
          "no penalties")
    check("min_p", getattr(params, "min_p", 0.0) > 0.0, "no min_p (top_k and top_p are served)")
    check("min_tokens", getattr(params, "min_tokens", 0) > 0, "no min_tokens")
    check("logit_bias", bool(getattr(params, "logit_bias", None)), "no logit_bias")
    check("bad_words", bool(getattr(params, "bad_words", None)), "no bad_words")
    check("allowed_token_ids", bool(getattr(params, "allowed_token_ids", None)),
          "no allowed_token_ids")
    check("structured_outputs", getattr(params, "structured_outputs", None) is not None,
          "no structured outputs")
    check("logits_processors", bool(getattr(params, "logits_processors", None)),
          "no logits processors")
    stop_token_ids = set(getattr(params, "stop_token_ids", None) or ())
    check("stop_token_ids", len(stop_token_ids) > MAX_REQUEST_STOP_IDS,
          f"at most {MAX_REQUEST_STOP_IDS} stop token ids, got {len(stop_token_ids)}")
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
