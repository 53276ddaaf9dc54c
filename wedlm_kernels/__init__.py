"""wedlm_kernels: fused kernels for WeDLM (causal-attention diffusion LM) decoding.

Public ops (exact semantics in docs/contracts.md):

- :func:`reorder_window`: topological reordering of the decode window (ids, logical RoPE
  positions, physical cache slots).
- :func:`rope_cache` (plain or :class:`YarnScaling` RoPE), :func:`rope_kv_append`: per-head
  RMSNorm + RoPE at logical positions + K/V append into a paged cache.
- :func:`paged_attention`: causal (bottom-right aligned) attention over a paged cache, GQA.
- :func:`process_logits`: a request's logit rules (bans, bias, penalties, min_p, a grammar's
  bitmask) on a step's window rows, before the selection.
- :func:`select_tokens`: entropy, distance penalty, threshold selection and sampling.
- :func:`commit_window`: commit, stop/length rules, window shift, fill and refill.
- :func:`silu_mul`: ``silu(gate) * up`` read from a fused gate/up projection (the MLP).

Helpers for what an engine builds around the ops (:mod:`wedlm_kernels.batch`, plain
PyTorch): :func:`new_window_state` (a batch's :class:`WindowState`), :func:`prefill_slots`
(packed prefill rows' positions and cache slots), :func:`paged_slots` (cache slots through
block tables) and :func:`mask_rows` (the rows of a packed step that ``select_tokens`` reads);
and the adaptive streaming window (:mod:`wedlm_kernels.window_policy`: :class:`AdaptiveWindow`,
:func:`new_policy_state`, :func:`window_masks`, :func:`next_window_lengths`,
:func:`resize_windows`).

Each is a ``torch.library`` custom op in namespace ``wedlm`` (``torch.ops.wedlm.<op>``),
registered in one place (``ops/_library.py``). The package's rooms:

- :mod:`wedlm_kernels.ops`: one module per kernel family, and the ops' plumbing
  (registration, dispatch, argument checks);
- :mod:`wedlm_kernels.requests`: what a decoding request means, shared by the front ends
  above the ops (``model_min``, the vLLM plugin): its parameters (``requests.params``),
  grammars (``requests.grammar``), logprobs (``requests.logprobs``), bad words
  (``requests.bad_words``) and the ids no request outputs (``requests.output_ids``);
- :mod:`wedlm_kernels.checkpoints`: what a checkpoint's ``config.json`` means for the math
  (``checkpoints.config``);
- :mod:`wedlm_kernels.integrations`: engines that serve WeDLM on the ops (vLLM).

The modules' earlier names (``wedlm_kernels.grammar``, ``wedlm_kernels.request_params``,
``wedlm_kernels.model_config``, ...) keep working. The backend is chosen once at import by
``WEDLM_KERNELS_BACKEND`` (see ``_backend``).
"""

import sys
import types

from . import _backend
from ._backend import BACKEND
from .batch import WindowState, mask_rows, new_window_state, paged_slots, prefill_slots
from .ops import _library  # noqa: F401  (registers torch.ops.wedlm.*)
from .ops.attention import paged_attention
from .ops.commit import commit_window
from .ops.logits import process_logits
from .ops.reorder import reorder_window
from .ops.rope import YarnScaling, rope_cache, rope_kv_append
from .ops.select import select_tokens
from .ops.silu_mul import silu_mul
from .window_policy import (
    AdaptiveWindow,
    WindowPolicyState,
    new_policy_state,
    next_window_lengths,
    resize_windows,
    window_masks,
)

__version__ = "0.10.0"

__all__ = [
    "AdaptiveWindow",
    "BACKEND",
    "YarnScaling",
    "DEBUG",
    "WindowPolicyState",
    "WindowState",
    "commit_window",
    "mask_rows",
    "new_policy_state",
    "new_window_state",
    "next_window_lengths",
    "paged_slots",
    "prefill_slots",
    "paged_attention",
    "process_logits",
    "reorder_window",
    "resize_windows",
    "rope_cache",
    "rope_kv_append",
    "select_tokens",
    "silu_mul",
    "window_masks",
]


# The request and checkpoint modules' earlier names, kept working (the same module objects).
from .checkpoints import config as _checkpoint_config  # noqa: E402
from .requests import bad_words as _bad_words  # noqa: E402
from .requests import grammar as _grammar  # noqa: E402
from .requests import logprobs as _logprobs  # noqa: E402
from .requests import output_ids as _output_ids  # noqa: E402
from .requests import params as _request_params  # noqa: E402

for _old_name, _module in {
    "request_params": _request_params, "grammar": _grammar, "bad_words": _bad_words,
    "logprobs": _logprobs, "output_ids": _output_ids, "model_config": _checkpoint_config,
}.items():
    sys.modules[f"{__name__}.{_old_name}"] = _module


class _Package(types.ModuleType):
    """The package module, with ``DEBUG`` read from and written to the one setting that the
    value checks read at every call (``WEDLM_KERNELS_DEBUG`` at import)."""

    @property
    def DEBUG(self) -> bool:  # noqa: N802 - the module constant's name
        return _backend.DEBUG

    @DEBUG.setter
    def DEBUG(self, value: bool) -> None:  # noqa: N802
        if not isinstance(value, bool):
            raise TypeError(f"wedlm_kernels.DEBUG must be a bool, got {type(value).__name__}")
        _backend.DEBUG = value


sys.modules[__name__].__class__ = _Package
