"""No request can stop the engine. Every per-request field, drawn from edge values
(fuzz_values.py), goes through ``LLM.generate`` on a real engine: each draw is refused with a
``VLLMValidationError`` naming its field, or served, and served exactly as model_min serves
the same draw (a grammar that allows nothing more ends that request with finish_reason
"error" in both); model_min accepts and refuses the same draws (one definition,
wedlm_kernels.requests.params; structured outputs checked and compiled by vLLM's own backend
for both); afterwards a fixed good request decodes as it did before.
The same draws go over HTTP in test_vllm_server.py. And every device buffer of the plugin's
model state has a declared source, whose bound fits its dtype."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from wedlm_kernels.integrations.vllm import request_stats
from wedlm_kernels.integrations.vllm.state import BUFFER_SOURCES
from wedlm_kernels.requests import params as rp

from .fuzz_values import (
    GRID,
    SERVED,
    VALUES,
    ModelMinDecoder,
    Refused,
    Served,
    engine_refusal,
    names_a_field,
    vllm_request,
)

MAX_MODEL_LEN = 64  # a short context, so that a draw served "to the limit" is quick
EXAMPLES = int(os.environ.get("WEDLM_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fuzz_engine(engines):
    with engines.own(max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def decoder(reference):
    model, _ = reference
    return ModelMinDecoder(model, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def good_request(fuzz_engine):
    """The fixed good request's tokens and forwards, before any fuzzing."""
    return serve(fuzz_engine, {})


class RefusedByConstructor(Refused):
    """vLLM's own SamplingParams constructor refused the draw, in the caller's process."""


def serve(llm, draw: dict) -> Refused | Served:
    try:
        prompt, params = vllm_request(draw, SamplingParams)
    except (TypeError, ValueError, VLLMValidationError) as error:
        return RefusedByConstructor(error)
    try:
        [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    except VLLMValidationError as error:
        return Refused(error)
    # n > 1: vLLM's child 0 (request "0_<id>") has the request's seed, as model_min's
    [first] = [child for child in output.outputs if child.index == 0]
    request_id = output.request_id if params.n == 1 else f"0_{output.request_id}"
    stats = request_stats(llm, [request_id])[request_id]
    return Served(list(first.token_ids), stats["forwards"],
                  params.temperature == 0 or params.seed is not None,
                  first.finish_reason == "error")


def check_draw(llm, decoder, draw: dict, fuzzed) -> str:
    """Serve ``draw`` and check its verdict against model_min's; a refusal must name one of
    the ``fuzzed`` fields. Returns the verdict."""
    got, want = serve(llm, draw), decoder.decode(draw)
    if isinstance(got, Refused):
        # a refusal names its field, except vLLM's own constructor comparing a non-number
        # (a TypeError in the caller's process: docs/vllm.md, "Request values")
        assert names_a_field(got.error, fuzzed) or (
            isinstance(got, RefusedByConstructor) and isinstance(got.error, TypeError)), (
            draw, got.error)
        # the two front ends refuse alike (model_min naming a field too), beyond the
        # engine's own bounds
        assert isinstance(want, Refused) or engine_refusal(draw, MAX_MODEL_LEN), (
            draw, got.error)
        assert not isinstance(want, Refused) or names_a_field(want.error, fuzzed), (
            draw, want.error)
        return "refused"
    assert isinstance(want, Served), (draw, want.error)
    assert not engine_refusal(draw, MAX_MODEL_LEN), draw
    if got.deterministic:
        assert (got.tokens, got.forwards, got.error) == (want.tokens, want.forwards,
                                                         want.error), draw
    # (a request ends with an error only when its grammar allows nothing more)
    assert not got.error or "structured_outputs" in draw, draw
    assert (0 if got.error else 1) <= len(got.tokens) <= MAX_MODEL_LEN
    return "served"


def test_every_edge_value_of_every_field_is_refused_by_name_or_served_as_model_min(
        fuzz_engine, decoder, good_request):
    verdicts = {"refused": 0, "served": 0}
    for field, draw in GRID:
        verdicts[check_draw(fuzz_engine, decoder, draw, [field])] += 1
    assert serve(fuzz_engine, {}) == good_request
    assert verdicts["refused"] > 200 and verdicts["served"] > 100, verdicts


@st.composite
def combined_draws(draw):
    fields = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=2, max_size=4,
                           unique=True))
    return {field: draw(st.sampled_from(SERVED[field]) | st.sampled_from(VALUES[field]))
            for field in fields}


def test_combinations_of_edge_values_are_refused_by_name_or_served_as_model_min(
        fuzz_engine, decoder, good_request):
    @settings(max_examples=EXAMPLES)
    @given(draw=combined_draws())
    def check(draw):
        check_draw(fuzz_engine, decoder, draw, list(draw))

    check()
    assert serve(fuzz_engine, {}) == good_request


@pytest.mark.parametrize("threshold", [0, -0.5, None])
def test_a_threshold_of_zero_or_below_commits_one_token_per_step(fuzz_engine, threshold):
    served = serve(fuzz_engine, {"wedlm_entropy_threshold": threshold, "max_tokens": 12})
    assert isinstance(served, Served) and served.forwards == len(served.tokens) == 12


def test_a_threshold_past_float32_selects_every_mask(fuzz_engine):
    served = serve(fuzz_engine, {"wedlm_entropy_threshold": 1e300, "max_tokens": 6})
    # one forward fills all six masks, the next step commits them without a forward
    assert isinstance(served, Served) and served.forwards == 1 and len(served.tokens) == 6


def _buffers(worker) -> dict[str, str]:
    state = worker.model_runner.model_state
    return {name: str(value.dtype).removeprefix("torch.") for name, value in vars(state).items()
            if isinstance(value, torch.Tensor)}


def test_every_device_buffer_has_a_declared_source_whose_bound_fits_it(fuzz_engine):
    buffers = fuzz_engine.collective_rpc(_buffers)[0]
    assert set(buffers) == set(BUFFER_SOURCES), "declare each buffer in BUFFER_SOURCES"
    for name, source in BUFFER_SOURCES.items():
        if source != "loop":  # a request field: its check bounds it to this dtype
            assert rp.FIELDS[source][0] == buffers[name], (name, source, buffers[name])
