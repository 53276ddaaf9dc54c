"""Logprobs of committed tokens (wedlm_kernels.logprobs, docs/contracts.md "Logprobs"):
the records against the float64 reference (reference/logprobs.py) in every mode, the store
a slot's record waits in, and model_min's logprobs against the logits its trace recorded
at the step that filled each slot."""

import math
from pathlib import Path

import pytest
import torch

from model_min import Generator, SamplingParams, load_model
from reference import logprobs as ref
from wedlm_kernels import logprobs as lp
from wedlm_kernels import request_params as rp

TINY = Path(__file__).resolve().parent.parent / "model_min" / "tiny_wedlm"

MODES = lp.MODES


def random_logits(rows: int, vocab: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((rows, vocab), generator=generator) * 3
    logits[0, : vocab // 3] = float("-inf")  # a row with banned tokens
    logits[1, 5:9] = logits[1, 4]  # ties
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_logprobs", [0, 1, 7, 37])
def test_records_equal_the_float64_reference(mode, num_logprobs, dtype):
    rows, vocab = 6, 37
    logits = random_logits(rows, vocab, dtype, seed=num_logprobs)
    token = torch.tensor([vocab - 1, 4, 0, 17, 36, 2])
    cu_rows = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    temperature = torch.tensor([0.7, 0.0, 1.3])
    top_k = torch.tensor([5, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.6])
    records = lp.row_records(logits, token, num_logprobs, mode, cu_rows, temperature, top_k,
                             top_p)
    assert records.token_ids.shape == records.logprobs.shape == (rows, 1 + num_logprobs)
    assert records.token_ids.dtype == torch.int64 and records.logprobs.dtype == torch.float32
    sequence = [0, 0, 1, 2, 2, 2]
    for r in range(rows):
        b = sequence[r]
        value, rank, top = ref.row_record(logits[r], int(token[r]), num_logprobs, mode,
                                          float(temperature[b]), int(top_k[b]), float(top_p[b]))
        assert records.token_ids[r, 0] == token[r]
        assert records.ranks[r] == rank, r
        got = records.logprobs[r].double().tolist()
        assert got[0] == pytest.approx(value, rel=1e-5, abs=1e-5), r
        assert got[1:] == pytest.approx(top, rel=1e-5, abs=1e-5), r
        # each listed alternative's value is its own token's
        for column in range(1, 1 + num_logprobs):
            alternative = int(records.token_ids[r, column])
            own, _, _ = ref.row_record(logits[r], alternative, 0, mode, float(temperature[b]),
                                       int(top_k[b]), float(top_p[b]))
            assert got[column] == pytest.approx(own, rel=1e-5, abs=1e-5)


def test_a_processed_mode_leaves_greedy_rows_unscaled_and_unfiltered():
    logits = random_logits(2, 11)
    token = torch.tensor([3, 4])
    cu_rows = torch.tensor([0, 1, 2], dtype=torch.int32)
    raw = lp.row_records(logits, token, 4, "raw_logprobs")
    processed = lp.row_records(logits, token, 4, "processed_logprobs", cu_rows,
                               torch.tensor([0.0, 0.5]), torch.tensor([2, 2], dtype=torch.int32),
                               torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(processed.logprobs[0], raw.logprobs[0])
    assert not torch.allclose(processed.logprobs[1], raw.logprobs[1])
    assert torch.isinf(processed.logprobs[1, 3:]).all()  # top-k 2 cut the others


def test_records_wait_in_their_place_until_read_and_a_refill_replaces_them():
    store = lp.empty_store(3, 4, 2, torch.device("cpu"))
    logits = random_logits(4, 9)
    records = lp.row_records(logits, torch.tensor([1, 2, 3, 4]), 1, "raw_logprobs")
    # rows 0 and 2 fill (sequence 2, place 1) and (sequence 0, place 3); rows 1, 3 do not
    lp.keep_filled(store, records, torch.tensor([2, 2, 0, 1]), torch.tensor([1, 0, 3, 2]),
                   torch.tensor([True, False, True, False]))
    taken = lp.take(store, torch.tensor([2, 0, 1]), torch.tensor([[1, 0], [3, 3], [2, 1]]))
    assert taken.token_ids[0, 0, :2].tolist() == records.token_ids[0].tolist()
    assert taken.token_ids[0, 0, 2] == 0 and taken.logprobs[0, 0, 2] == -math.inf
    assert taken.logprobs[1, 0, :2].tolist() == records.logprobs[2].tolist()
    assert taken.ranks[0, 0] == records.ranks[0] and taken.ranks[1, 1] == records.ranks[2]
    # places no row filled hold the empty record
    assert taken.token_ids[0, 1].tolist() == [0, 0, 0] and taken.ranks[2].tolist() == [0, 0]
    assert torch.isinf(taken.logprobs[2]).all()
    # a second fill of a place replaces its record
    again = lp.row_records(logits.flip(0), torch.tensor([5, 5, 5, 5]), 2, "raw_logits")
    lp.keep_filled(store, again, torch.tensor([2, 0, 0, 0]), torch.tensor([1, 0, 0, 0]),
                   torch.tensor([True, False, False, False]))
    taken = lp.take(store, torch.tensor([2]), torch.tensor([[1]]))
    assert taken.token_ids[0, 0].tolist() == again.token_ids[0].tolist()
    with pytest.raises(ValueError, match="alternatives"):
        lp.keep_filled(lp.empty_store(1, 2, 0, torch.device("cpu")), again,
                       torch.tensor([0] * 4), torch.tensor([0] * 4), torch.ones(4, dtype=bool))


def test_a_position_lists_the_token_and_the_most_likely_as_vllm_does():
    entry = lp.position_logprobs([7, 3, 7, 9], [-2.0, -0.5, -2.0, -3.0], 2, 3)
    assert entry == {7: lp.Logprob(-2.0, 2), 3: lp.Logprob(-0.5, 1), 9: lp.Logprob(-3.0, 3)}
    assert lp.position_logprobs([7, 3, 5], [-2.0, -0.5, -1.0], 3, 0) == {7: (-2.0, 3)}


@pytest.mark.parametrize("value, stored", [(None, None), (0, 0), (20, 20), (64, 64),
                                           (True, 1)])
def test_the_logprobs_count_is_checked_like_every_field(value, stored):
    assert rp.logprobs(value, "logprobs", 300) == stored


@pytest.mark.parametrize("value, vocab, message", [
    (65, 300, "from 0 to 64"), (-1, 300, "whole vocabulary"), (-2, 300, "from 0 to 64"),
    (12, 10, "from 0 to 10"), (1.0, 300, "integer"), (False, 300, "integer"),
    ("3", 300, "integer")])
def test_a_logprobs_count_out_of_bounds_is_refused_by_name(value, vocab, message):
    with pytest.raises(rp.ParameterError, match=f"logprobs must be .*{message}"):
        rp.logprobs(value, "logprobs", vocab)


def test_minus_one_is_the_whole_of_a_small_vocabulary():
    assert rp.logprobs(-1, "logprobs", 40) == 40
    assert rp.logprobs(-1, "logprobs") == -1  # mapped once the vocabulary is known
    assert SamplingParams(logprobs=-1).logprobs == -1


# ------------------------------------------------------------------ model_min


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(TINY)


PROMPTS = [list(b"The cat sat on"), list(b"1, 2, 3,"), list(b"Once upon a time there")]


def fill_steps(trace: list[dict]) -> dict[tuple[int, int], tuple[torch.Tensor, int]]:
    """(request, logical position) -> (logits row, request's batch row) of the last step
    that had the position as a mask row: the step that filled it."""
    found = {}
    for record in trace:
        window = record["row_pos"].shape[0] // len(record["request"])
        for b, request in enumerate(record["request"]):
            for r in range(b * window, (b + 1) * window):
                position = int(record["row_pos"][r])
                if position >= 0:
                    found[(request, position)] = (record["logits"][r], b)
    return found


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5,
                                                                  top_k=40, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_model_mins_logprobs_are_the_filling_steps_distribution(tiny, mode, sampling):
    """Each committed token's entry is that of the step that filled its slot (recorded by
    the trace), not of the step that committed it; the alternatives are its top tokens."""
    generator = Generator(tiny, window=8, max_batch=3)
    generator.trace = []
    params = SamplingParams(max_new_tokens=24, threshold=1.5, logprobs=3, **sampling)
    results = generator.generate(PROMPTS, params, mode=mode)
    if mode == "ar":  # the trace records window steps only: AR's rows are its own forwards
        for result in results:
            assert [len(p) in (3, 4) for p in result.logprobs] == [True] * len(result.token_ids)
            assert all(t in p and p[t].logprob <= 0 for t, p in
                       zip(result.token_ids, result.logprobs))
        return
    filled = fill_steps(generator.trace)
    parallel = 0
    for index, result in enumerate(results):
        prompt = PROMPTS[index]
        parallel += result.forwards < len(result.token_ids)
        for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            row, _ = filled[(index, len(prompt) + j)]
            value, rank, top = ref.row_record(row, token, 3, "raw_logprobs")
            assert entry[token].rank == rank
            assert entry[token].logprob == pytest.approx(value, abs=1e-5)
            others = sorted((e.logprob for t, e in entry.items() if e.rank <= 3 and (
                t != token or rank <= 3)), reverse=True)
            assert others == pytest.approx(top, abs=1e-5)
    assert parallel  # some request committed several tokens a forward


def test_model_mins_processed_logprobs_read_the_rules_and_the_temperature(tiny):
    generator = Generator(tiny, window=8, max_batch=3, logprobs_mode="processed_logprobs")
    generator.trace = []
    params = SamplingParams(max_new_tokens=16, threshold=1.5, temperature=0.7, seed=2,
                            top_k=30, presence_penalty=1.0, logit_bias={32: 2.0}, logprobs=2)
    results = generator.generate(PROMPTS, params)
    filled = fill_steps(generator.trace)  # the trace's logits are after the rules
    for index, result in enumerate(results):
        for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            row, _ = filled[(index, len(PROMPTS[index]) + j)]
            value, rank, _ = ref.row_record(row, token, 2, "processed_logprobs", 0.7, 30, 1.0)
            assert entry[token].logprob == pytest.approx(value, abs=1e-5)
            assert entry[token].rank == rank


def test_logprobs_change_nothing_else_and_are_none_when_not_asked(tiny):
    plain = Generator(tiny, window=8, max_batch=3).generate(
        PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.9, seed=1))
    asked = Generator(tiny, window=8, max_batch=3).generate(
        PROMPTS, [SamplingParams(max_new_tokens=16, temperature=0.9, seed=1, logprobs=k)
                  for k in (None, 0, 5)])
    assert [r.token_ids for r in asked] == [r.token_ids for r in plain]
    assert [r.forwards for r in asked] == [r.forwards for r in plain]
    assert asked[0].logprobs is None and plain[0].logprobs is None
    assert all(len(p) == 1 for p in asked[1].logprobs)
    assert all(len(p) in (5, 6) for p in asked[2].logprobs)


def test_a_bad_logprobs_mode_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Generator(tiny, logprobs_mode="processed")
    with pytest.raises(rp.ParameterError, match="prompt 0: logprobs"):
        Generator(tiny, window=4).generate([[1, 2]], SamplingParams(logprobs=-1))


def test_raw_logprobs_are_the_models_before_the_rules(tiny):
    """allowed_token_ids bans every other token; the raw entries still list the model's
    favourites among them, and the processed ones only allowed tokens."""
    allowed = [32, 101, 108]
    params = SamplingParams(max_new_tokens=10, allowed_token_ids=allowed, logprobs=4)
    raw = Generator(tiny, window=8).generate(PROMPTS, params)
    processed = Generator(tiny, window=8, logprobs_mode="processed_logprobs").generate(
        PROMPTS, params)
    assert [r.token_ids for r in raw] == [r.token_ids for r in processed]
    # a banned token listed with a finite value: the model's distribution, not the rules'
    assert any(t not in allowed and math.isfinite(e.logprob)
               for r in raw for p in r.logprobs for t, e in p.items())
    for result in processed:
        for position in result.logprobs:
            assert all(t in allowed or e.logprob == -math.inf for t, e in position.items())
