"""What a WeDLM engine client does with the requests still open when it shuts down
(``wedlm_kernels.integrations.vllm.shutdown``; docs/vllm.md, "Shutdown"), in-process on
vLLM's own ``AsyncLLM.shutdown`` and request queues: each open request gets a 503 error,
on the event loop it waits on, from the thread vLLM's server shuts the client down in.
test_vllm_server.py runs the same over HTTP at SIGTERM and SIGINT."""

import asyncio
import threading
from types import SimpleNamespace

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

from wedlm_kernels.integrations.vllm import ARCHITECTURE, register
from wedlm_kernels.integrations.vllm.shutdown import ServerShuttingDown


class Processor:
    """vLLM's OutputProcessor where shutdown reads it: its open requests' queues."""

    propagate_error = OutputProcessor.propagate_error

    def __init__(self, request_ids: list[str]) -> None:
        self.request_states = {
            request_id: SimpleNamespace(queue=RequestOutputCollector(
                RequestOutputKind.DELTA, request_id)) for request_id in request_ids}


class AbortingEngineCore:
    """vLLM's engine core at a shutdown without a drain: it aborts every open request and
    its abort outputs reach the output handler, which finishes each request (its final
    output in its queue, its state dropped), before the client's shutdown returns."""

    def __init__(self, processor: Processor, loop: asyncio.AbstractEventLoop) -> None:
        self.processor, self.loop = processor, loop

    def finish_aborted(self, processed: threading.Event) -> None:
        for request_id, state in list(self.processor.request_states.items()):
            state.queue.put(RequestOutput(
                request_id, None, [], None,
                [CompletionOutput(0, "", [], None, None, finish_reason="abort")],
                finished=True))
            del self.processor.request_states[request_id]
        processed.set()

    def shutdown(self, timeout: float | None = None) -> None:
        processed = threading.Event()
        self.loop.call_soon_threadsafe(self.finish_aborted, processed)
        assert processed.wait(timeout=5)


def engine_client(architecture: str, processor: Processor, handler: asyncio.Task,
                  shutdown_timeout: int = 0, engine_core=None):
    """An AsyncLLM as far as its shutdown reads one (``engine_core``: none to stop by
    default)."""
    client = object.__new__(AsyncLLM)
    client.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=[architecture]))
    client.vllm_config = SimpleNamespace(shutdown_timeout=shutdown_timeout)
    client.output_processor = processor
    client.output_handler = handler
    if engine_core is not None:
        client.engine_core = engine_core
    return client


async def shut_down_while_waiting(architecture: str, aborting_engine: bool = False,
                                  shutdown_timeout: int = 0) -> list:
    """Two requests wait on their queues while the client shuts down in another thread
    (as vLLM's server does at SIGTERM); what each wait ends with (None: still waiting).
    ``aborting_engine``: the engine core's abort outputs reach the requests during the
    shutdown (:class:`AbortingEngineCore`)."""
    register()
    processor = Processor(["a", "b"])
    handler = asyncio.create_task(asyncio.sleep(3600))  # vLLM's output handler
    engine_core = (AbortingEngineCore(processor, asyncio.get_running_loop())
                   if aborting_engine else None)
    client = engine_client(architecture, processor, handler, shutdown_timeout, engine_core)
    waits = [asyncio.create_task(state.queue.get())
             for state in processor.request_states.values()]
    await asyncio.get_running_loop().run_in_executor(None, client.shutdown)
    await asyncio.wait(waits, timeout=2)
    results = []
    for wait in waits:
        if not wait.done():
            wait.cancel()
            results.append(None)
        else:
            results.append(wait.exception() or wait.result())
    return results


def test_a_wedlm_clients_shutdown_ends_each_open_request_with_a_503():
    errors = asyncio.run(shut_down_while_waiting(ARCHITECTURE))
    assert all(isinstance(error, ServerShuttingDown) for error in errors), errors
    assert errors[0].http_status == 503 and "retry it" in errors[0].message


def test_requests_the_engine_aborts_at_shutdown_get_the_503_not_a_finished_cut_text():
    """Without a drain vLLM's engine core aborts what is open and sends the aborts back,
    racing the ending: an abort that arrived first finished its stream as complete, with a
    cut text and no error. The ending goes first, and an error in a queue is not replaced
    by a later output."""
    errors = asyncio.run(shut_down_while_waiting(ARCHITECTURE, aborting_engine=True))
    assert all(isinstance(error, ServerShuttingDown) for error in errors), errors


def test_after_a_drain_the_requests_it_finished_keep_their_output():
    """With ``--shutdown-timeout N`` the ending waits for the drain: a request the engine
    finished in it keeps its final output (here, an abort's)."""
    outputs = asyncio.run(shut_down_while_waiting(ARCHITECTURE, aborting_engine=True,
                                                  shutdown_timeout=2))
    assert all(isinstance(output, RequestOutput) and output.finished for output in outputs)


def test_another_models_client_keeps_vllms_shutdown():
    assert asyncio.run(shut_down_while_waiting("Qwen3ForCausalLM")) == [None, None]


def test_the_wrapper_is_installed_once():
    register()
    register()  # (vLLM calls the entry point in every process, maybe more than once)
    assert getattr(AsyncLLM.shutdown._wedlm_original, "_wedlm_original", None) is None
