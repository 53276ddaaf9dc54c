"""``logprobs`` served by WeDLM decoding (docs/requests.md, "Logprobs"): each committed
token's entry and its alternatives, from the distribution its slot was filled from at the
step that filled it, equal to model_min's (the same tokens; the values within the two
engines' float32 rounding), in vLLM's format, greedy and seeded, with logit rules, a
grammar, the engine's processed mode and under preemption."""

import math

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats

from .conftest import WINDOW
from .test_vllm_decoding import PROMPTS, vllm_generate

TOLERANCE = 2e-4  # the two engines' logits differ by float32 rounding (attention order)


def served_logprobs(engine, prompts, params):
    """(token ids, [{token: (logprob, rank)}] per token) per prompt, from vLLM."""
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: (e.logprob, e.rank) for t, e in position.items()}
              for position in o.outputs[0].logprobs]) for o in outputs]


def reference_logprobs(reference, prompts, params, mode="streaming", logprobs_mode=None):
    model, _ = reference
    options = {} if logprobs_mode is None else {"logprobs_mode": logprobs_mode}
    generator = model_min.Generator(model, window=WINDOW, max_batch=len(prompts), **options)
    return [(r.token_ids, [{t: tuple(e) for t, e in position.items()}
                           for position in r.logprobs])
            for r in generator.generate(prompts, params, mode=mode)]


def assert_same(got, want):
    """The same tokens; per position the same entries (the chosen token's rank exact, the
    alternatives as a set up to near-ties) and values within TOLERANCE."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (tokens, served), (_, expected) in zip(got, want):
        assert len(served) == len(expected) == len(tokens)
        for token, a, b in zip(tokens, served, expected):
            assert token in a and token in b
            assert a[token][1] == b[token][1]
            assert a[token][0] == pytest.approx(b[token][0], abs=TOLERANCE)
            assert len(a) == len(b)
            for alternative in set(a) & set(b):
                assert a[alternative][0] == pytest.approx(b[alternative][0], abs=TOLERANCE)
            assert sorted(v for v, _ in a.values()) == pytest.approx(
                sorted(v for v, _ in b.values()), abs=TOLERANCE)


def both(seed, logprobs, max_tokens=20, **fields):
    sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    return (SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                           **sampling, **fields),
            model_min.SamplingParams(max_new_tokens=max_tokens, logprobs=logprobs,
                                     **sampling, **fields))


@pytest.mark.parametrize("seed", [None, 9], ids=["greedy", "seeded"])
@pytest.mark.parametrize("logprobs", [0, 5])
def test_logprobs_equal_model_mins(engine, reference, seed, logprobs):
    served, wanted = both(seed, logprobs)
    got = served_logprobs(engine, PROMPTS, served)
    assert_same(got, reference_logprobs(reference, PROMPTS, wanted))
    for tokens, positions in got:
        for token, position in zip(tokens, positions):
            assert len(position) in (logprobs, logprobs + 1)  # the token among the top or not
            assert all(value <= 0 for value, _ in position.values())
            ranks = sorted(rank for t, (_, rank) in position.items() if t != token)
            assert ranks == list(range(1, len(ranks) + 1)) or position[token][1] <= logprobs


def test_logprobs_leave_tokens_and_forwards_unchanged(engine, reference):
    """Asking for logprobs changes nothing else, in a batch that mixes requests with and
    without them (the records of a slot are its own)."""
    plain, _ = both(5, None)
    asked = [both(5, k)[0] for k in (None, 3, None, 0)]
    tokens = vllm_generate(engine, PROMPTS, [plain] * len(PROMPTS))
    assert vllm_generate(engine, PROMPTS, asked) == tokens
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], asked,
                              use_tqdm=False)
    assert [o.outputs[0].logprobs is None for o in outputs] == [True, False, True, False]
    for output in outputs:
        if output.outputs[0].logprobs is not None:
            assert output.outputs[0].cumulative_logprob == pytest.approx(sum(
                position[t].logprob for t, position in zip(output.outputs[0].token_ids,
                                                           output.outputs[0].logprobs)),
                abs=1e-3)


def test_logprobs_with_logit_rules_are_the_raw_distribution(engine, reference):
    """vLLM's default mode (raw_logprobs): the model's distribution before the rules; a
    banned token keeps its raw value."""
    fields = {"presence_penalty": 1.0, "logit_bias": {53: 3.0}, "min_p": 0.05}
    served, wanted = both(3, 4, **fields)
    got = served_logprobs(engine, PROMPTS, served)
    assert_same(got, reference_logprobs(reference, PROMPTS, wanted))
    allowed, _ = both(None, 2, allowed_token_ids=[48, 49, 50])
    for tokens, positions in served_logprobs(engine, PROMPTS[:2], allowed):
        assert set(tokens) <= {48, 49, 50}
        # the alternatives are the model's favourites, banned or not
        assert any(set(p) - {48, 49, 50} for p in positions)


def test_logprobs_under_a_grammar(engine, reference):
    served = SamplingParams(max_tokens=16, temperature=0, logprobs=2, structured_outputs=(
        StructuredOutputsParams(regex="[a-c]{3}-[0-9]{4}")))
    for tokens, positions in served_logprobs(engine, PROMPTS[:2], served):
        assert len(positions) == len(tokens)
        # a forced token is the only one the grammar's mask leaves: probability 1 (raw
        # logprobs are taken after the grammar's mask, as vLLM does)
        assert any(math.isclose(p[t][0], 0.0, abs_tol=1e-6) for t, p in zip(tokens, positions))


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_the_engines_logprobs_mode(engines, reference, mode):
    served, wanted = both(6, 3, top_k=20, top_p=0.9, repetition_penalty=1.3)
    with engines.own(logprobs_mode=mode) as engine:
        got = served_logprobs(engine, PROMPTS, served)
    assert_same(got, reference_logprobs(reference, PROMPTS, wanted, logprobs_mode=mode))
    if mode == "processed_logprobs":  # the token is among the kept, top-p cuts the rest
        assert all(math.isfinite(p[t][0]) for tokens, ps in got for t, p in zip(tokens, ps))
        assert any(v == -math.inf for _, ps in got for p in ps for v, _ in p.values())
    else:  # logits, not log-probabilities: some above 0
        assert any(v > 0 for _, ps in got for p in ps for v, _ in p.values())


def test_logprobs_survive_preemption(engines, reference):
    """A cache too small for the batch preempts requests mid-window; a resumed request's
    filled, uncommitted slots keep the records of the steps that filled them, so each
    request's logprobs equal model_min's for it alone."""
    count = 8
    bases = [PROMPTS[1], PROMPTS[3], PROMPTS[0], list(b"Once upon a time")]
    prompts = [(bases[i % 4] * 2)[: 20 + (i * 7) % 30] for i in range(count)]
    pairs = [both(100 + i if i % 2 else None, 2, max_tokens=60 + (i % 3) * 10)
             for i in range(count)]
    with engines.own(num_gpu_blocks_override=10) as engine:
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                                  [served for served, _ in pairs], use_tqdm=False)
        stats = request_stats(engine, [o.request_id for o in outputs])
    restarts = [stats[o.request_id]["restarts"] for o in outputs]
    assert sum(map(len, restarts)) >= 4, f"{restarts}: the test needs a smaller cache"
    for prompt, (_, wanted), output in zip(prompts, pairs, outputs):
        got = (list(output.outputs[0].token_ids),
               [{t: (e.logprob, e.rank) for t, e in position.items()}
                for position in output.outputs[0].logprobs])
        assert_same([got], reference_logprobs(reference, [prompt], wanted))


@pytest.mark.parametrize("seed", [None, 9], ids=["greedy", "seeded"])
def test_named_token_logprobs_equal_model_mins(engine, reference, seed):
    """logprob_token_ids: per token, the token's entry and each named id's, from the
    distribution its slot was filled from; beside a top-k request, a plain one and one
    naming 100 ids (wider than the 64 alternatives a slot keeps otherwise)."""
    named = [32, 101, 108, 32, 0]  # a repeat, and an id the model never writes
    fields = [dict(logprob_token_ids=named), dict(logprobs=4), dict(),
              dict(logprob_token_ids=list(range(20, 120)))]
    pairs = [both(seed, f.pop("logprobs", None), **f) for f in fields]
    got = served_logprobs(engine, PROMPTS[:1], pairs[0][0])
    wanted = reference_logprobs(reference, PROMPTS[:1], pairs[0][1])
    assert_same(got, wanted)
    for tokens, positions in got:
        assert all(set(p) == {t, *named} for t, p in zip(tokens, positions))
        assert all(p[0][1] == 5 for p in positions)  # id 0's rank: its column
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS],
                              [served for served, _ in pairs], use_tqdm=False)
    for prompt, output, (_, want) in zip(PROMPTS, outputs, pairs):
        result = output.outputs[0]
        if want.logprobs is None and want.logprob_token_ids is None:
            assert result.logprobs is None
            continue
        got = [(list(result.token_ids), [{t: (e.logprob, e.rank) for t, e in position.items()}
                                         for position in result.logprobs])]
        assert_same(got, reference_logprobs(reference, [prompt], want))
    wide = outputs[3].outputs[0]
    assert all(set(p) == {t, *range(20, 120)} for t, p in zip(wide.token_ids, wide.logprobs))


@pytest.mark.parametrize("value", [65, -2, 1.5])
def test_a_logprobs_count_out_of_bounds_is_refused_by_name(engine, value):
    """(vLLM's own check comes first here, at its max_logprobs of 20; WeDLM's bound, 64
    and the vocabulary, is tested in tests/test_vllm_settings.py.)"""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises((VLLMValidationError, ValueError, TypeError), match="logprobs"):
        engine.generate([{"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(max_tokens=4, logprobs=value), use_tqdm=False)
