"""Decoding through vLLM equals model_min's Generator token for token, in the same number
of forwards, on the shipped tiny model (greedy and seeded sampling, streaming and
block-wise, mixed prompt lengths, length and stop limits)."""

import pytest
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats

from .conftest import WINDOW

PROMPTS = [
    [72, 101, 108, 108, 111, 32],
    list(range(40, 61)),
    [1, 2, 3],
    list(b"def add(a, b):\n    return"),
]


def vllm_generate(engine, prompts, params):
    """(token ids, forwards, rows) per prompt."""
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    stats = request_stats(engine, [o.request_id for o in outputs])
    return [(list(o.outputs[0].token_ids), stats[o.request_id]["forwards"],
             stats[o.request_id]["rows"]) for o in outputs]


def reference_generate(reference, prompts, params, mode="streaming", window=WINDOW):
    model, _ = reference
    generator = model_min.Generator(model, window=window, max_batch=len(prompts))
    return [(r.token_ids, r.forwards, r.rows)
            for r in generator.generate(prompts, params, mode=mode)]


# The requests of the engines of several processes (tensor and pipeline parallel, Ray):
# greedy, and seeded sampling with top-k and top-p
PARALLEL_GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PARALLEL_SEEDS = [11, 12, 13, 2**40 + 7]
PARALLEL_SEEDED = [SamplingParams(max_tokens=16, temperature=0.9, top_k=12, top_p=0.95,
                                  seed=seed, ignore_eos=True) for seed in PARALLEL_SEEDS]


def parallel_reference(reference) -> tuple[list, list]:
    """model_min's (token ids, forwards, rows) per prompt of PROMPTS for PARALLEL_GREEDY and
    for PARALLEL_SEEDED."""
    greedy = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=24))
    seeded = reference_generate(reference, PROMPTS, [
        model_min.SamplingParams(max_new_tokens=16, temperature=0.9, top_k=12, top_p=0.95,
                                 seed=seed) for seed in PARALLEL_SEEDS])
    return greedy, seeded


def test_greedy_streaming_equals_model_min(engine, reference):
    got = vllm_generate(engine, PROMPTS, SamplingParams(max_tokens=40, temperature=0,
                                                        ignore_eos=True))
    want = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=40))
    assert got == want
    assert all(len(tokens) == 40 for tokens, _, _ in got)
    assert any(forwards < 40 for _, forwards, _ in got)  # more than one token per forward


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0),
                                                       (1.3, 0, 0.8), (0.9, 12, 0.95)])
def test_seeded_sampling_equals_model_min(engine, reference, temperature, top_k, top_p):
    seeds = [11, 12, 13, 2**40 + 7]
    params = [SamplingParams(max_tokens=24, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, ignore_eos=True) for seed in seeds]
    got = vllm_generate(engine, PROMPTS, params)
    want = reference_generate(reference, PROMPTS, [
        model_min.SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed) for seed in seeds])
    assert got == want


def test_blockwise_equals_model_min(engine, reference):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                            extra_args={"wedlm_mode": "blockwise"})
    got = vllm_generate(engine, PROMPTS, params)
    want = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=30),
                              mode="blockwise")
    assert got == want


def test_mixed_modes_windows_and_thresholds_in_one_batch(engine, reference):
    settings = [
        {"wedlm_mode": "blockwise", "wedlm_window": 4},
        {"wedlm_window": 5, "wedlm_distance_penalty": 0.1},
        {"wedlm_entropy_threshold": None},
        {"wedlm_mode": "blockwise", "wedlm_entropy_threshold": 1.5},
    ]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, extra_args=extra)
              for extra in settings]
    got = vllm_generate(engine, PROMPTS, params)
    for prompt, extra, result in zip(PROMPTS, settings, got):
        threshold = extra.get("wedlm_entropy_threshold", 0.4)
        want = reference_generate(
            reference, [prompt],
            model_min.SamplingParams(max_new_tokens=20, threshold=threshold,
                                     penalty=extra.get("wedlm_distance_penalty", 0.02)),
            mode=extra.get("wedlm_mode", "streaming"), window=extra.get("wedlm_window", WINDOW))
        assert [result] == want, extra


def test_max_tokens_and_stop_ids_end_requests_as_in_model_min(engine, reference):
    # stop ids taken from the greedy continuations, so that each request meets one
    greedy = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=30))
    stops = [(tokens[9],) for tokens, _, _ in greedy]
    max_tokens = [30, 7, 1, 17]
    params = [SamplingParams(max_tokens=m, temperature=0, stop_token_ids=list(s),
                             ignore_eos=True) for m, s in zip(max_tokens, stops)]
    got = vllm_generate(engine, PROMPTS, params)
    want = reference_generate(reference, PROMPTS, [
        model_min.SamplingParams(max_new_tokens=m, stop_token_ids=s)
        for m, s in zip(max_tokens, stops)])
    assert got == want
    assert any(len(tokens) < m for (tokens, _, _), m in zip(got, max_tokens))


def test_24_stop_ids_and_eos_each_end_a_request_as_in_model_min(engine, reference):
    # 23 ids the continuations never commit, then the one each commits at its tenth token
    # (vLLM adds eos in front of them: 25 stop ids on the device)
    greedy = reference_generate(reference, PROMPTS, model_min.SamplingParams(max_new_tokens=30))
    unused = [t for t in range(128, 256) if all(t not in tokens for tokens, _, _ in greedy)]
    stops = [unused[:23] + [tokens[9]] for tokens, _, _ in greedy]
    params = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=s) for s in stops]
    got = vllm_generate(engine, PROMPTS, params)
    eos = 256  # config.json's eos_token_id
    want = reference_generate(reference, PROMPTS, [
        model_min.SamplingParams(max_new_tokens=30, stop_token_ids=(eos, *s)) for s in stops])
    assert got == want
    assert all(len(tokens) <= 10 for tokens, _, _ in got)


def test_eos_ends_a_request_unless_ignore_eos(engine, reference):
    eos = 256  # config.json's eos_token_id
    prompt = [list(b"x = 1\n")]
    stopped = vllm_generate(engine, prompt, SamplingParams(max_tokens=60, temperature=0))
    ignored = vllm_generate(engine, prompt, SamplingParams(max_tokens=60, temperature=0,
                                                           ignore_eos=True))
    want = reference_generate(reference, prompt, model_min.SamplingParams(
        max_new_tokens=60, stop_token_ids=(eos,)))
    assert stopped == want
    assert ignored == reference_generate(reference, prompt,
                                         model_min.SamplingParams(max_new_tokens=60))


def test_a_stop_string_ends_the_request_where_vllm_finds_it(engine, reference):
    _, tokenizer = reference
    prompt = tokenizer.encode("def add(a, b):\n    return")
    full = reference_generate(reference, [prompt], model_min.SamplingParams(
        max_new_tokens=40))[0][0]
    text = tokenizer.decode(full)
    stop = text[12:15]
    output = engine.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].text == text[: text.index(stop)]
    tokens = list(output.outputs[0].token_ids)
    assert tokens == full[: len(tokens)] and len(tokens) < len(full)
