"""Bad input gets a clear error naming what is wrong, and nothing hangs: parameters WeDLM
decoding does not serve, bad WeDLM settings, a prompt past max_model_len, bad engine
configuration; and a request whose decode step stops making progress ends alone by the
guard (the engine stops only where no scheduler of the plugin's runs)."""

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

import model_min
from wedlm_kernels.integrations.vllm.state import NoProgressError

from .conftest import WINDOW, Engines
from .test_vllm_decoding import PROMPTS, reference_generate

UNSUPPORTED = [
    ("logprobs", dict(logprobs=False)),  # (vLLM's own checks let it through)
    ("prompt_logprobs", dict(prompt_logprobs=1)),
    ("bad_words", dict(bad_words=["ab"], structured_outputs=StructuredOutputsParams(
        regex="[ab]+"))),  # (bad_words are served, but not beside a grammar)
    # values of served rules that vLLM's own checks let through and the device cannot hold
    ("logit_bias", dict(logit_bias={5: float("nan")})),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(301)})),
    ("repetition_penalty", dict(repetition_penalty=1e-50)),
    ("seed", dict(n=2, temperature=1.0, seed=2**63 - 1)),
    ("stop_token_ids", dict(stop_token_ids=list(range(100, 125)))),
    ("wedlm_distance_penalty", dict(extra_args={"wedlm_distance_penalty": 1e300})),
    ("seed", dict(seed=2**64)),
    ("max_tokens", dict(max_tokens=2**31 - 1)),  # prompt_len + max_tokens past int32
    # (served; vLLM's own checks let this one through: a bool is an int to it)
    ("logprob_token_ids", dict(logprob_token_ids=[1, True])),
    ("prompt_logprob_token_ids", dict(prompt_logprob_token_ids=[[0]] * 5)),
    ("diffusion_canvas_length", dict(extra_args={"diffusion_canvas_length": 8})),
    ("wedlm_block", dict(extra_args={"wedlm_block": 4})),
    ("wedlm_window", dict(extra_args={"wedlm_window": WINDOW + 1})),
    ("wedlm_window", dict(extra_args={"wedlm_window": 0})),
    ("wedlm_mode", dict(extra_args={"wedlm_mode": "autoregressive"})),
    ("wedlm_entropy_threshold", dict(extra_args={"wedlm_entropy_threshold": "low"})),
    ("wedlm_distance_penalty", dict(extra_args={"wedlm_distance_penalty": float("inf")})),
]


@pytest.mark.parametrize("name, options", UNSUPPORTED, ids=[f"{n}-{i}" for i, (n, _) in
                                                            enumerate(UNSUPPORTED)])
def test_an_unsupported_parameter_fails_at_request_time_naming_it(engine, name, options):
    params = SamplingParams(**{"max_tokens": 8, **options})
    with pytest.raises(VLLMValidationError, match=name) as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert name in failure.value.parameter  # the OpenAI server reports it as the "param"


def test_a_top_k_past_int32_is_served_as_no_top_k(engine, reference):
    """A sampled request's top_k of 2**40 (above the vocabulary, so no filter) is stored as
    0, the int32 buffer's "off", and decodes as model_min's top_k=0."""
    import model_min

    from .test_vllm_decoding import reference_generate, vllm_generate

    served = SamplingParams(max_tokens=8, temperature=0.8, seed=5, top_k=2**40, ignore_eos=True)
    assert vllm_generate(engine, PROMPTS[:1], served) == reference_generate(
        reference, PROMPTS[:1], model_min.SamplingParams(max_new_tokens=8, temperature=0.8,
                                                         seed=5))


@pytest.mark.parametrize("options", [
    dict(ignore_eos=1), dict(n=True), dict(presence_penalty=False),
    dict(repetition_penalty=True), dict(min_tokens=False), dict(detokenize=0),
    dict(skip_special_tokens=1), dict(include_stop_str_in_output=0),
    dict(seed=np.int64(3)), dict(extra_args={"wedlm_window": np.int32(2)}),
], ids=lambda options: next(iter(options)))
def test_a_value_vllms_engine_process_cannot_decode_is_refused_by_name(engine, options):
    # vLLM type-checks none of these; its engine process decodes a request strictly (and
    # its encoder refuses numpy numbers), and a multiprocess LLM hangs on one it cannot
    # pass on (docs/vllm.md)
    [name] = options
    # (named by the plugin's value check where the field is one it reads, else by the
    # engine-process round trip: "ignore_eos: Expected `bool`, got `int`")
    with pytest.raises(VLLMValidationError, match=rf"^{name}\b") as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4,
                                                                          **options),
                        use_tqdm=False)
    assert failure.value.parameter == name
    assert engine.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4),
                           use_tqdm=False)[0].outputs[0].token_ids


def test_temperature_and_seed_are_served_and_the_engine_survives_bad_requests(engine):
    # vLLM refuses both for diffusion models; WeDLM serves them
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=1234, ignore_eos=True)
    output = engine.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8


def test_a_prompt_past_max_model_len_is_refused(engine):
    with pytest.raises(VLLMValidationError, match="maximum context length is 256"):
        engine.generate([{"prompt_token_ids": [65] * 300}], SamplingParams(max_tokens=4),
                        use_tqdm=False)


@pytest.mark.parametrize("additional_config, message", [
    ({"wedlm": {"window": 0}}, r'additional_config\["wedlm"\]\["window"\]'),
    ({"wedlm": {"mode": "ar"}}, r'additional_config\["wedlm"\]\["mode"\]'),
    ({"wedlm": {"threshold": 0.4}}, "unknown keys"),
])
def test_bad_engine_settings_fail_at_startup_naming_them(wedlm_checkpoint, additional_config,
                                                         message):
    with pytest.raises(Exception, match=message):
        Engines.start(wedlm_checkpoint, additional_config=additional_config)


def test_the_v1_model_runner_is_refused(wedlm_checkpoint, monkeypatch):
    import vllm.envs

    # vLLM caches its environment once an engine has started: set both
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setattr(vllm.envs, "VLLM_USE_V2_MODEL_RUNNER", False, raising=False)
    with pytest.raises(Exception, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        Engines.start(wedlm_checkpoint)


def test_a_checkpoint_without_a_mask_token_is_refused(wedlm_checkpoint):
    with pytest.raises(Exception, match="mask_token_id"):
        Engines.start(wedlm_checkpoint, hf_overrides={"mask_token_id": None})


def _selects_nothing_for(seed: int | None):
    """``select_tokens`` that selects no row of a sequence seeded ``seed`` (every
    sequence's for None): such a request never fills a mask, so it never commits."""
    import wedlm_kernels as wk

    select_tokens = wk.select_tokens

    def select(logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty,
               seeds, sampling="any"):
        token, selected, entropy = select_tokens(logits, cu_rows, row_pos, temperature,
                                                 top_k, top_p, threshold, penalty, seeds,
                                                 sampling)
        rows = torch.arange(selected.numel(), device=selected.device)
        owner = torch.searchsorted(cu_rows[1:].long(), rows, right=True).clamp(
            max=seeds.numel() - 1)
        stuck = torch.ones_like(selected) if seed is None else seeds[owner] == seed
        return token, selected & ~stuck, entropy

    return select


def test_a_request_that_makes_no_progress_ends_alone_and_the_engine_keeps_serving(
        engines, reference, monkeypatch):
    """The progress guard (the plugin's scheduler) ends a request that commits nothing in
    more than 4W + 2 steps with finish_reason "error", naming why; the request beside it
    decodes model_min's tokens, and the engine serves the stalled one once the step is
    fixed."""
    import wedlm_kernels as wk

    monkeypatch.setattr(wk, "select_tokens", _selects_nothing_for(777))
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    stalled = SamplingParams(max_tokens=20, temperature=0.8, seed=777, ignore_eos=True)
    with engines.own(additional_config={"wedlm": {"window": 2}}) as engine:
        good, bad = engine.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                                    [plain, stalled], use_tqdm=False)
        failed = bad.outputs[0]
        assert (list(failed.token_ids), failed.finish_reason) == ([], "error")
        assert failed.stop_reason == ("committed no token in 11 decode steps (a correct "
                                      "step commits within 3): the decode step makes no "
                                      "progress")
        assert [list(good.outputs[0].token_ids)] == [t for t, _, _ in reference_generate(
            reference, PROMPTS[:1], model_min.SamplingParams(max_new_tokens=20), window=2)]
        monkeypatch.undo()
        [again] = engine.generate([{"prompt_token_ids": PROMPTS[1]}], stalled, use_tqdm=False)
        assert list(again.outputs[0].token_ids) == reference_generate(
            reference, PROMPTS[1:2], model_min.SamplingParams(
                max_new_tokens=20, temperature=0.8, seed=777), window=2)[0][0]


def test_with_a_scheduler_of_the_users_own_the_worker_guard_stops_the_engine(engines,
                                                                            monkeypatch):
    """Where no scheduler of the plugin's can end a request, the worker's backstop stops
    the engine past twice the scheduler's bound (8W + 4 steps) rather than spin."""
    import wedlm_kernels as wk

    monkeypatch.setattr(wk, "select_tokens", _selects_nothing_for(None))
    with engines.own(additional_config={"wedlm": {"window": 2}},
                     scheduler_cls="vllm.v1.core.sched.diffusion_scheduler."
                                   "DiffusionScheduler") as engine, \
            pytest.raises(Exception) as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    chain = [failure.value, *_causes(failure.value)]
    assert any(isinstance(error, NoProgressError) for error in chain), chain
    assert "committed no token in 21 decode steps" in str(
        next(e for e in chain if isinstance(e, NoProgressError)))


def _causes(error):
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
        yield error
