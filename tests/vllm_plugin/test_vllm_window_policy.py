"""The adaptive window (``window_policy: "adaptive"``, wedlm_kernels.window_policy) in the
plugin: each request's window is sized step by step as in model_min, token for token, in
the same forwards and live rows, greedy and seeded, per engine and per request, with a
request's own window, under preemption and under asynchronous scheduling; "fixed" requests
in an adaptive engine decode as before; the settings are checked by name."""

import pytest
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats, row_stats
from wedlm_kernels.integrations.vllm.settings import (
    SettingsError,
    engine_settings,
    request_settings,
)

from .conftest import WINDOW
from .test_vllm_async import async_engine_of
from .test_vllm_decoding import PROMPTS, vllm_generate

ADAPTIVE = {"wedlm": {"window": WINDOW, "window_policy": "adaptive", "min_window": 1}}
SEEDS = [11, 12, 13, 2**40 + 7]


def served(max_tokens, temperature=0.0, seed=None, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          ignore_eos=True, extra_args=extra or None)


def model_min_run(reference, prompts, params, window=WINDOW, **generator):
    """model_min's (token ids, forwards, rows) per prompt; ``generator``: the Generator's
    window_policy, min_window and max_batch."""
    model, _ = reference
    generator = model_min.Generator(model, window=window, **{"max_batch": 4, **generator})
    return [(r.token_ids, r.forwards, r.rows) for r in generator.generate(prompts, params)]


def wanted(max_new_tokens, temperature=0.0, seeds=(None,) * 4, **fields):
    return [model_min.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                     seed=seed, **fields) for seed in seeds]


@pytest.fixture(scope="module")
def adaptive_engine(engines):
    """An engine whose requests take the adaptive window by default, with a floor of one
    mask (so that unpredictable text shrinks windows to one mask)."""
    with engines.own(additional_config=ADAPTIVE) as llm:
        yield llm


def test_greedy_and_seeded_adaptive_windows_equal_model_min(adaptive_engine, reference):
    greedy = vllm_generate(adaptive_engine, PROMPTS, served(40))
    assert greedy == model_min_run(reference, PROMPTS, wanted(40), window_policy="adaptive",
                                   min_window=1)
    seeded = vllm_generate(adaptive_engine, PROMPTS,
                           [served(32, 1.0, seed) for seed in SEEDS])
    assert seeded == model_min_run(reference, PROMPTS, wanted(32, 1.0, SEEDS),
                                   window_policy="adaptive", min_window=1)


def test_the_adaptive_window_feeds_fewer_rows_per_token_on_unpredictable_text(
        adaptive_engine, reference):
    # sampled at temperature 1, the tiny model commits about one token per forward: the
    # adaptive windows shrink (fewer live rows per token than the fixed window's), and the
    # live canvas schedules only those rows
    params = [served(32, 1.0, seed) for seed in SEEDS]
    before = row_stats(adaptive_engine)
    adaptive = vllm_generate(adaptive_engine, PROMPTS, params)
    after = row_stats(adaptive_engine)
    fixed = model_min_run(reference, PROMPTS, wanted(32, 1.0, SEEDS))
    tokens = sum(len(t) for t, _, _ in adaptive)
    assert tokens == sum(len(t) for t, _, _ in fixed) == 4 * 32
    assert sum(r for _, _, r in adaptive) < 0.75 * sum(r for _, _, r in fixed)
    fed = after["rows_fed"] - before["rows_fed"]
    assert fed == after["live_rows"] - before["live_rows"] == sum(r for _, _, r in adaptive)


def test_a_request_chooses_the_adaptive_window_in_a_fixed_engine(engine, reference):
    # the shared engine (window_policy "fixed", max_num_seqs 4: the CPU's 32-row budget
    # gives a floor of 4 masks, as model_min's max_batch 4); one request adaptive with a
    # window of its own, one adaptive, one fixed, one block-wise asking for adaptive
    extras = [{"wedlm_window_policy": "adaptive", "wedlm_window": 5},
              {"wedlm_window_policy": "adaptive"}, {},
              {"wedlm_window_policy": "adaptive", "wedlm_mode": "blockwise"}]
    got = vllm_generate(engine, PROMPTS, [served(30, 1.0, seed, **extra)
                                          for seed, extra in zip(SEEDS, extras)])
    for prompt, seed, extra, result in zip(PROMPTS, SEEDS, extras, got):
        policy = extra.get("wedlm_window_policy")
        model, _ = reference
        generator = model_min.Generator(model, window=extra.get("wedlm_window", WINDOW),
                                        max_batch=4, min_window=4)
        [want] = generator.generate([prompt], wanted(30, 1.0, [seed], window_policy=policy)[:1],
                                    mode=extra.get("wedlm_mode", "streaming"))
        assert result == (want.token_ids, want.forwards, want.rows), extra


def test_a_fixed_request_in_an_adaptive_engine_decodes_as_in_a_fixed_engine(
        adaptive_engine, reference):
    got = vllm_generate(adaptive_engine, PROMPTS, [served(24, 1.0, seed,
                                                          wedlm_window_policy="fixed")
                                                   for seed in SEEDS])
    assert got == model_min_run(reference, PROMPTS, wanted(24, 1.0, SEEDS))


def test_preempted_adaptive_requests_resume_their_window_and_its_policy(engines, reference):
    # 10 cache blocks of 32 positions for 8 requests of 3 to 4 blocks each: vLLM preempts
    # and resumes them; each resumes its window and the policy's state with it, so each
    # decodes exactly as alone
    count = 8
    bases = [PROMPTS[1], PROMPTS[3], PROMPTS[0], list(b"Once upon a time")]
    prompts = [(bases[i % 4] * 2)[: 20 + (i * 7) % 30] for i in range(count)]
    settings = [dict(max_tokens=60 + (i % 3) * 10, temperature=1.0 if i % 2 else 0.0,
                     seed=100 + i) for i in range(count)]
    with engines.own(num_gpu_blocks_override=10, additional_config=ADAPTIVE) as engine:
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                                  [served(**kw) for kw in settings], use_tqdm=False)
        stats = request_stats(engine, [o.request_id for o in outputs])
    restarts = [stats[o.request_id]["restarts"] for o in outputs]
    assert sum(map(len, restarts)) >= 4, f"{restarts}: the test needs a smaller cache"
    for prompt, kw, output in zip(prompts, settings, outputs):
        [alone] = model_min_run(reference, [prompt], wanted(
            kw["max_tokens"], kw["temperature"], [kw["seed"]])[:1],
            window_policy="adaptive", min_window=1)
        assert (list(output.outputs[0].token_ids), stats[output.request_id]["forwards"],
                stats[output.request_id]["rows"]) == alone


def test_adaptive_windows_equal_model_min_under_asynchronous_scheduling(engines, reference):
    with async_engine_of(engines, additional_config=ADAPTIVE) as engine:
        got = vllm_generate(engine, PROMPTS, [served(24, 1.0, seed) for seed in SEEDS])
    assert got == model_min_run(reference, PROMPTS, wanted(24, 1.0, SEEDS),
                                window_policy="adaptive", min_window=1)


def test_the_settings_are_checked_by_name():
    for config, name in [({"window_policy": "wide"}, '["window_policy"]'),
                         ({"min_window": 0}, '["min_window"]'),
                         ({"window": 4, "min_window": 5}, '["min_window"]'),
                         ({"min_window": 2.0}, '["min_window"]')]:
        with pytest.raises(SettingsError, match=rf'additional_config\["wedlm"\]\{name}'):
            engine_settings({"wedlm": config})
    engine = engine_settings({"wedlm": {"window": 8, "window_policy": "adaptive"}})
    with pytest.raises(SettingsError, match="wedlm_window_policy") as refused:
        request_settings(engine, {"wedlm_window_policy": "AR"})
    assert refused.value.parameter == "extra_args['wedlm_window_policy']"
    # None: the engine's; a request's own window keeps the engine's floor
    assert request_settings(engine, {"wedlm_window_policy": None}).window_policy == "adaptive"
    assert request_settings(engine, {"wedlm_window_policy": "fixed"}).window_policy == "fixed"
    assert engine_settings({}).window_policy == "fixed"
