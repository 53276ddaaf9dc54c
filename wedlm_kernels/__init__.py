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
block tables) and :func:`mask_rows` (the rows of a packed step that ``select_tokens`` reads).

Each is a ``torch.library`` custom op in namespace ``wedlm`` (``torch.ops.wedlm.<op>``).
:mod:`wedlm_kernels.request_params` defines a decoding request's parameters once (types,
bounds, meanings) for the front ends above the ops (``model_min``, the vLLM plugin),
:mod:`wedlm_kernels.grammar` how a grammar (structured outputs) constrains a window,
:mod:`wedlm_kernels.logprobs` which distribution a committed token's logprobs come from,
:mod:`wedlm_kernels.bad_words` how a window never writes a bad word,
:mod:`wedlm_kernels.output_ids` which ids no request outputs (the mask id, the ids the
tokenizer cannot decode), and :mod:`wedlm_kernels.model_config` what a checkpoint's
``config.json`` means for the math.
The backend is chosen once at import by ``WEDLM_KERNELS_BACKEND`` (see ``_backend``).
"""

import sys
import types

from . import _backend, _library  # noqa: F401  (_library registers torch.ops.wedlm.*)
from ._backend import BACKEND
from .batch import WindowState, mask_rows, new_window_state, paged_slots, prefill_slots
from .ops.attention import paged_attention
from .ops.commit import commit_window
from .ops.logits import process_logits
from .ops.reorder import reorder_window
from .ops.rope import YarnScaling, rope_cache, rope_kv_append
from .ops.select import select_tokens
from .ops.silu_mul import silu_mul

__version__ = "0.10.0"

__all__ = [
    "BACKEND",
    "YarnScaling",
    "DEBUG",
    "WindowState",
    "commit_window",
    "mask_rows",
    "new_window_state",
    "paged_slots",
    "prefill_slots",
    "paged_attention",
    "process_logits",
    "reorder_window",
    "rope_cache",
    "rope_kv_append",
    "select_tokens",
    "silu_mul",
]


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
