"""The no-cache reference decoder (reference/decoder.py).

Three kinds of oracle:
- a scripted fake model whose rows have chosen entropies and argmax tokens, so whole decodes
  can be worked out by hand from docs/algorithm.md section 4 (including its worked example);
- Hugging Face transformers on a tiny random Qwen3 (AR greedy, window logits, first steps);
- the cached path (reference.model.forward_paged with reference.window.reorder_window):
  replaying every recorded forward through a paged KV cache must give the recorded logits
  (the prefix-cacheability invariant of docs/algorithm.md section 3).
"""

import dataclasses
import functools
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from bench.tiny_models import MASK_TOKEN_ID, build_tiny_model, hf_logits, save_checkpoint
from reference import philox
from reference.decoder import Params, decode
from reference.model import forward, forward_paged, load_config, load_weights
from reference.rope import rope_cache
from reference.window import reorder_window

PROMPT = [5, 17, 42, 7, 99, 3]
# the tiny model's row entropies lie between ~1.5 and ~4 nats: thresholds in that range
# make steps that fill several slots at once
MULTI_TOKEN_THRESHOLD = 2.8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, reference config, reference weights, no-cache forward callable)."""
    model = build_tiny_model("qwen3", seed=3)
    directory = save_checkpoint(model, tmp_path_factory.mktemp("decoder_qwen3"))
    config, weights = load_config(directory), load_weights(directory)
    return model, config, weights, functools.partial(forward, weights, config)


# ---- a scripted fake model -----------------------------------------------------------------

FAKE_VOCAB = 64
FAKE_MASK_ID = 0


def token_for(position: int) -> int:
    """The fake model's argmax token for a mask at ``position``."""
    return 20 + position


def peaked_row(peak_token: int, entropy: float) -> torch.Tensor:
    """Logits with one raised entry and ``FAKE_VOCAB - 1`` zeros whose softmax entropy is
    ``entropy`` nats (found by bisection on the height of the raised entry)."""

    def row_entropy_of(height: float) -> float:
        weight, rest = math.exp(height), FAKE_VOCAB - 1
        total = weight + rest
        return math.log(total) - height * weight / total

    low, high = 0.0, 60.0  # entropy decreases from log(V) to ~0 on this interval
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if row_entropy_of(middle) > entropy else (low, middle)
    row = torch.zeros(FAKE_VOCAB, dtype=torch.float64)
    row[peak_token] = (low + high) / 2
    return row


class ScriptedModel:
    """Forward callable: the mask row at position ``p`` in call ``c`` has argmax
    ``token_for(p)`` and entropy ``script[c][p]`` (``default_entropy`` when unscripted)."""

    def __init__(self, script: list[dict[int, float]], default_entropy: float = 0.1):
        self.script = script
        self.default_entropy = default_entropy
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        call = len(self.calls)
        self.calls.append((input_ids.tolist(), position_ids.tolist()))
        entropies = self.script[call] if call < len(self.script) else {}
        rows = []
        for token, position in zip(input_ids.tolist(), position_ids.tolist()):
            if token == FAKE_MASK_ID:
                entropy = entropies.get(position, self.default_entropy)
                rows.append(peaked_row(token_for(position), entropy))
            else:
                rows.append(torch.zeros(FAKE_VOCAB, dtype=torch.float64))
        return torch.stack(rows)


def fake_decode(
    script, threshold, max_new_tokens=8, window=4, penalty=0.02, mode="streaming", **options
):
    model = ScriptedModel(script)
    params = Params(max_new_tokens=max_new_tokens, threshold=threshold, penalty=penalty,
                    **options)
    prompt = list(range(1, 11))  # L = 10 as in the worked example
    result = decode(model, prompt, params, mode=mode, window=window, mask_id=FAKE_MASK_ID)
    return result, model


def test_worked_example_of_algorithm_section_4():
    """docs/algorithm.md's worked example: W=4, lam=0.02, tau=0.6, L=10."""
    script = [
        # step 1: positions 10 and 12 pass (0.10, 0.30 + 0.04): window [a, M, c, M]
        {10: 0.1, 11: 2.0, 12: 0.3, 13: 2.0},
        # step 2 (the example): adjusted 0.10, 0.54, 0.96 -> 11 and 13 are filled
        {11: 0.10, 13: 0.50, 14: 0.90},
        # step 3: every mask passes; the new leading run reaches max_new: early finish
        {14: 0.1, 15: 0.1, 16: 0.1, 17: 0.1},
    ]
    result, model = fake_decode(script, threshold=0.6)
    a, c = token_for(10), token_for(12)
    # step 2 is fed [a, M, c, M, M]: rows [a, c, M, M, M] at RoPE positions [10, 12, 11, 13, 14]
    ids, positions = model.calls[1]
    assert ids[10:] == [a, c, FAKE_MASK_ID, FAKE_MASK_ID, FAKE_MASK_ID]
    assert positions == list(range(10)) + [10, 12, 11, 13, 14]
    assert result.trace[1].order == [0, 2, 1, 3, 4]
    assert result.trace[1].committed == 1  # only a: c is behind a mask
    # step 3 commits x, c, y, which now sit at their own positions, and has 7 rows
    ids, positions = model.calls[2]
    assert ids[:10] == list(range(1, 11)) and ids[10] == a
    assert ids[11:] == [token_for(11), c, token_for(13)] + [FAKE_MASK_ID] * 4
    assert positions == list(range(18))
    assert result.trace[2].committed == 3
    assert result.token_ids == [token_for(p) for p in range(10, 18)]
    assert result.finish_reason == "length"
    assert result.forwards == 3
    assert result.rows == 4 + 5 + 7
    assert result.p_cache == 8 / 16
    assert result.tokens_per_forward == 8 / 3


def test_an_id_never_output_is_banned_before_the_entropy_and_the_token():
    """The scripted model's argmax at position 11 is never output: its row's next best is
    filled instead (every other entry ties at 0: the first, id 0), and the row's entropy is
    then that of the tie, above the one-token-per-step fallback's other rows."""
    banned = token_for(11)
    model = ScriptedModel([], default_entropy=0.1)
    result = decode(model, list(range(1, 11)), Params(max_new_tokens=3, threshold=None),
                    window=4, mask_id=FAKE_MASK_ID, never_output=(banned,))
    assert banned not in result.token_ids
    assert all(torch.isneginf(record.logits[:, banned]).all() for record in result.trace)
    unbanned = decode(ScriptedModel([], default_entropy=0.1), list(range(1, 11)),
                      Params(max_new_tokens=3, threshold=None), window=4,
                      mask_id=FAKE_MASK_ID)
    assert banned in unbanned.token_ids


def test_distance_penalty_can_reject_a_mask_below_threshold():
    # position 13 has entropy 0.50 < 0.52 but adjusted 0.54 >= 0.52: only 11 is filled
    script = [{10: 0.1, 11: 2.0, 12: 0.3, 13: 2.0}, {11: 0.10, 13: 0.50, 14: 0.90}]
    result, _ = fake_decode(script, threshold=0.52)
    # after step 2 the window is [x, c, M, M]; leading run 2 -> two masks appended
    assert result.trace[2].win_mask == [False, False, True, True, True, True]
    assert result.trace[2].win_tokens[:2] == [token_for(11), token_for(12)]


def test_fallback_selects_the_smallest_adjusted_entropy_when_none_passes():
    # adjusted 2.0, 2.02, 1.54, 2.06: none < 0.6, position 12 is the smallest
    script = [{10: 2.0, 11: 2.0, 12: 1.5, 13: 2.0}, {10: 2.0, 11: 2.0, 13: 2.0}]
    result, model = fake_decode(script, threshold=0.6)
    # leading run 0: nothing committed, nothing appended; the filled slot is fed first
    assert (result.trace[0].committed, result.trace[1].ctx_len) == (0, 10)
    assert result.trace[1].win_mask == [True, True, False, True]
    assert model.calls[1][1][10:] == [12, 10, 11, 13]
    # step 2: adjusted 2.0, 2.02, 2.06 -> position 10; leading run 1 -> one mask appended
    assert result.trace[2].win_mask == [False, True, False, True, True]
    assert result.trace[2].committed == 1


def test_fallback_ties_pick_the_leftmost_mask():
    # no penalty and equal entropies: every adjusted value ties, the first mask wins
    script = [{10: 2.0, 11: 2.0, 12: 2.0, 13: 2.0}]
    result, _ = fake_decode(script, threshold=0.6, penalty=0.0)
    assert result.trace[1].win_mask == [False, True, True, True, True]
    assert result.trace[1].win_tokens[0] == token_for(10)


def test_threshold_none_fills_exactly_one_slot_per_step():
    # every row is below any threshold, yet None means one token per step
    result, model = fake_decode([], threshold=None, max_new_tokens=6)
    assert result.token_ids == [token_for(p) for p in range(10, 16)]
    assert result.forwards == 6
    assert result.tokens_per_forward == 1.0
    for before, after in zip(result.trace, result.trace[1:]):
        filled_before = before.win_mask.count(False) - before.committed
        assert after.win_mask.count(False) == filled_before + 1


def test_stop_token_inside_the_new_leading_run_finishes_without_a_forward():
    # threshold +inf fills all four masks in step 1; the run [30, 31, 32, 33] holds the stop
    stop = token_for(12)
    result, model = fake_decode([], threshold=math.inf, stop_token_ids=(stop,))
    assert result.token_ids == [token_for(10), token_for(11), stop]
    assert result.finish_reason == "stop"
    assert result.forwards == 1 and len(model.calls) == 1
    assert result.p_cache == 3 / 4


def test_blockwise_waits_for_the_whole_block():
    """Threshold None with equal entropies fills the leftmost mask each step. Forwards 1-4
    fill block 1 without committing or appending; forward 5 carries block 1 (committed)
    plus 4 masks; forwards 6-8 fill block 2, whose completion finishes the sequence."""
    result, _ = fake_decode([], threshold=None, mode="blockwise")
    assert [len(r.win_mask) for r in result.trace] == [4, 4, 4, 4, 8, 4, 4, 4]
    assert [r.committed for r in result.trace] == [0, 0, 0, 0, 4, 0, 0, 0]
    assert [r.ctx_len for r in result.trace] == [10] * 5 + [14] * 3
    assert result.trace[4].win_mask == [False] * 4 + [True] * 4
    assert result.token_ids == [token_for(p) for p in range(10, 18)]
    assert (result.forwards, result.rows) == (8, 36)


# ---- the tiny model: HF as oracle ------------------------------------------------------


def test_ar_greedy_equals_hf_argmax_loop(tiny):
    model, _, _, reference_forward = tiny
    tokens = list(PROMPT)
    for _ in range(10):
        logits = hf_logits(model, tokens, list(range(len(tokens))))
        tokens.append(int(logits[-1].argmax()))
    result = decode(reference_forward, PROMPT, Params(max_new_tokens=10), mode="ar")
    assert result.token_ids == tokens[len(PROMPT):]
    assert (result.forwards, result.rows) == (10, 10)
    assert result.p_cache == 1.0 and result.tokens_per_forward == 1.0
    assert result.finish_reason == "length"


def test_threshold_inf_decodes_a_whole_window_per_forward(tiny):
    """Hand-traced with +inf threshold, W=4, max_new=8: forward 1 fills the four masks at
    L..L+3 (plain causal, no reordering); forward 2 commits them and fills the next four,
    which finish the sequence at once (early finish): 2 forwards, 12 rows, p_cache 2/3."""
    model, _, _, reference_forward = tiny
    masks = [MASK_TOKEN_ID] * 4
    first = hf_logits(model, PROMPT + masks, range(len(PROMPT) + 4))[len(PROMPT):]
    first_tokens = first.argmax(dim=-1).tolist()
    second = hf_logits(model, PROMPT + first_tokens + masks, range(len(PROMPT) + 8))
    second_tokens = second[len(PROMPT) + 4:].argmax(dim=-1).tolist()

    params = Params(max_new_tokens=8, threshold=math.inf)
    result = decode(reference_forward, PROMPT, params, window=4, mask_id=MASK_TOKEN_ID)
    assert result.token_ids == first_tokens + second_tokens
    assert (result.forwards, result.rows) == (2, 12)
    assert result.p_cache == pytest.approx(2 / 3)
    assert result.tokens_per_forward == 4


def gumbel_max(logits_row: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The contract's sample without top-k/top-p: argmax of logits / T + Philox Gumbel noise
    keyed by (seed, absolute position)."""
    noise = torch.from_numpy(philox.gumbel(seed, position, logits_row.shape[0]))
    return int((logits_row.double() / temperature + noise).argmax())


def test_sampling_is_keyed_by_the_predicted_position(tiny):
    """Threshold +inf, W=4, max_new=4: one forward over prompt ++ 4 masks; the mask at
    position p gets the Gumbel-max sample of its HF logits with the noise of (seed, p)."""
    model, _, _, reference_forward = tiny
    seed, temperature = 1234, 1.5
    logits = hf_logits(model, PROMPT + [MASK_TOKEN_ID] * 4, range(len(PROMPT) + 4))
    expected = [
        gumbel_max(logits[len(PROMPT) + i], temperature, seed, len(PROMPT) + i)
        for i in range(4)
    ]
    params = Params(max_new_tokens=4, threshold=math.inf, temperature=temperature, seed=seed)
    result = decode(reference_forward, PROMPT, params, window=4, mask_id=MASK_TOKEN_ID)
    assert result.token_ids == expected
    assert result.forwards == 1


def test_ar_sampling_is_keyed_by_the_predicted_position(tiny):
    model, _, _, reference_forward = tiny
    seed, temperature = 99, 0.8
    tokens = list(PROMPT)
    for _ in range(5):
        logits = hf_logits(model, tokens, range(len(tokens)))
        tokens.append(gumbel_max(logits[-1], temperature, seed, len(tokens)))
    params = Params(max_new_tokens=5, temperature=temperature, seed=seed)
    result = decode(reference_forward, PROMPT, params, mode="ar")
    assert result.token_ids == tokens[len(PROMPT):]


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
def test_window_logits_equal_hf_over_committed_and_reordered_window(tiny, mode):
    model, _, _, reference_forward = tiny
    params = Params(max_new_tokens=12, threshold=MULTI_TOKEN_THRESHOLD)
    result = decode(reference_forward, PROMPT, params, mode=mode, window=4,
                    mask_id=MASK_TOKEN_ID)
    assert any(record.win_mask.count(False) > record.committed for record in result.trace)
    for record in result.trace:
        expected = hf_logits(model, record.input_ids, record.position_ids)[record.ctx_len:]
        torch.testing.assert_close(record.logits, expected.double(), atol=1e-4, rtol=0)


# ---- the cached path replays the no-cache decode ---------------------------------------


def replay_through_paged_cache(config, weights, prompt, result, window, page_size=4):
    """Run prefill and every recorded step through ``forward_paged`` with a paged KV cache
    (shuffled pages); returns the caches and the block table. Asserts per step that the
    reference reorder_window reproduces the fed rows and that the logits match."""
    slots = 2 * window
    max_positions = len(prompt) + len(result.token_ids) + slots
    pages = -(-max_positions // page_size)
    block_table = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(0))[:pages]
    block_table = block_table.to(torch.int32).reshape(1, pages)
    shape = (pages + 2, page_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [
        (torch.full(shape, math.nan, dtype=torch.float64),
         torch.full(shape, math.nan, dtype=torch.float64))
        for _ in range(config.num_hidden_layers)
    ]
    cos_sin = rope_cache(max_positions, config.head_dim, config.rope_theta)

    positions = torch.arange(len(prompt))
    table = block_table[0].to(torch.int64)
    prefill_slots = table[positions // page_size] * page_size + positions % page_size
    forward_paged(
        weights, config, kv_caches, cos_sin, torch.tensor(prompt), positions, prefill_slots,
        block_table, torch.tensor([0, len(prompt)], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
    )
    for step, record in enumerate(result.trace):
        n = len(record.win_mask)
        win_tokens = torch.full((1, slots), MASK_TOKEN_ID, dtype=torch.int64)
        win_tokens[0, :n] = torch.tensor(record.win_tokens)
        win_mask = torch.ones(1, slots, dtype=torch.bool)
        win_mask[0, :n] = torch.tensor(record.win_mask)
        win_len = torch.tensor([n], dtype=torch.int32)
        ctx_len = torch.tensor([record.ctx_len], dtype=torch.int32)
        input_ids, row_positions, slot_mapping, order, query_start, _ = reorder_window(
            win_tokens, win_mask, win_len, ctx_len, block_table, page_size, n
        )
        assert query_start.tolist() == [0, n]
        assert order.tolist() == record.order
        assert input_ids.tolist() == record.input_ids[record.ctx_len:].tolist()
        assert row_positions.tolist() == record.position_ids[record.ctx_len:].tolist()
        logits = forward_paged(
            weights, config, kv_caches, cos_sin, input_ids, row_positions, slot_mapping,
            block_table, query_start, ctx_len,
        )
        torch.testing.assert_close(
            logits, record.logits, atol=1e-9, rtol=1e-9, msg=f"step {step}"
        )
    return kv_caches, block_table


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_cache_replay_reproduces_every_step_and_final_kv(tiny, mode, temperature):
    _, config, weights, reference_forward = tiny
    window, page_size = 4, 4
    params = Params(max_new_tokens=14, threshold=MULTI_TOKEN_THRESHOLD,
                    temperature=temperature, seed=11)
    result = decode(reference_forward, PROMPT, params, mode=mode, window=window,
                    mask_id=MASK_TOKEN_ID)
    kv_caches, block_table = replay_through_paged_cache(
        config, weights, PROMPT, result, window, page_size
    )

    # K/V of every position committed by a forward is final and equals a plain causal
    # forward over prompt ++ output (tokens committed by the early finish were never fed
    # as committed rows, so their cache entries are scratch)
    last = result.trace[-1]
    final_len = last.ctx_len + last.committed
    assert final_len > len(PROMPT)
    sequence = torch.tensor(PROMPT + result.token_ids)
    _, expected_kv = forward(weights, config, sequence, torch.arange(len(sequence)),
                             return_kv=True)
    table = block_table[0].tolist()
    for layer, ((k_cache, v_cache), (k, v)) in enumerate(zip(kv_caches, expected_kv)):
        for position in range(final_len):
            page, offset = table[position // page_size], position % page_size
            torch.testing.assert_close(k_cache[page, offset], k[position], atol=1e-9,
                                       rtol=1e-9, msg=f"layer {layer} position {position}")
            torch.testing.assert_close(v_cache[page, offset], v[position], atol=1e-9,
                                       rtol=1e-9, msg=f"layer {layer} position {position}")


# ---- rules and metrics on random decodes -----------------------------------------------


def leading_filled_run(win_mask: list[bool]) -> int:
    run = 0
    while run < len(win_mask) and not win_mask[run]:
        run += 1
    return run


@given(
    mode=st.sampled_from(["streaming", "blockwise"]),
    max_new_tokens=st.integers(1, 12),
    window=st.integers(1, 6),
    threshold=st.sampled_from([None, 2.0, 2.8, 3.5, math.inf]),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
@example(mode="streaming", max_new_tokens=1, window=1, threshold=None, temperature=0.0, seed=0)
@example(mode="blockwise", max_new_tokens=12, window=6, threshold=math.inf, temperature=1.0,
         seed=1)
@example(mode="streaming", max_new_tokens=12, window=5, threshold=2.0, temperature=1.0, seed=2)
def test_decode_rules_and_metrics_hold(
    tiny, mode, max_new_tokens, window, threshold, temperature, seed
):
    _, _, _, reference_forward = tiny
    params = Params(max_new_tokens=max_new_tokens, threshold=threshold,
                    temperature=temperature, seed=seed)
    result = decode(reference_forward, PROMPT, params, mode=mode, window=window,
                    mask_id=MASK_TOKEN_ID)
    trace, out = result.trace, result.token_ids
    end = len(PROMPT) + max_new_tokens

    assert out and len(out) == max_new_tokens and result.finish_reason == "length"
    assert len(trace[0].win_mask) == min(window, max_new_tokens)
    assert result.forwards == len(trace)
    assert result.rows == sum(len(record.win_mask) for record in trace)
    assert result.p_cache == len(out) / result.rows
    assert result.tokens_per_forward == len(out) / result.forwards
    for step, record in enumerate(trace):
        n = len(record.win_mask)
        # the window never reaches past prompt_len + max_new
        assert int(record.position_ids.max()) < end
        assert 1 <= n <= 2 * window
        # the commit is the leading filled run, exactly the tokens the window held
        run = leading_filled_run(record.win_mask)
        if mode == "blockwise":
            assert record.committed == (min(window, n) if run >= min(window, n) else 0)
            assert (record.ctx_len - len(PROMPT)) % window == 0
        else:
            assert record.committed == run
        emitted = record.ctx_len - len(PROMPT)
        assert out[emitted:emitted + record.committed] == record.win_tokens[:record.committed]
        if step + 1 < len(trace):
            assert trace[step + 1].ctx_len == record.ctx_len + record.committed
    # every token committed by a forward was fed twice (as a mask, then filled)
    committed_by_forwards = sum(record.committed for record in trace)
    assert result.rows >= len(out) + committed_by_forwards
    if committed_by_forwards == len(out):
        assert result.p_cache <= 0.5


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_max_new_tokens_zero_runs_no_forward(tiny, mode):
    _, _, _, reference_forward = tiny
    result = decode(reference_forward, PROMPT, Params(max_new_tokens=0), mode=mode,
                    mask_id=MASK_TOKEN_ID)
    assert result.token_ids == [] and result.finish_reason == "length"
    assert (result.forwards, result.rows, result.p_cache) == (0, 0, 0.0)


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_stop_token_truncates_output_at_its_first_occurrence(tiny, mode):
    _, _, _, reference_forward = tiny
    params = Params(max_new_tokens=16, threshold=MULTI_TOKEN_THRESHOLD)
    free = decode(reference_forward, PROMPT, params, mode=mode, window=4,
                  mask_id=MASK_TOKEN_ID)
    # a token whose first occurrence is not at the start
    index = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    stop = free.token_ids[index]
    stopped = decode(
        reference_forward, PROMPT, dataclasses.replace(params, stop_token_ids=(stop,)),
        mode=mode, window=4, mask_id=MASK_TOKEN_ID,
    )
    assert stopped.token_ids == free.token_ids[: index + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.forwards <= free.forwards


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny, mode):
    _, _, _, reference_forward = tiny

    def sample(seed):
        params = Params(max_new_tokens=10, temperature=1.0, threshold=MULTI_TOKEN_THRESHOLD,
                        seed=seed)
        return decode(reference_forward, PROMPT, params, mode=mode, window=4,
                      mask_id=MASK_TOKEN_ID).token_ids

    assert sample(7) == sample(7)
    assert len({tuple(sample(seed)) for seed in (7, 8, 9)}) > 1


def test_greedy_ignores_the_seed(tiny):
    _, _, _, reference_forward = tiny
    outputs = {
        tuple(decode(reference_forward, PROMPT, Params(max_new_tokens=8, seed=seed),
                     window=4, mask_id=MASK_TOKEN_ID).token_ids)
        for seed in (0, 1)
    }
    assert len(outputs) == 1


def test_invalid_arguments_raise(tiny):
    _, _, _, reference_forward = tiny
    params = Params(max_new_tokens=4)
    with pytest.raises(ValueError, match="mode"):
        decode(reference_forward, PROMPT, params, mode="beam", mask_id=MASK_TOKEN_ID)
    with pytest.raises(ValueError, match="window"):
        decode(reference_forward, PROMPT, params, window=0, mask_id=MASK_TOKEN_ID)
    with pytest.raises(ValueError, match="mask_id"):
        decode(reference_forward, PROMPT, params)
    with pytest.raises(ValueError, match="prompt"):
        decode(reference_forward, [], params, mode="ar")
