"""Structured outputs for WeDLM on vLLM: vLLM's structured-output manager and grammar
backend (xgrammar by default) decide, :mod:`wedlm_kernels.grammar`'s window rule applies
(docs/vllm.md, "Structured outputs").

Where each piece runs:

- worker, after a step: ``next_canvas`` (through the live canvas patch of
  ``take_draft_token_ids``) reports each structured request's window as its draft list:
  a filled slot's token, ``-1`` for a mask, one entry per row its next canvas takes;
- scheduler, before the next step's sampling (:class:`StructuredWindows`, mixed into the
  plugin's schedulers): keeps that report instead of vLLM's draft validation (which would
  cut the list at the first ``-1``, leaving the request no rows), and builds the step's
  ``GrammarOutput`` itself: per request one mask row per scheduled row, the window's slots
  in logical order, walked by :func:`wedlm_kernels.grammar.plan_window` from the grammar
  vLLM advanced with the committed tokens, then one row per request whose first word
  carries its decided slots and a 20-bit key of the window walked (:func:`pack_decided`);
- worker, at sampling: vLLM's ``StructuredOutputsWorker.apply_grammar_bitmask`` (which
  would apply row ``i`` to a request's ``i``-th logit row, while WeDLM's canvas puts the
  filled slots' rows first) hands the rows to the WeDLM state instead (:func:`install`),
  whose sampler maps them to mask slots. A request whose fed window is not the one walked
  (its key differs: a report that did not arrive before the step under asynchronous
  scheduling, a resumed window) commits nothing that step and is walked again after it.

vLLM then accepts the committed tokens into the grammar as for any request. Written for
the vLLM releases of :data:`live_canvas.PATCHED_VERSIONS`.
"""

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.core.sched.diffusion_scheduler import diffusion_canvas_width

from wedlm_kernels.grammar import plan_window

KEY_BITS = 20


def window_key(window: Sequence[int]) -> int:
    """A 20-bit key of a reported window (trailing masks dropped: the fixed canvas pads
    the report with masks the live window does not hold)."""
    end = len(window)
    while end and window[end - 1] < 0:
        end -= 1
    data = np.asarray(window[:end], dtype=np.int64).tobytes()
    return zlib.crc32(data) & ((1 << KEY_BITS) - 1)


def pack_decided(decided: int, window: Sequence[int], slots: int) -> int:
    """What ``num_acceptable_drafts`` carries for a request: its decided slots and its
    window's key (``decided <= slots``; the value stays below 2**31, int32 in vLLM)."""
    return decided + (slots + 1) * window_key(window)


def unpack_decided(value: int, slots: int) -> tuple[int, int]:
    """``(decided, key)`` of :func:`pack_decided`."""
    return value % (slots + 1), value // (slots + 1)


class StructuredWindows:
    """Mixed into the plugin's schedulers (before vLLM's): structured WeDLM requests keep
    the window their worker reported and get their grammar rows from
    :func:`wedlm_kernels.grammar.plan_window` (module docstring)."""

    def _wedlm_windows(self) -> dict[str, list[int]]:
        windows = getattr(self, "_wedlm_reported", None)
        if windows is None:
            windows = self._wedlm_reported = {}
        return windows

    def _take_reports(self, draft_token_ids: Any) -> set[str]:
        """Keep the reported windows of structured requests; their ids."""
        windows, taken = self._wedlm_windows(), set()
        for req_id, tokens in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or not request.use_structured_output:
                continue
            windows[req_id] = list(tokens)
            taken.add(req_id)
        return taken

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        taken = self._take_reports(draft_token_ids)
        for req_id in taken:  # sized as any request's canvas is, never validated
            request = self.requests[req_id]
            if request.is_finished():
                continue
            width = diffusion_canvas_width(request, self.num_spec_tokens)
            count = 0 if request.is_prefill_chunk else len(self._wedlm_windows()[req_id])
            request.spec_token_ids = [-1] * min(count, width)
        kept = [(i, t) for i, t in zip(draft_token_ids.req_ids,
                                      draft_token_ids.draft_token_ids) if i not in taken]
        draft_token_ids.req_ids = [i for i, _ in kept]
        draft_token_ids.draft_token_ids = [t for _, t in kept]
        super().update_draft_token_ids(draft_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any
                                         ) -> None:
        taken = self._take_reports(draft_token_ids)  # their scheduled rows stay as they are
        kept = [(i, t) for i, t in zip(draft_token_ids.req_ids,
                                      draft_token_ids.draft_token_ids) if i not in taken]
        draft_token_ids.req_ids = [i for i, _ in kept]
        draft_token_ids.draft_token_ids = [t for _, t in kept]
        super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        from vllm.v1.core.sched.output import GrammarOutput

        if not scheduler_output.has_structured_output_requests:
            return None
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        ids = [req_id for req_id in scheduler_output.num_scheduled_tokens
               if (request := self.requests.get(req_id)) is not None
               and request.use_structured_output and not request.is_prefill_chunk
               and scheduled.get(req_id)]
        if not ids:
            return None
        manager = self.structured_output_manager
        rows = sum(len(scheduled[req_id]) for req_id in ids)
        bitmask = manager.backend.allocate_token_bitmask(rows + len(ids))
        windows, decided_slots, first_row = self._wedlm_windows(), [], 0
        for req_id in ids:
            count = len(scheduled[req_id])
            # the reported window, as many slots as rows (masks when none arrived: a
            # fresh window; the worker checks the key)
            window = (windows.get(req_id, []) + [-1] * count)[:count]
            grammar = self.requests[req_id].structured_output_request.grammar
            decided = plan_window(grammar, window, bitmask, first_row, req_id)
            bitmask[rows + len(decided_slots)] = 0
            bitmask[rows + len(decided_slots), 0] = pack_decided(decided, window,
                                                                 self.num_spec_tokens)
            decided_slots.append(decided)
            first_row += count
        return GrammarOutput(ids, bitmask.numpy(), decided_slots)

    def _free_request(self, request: Any, *args, **kwargs):
        self._wedlm_windows().pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


# ------------------------------------------------------------------------ the worker side

_EXPECTED_NAMES = ("async_tensor_h2d",)  # what the wrapped method was read to call
_states: "list[Any]" = []  # the WeDLM model states of this process (weak enough: one engine)


def register(state: Any) -> None:
    """A WeDLM model state receives the grammar outputs of the batches it prepared."""
    import weakref

    _states[:] = [ref for ref in _states if ref() is not None]
    _states.append(weakref.ref(state))
    install()


def install() -> None:
    """Wrap ``StructuredOutputsWorker.apply_grammar_bitmask`` (idempotent): a batch a
    WeDLM state prepared hands its grammar output to that state, others are vLLM's."""
    from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker

    method = StructuredOutputsWorker.apply_grammar_bitmask
    if getattr(method, "_wedlm_original", None) is not None:
        return

    def apply_grammar_bitmask(self, logits, input_batch, grammar_req_ids, grammar_bitmask):
        for ref in _states:
            state = ref()
            if state is not None and state.owns_batch(input_batch):
                state.take_grammar(list(grammar_req_ids), grammar_bitmask)
                return None
        return method(self, logits, input_batch, grammar_req_ids, grammar_bitmask)

    apply_grammar_bitmask._wedlm_original = method
    apply_grammar_bitmask.__doc__ = method.__doc__
    StructuredOutputsWorker.apply_grammar_bitmask = apply_grammar_bitmask
