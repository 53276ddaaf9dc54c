"""select_tokens' sampling mode in the plugin's sampler: each decode step passes the
narrowest mode its requests' parameters allow ("greedy": every request greedy;
"temperature": no sampling request with top-k or top-p; "any" otherwise), chosen from host
facts kept at admission (no device read), and the tokens are those of the full rule."""

import numpy as np
import pytest
from vllm import SamplingParams

import wedlm_kernels
from wedlm_kernels.integrations.vllm.state import sampling_mode

from .test_vllm_decoding import PROMPTS, vllm_generate

VOCAB = 64


def mode(temperature, top_k=None, top_p=None, vocab=VOCAB):
    count = len(temperature)
    return sampling_mode(np.array(temperature, dtype=np.float64),
                         np.array(top_k or [0] * count, dtype=np.float64),
                         np.array(top_p or [1.0] * count, dtype=np.float64), vocab)


def test_the_mode_is_the_narrowest_that_agrees_with_every_request():
    assert mode([0.0]) == mode([0.0, 0.0]) == "greedy"
    # a greedy request's top_k and top_p are never read (the frontend sets them off)
    assert mode([0.0], [5], [0.5]) == "greedy"
    assert mode([0.7]) == mode([0.0, 0.7]) == "temperature"
    # top-k off: 0 or at least the vocabulary; top-p off: 1
    assert mode([0.7, 0.9], [VOCAB, 10**6]) == "temperature"
    assert mode([0.7], [VOCAB - 1]) == mode([0.7], [1]) == "any"
    assert mode([0.7], None, [0.999]) == "any"
    assert mode([0.0, 0.7, 1.0], None, [1.0, 1.0, 0.9]) == "any"
    assert mode([]) == "greedy"  # (no request: nothing samples)


def expected_mode(temperature, top_k, top_p, vocab: int) -> str:
    """The mode the step's parameters allow, from the tensors select_tokens was given."""
    samples = temperature > 0
    if not samples.any():
        return "greedy"
    filtered = samples & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    return "any" if filtered.any() else "temperature"


@pytest.fixture
def recorded_modes(monkeypatch):
    """(the step's mode, the mode its select_tokens arguments allow) per select_tokens call
    (the engine runs in this process); ``forced[0]``, when set, replaces the mode."""
    original = wedlm_kernels.select_tokens
    calls: list[tuple[str, str]] = []
    forced: list[str | None] = [None]

    def select_tokens(logits, cu_rows, row_pos, temperature, top_k, top_p, *rest,
                      sampling="any"):
        calls.append((sampling, expected_mode(temperature, top_k, top_p, logits.shape[-1])))
        return original(logits, cu_rows, row_pos, temperature, top_k, top_p, *rest,
                        sampling=forced[0] or sampling)

    monkeypatch.setattr(wedlm_kernels, "select_tokens", select_tokens)
    return calls, forced


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BATCHES = {
    "greedy": [GREEDY] * 4,
    # temperature only (top_k -1, top_p 1), beside a greedy request
    "temperature": [SamplingParams(max_tokens=16, temperature=t, top_k=-1, top_p=1.0,
                                   seed=s, ignore_eos=True)
                    for t, s in ((0.9, 11), (1.3, 12), (0.7, 13))] + [GREEDY],
    # greedy, temperature-only and a top-p request
    "any": [GREEDY, SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True),
            GREEDY],
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_each_step_passes_its_requests_mode_and_decodes_the_full_rules_tokens(
        engine, recorded_modes, batch):
    calls, forced = recorded_modes
    got = vllm_generate(engine, PROMPTS, BATCHES[batch])
    assert calls and all(passed == allowed for passed, allowed in calls), calls
    # the batch's own mode in the steps that hold all its requests (a step without its
    # sampling requests, finished or not scheduled, may be narrower: the mode is the step's)
    assert batch in {passed for passed, _ in calls}
    forced[0] = "any"
    assert vllm_generate(engine, PROMPTS, BATCHES[batch]) == got
