"""A window cut at max_model_len under asynchronous scheduling: what runs where the plugin's
scheduler does not (a ``scheduler_cls`` of the user's own, or vLLM's
``DiffusionAsyncScheduler`` on a release other than the one the rule was written for).

vLLM's bound counts the canvas rows still in flight as computed, so in the last ``4W``
positions before the limit a canvas can be shorter than its window. The window state must
then refill what the cut left (it used to shrink to 0 live slots and spin there): requests
decode to exactly ``max_model_len``, model_min's tokens up to ``max_model_len - 4W`` and
their own after (docs/vllm.md, "Asynchronous scheduling")."""

from vllm import SamplingParams
from vllm.v1.core.sched.diffusion_scheduler import DiffusionAsyncScheduler

import model_min

from .conftest import WINDOW
from .test_vllm_async import MAX_MODEL_LEN, async_engine_of, scheduler_of
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

# vLLM cuts a canvas below the window only past this position: L + 2 canvases > the limit
UNCUT = MAX_MODEL_LEN - 4 * WINDOW
VLLM_ASYNC_SCHEDULER = "vllm.v1.core.sched.diffusion_scheduler.DiffusionAsyncScheduler"


def test_a_cut_window_refills_and_decodes_to_max_model_len(engines, reference):
    with async_engine_of(engines, scheduler_cls=VLLM_ASYNC_SCHEDULER) as llm:
        assert type(scheduler_of(llm)) is DiffusionAsyncScheduler  # the user's choice kept
        got = vllm_generate(llm, PROMPTS, SamplingParams(max_tokens=None, temperature=0,
                                                         ignore_eos=True))
    for prompt, (tokens, _, _) in zip(PROMPTS, got):
        want = reference_generate(reference, [prompt], model_min.SamplingParams(
            max_new_tokens=MAX_MODEL_LEN - len(prompt)))[0][0]
        assert len(prompt) + len(tokens) == MAX_MODEL_LEN
        assert tokens[: UNCUT - len(prompt)] == want[: UNCUT - len(prompt)]
