"""``bad_words`` served by WeDLM decoding (docs/requests.md, "Bad words"): vLLM tokenizes
each word (with and without a leading space) and the window never commits one; the tokens
and forwards equal model_min's with the same token ids, greedy and seeded, alone, mixed
with plain requests, under preemption and asynchronous scheduling; bad values and the
combination with structured outputs are refused by name."""

import functools

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.tokenizers import get_tokenizer

import model_min
from reference.bad_words import contains_word

from .conftest import TINY
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

WORDS = ["77", ",,", "57", "ol", "oo", "ar", "the"]  # pairs the tiny model writes


@functools.cache
def tokenizer():
    return get_tokenizer(str(TINY))


def token_ids(words: list[str] | None) -> list[list[int]] | None:
    """The words' token ids as vLLM finds them (SamplingParams.update_from_tokenizer)."""
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tokenizer())
    return params.bad_words_token_ids


def both(seed, words=WORDS, max_tokens=30):
    sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    return (SamplingParams(max_tokens=max_tokens, ignore_eos=True, bad_words=words,
                           **sampling),
            model_min.SamplingParams(max_new_tokens=max_tokens,
                                     bad_words_token_ids=token_ids(words), **sampling))


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_bad_words_decode_model_mins_tokens_and_never_a_word(engine, reference, seed):
    served, wanted = both(seed)
    got = vllm_generate(engine, PROMPTS, served)
    assert got == reference_generate(reference, PROMPTS, wanted)
    ids = token_ids(WORDS)
    for tokens, _, _ in got:
        assert not contains_word(tokens, ids)
    # (not vacuous: without the rule some output holds a word, and the tokens differ)
    plain = vllm_generate(engine, PROMPTS, both(seed, words=None)[0])
    assert any(contains_word(tokens, ids) for tokens, _, _ in plain)
    assert any(forwards < len(tokens) for tokens, forwards, _ in got)


def test_a_batch_mixes_bad_words_with_plain_requests(engine, reference):
    """Slots that held bad words serve plain requests exactly (the first round fills every
    slot with words; the second puts plain requests in some of them)."""
    for pairs in ([both(3), both(None), both(None, words=["a", "b c"]), both(7)],
                  [both(3), both(None, words=None), both(None, words=["a", "b c"]),
                   both(7, words=None)]):
        got = vllm_generate(engine, PROMPTS, [served for served, _ in pairs])
        assert got == reference_generate(reference, PROMPTS, [wanted for _, wanted in pairs])


def test_bad_words_survive_preemption(engines, reference):
    count = 8
    bases = [PROMPTS[1], PROMPTS[3], PROMPTS[0], list(b"Once upon a time")]
    prompts = [(bases[i % 4] * 2)[: 20 + (i * 7) % 30] for i in range(count)]
    pairs = [both(100 + i if i % 2 else None, max_tokens=60 + (i % 3) * 10)
             for i in range(count)]
    with engines.own(num_gpu_blocks_override=10) as engine:
        got = vllm_generate(engine, prompts, [served for served, _ in pairs])
    for prompt, (_, wanted), result in zip(prompts, pairs, got):
        assert [result] == reference_generate(reference, [prompt], wanted)


@pytest.mark.parametrize("words, message", [
    (["x" * 200], "tokens, more than 16"),
    ([f"w{i}" for i in range(150)], "words"),
])
def test_bad_words_past_the_bounds_are_refused_by_name(engine, words, message):
    with pytest.raises(VLLMValidationError, match=message) as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(max_tokens=4, bad_words=words), use_tqdm=False)
    assert failure.value.parameter == "bad_words"


def test_bad_words_with_structured_outputs_are_refused_by_name(engine):
    with pytest.raises(VLLMValidationError, match="bad_words") as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
            max_tokens=4, bad_words=["a"],
            structured_outputs=StructuredOutputsParams(regex="[ab]+")), use_tqdm=False)
    assert failure.value.parameter == "bad_words"
