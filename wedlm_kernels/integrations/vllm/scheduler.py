"""The scheduler a WeDLM engine runs: vLLM's diffusion schedulers, with a way to end one
request with an error while the engine goes on (:class:`EndsRequests`: a request that makes
no progress, one whose grammar allows nothing), and one rule added under asynchronous
scheduling so that a window is never cut at ``max_model_len`` by rows that are still in
flight (docs/vllm.md, "Asynchronous scheduling").

vLLM's ``Scheduler.schedule`` bounds a request's query rows by ``max_model_len -
num_computed_tokens``. Under asynchronous scheduling ``num_computed_tokens`` already counts
the canvas rows of the step still in flight, of which the step will commit only some. In the
last ``4W`` positions before the limit the bound then cuts the canvas shorter than the
window, where synchronous scheduling (which counts only committed rows) does not, and a cut
window decodes differently from model_min's whole one. The rule: a WeDLM request whose
canvas that bound would cut while a step of it is in flight sits this one scheduling call
out, as vLLM's ``DiffusionAsyncScheduler`` already has read-only requests do. By the next
call the step has landed (the engine core waits for the oldest step of its batch queue
before it schedules again), ``num_computed_tokens`` holds the committed length, and the
bound is synchronous scheduling's own. The cost: near the limit, such a request runs every
other scheduling call, without the overlap asynchronous scheduling buys.

:func:`make_scheduler` is the ``scheduler_config.scheduler_cls`` the config hook sets for a
WeDLM engine when none was given; vLLM calls it in the engine core process like a class, once
its configuration is final (asynchronous scheduling on or off).
"""

from typing import Any

import vllm
from vllm.logger import init_logger
from vllm.v1.core.sched.diffusion_scheduler import (
    DiffusionAsyncScheduler,
    DiffusionScheduler,
    diffusion_canvas_width,
)
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .live_canvas import PATCHED_VERSIONS, is_patched_version
from .settings import engine_settings
from .structured import StructuredWindows, install_async_reports

logger = init_logger(__name__)


def max_steps_without_commit(window: int) -> int:
    """Decode steps a request may take without committing a token: a correct step fills a
    mask whenever the window holds one and commits the leading run otherwise, so a request
    commits within ``W + 1`` steps (block-wise too); the guard allows twice the canvas, and
    two (``4W + 2``). A held step (a structured request whose fed window was not the one
    walked) counts too."""
    return 4 * window + 2


class EndsRequests:
    """Mixed into the plugin's schedulers (before vLLM's): ends one request with an error
    while the engine and every other request go on, as vLLM ends a request whose committed
    tokens its grammar rejects on the AR path: the request finishes with
    ``RequestStatus.FINISHED_ERROR`` (finish reason ``"error"``; the OpenAI server answers
    that request with HTTP 500, or an error event on its stream) and frees its blocks; the
    reason goes to the log and to the output's ``stop_reason``.

    Requests end here when (docs/vllm.md, "When a request fails"):

    - **the progress guard**: a request commits no token in more than
      :func:`max_steps_without_commit` decode steps in a row (counted from each step's
      committed tokens, the sampled tokens vLLM receives);
    - **a grammar that allows nothing**: :class:`.structured.StructuredWindows` finds, at a
      walk, that the grammar allows no token after the committed ones and has not ended, or
      its grammar backend fails (:meth:`end_request_with_error`).
    """

    def _wedlm_failures(self) -> tuple[dict[str, str], dict[str, int]]:
        """The requests to end (id -> reason) and each decoding request's steps without a
        commit."""
        failures = getattr(self, "_wedlm_ending", None)
        if failures is None:
            failures = self._wedlm_ending = ({}, {})
        return failures

    def end_request_with_error(self, request_id: str, reason: str) -> None:
        """End the request with an error after the current step's output (it is logged
        now)."""
        logger.error("WeDLM request %s ends with an error: %s", request_id, reason)
        self._wedlm_failures()[0].setdefault(request_id, reason)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self._count_steps_without_commit(scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        ending, _ = self._wedlm_failures()
        if ending:
            reasons = dict(ending)
            ending.clear()
            # (requests that finished otherwise meanwhile are skipped by finish_requests)
            for request in self.finish_requests(list(reasons), RequestStatus.FINISHED_ERROR):
                output = EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=reasons[request.request_id], events=request.take_events(),
                    trace_headers=request.trace_headers)
                outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                    output)
        return outputs

    def _count_steps_without_commit(self, scheduler_output: Any, model_runner_output: Any
                                    ) -> None:
        """The progress guard: count each decoding request's steps since it last
        committed a token, and end a request past the bound."""
        _, stalled = self._wedlm_failures()
        window = getattr(self, "_wedlm_window", None)
        if window is None:
            window = self._wedlm_window = engine_settings(
                self.vllm_config.additional_config).window
        bound = max_steps_without_commit(window)
        sampled = model_runner_output.sampled_token_ids
        index_of = model_runner_output.req_id_to_index
        for request_id in scheduler_output.scheduled_spec_decode_tokens:
            request = self.requests.get(request_id)
            index = index_of.get(request_id)
            if request is None or request.is_finished() or index is None:
                continue
            if sampled and len(sampled[index]):
                stalled.pop(request_id, None)
                continue
            stalled[request_id] = count = stalled.get(request_id, 0) + 1
            if count == bound + 1:
                self.end_request_with_error(request_id, (
                    f"committed no token in {count} decode steps (a correct step commits "
                    f"within {window + 1}): the decode step makes no progress"))

    def _free_request(self, request: Any, *args, **kwargs):
        ending, stalled = self._wedlm_failures()
        ending.pop(request.request_id, None)
        stalled.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


class WeDLMScheduler(EndsRequests, StructuredWindows, DiffusionScheduler):
    """``DiffusionScheduler`` ending a request that cannot go on (:class:`EndsRequests`),
    with WeDLM's structured outputs (:mod:`.structured`), and,
    with pipeline parallelism, a request's decode steps ``pipeline_parallel_size``
    scheduling calls apart.

    vLLM's pipeline stages before the last learn a step's outcome (here: the window the
    last stage's sampler left, :mod:`.state`) ``pipeline_parallel_size`` steps after it,
    and its asynchronous scheduler spaces a request's decodes that far apart to match.
    Under synchronous scheduling (vLLM's CPU platform forces it) nothing spaces them: a
    diffusion request's draft list reaches the scheduler after its step's sampling but
    before its output, so the step after a prefill would decode the request again, on a
    first stage that has not received its window yet. The same spacing, for synchronous
    scheduling: between decode steps it changes nothing (a decode step's rows count as
    computed until its output is in, which is before the call ``pipeline_parallel_size``
    steps later: the engine core's batch queue holds that many steps); its one cost is
    the step right after a prefill, which the request sits out."""

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        super()._update_after_schedule(scheduler_output)
        depth = self.parallel_config.pipeline_parallel_size
        if depth <= 1:
            return
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            if not request.is_prefill_chunk:  # a prefill's next chunk may follow at once
                request.next_decode_eligible_step = self.current_step + depth


class WeDLMAsyncScheduler(EndsRequests, StructuredWindows, DiffusionAsyncScheduler):
    """``DiffusionAsyncScheduler`` ending a request that cannot go on
    (:class:`EndsRequests`), with WeDLM's structured outputs (:mod:`.structured`), and a
    request that the length bound would cut while a step of it is in flight waits for that
    step (module docstring)."""

    def schedule(self, throttle_prefills: bool = False) -> Any:
        for request in self.running:
            if request.num_output_placeholders == 0:
                continue  # nothing in flight: the bound counts committed rows only
            if request.use_structured_output:
                # A structured request's window reaches the scheduler only when vLLM
                # defers its sampling behind a step in flight, so it never waits for one
                # (near the limit its window may be cut; docs/vllm.md)
                continue
            width = diffusion_canvas_width(request, self.num_spec_tokens)
            # the query rows Scheduler.schedule will ask for, and its bound on them
            wanted = (request.num_tokens + min(len(request.spec_token_ids), width)
                      + request.num_output_placeholders - request.num_computed_tokens)
            room = (self.max_model_len - request.num_computed_tokens
                    - self.num_sampled_tokens_per_step)
            if room < wanted:
                # schedule() advances current_step before it checks eligibility, so
                # current_step + 2 skips this call alone
                request.next_decode_eligible_step = max(
                    request.next_decode_eligible_step, self.current_step + 2)
        return super().schedule(throttle_prefills)


def make_scheduler(*args: Any, **kwargs: Any) -> DiffusionScheduler:
    """On the vLLM releases the plugin was written for, :class:`WeDLMScheduler` under
    synchronous scheduling and :class:`WeDLMAsyncScheduler` under asynchronous scheduling;
    on others vLLM's ``DiffusionScheduler`` or ``DiffusionAsyncScheduler`` (with a warning
    for the latter; the request check refuses structured outputs there). Takes the
    scheduler's arguments."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    patched = is_patched_version(vllm.__version__)
    if not vllm_config.scheduler_config.async_scheduling:
        return (WeDLMScheduler if patched else DiffusionScheduler)(*args, **kwargs)
    if not patched:
        logger.warning(
            "WeDLM: the asynchronous scheduling rule was written for vLLM %s, this is vLLM "
            "%s: running vLLM's DiffusionAsyncScheduler, which may cut a window in the last "
            "4W positions before max_model_len (docs/vllm.md)",
            list(PATCHED_VERSIONS), vllm.__version__)
        return DiffusionAsyncScheduler(*args, **kwargs)
    install_async_reports()  # the structured requests' windows after every step
    return WeDLMAsyncScheduler(*args, **kwargs)
