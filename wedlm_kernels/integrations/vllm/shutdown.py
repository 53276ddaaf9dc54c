"""What the requests still open see when a WeDLM server stops (docs/vllm.md, "Shutdown").

At SIGTERM or SIGINT, vLLM's OpenAI server (0.32.0) stops its engine client
(``AsyncLLM.shutdown``: with ``--shutdown-timeout N`` it first lets the running requests
finish for up to ``N`` seconds, then aborts the rest; with the default 0 it aborts at once)
and then waits for every open connection to close. Nothing tells a request still open that
its engine is gone: a stream waits for outputs that never come, until its client gives up,
and the server's process waits for it (measured here: 16 of 16 streams open at SIGTERM
ended by their client's 60 s timeout, the process exited 60 s after the signal).

For a WeDLM engine the plugin ends every request still open: each waiting ``generate``
raises :class:`ServerShuttingDown`, which vLLM's server answers with HTTP 503 ("Service
Unavailable": retry elsewhere), as an error event followed by ``[DONE]`` on a stream, and
the server exits once those answers are sent. With a drain (``--shutdown-timeout N > 0``)
the requests are ended once the engine client has stopped: those the drain finished keep
their text. Without one they are ended before vLLM's shutdown starts: its engine core then
aborts every request and sends those aborts back, and an abort that reached the output
handler first would finish its stream as if complete (``finish_reason "abort"``, no error,
a cut text), depending on timing. An error handed to a request's queue first is not
replaced by a later output. Other models served in the process keep vLLM's behaviour.
"""

from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError


class ServerShuttingDown(GracefulHTTPError):
    """A request still open when its server stopped (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__(
            "the server is shutting down and this request did not finish; retry it",
            HTTPStatus.SERVICE_UNAVAILABLE)


def end_open_requests(engine_client: Any) -> int:
    """Hand every request ``engine_client`` (an ``AsyncLLM``) still holds a
    :class:`ServerShuttingDown`, on the event loop its requests wait on (from any thread).
    Returns how many requests it ends."""
    processor = getattr(engine_client, "output_processor", None)
    handler = getattr(engine_client, "output_handler", None)
    if processor is None or handler is None or not processor.request_states:
        return 0
    count = len(processor.request_states)
    try:
        handler.get_loop().call_soon_threadsafe(processor.propagate_error,
                                                ServerShuttingDown())
    except RuntimeError:  # the loop has closed: nothing waits on it any more
        return 0
    return count


def drains(engine_client: Any) -> bool:
    """Whether ``engine_client``'s shutdown first lets the running requests finish
    (``--shutdown-timeout`` above 0; vLLM's engine core reads the same setting)."""
    config = getattr(engine_client, "vllm_config", None)
    return bool(getattr(config, "shutdown_timeout", 0))


def install() -> None:
    """Wrap ``AsyncLLM.shutdown`` (idempotent): a WeDLM engine client's open requests get
    :func:`end_open_requests` before vLLM's own shutdown when it aborts them at once, and
    after it (what the drain left) in any case."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from ._register import is_wedlm

    method = AsyncLLM.shutdown
    if getattr(method, "_wedlm_original", None) is not None:
        return

    def shutdown(self, *args, **kwargs):
        model_config = getattr(self, "model_config", None)
        wedlm = model_config is not None and is_wedlm(model_config)
        if wedlm and not drains(self):  # before the engine core's aborts can come back
            end_open_requests(self)
        method(self, *args, **kwargs)
        if wedlm:
            end_open_requests(self)

    shutdown._wedlm_original = method
    shutdown.__doc__ = method.__doc__
    AsyncLLM.shutdown = shutdown
