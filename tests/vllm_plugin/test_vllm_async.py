"""vLLM's asynchronous scheduling (its default on a GPU) on the CPU: the CPU platform turns
it off (``CpuPlatform.check_and_update_config``), so this module's engine turns it back on
after that hook, test-only. vLLM then runs ``DiffusionAsyncScheduler`` and the engine
core's batch queue: each step is scheduled while the previous one is still in flight (its
canvas rows as placeholders), so a request can finish with a step in flight, and the
canvas is the fixed 2W rows (the live count would be a step stale). The decoding must
still equal model_min's token for token, up to max_model_len: there vLLM bounds a canvas
counting the rows still in flight as computed, and the plugin's scheduler has a request that
bound would cut wait for its step in flight instead (docs/vllm.md, "Asynchronous
scheduling")."""

import contextlib
from types import SimpleNamespace

import pytest
import vllm
from vllm import SamplingParams
from vllm.platforms import current_platform
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.core.sched.diffusion_scheduler import DiffusionAsyncScheduler, DiffusionScheduler

import model_min
from wedlm_kernels.integrations.vllm import row_stats
from wedlm_kernels.integrations.vllm import scheduler as scheduler_module
from wedlm_kernels.integrations.vllm.scheduler import WeDLMAsyncScheduler, WeDLMScheduler

from .conftest import WINDOW
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

MAX_MODEL_LEN = 80


@contextlib.contextmanager
def async_engine_of(engines, **overrides):
    """An engine of its own with vLLM's asynchronous scheduling on (the CPU platform's hook
    turns it off; this turns it back on after that hook, for this engine's config only)."""
    platform = type(current_platform)
    vllm_hook = platform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config):
        vllm_hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(platform, "check_and_update_config", classmethod(keep_async_scheduling))
        with engines.own(max_model_len=MAX_MODEL_LEN, **overrides) as llm:
            patch.undo()
            assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
            yield llm


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


@pytest.fixture(scope="module")
def async_engine(engines):
    with async_engine_of(engines) as llm:
        assert type(scheduler_of(llm)) is WeDLMAsyncScheduler
        yield llm


def test_greedy_and_seeded_equal_model_min(async_engine, reference):
    greedy = vllm_generate(async_engine, PROMPTS, SamplingParams(
        max_tokens=22, temperature=0, ignore_eos=True))
    assert greedy == reference_generate(reference, PROMPTS,
                                        model_min.SamplingParams(max_new_tokens=22))
    seeds = [11, 12, 13, 2**40 + 7]
    seeded = vllm_generate(async_engine, PROMPTS, [SamplingParams(
        max_tokens=24, temperature=0.9, top_k=12, top_p=0.95, seed=seed, ignore_eos=True)
        for seed in seeds])
    assert seeded == reference_generate(reference, PROMPTS, [model_min.SamplingParams(
        max_new_tokens=24, temperature=0.9, top_k=12, top_p=0.95, seed=seed)
        for seed in seeds])


def test_blockwise_and_mixed_settings_equal_model_min(async_engine, reference):
    settings = [
        {"wedlm_mode": "blockwise"},
        {"wedlm_mode": "blockwise", "wedlm_window": 4},
        {"wedlm_window": 5, "wedlm_distance_penalty": 0.1},
        {"wedlm_entropy_threshold": None},
    ]
    got = vllm_generate(async_engine, PROMPTS, [SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, extra_args=extra) for extra in settings])
    for prompt, extra, result in zip(PROMPTS, settings, got):
        want = reference_generate(
            reference, [prompt],
            model_min.SamplingParams(max_new_tokens=20,
                                     threshold=extra.get("wedlm_entropy_threshold", 0.4),
                                     penalty=extra.get("wedlm_distance_penalty", 0.02)),
            mode=extra.get("wedlm_mode", "streaming"), window=extra.get("wedlm_window", WINDOW))
        assert [result] == want, extra


def test_stop_ids_and_eos_end_requests_with_a_step_in_flight(async_engine, reference):
    # each request stops at its tenth token while its next step is already scheduled
    greedy = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=30))
    stops = [[tokens[9]] for tokens, _, _ in greedy]
    got = vllm_generate(async_engine, PROMPTS, [SamplingParams(
        max_tokens=30, temperature=0, stop_token_ids=s) for s in stops])
    eos = 256  # config.json's eos_token_id
    assert got == reference_generate(reference, PROMPTS, [model_min.SamplingParams(
        max_new_tokens=30, stop_token_ids=(eos, *s)) for s in stops])
    assert all(len(tokens) <= 10 for tokens, _, _ in got)


def test_requests_decode_to_max_model_len_equal_to_model_min(async_engine, reference):
    # max_tokens None: up to max_model_len. vLLM's bound counts the rows in flight, so
    # without the plugin's scheduler a window is cut in the last 4W positions (and decodes
    # otherwise than model_min's); before the refill rule a cut window spun at 0 live slots
    got = vllm_generate(async_engine, PROMPTS, SamplingParams(max_tokens=None, temperature=0,
                                                              ignore_eos=True))
    assert got == reference_generate(reference, PROMPTS, [model_min.SamplingParams(
        max_new_tokens=MAX_MODEL_LEN - len(prompt)) for prompt in PROMPTS])
    assert all(len(prompt) + len(tokens) == MAX_MODEL_LEN
               for prompt, (tokens, _, _) in zip(PROMPTS, got))
    seeds = [5, 6, 7, 8]
    seeded = vllm_generate(async_engine, PROMPTS, [SamplingParams(
        max_tokens=None, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
        for seed in seeds])
    assert seeded == reference_generate(reference, PROMPTS, [model_min.SamplingParams(
        max_new_tokens=MAX_MODEL_LEN - len(prompt), temperature=0.8, top_k=20, seed=seed)
        for prompt, seed in zip(PROMPTS, seeds)])


def test_asynchronous_scheduling_feeds_the_fixed_canvas(async_engine):
    before = row_stats(async_engine)
    got = vllm_generate(async_engine, PROMPTS, SamplingParams(
        max_tokens=22, temperature=0, ignore_eos=True))
    after = row_stats(async_engine)
    fed = after["rows_fed"] - before["rows_fed"]
    live = after["live_rows"] - before["live_rows"]
    # every step 2W rows per request, a step past each request's end included
    assert fed % (2 * WINDOW) == 0 and live == sum(rows for _, _, rows in got) < fed


@pytest.mark.parametrize("async_scheduling, version, chosen", [
    (False, "0.32.0", WeDLMScheduler),
    (False, "0.33.0", DiffusionScheduler),
    (True, "0.32.0", WeDLMAsyncScheduler),
    (True, "0.32.0+cu130", WeDLMAsyncScheduler),
    (True, "0.33.0", DiffusionAsyncScheduler),
])
def test_the_scheduler_is_chosen_by_the_final_config_and_the_vllm_release(
        monkeypatch, caplog, async_scheduling, version, chosen):
    made = []
    for cls in (DiffusionScheduler, DiffusionAsyncScheduler, WeDLMScheduler,
                WeDLMAsyncScheduler):
        monkeypatch.setattr(scheduler_module, cls.__name__,
                            lambda *args, cls=cls, **kwargs: made.append((cls, args, kwargs)))
    monkeypatch.setattr(vllm, "__version__", version)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(
        async_scheduling=async_scheduling))
    scheduler_module.make_scheduler(vllm_config=config, block_size=32)
    assert made == [(chosen, (), {"vllm_config": config, "block_size": 32})]
    warned = "written for vLLM" in caplog.text
    assert warned == (chosen is DiffusionAsyncScheduler)


@pytest.mark.parametrize("case", ["json", "regex"])
def test_structured_outputs_equal_model_min_under_asynchronous_scheduling(
        async_engine, reference, case):
    """The window a step is fed reaches the scheduler before the step's grammar rows are
    built (vLLM defers the sampling of a structured request with a step in flight), and a
    step fed another window than the one walked commits nothing (docs/vllm.md)."""
    from .test_vllm_structured import assert_valid, both

    for seed in (None, 9):
        served, wanted = both(async_engine, case, seed)
        got = vllm_generate(async_engine, PROMPTS, served)
        assert [tokens for tokens, _, _ in got] == [
            tokens for tokens, _, _ in reference_generate(reference, PROMPTS, wanted)]
        assert_valid(case, got)


def test_a_lone_structured_request_decodes_up_to_max_model_len(async_engine, reference):
    """Near max_model_len vLLM's length bound skips a request while its step is in flight,
    so its next step is not deferred; the window is fetched after every step anyway, so the
    request is walked from its window and runs to the limit (it never ends on eos)."""
    prompt = PROMPTS[1]
    served = SamplingParams(max_tokens=MAX_MODEL_LEN - len(prompt), temperature=0,
                            structured_outputs=StructuredOutputsParams(regex="[ab]{1000}"))
    [output] = async_engine.generate([{"prompt_token_ids": prompt}], served, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    assert len(tokens) == MAX_MODEL_LEN - len(prompt) and set(tokens) <= {ord("a"), ord("b")}
    assert output.outputs[0].finish_reason == "length"


def test_logprobs_equal_model_min_under_asynchronous_scheduling(async_engine, reference):
    """A step's committed records reach vLLM with its tokens while the next step is in
    flight (the fixed canvas: other rows per request than the live canvas's)."""
    from .test_vllm_logprobs import assert_same, both, reference_logprobs, served_logprobs

    pairs = [both(seed, k, max_tokens=30) for seed, k in ((None, 2), (8, 0), (9, 5), (None, 1))]
    got = served_logprobs(async_engine, PROMPTS, [served for served, _ in pairs])
    assert_same(got, reference_logprobs(reference, PROMPTS, [wanted for _, wanted in pairs]))


def test_bad_words_equal_model_min_under_asynchronous_scheduling(async_engine, reference):
    """The committed tail a word's left context reads is the step's own (the next step is
    planned before it lands)."""
    from .test_vllm_bad_words import both

    pairs = [both(None), both(6), both(None, words=None), both(2, words=["a", "b c"])]
    got = vllm_generate(async_engine, PROMPTS, [served for served, _ in pairs])
    assert got == reference_generate(reference, PROMPTS, [wanted for _, wanted in pairs])
