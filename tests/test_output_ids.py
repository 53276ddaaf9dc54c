"""wedlm_kernels.requests.output_ids: which ids no request outputs (the mask id, the ids the
tokenizer does not decode), read from a checkpoint's tokenizer.json; and model_min never
writing one, whatever a request's logit rules or grammar say (docs/requests.md, "Ids never
output")."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_min import Generator, SamplingParams, load_model
from tests.grammars import Choice
from wedlm_kernels.requests.grammar import token_allowed
from wedlm_kernels.requests.output_ids import never_output_ids, output_bitmask, tokenizer_ids
from wedlm_kernels.requests.params import allowed_bitmask

TINY = Path(__file__).resolve().parent.parent / "model_min" / "tiny_wedlm"
EOS, MASK = 256, 257
NEVER = {257, 258, 259, 260, 261, 262, 263}  # the tiny model: 264 rows, 258 tokens


def write_tokenizer(folder: Path, model: dict, added=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps({
        "model": model, "added_tokens": [{"id": i, "content": f"<{i}>"} for i in added]}))
    return folder


def test_the_tiny_checkpoints_tokenizer_decodes_ids_0_to_257():
    assert tokenizer_ids(TINY) == frozenset(range(258))
    assert never_output_ids(264, MASK, tokenizer_ids(TINY)) == tuple(sorted(NEVER))


def test_a_tokenizer_json_is_read_for_every_model_kind(tmp_path):
    bpe = write_tokenizer(tmp_path / "bpe", {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 5}},
                          added=[7])
    assert tokenizer_ids(bpe) == {0, 1, 5, 7}
    unigram = write_tokenizer(tmp_path / "unigram",
                              {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0]]})
    assert tokenizer_ids(unigram) == {0, 1}
    assert tokenizer_ids(tmp_path / "none") is None  # no tokenizer.json: unknown


@pytest.mark.parametrize("text", ["{not json", json.dumps({"model": {}}),
                                  json.dumps({"model": {"vocab": {"a": "0"}}})])
def test_an_unreadable_tokenizer_json_is_refused_naming_the_file(tmp_path, text):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match="tokenizer.json"):
        tokenizer_ids(tmp_path)


def test_the_ids_never_output_are_the_mask_and_the_tokenizers_gaps():
    # ids 3 and 6..9 are not the tokenizer's; 4 is the mask
    assert never_output_ids(10, 4, [0, 1, 2, 4, 5]) == (3, 4, 6, 7, 8, 9)
    assert never_output_ids(10, 4, None) == (4,)  # tokenizer unknown: the mask id alone
    assert never_output_ids(10, None, range(10)) == ()  # AR: no mask id
    assert never_output_ids(10, 12, range(10)) == ()  # a mask id past the vocabulary


@pytest.mark.parametrize("mask, ids, why", [(0, range(10), "mask id"),
                                            (4, range(1, 10), "no token 0")])
def test_a_checkpoint_whose_id_0_is_not_text_is_refused(mask, ids, why):
    # an empty row's token is 0 (select_tokens), so 0 must be one the engine can output
    with pytest.raises(ValueError, match=why):
        never_output_ids(10, mask, ids)


@given(vocab=st.integers(1, 200), data=st.data())
def test_the_output_bitmask_allows_exactly_the_other_ids(vocab, data):
    never = data.draw(st.sets(st.integers(1, vocab - 1), max_size=vocab) if vocab > 1
                      else st.just(set()))
    words = output_bitmask(vocab, never)
    assert words.dtype == np.int32 and words.shape == (-(-vocab // 32),)
    assert words.tolist() == allowed_bitmask([v for v in range(vocab) if v not in never],
                                             vocab)
    assert {v for v in range(vocab) if token_allowed(words, v)} == set(range(vocab)) - never


# ------------------------------------------------------------------------ model_min


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(TINY)


PROMPTS = [list(b"hello "), list(b"x = 1"), [1, 2, 3]]


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_model_min_never_outputs_the_mask_or_an_id_the_tokenizer_lacks(tiny, mode):
    generator = Generator(tiny, window=8, max_batch=3)
    assert set(generator.never_output_ids) == NEVER
    pushed = {t: 100.0 for t in sorted(NEVER)}
    for params in (SamplingParams(max_new_tokens=16, logit_bias=pushed),
                   SamplingParams(max_new_tokens=16, temperature=1.5, seed=3,
                                  logit_bias=pushed),
                   SamplingParams(max_new_tokens=16, allowed_token_ids=[*NEVER, 97, 98])):
        for result in generator.generate(PROMPTS, params, mode=mode):
            assert len(result.token_ids) == 16 and not NEVER & set(result.token_ids)
            if params.allowed_token_ids:
                assert set(result.token_ids) <= {97, 98}


@pytest.mark.parametrize("mode", ["streaming", "ar"])
def test_rules_that_leave_only_such_ids_leave_nothing(tiny, mode):
    """allowed_token_ids of ids never output decodes as rules that ban every token
    (allowed_token_ids=[eos] with min_tokens banning eos): an empty row gives token 0."""
    generator = Generator(tiny, window=8, max_batch=3)
    only_never = generator.generate(PROMPTS, SamplingParams(
        max_new_tokens=6, allowed_token_ids=[MASK, 260]), mode=mode)
    nothing = generator.generate(PROMPTS, SamplingParams(
        max_new_tokens=6, allowed_token_ids=[EOS], min_tokens=6, stop_token_ids=(EOS,)),
        mode=mode)
    assert [(r.token_ids, r.forwards) for r in only_never] == [
        (r.token_ids, r.forwards) for r in nothing]
    assert all(r.token_ids == [0] * 6 for r in only_never)


def test_a_grammar_that_allows_only_such_ids_ends_its_request_with_an_error(tiny):
    generator = Generator(tiny, window=8, max_batch=3)
    params = [SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,),
                             grammar=lambda: Choice([[MASK, 97]], EOS, 264)),
              SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,),
                             grammar=lambda: Choice([[97, 261]], EOS, 264))]
    first, second = generator.generate(PROMPTS[:2], params)
    assert (first.token_ids, first.forwards, first.finish_reason) == ([], 0, "error")
    assert (second.token_ids, second.finish_reason) == ([97], "error")
    assert "grammar allows no token after its 1 output tokens" in second.error
