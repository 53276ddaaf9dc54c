"""Structured outputs for WeDLM on vLLM: vLLM's structured-output manager and grammar
backend (xgrammar by default) decide, :mod:`wedlm_kernels.requests.grammar`'s window rule applies
(docs/vllm.md, "Structured outputs").

Where each piece runs:

- worker, after a step: ``next_canvas`` (through the live canvas patch of
  ``take_draft_token_ids``) reports each structured request's window as its draft list:
  a filled slot's token, ``-1`` for a mask, one entry per row its next canvas takes;
- scheduler, before the next step's sampling (:class:`StructuredWindows`, mixed into the
  plugin's schedulers): keeps that report instead of vLLM's draft validation (which would
  cut the list at the first ``-1``, leaving the request no rows), and builds the step's
  ``GrammarOutput`` itself: per request one mask row per scheduled row, the window's slots
  in logical order, walked by :func:`wedlm_kernels.requests.grammar.plan_window` from the grammar
  vLLM advanced with the committed tokens (each mask narrowed to the ids a request may
  output), then one row per request whose first words carry the walk's conclusion, a
  32-bit key of the window walked and whether the request ends (:func:`plan_words`). A
  request whose grammar allows no token after its committed ones (a grammar that allows
  nothing: at its first walk), or whose grammar fails, ends with an error
  (``EndsRequests.end_request_with_error``, :mod:`.scheduler`) and samples nothing;
- worker, at sampling: vLLM's ``StructuredOutputsWorker.apply_grammar_bitmask`` (which
  would apply row ``i`` to a request's ``i``-th logit row, while WeDLM's canvas puts the
  filled slots' rows first) hands the rows to the WeDLM state instead (:func:`install`),
  whose sampler maps them to mask slots. A request whose fed window is not the one walked
  (its key differs: a report that did not arrive before the step, a resumed window)
  commits nothing that step and is walked again after it;
- engine core, under asynchronous scheduling: vLLM fetches the drafts only when it defers
  a structured request's sampling behind a step in flight, so after every step the plugin
  fetches the windows too (:func:`install_async_reports`; ``next_canvas`` reports every
  structured slot), and a request vLLM's length bound makes skip a step is walked from its
  window after its last step, not an older one.

vLLM then accepts the committed tokens into the grammar as for any request. Written for
the vLLM releases of :data:`live_canvas.PATCHED_VERSIONS`.
"""

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.core.sched.diffusion_scheduler import diffusion_canvas_width

from wedlm_kernels.requests.grammar import WindowPlan, plan_window
from wedlm_kernels.requests.output_ids import output_bitmask

logger = init_logger(__name__)

# decided, rejected, window key, flags (ENDED: the request ends, nothing of it is sampled;
# DEAD_END, GRAMMAR_SLOT: the walk's): a mask row holds them from 128 tokens up
PLAN_WORDS = 4
ENDED, DEAD_END, GRAMMAR_SLOT = 1, 2, 4


def window_key(window: Sequence[int]) -> int:
    """A 32-bit key of a reported window, as an int32 (trailing masks dropped: the fixed
    canvas pads the report with masks the live window does not hold)."""
    end = len(window)
    while end and window[end - 1] < 0:
        end -= 1
    key = zlib.crc32(np.asarray(window[:end], dtype=np.int64).tobytes())
    return key - (1 << 32) if key >= 1 << 31 else key


def plan_words(plan: WindowPlan, window: Sequence[int], ended: bool = False) -> list[int]:
    """A request's metadata row's first words: the walk's conclusion, its window's key and
    whether the request ends (then the worker holds it: it samples and commits nothing)."""
    flags = ENDED * ended | DEAD_END * plan.dead_end | GRAMMAR_SLOT * plan.grammar_slot
    return [plan.decided, plan.rejected, window_key(window), flags]


def plan_of(words: Sequence[int]) -> tuple[WindowPlan, int, bool]:
    """The worker's reading of :func:`plan_words`: ``(plan, window key, ended)``."""
    decided, rejected, key, flags = (int(v) for v in words[:PLAN_WORDS])
    plan = WindowPlan(decided, rejected, bool(flags & DEAD_END), bool(flags & GRAMMAR_SLOT))
    return plan, key, bool(flags & ENDED)


class StructuredWindows:
    """Mixed into the plugin's schedulers (before vLLM's): structured WeDLM requests keep
    the window their worker reported and get their grammar rows from
    :func:`wedlm_kernels.requests.grammar.plan_window` (module docstring). A request its walk ends
    goes to ``end_request_with_error``, which the scheduler it is mixed into provides
    (:class:`.scheduler.EndsRequests`)."""

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
            if request is None or request.is_finished() or not request.use_structured_output:
                continue
            windows[req_id] = list(tokens)
            taken.add(req_id)
        return taken

    @staticmethod
    def _drop(draft_token_ids: Any, taken: set[str]) -> Any:
        """``draft_token_ids`` without the requests in ``taken`` (in place)."""
        kept = [(i, t) for i, t in zip(draft_token_ids.req_ids,
                                      draft_token_ids.draft_token_ids) if i not in taken]
        draft_token_ids.req_ids = [i for i, _ in kept]
        draft_token_ids.draft_token_ids = [t for _, t in kept]
        return draft_token_ids

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        taken = self._take_reports(draft_token_ids)  # (none of them finished)
        for req_id in taken:  # sized as any request's canvas is, never validated
            request = self.requests[req_id]
            width = diffusion_canvas_width(request, self.num_spec_tokens)
            count = 0 if request.is_prefill_chunk else len(self._wedlm_windows()[req_id])
            request.spec_token_ids = [-1] * min(count, width)
        super().update_draft_token_ids(self._drop(draft_token_ids, taken))

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any
                                         ) -> None:
        taken = self._take_reports(draft_token_ids)  # their scheduled rows stay as they are
        super().update_draft_token_ids_in_output(self._drop(draft_token_ids, taken),
                                                 scheduler_output)

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
        windows, counts, first_row = self._wedlm_windows(), [], 0
        for req_id in ids:
            count = len(scheduled[req_id])
            # the reported window, as many slots as rows (masks when none arrived: a
            # fresh window; the worker checks the key)
            window = (windows.get(req_id, []) + [-1] * count)[:count]
            plan, ended = self._walk(req_id, window, bitmask, first_row)
            meta = bitmask[rows + len(counts)]
            meta.fill_(0)
            meta[:PLAN_WORDS] = torch.tensor(plan_words(plan, window, ended),
                                             dtype=meta.dtype)
            counts.append(count)
            first_row += count
        # (num_acceptable_drafts: every row, so that vLLM's grammar_invalid_drafts, which
        # only WeDLM's absent rejection sampler would read, returns at once)
        return GrammarOutput(ids, bitmask.numpy(), counts)

    def _walk(self, req_id: str, window: list[int], bitmask: torch.Tensor, first_row: int
              ) -> tuple[WindowPlan, bool]:
        """One request's walk, and whether the request ends: its grammar allows no token
        after its committed ones and has not ended (the grammar allows nothing: caught at
        its first walk), or the grammar fails. Either ends this request alone
        (``end_request_with_error``, :class:`.scheduler.EndsRequests`)."""
        request = self.requests[req_id]
        grammar = request.structured_output_request.grammar
        try:
            plan = plan_window(grammar, window, bitmask, first_row, req_id,
                               self._wedlm_output_mask())
        except Exception as error:  # the grammar backend's, for this request alone
            logger.exception("WeDLM request %s: its grammar failed in the window walk",
                             req_id)
            self.end_request_with_error(req_id, (
                f"structured_outputs: the request's grammar failed ({type(error).__name__}: "
                f"{error})"))
            return WindowPlan(0, -1, True), True
        if plan.stuck:
            self.end_request_with_error(req_id, (
                "structured_outputs: the request's grammar (structured_outputs, "
                "response_format or tool_choice) allows no token after its "
                f"{request.num_output_tokens} output tokens and has not ended, so the "
                "request cannot go on"))
        return plan, plan.stuck

    def _wedlm_output_mask(self) -> np.ndarray:
        """The ids a request may output as a mask row (the config hook's
        ``hf_config.wedlm_never_output``, wedlm_kernels.requests.output_ids)."""
        mask = getattr(self, "_wedlm_output_bits", None)
        if mask is None:
            model_config = self.vllm_config.model_config
            mask = self._wedlm_output_bits = output_bitmask(
                model_config.get_vocab_size(), model_config.hf_config.wedlm_never_output)
        return mask

    def wants_window_reports(self) -> bool:
        """Whether a structured request runs (install_async_reports fetches windows)."""
        return any(request.use_structured_output for request in self.running)

    def _free_request(self, request: Any, *args, **kwargs):
        self._wedlm_windows().pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


# ------------------------------------------------------------------------ the worker side

_states: "list[Any]" = []  # the WeDLM model states of this process (weak enough: one engine)


def register(state: Any) -> None:
    """A WeDLM model state receives the grammar outputs of the batches it prepared."""
    import weakref

    _states[:] = [ref for ref in _states if ref() is not None]
    _states.append(weakref.ref(state))
    install()


def install() -> None:
    """Wrap ``StructuredOutputsWorker.apply_grammar_bitmask`` (idempotent; the model state
    installs it on the vLLM releases of ``live_canvas.PATCHED_VERSIONS`` only): a batch a
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


def install_async_reports() -> None:
    """Wrap ``EngineCore.post_step`` (idempotent; in the engine core process, by the
    plugin's asynchronous scheduler): after each step, while a structured request runs,
    fetch the workers' window reports as synchronous scheduling does (vLLM's asynchronous
    loop fetches drafts only behind a deferred sampling), so the scheduler walks every
    structured request from its window after its last step."""
    from vllm.v1.engine.core import EngineCore

    method = EngineCore.post_step
    if getattr(method, "_wedlm_original", None) is not None:
        return

    def post_step(self, model_executed: bool) -> None:
        method(self, model_executed)
        scheduler = self.scheduler
        if (getattr(self, "async_scheduling", False) and isinstance(scheduler, StructuredWindows)
                and scheduler.wants_window_reports()):
            reports = self.model_executor.take_draft_token_ids()
            if reports is not None:
                scheduler._take_reports(reports)

    post_step._wedlm_original = method
    post_step.__doc__ = method.__doc__
    EngineCore.post_step = post_step
