"""WeDLM decoding in vLLM (Model Runner V2): an out-of-tree plugin on this library's ops.

``register()`` is vLLM's ``vllm.general_plugins`` entry point (pyproject.toml), called in
every vLLM process. It registers

- the architecture ``WeDLMForCausalLM`` (:mod:`.model`; vLLM's Qwen3/Qwen2 layers, WeDLM's
  loop from :mod:`.state`) and a config class for ``model_type: "wedlm"`` checkpoints;
- a config hook that turns vLLM's diffusion scheduling on for it: at most
  ``canvas_length = 2W`` query rows per request per step
  (``additional_config={"wedlm": {"window": W}}``; the live canvas schedules the rows a
  window holds, :mod:`.live_canvas`);
- the request check: vLLM refuses temperature, seed, min_p, min_tokens, logit_bias and
  allowed_token_ids for diffusion models; WeDLM serves them (and the penalties and n > 1)
  and refuses what it does not serve (logprobs, bad_words, structured outputs, ...) by name.

Nothing here imports vLLM until vLLM calls it; docs/vllm.md has the whole story.
"""

ARCHITECTURE = "WeDLMForCausalLM"


def register() -> None:
    """Register WeDLM with vLLM (idempotent)."""
    from ._register import register_all

    register_all()


def _model_state(worker):
    """The worker's WeDLM model state, or None on a pipeline stage before the last (the
    last stage's sampler moves the windows and keeps the counts)."""
    from vllm.distributed.parallel_state import get_pp_group

    return worker.model_runner.model_state if get_pp_group().is_last_rank else None


def _worker_request_stats(worker, request_ids: list[str]) -> dict | None:
    state = _model_state(worker)
    if state is None:
        return None
    return {request_id: state.request_stats(request_id) for request_id in request_ids}


def _worker_row_stats(worker) -> dict | None:
    state = _model_state(worker)
    return None if state is None else state.row_stats()


def _from_last_stage(replies: list):
    """The first worker's reply among the last pipeline stage's (every worker replies)."""
    return next(reply for reply in replies if reply is not None)


def request_stats(llm, request_ids: list[str]) -> dict:
    """``{request_id: {"forwards": F, "rows": R, "restarts": [...]} or None}`` for
    requests of ``llm`` (a ``vllm.LLM`` on a WeDLM model), finished ones included: the
    decode forwards each took part in and the live window rows it fed (model_min's
    ``Result.forwards`` and ``Result.rows``). From the first worker of the last pipeline
    stage."""
    return _from_last_stage(llm.collective_rpc(_worker_request_stats,
                                               args=(list(request_ids),)))


def row_stats(llm) -> dict:
    """``{"rows_fed": N, "live_rows": L}``: the query rows the engine's decode steps fed
    (with the live canvas, the live rows; with the fixed canvas or asynchronous scheduling,
    ``2W`` per request) and the live window rows among them, since it started.
    ``live_rows / rows_fed`` is the share of the canvas that did useful work. From the
    first worker of the last pipeline stage."""
    return _from_last_stage(llm.collective_rpc(_worker_row_stats))
