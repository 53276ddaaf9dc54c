"""Logprobs of committed tokens (wedlm_kernels.requests.logprobs, docs/requests.md "Logprobs"):
the records against the float64 reference (reference/logprobs.py) in every mode, the store
a slot's record waits in, and model_min's logprobs against the logits its trace recorded
at the step that filled each slot."""

import math
from pathlib import Path

import pytest
import torch

from model_min import Generator, SamplingParams, load_model
from reference import logprobs as ref
from wedlm_kernels.requests import logprobs as lp
from wedlm_kernels.requests import params as rp

TINY = Path(__file__).resolve().parent.parent / "model_min" / "tiny_wedlm"

MODES = lp.MODES
INF = math.inf


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


# ------------------------------------------------------------------ named tokens
# (vLLM's logprob_token_ids: row_records' chosen_ids)


def named_batch(num_named: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """``(cu_rows, chosen_ids, tokens)`` of a batch of 5 sequences with 3, 0, 2, 4 and 1
    rows (10 rows, then 2 rows outside every sequence) and fresh random named tokens:
    sequence 0 names a token twice and its first row's token; sequence 1 names tokens but
    has no rows; sequences 2 and 4 name none (their rows list the top K); sequence 3 names
    a few, padded in the middle and at the end."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 29
    tokens = torch.randint(0, vocab, (12,), generator=generator)
    chosen = torch.full((5, num_named), -1, dtype=torch.int64)
    if num_named:
        chosen[0] = torch.randint(0, vocab, (num_named,), generator=generator)
        chosen[1] = torch.randint(0, vocab, (num_named,), generator=generator)
        chosen[3] = torch.randint(0, vocab, (num_named,), generator=generator)
        if num_named >= 2:
            chosen[0, 1] = chosen[0, 0]  # a repeated id
            chosen[3, num_named // 2 + 1:] = -1  # padding at the end ...
        if num_named >= 3:
            chosen[3, 1] = -1  # ... and in the middle
        chosen[0, -1] = tokens[0]  # an id equal to the token of a row of the sequence
    cu_rows = torch.tensor([0, 3, 3, 5, 9, 10], dtype=torch.int32)
    return cu_rows, chosen, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_logprobs, num_named", [(2, 5), (6, 3), (0, 4), (4, 4), (3, 1),
                                                     (3, 0)],
                         ids=["C>K", "C<K", "K=0", "C=K", "C=1", "C=0"])
def test_named_tokens_replace_the_top_k_of_their_sequences_rows_only(mode, dtype,
                                                                    num_logprobs, num_named):
    """A row of a sequence that names tokens lists them (in order, repeats kept, padding
    as token 0, -inf) with their values under the mode's distribution; the other rows
    (rows outside every sequence too) keep the top K; both kinds are 1 + max(K, C) wide,
    and column 0 and the rank are those of the plain record."""
    seed = 100 * num_logprobs + num_named
    cu_rows, chosen, token = named_batch(num_named, seed)
    rows, vocab = token.shape[0], 29
    logits = random_logits(rows, vocab, dtype, seed=seed)
    temperature = torch.tensor([0.8, 0.5, 0.0, 1.3, 0.6])
    top_k = torch.tensor([4, 0, 0, 0, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.7, 1.0])
    records = lp.row_records(logits, token, num_logprobs, mode, cu_rows, temperature, top_k,
                             top_p, chosen_ids=chosen)
    width = 1 + max(num_logprobs, num_named)
    assert records.token_ids.shape == records.logprobs.shape == (rows, width)
    assert records.token_ids.dtype == torch.int64 and records.logprobs.dtype == torch.float32
    plain = lp.row_records(logits, token, num_logprobs, mode, cu_rows, temperature, top_k,
                           top_p)
    assert torch.equal(records.ranks, plain.ranks)
    assert torch.equal(records.token_ids[:, 0], token)
    torch.testing.assert_close(records.logprobs[:, 0], plain.logprobs[:, 0])
    sequence = [0, 0, 0, 2, 2, 3, 3, 3, 3, 4, None, None]
    named_rows = 0
    for r in range(rows):
        b = sequence[r]
        sampling = ((0.0, 0, 1.0) if b is None
                    else (float(temperature[b]), int(top_k[b]), float(top_p[b])))
        named = [-1] * num_named if b is None else chosen[b].tolist()
        value, rank, columns = ref.record_columns(logits[r], int(token[r]), num_logprobs,
                                                  named, mode, *sampling)
        assert records.ranks[r] == rank, r
        got_ids = records.token_ids[r, 1:].tolist()
        got = records.logprobs[r].double().tolist()
        assert got[0] == pytest.approx(value, rel=1e-5, abs=1e-5), r
        assert got[1:] == pytest.approx([v for _, v in columns], rel=1e-5, abs=1e-5), r
        for column, ((expected_id, _), listed) in enumerate(zip(columns, got_ids), start=1):
            if expected_id is not None:  # a named token or padding: exactly that id
                assert listed == expected_id, (r, column)
            else:  # a top-K token (which of several tied ones is the top-k's choice)
                own = ref.values_of(logits[r], mode, *sampling)[listed]
                assert got[column] == pytest.approx(own, rel=1e-5, abs=1e-5), (r, column)
        named_rows += any(t >= 0 for t in named)
    assert named_rows == (7 if num_named else 0)  # sequences 0 and 3 (3 + 4 rows)


def test_a_named_token_equal_to_the_token_and_a_repeated_one_are_listed_each_time():
    logits = random_logits(2, 13)
    token = torch.tensor([6, 2])
    cu_rows = torch.tensor([0, 1, 2], dtype=torch.int32)
    chosen = torch.tensor([[6, 9, 9, 6], [-1, -1, -1, -1]])
    records = lp.row_records(logits, token, 1, "raw_logits", cu_rows, chosen_ids=chosen)
    assert records.token_ids[0].tolist() == [6, 6, 9, 9, 6]
    assert records.logprobs[0].tolist() == logits[0, [6, 6, 9, 9, 6]].tolist()
    assert records.token_ids[1, 2:].tolist() == [0, 0, 0]  # the top 1, then padding
    assert records.logprobs[1, 1] == logits[1].max()
    assert torch.isinf(records.logprobs[1, 2:]).all()


def test_named_tokens_need_the_rows_of_each_sequence_and_a_tensor_of_ids():
    logits = random_logits(3, 9)
    token = torch.tensor([1, 2, 3])
    cu_rows = torch.tensor([0, 2, 3], dtype=torch.int32)
    chosen = torch.tensor([[1, 2], [3, -1]])
    with pytest.raises(ValueError, match="chosen_ids needs cu_rows"):
        lp.row_records(logits, token, 2, "raw_logprobs", chosen_ids=chosen)
    with pytest.raises(TypeError, match="`chosen_ids` must have dtype int64"):
        lp.row_records(logits, token, 2, "raw_logprobs", cu_rows,
                       chosen_ids=chosen.to(torch.int32))
    with pytest.raises(ValueError, match="`chosen_ids` has size 3 in dimension 0"):
        lp.row_records(logits, token, 2, "raw_logprobs", cu_rows,
                       chosen_ids=torch.zeros((3, 2), dtype=torch.int64))
    with pytest.raises(ValueError, match="`chosen_ids` must be 2-D"):
        lp.row_records(logits, token, 2, "raw_logprobs", cu_rows, chosen_ids=chosen[0])


def test_records_with_named_tokens_wait_in_a_store_as_wide_and_are_taken_back():
    logits = random_logits(4, 17)
    cu_rows = torch.tensor([0, 2, 4], dtype=torch.int32)
    chosen = torch.tensor([[3, 5, 7, -1, 11], [-1] * 5])
    records = lp.row_records(logits, torch.tensor([1, 2, 3, 4]), 2, "raw_logprobs", cu_rows,
                             chosen_ids=chosen)
    assert records.token_ids.shape == (4, 6)
    store = lp.empty_store(2, 3, 5, torch.device("cpu"))
    lp.keep_filled(store, records, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 2]),
                   torch.tensor([True, True, True, False]))
    taken = lp.take(store, torch.tensor([0, 1]), torch.tensor([[1, 0], [0, 2]]))
    assert taken.token_ids[0, 0].tolist() == [2, 3, 5, 7, 0, 11]
    assert taken.token_ids[0, 0].tolist() == records.token_ids[1].tolist()
    assert taken.logprobs[1, 0].tolist() == records.logprobs[2].tolist()  # top 2, padding
    assert taken.ranks[0].tolist() == records.ranks[[1, 0]].tolist()
    assert taken.token_ids[1, 1].tolist() == [0] * 6  # a place no row filled
    # a caller's narrower view: the token and its first three named tokens
    assert lp.take(store, torch.tensor([0]), torch.tensor([[0]]), 3).token_ids.tolist() == [
        [[1, 3, 5, 7]]]
    with pytest.raises(ValueError, match="the records have 5 alternatives, the store 4"):
        lp.keep_filled(lp.empty_store(2, 3, 4, torch.device("cpu")), records,
                       torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 2]),
                       torch.ones(4, dtype=torch.bool))


def test_a_widened_store_keeps_its_records_and_pads_the_new_columns():
    store = lp.empty_store(2, 3, 2, torch.device("cpu"))
    records = lp.row_records(random_logits(2, 11), torch.tensor([4, 7]), 2, "raw_logprobs")
    lp.keep_filled(store, records, torch.tensor([0, 1]), torch.tensor([2, 0]),
                   torch.tensor([True, True]))
    wide = lp.widen_store(store, 5)
    assert wide.token_ids.shape == wide.logprobs.shape == (2, 4, 6)
    assert torch.equal(wide.token_ids[..., :3], store.token_ids)
    assert torch.equal(wide.logprobs[..., :3], store.logprobs)
    assert torch.equal(wide.ranks, store.ranks)
    assert (wide.token_ids[..., 3:] == 0).all() and (wide.logprobs[..., 3:] == -INF).all()
    assert lp.widen_store(wide, 4) is wide and lp.widen_store(wide, 5) is wide


def test_a_position_of_named_tokens_is_vllms_dict_of_the_token_and_the_ids():
    """vLLM's frontend: the token with its rank, then id j with rank j; a repeated id, or
    one equal to the token, keeps its last column (a dict's later entry)."""
    ids, values = [6, 9, 6, 9, 4], [-2.0, -1.0, -2.0, -1.0, -3.5]
    entry = lp.position_logprobs(ids, values, 7, 4)
    assert entry == {6: lp.Logprob(-2.0, 2), 9: lp.Logprob(-1.0, 3), 4: lp.Logprob(-3.5, 4)}
    assert list(entry) == [6, 9, 4]
    # a request naming fewer tokens than the record's width stops at its own count
    assert lp.position_logprobs([5, 1, 0, 0], [-1.0, -2.0, -INF, -INF], 3, 1) == {
        5: lp.Logprob(-1.0, 3), 1: lp.Logprob(-2.0, 1)}


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


# ------------------------------------------------------------------ model_min: named tokens

NAMED = [101, 32, 108, 32, 44]  # a repeated id, and ids the text commits (" ", ",", "e", "l")


def named_entry_expected(row: torch.Tensor, token: int, named: list[int], mode: str,
                         sampling: tuple = ()) -> dict[int, tuple[float, int]]:
    """The reference entry of a position whose request names ``named``: the token's value
    and rank, then id j's value with rank j (a later column replaces an earlier one)."""
    value, rank, _ = ref.row_record(row, token, 0, mode, *sampling)
    entry = {token: (value, rank)}
    for j, (named_id, named_value) in enumerate(
            ref.named_columns(row, named, mode, *sampling), start=1):
        entry[named_id] = (named_value, j)
    return entry


def assert_entry(entry: dict, expected: dict) -> None:
    assert list(entry) == list(expected)
    for token, (value, rank) in expected.items():
        assert entry[token].rank == rank, token
        assert entry[token].logprob == pytest.approx(value, abs=1e-5), token


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5,
                                                                  top_k=40, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_model_mins_named_tokens_have_the_filling_steps_values(tiny, mode, sampling):
    """A request naming tokens lists, per committed token, the token and exactly the named
    ids, each valued under the distribution of the step that filled the slot (the trace's
    logits); a top-K request and a plain one in the same batch keep their own entries."""
    generator = Generator(tiny, window=8, max_batch=3)
    generator.trace = []
    base = dict(max_new_tokens=24, threshold=1.5, **sampling)
    params = [SamplingParams(**base, logprob_token_ids=NAMED),
              SamplingParams(**base, logprobs=3), SamplingParams(**base)]
    results = generator.generate(PROMPTS, params, mode=mode)
    filled = fill_steps(generator.trace)
    named_result, top_result, plain_result = results
    assert plain_result.logprobs is None
    parallel = named_result.forwards < len(named_result.token_ids)
    for j, (token, entry) in enumerate(zip(named_result.token_ids, named_result.logprobs)):
        row, _ = filled[(0, len(PROMPTS[0]) + j)]
        assert set(entry) == {token, *NAMED}
        assert_entry(entry, named_entry_expected(row, token, NAMED, "raw_logprobs"))
    for j, (token, entry) in enumerate(zip(top_result.token_ids, top_result.logprobs)):
        row, _ = filled[(1, len(PROMPTS[1]) + j)]
        value, rank, top = ref.row_record(row, token, 3, "raw_logprobs")
        assert len(entry) in (3, 4) and entry[token].rank == rank
        others = sorted((e.logprob for t, e in entry.items() if e.rank <= 3 and (
            t != token or rank <= 3)), reverse=True)
        assert others == pytest.approx(top, abs=1e-5)
    assert parallel  # several tokens committed a forward: the filling step matters


def test_model_mins_processed_named_values_are_minus_inf_where_the_sampling_cut_them(tiny):
    generator = Generator(tiny, window=8, max_batch=3, logprobs_mode="processed_logprobs")
    generator.trace = []
    params = SamplingParams(max_new_tokens=16, threshold=1.5, temperature=0.7, seed=2,
                            top_k=5, presence_penalty=1.0, logprob_token_ids=NAMED,
                            logprobs=len(NAMED))
    results = generator.generate(PROMPTS, params)
    filled = fill_steps(generator.trace)  # the trace's logits are after the rules
    cut = 0
    for index, result in enumerate(results):
        for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            row, _ = filled[(index, len(PROMPTS[index]) + j)]
            assert_entry(entry, named_entry_expected(row, token, NAMED, "processed_logprobs",
                                                     (0.7, 5, 1.0)))
            cut += sum(entry[t].logprob == -math.inf for t in NAMED if t != token)
    assert cut  # top-k 5 cut some named tokens


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_named_tokens_change_no_token_of_their_batch(tiny, mode):
    """A batch of a request naming tokens, a top-K request and a plain one decodes each
    as it decodes alone, and the named request's entries equal its entries alone."""
    base = dict(max_new_tokens=16, threshold=1.5, temperature=0.9)
    params = [SamplingParams(**base, seed=1, logprob_token_ids=NAMED[:3]),
              SamplingParams(**base, seed=2, logprobs=6),
              SamplingParams(**base, seed=3)]
    batch = Generator(tiny, window=8, max_batch=3).generate(PROMPTS, params, mode=mode)
    for prompt, p, result in zip(PROMPTS, params, batch):
        [alone] = Generator(tiny, window=8).generate([prompt], p, mode=mode)
        assert result.token_ids == alone.token_ids
        assert result.forwards == alone.forwards
        if result.logprobs is not None:
            assert [list(e) for e in result.logprobs] == [list(e) for e in alone.logprobs]
            assert [[v.rank for v in e.values()] for e in result.logprobs] == [
                [v.rank for v in e.values()] for e in alone.logprobs]
            assert [v.logprob for e in result.logprobs for v in e.values()] == pytest.approx(
                [v.logprob for e in alone.logprobs for v in e.values()], abs=1e-4)
    named, top, plain = batch
    assert plain.logprobs is None
    assert all(set(e) == {t, *NAMED[:3]} for t, e in zip(named.token_ids, named.logprobs))
    assert all(len(e) in (6, 7) for e in top.logprobs)


def test_named_tokens_outside_the_vocabulary_are_refused_by_name(tiny):
    generator = Generator(tiny, window=4)
    with pytest.raises(rp.ParameterError, match=r"^prompt 1: logprob_token_ids has token ids "
                       r"outside the vocabulary \[0, 264\): \[264\]") as error:
        generator.generate(PROMPTS[:2], [SamplingParams(logprob_token_ids=[3]),
                                         SamplingParams(logprob_token_ids=[1, 264])])
    assert error.value.parameter == "prompt 1: logprob_token_ids"
    with pytest.raises(rp.ParameterError, match="^SamplingParams.logprob_token_ids: when "
                       "logprobs is set beside it, logprobs must equal its length 2"):
        SamplingParams(logprobs=5, logprob_token_ids=[1, 2])
