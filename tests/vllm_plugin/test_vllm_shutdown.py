"""What a WeDLM engine client does with the requests still open when it shuts down
(``wedlm_kernels.integrations.vllm.shutdown``; docs/vllm.md, "Shutdown"), in-process on
vLLM's own ``AsyncLLM.shutdown`` and request queues: each open request gets a 503 error,
on the event loop it waits on, from the thread vLLM's server shuts the client down in.
test_vllm_server.py runs the same over HTTP at SIGTERM and SIGINT."""

import asyncio
from types import SimpleNamespace

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


def engine_client(architecture: str, processor: Processor, handler: asyncio.Task):
    """An AsyncLLM as far as its shutdown reads one (no engine core to stop)."""
    client = object.__new__(AsyncLLM)
    client.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=[architecture]))
    client.output_processor = processor
    client.output_handler = handler
    return client


async def shut_down_while_waiting(architecture: str) -> list:
    """Two requests wait on their queues while the client shuts down in another thread
    (as vLLM's server does at SIGTERM); what each wait ends with (None: still waiting)."""
    register()
    processor = Processor(["a", "b"])
    handler = asyncio.create_task(asyncio.sleep(3600))  # vLLM's output handler
    client = engine_client(architecture, processor, handler)
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
            results.append(wait.exception())
    return results


def test_a_wedlm_clients_shutdown_ends_each_open_request_with_a_503():
    errors = asyncio.run(shut_down_while_waiting(ARCHITECTURE))
    assert all(isinstance(error, ServerShuttingDown) for error in errors), errors
    assert errors[0].http_status == 503 and "retry it" in errors[0].message


def test_another_models_client_keeps_vllms_shutdown():
    assert asyncio.run(shut_down_while_waiting("Qwen3ForCausalLM")) == [None, None]


def test_the_wrapper_is_installed_once():
    register()
    register()  # (vLLM calls the entry point in every process, maybe more than once)
    assert getattr(AsyncLLM.shutdown._wedlm_original, "_wedlm_original", None) is None
