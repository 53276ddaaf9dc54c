"""The helpers an engine builds a batch with (wedlm_kernels.batch) against loops that state
their contracts one row at a time, on random batches and at the edges; and a decode step
through them against one that packs every row (the same tokens)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wedlm_kernels as wk


def slot_of(block_table: list[int], position: int, page_size: int) -> int:
    """One position's cache slot, as the contract states it."""
    page = position // page_size
    if position < 0 or page >= len(block_table) or block_table[page] < 0:
        return -1
    return block_table[page] * page_size + position % page_size


@st.composite
def paged_batches(draw):
    batch = draw(st.integers(0, 5))
    pages = draw(st.integers(0, 4))
    page_size = draw(st.sampled_from([1, 2, 3, 16]))
    table = [[draw(st.integers(-1, 9)) for _ in range(pages)] for _ in range(batch)]
    return batch, pages, page_size, table


@given(paged_batches(), st.data())
def test_paged_slots_follow_each_sequences_block_table(paged, data):
    batch, pages, page_size, table = paged
    width = data.draw(st.integers(0, 6))
    positions = [[data.draw(st.integers(-2, (pages + 1) * page_size)) for _ in range(width)]
                 for _ in range(batch)]
    valid = [[data.draw(st.booleans()) for _ in range(width)] for _ in range(batch)]
    block_table = torch.tensor(table, dtype=torch.int32).view(batch, pages)
    position_tensor = torch.tensor(positions, dtype=torch.int64).view(batch, width)
    valid_tensor = torch.tensor(valid, dtype=torch.bool).view(batch, width)

    slots = wk.paged_slots(block_table, position_tensor, page_size, valid_tensor)
    expected = [[slot_of(table[b], p, page_size) if ok else -1
                 for p, ok in zip(positions[b], valid[b])] for b in range(batch)]
    assert slots.dtype == torch.int64
    assert slots.view(batch, width).tolist() == expected
    everywhere = [[slot_of(table[b], p, page_size) for p in positions[b]] for b in range(batch)]
    assert wk.paged_slots(block_table, position_tensor.int(), page_size).view(
        batch, width).tolist() == everywhere


@given(paged_batches(), st.data())
def test_prefill_slots_place_each_row_after_its_sequences_cached_tokens(paged, data):
    batch, pages, page_size, table = paged
    lengths = [data.draw(st.integers(0, 5)) for _ in range(batch)]
    cached = [data.draw(st.integers(0, 6)) for _ in range(batch)]
    padding = data.draw(st.integers(0, 3))
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    num_rows = starts[-1] + padding

    positions, slots = wk.prefill_slots(
        torch.tensor(starts, dtype=torch.int32), torch.tensor(cached, dtype=torch.int32),
        torch.tensor(table, dtype=torch.int32).view(batch, pages), page_size, num_rows)
    expected_positions, expected_slots = [], []
    for b, length in enumerate(lengths):
        for i in range(length):
            expected_positions.append(cached[b] + i)
            expected_slots.append(slot_of(table[b], cached[b] + i, page_size))
    expected_positions += [0] * padding
    expected_slots += [-1] * padding
    assert positions.tolist() == expected_positions
    assert slots.tolist() == expected_slots


@given(st.data())
def test_mask_rows_gather_each_sequences_masks_into_its_window(data):
    window = data.draw(st.integers(1, 4))
    batch = data.draw(st.integers(0, 4))
    filled = [data.draw(st.integers(0, 3)) for _ in range(batch)]
    masks = [data.draw(st.integers(0, window + 2)) for _ in range(batch)]
    starts = [0]
    for f, m in zip(filled, masks):
        starts.append(starts[-1] + f + m)
    num_rows = starts[-1] + data.draw(st.integers(0, 2))
    positions = torch.randperm(max(num_rows, 1))[:num_rows] + 100

    rows, cu_rows, row_pos = wk.mask_rows(torch.tensor(starts, dtype=torch.int32),
                                          torch.tensor(filled, dtype=torch.int32),
                                          positions, window)
    assert cu_rows.tolist() == [window * b for b in range(batch + 1)]
    assert rows.shape == row_pos.shape == (batch * window,)
    for b in range(batch):
        for j in range(window):
            row, pos = int(rows[b * window + j]), int(row_pos[b * window + j])
            if j < masks[b]:  # the j-th mask row of b predicts its own position
                assert row == starts[b] + filled[b] + j
                assert pos == int(positions[row])
            else:
                assert pos == -1
            if num_rows:
                assert 0 <= row < num_rows


def test_mask_rows_of_a_step_without_rows_are_all_padding():
    rows, cu_rows, row_pos = wk.mask_rows(torch.zeros(3, dtype=torch.int32),
                                          torch.zeros(2, dtype=torch.int32),
                                          torch.zeros(0, dtype=torch.int64), window=2)
    assert row_pos.tolist() == [-1] * 4 and cu_rows.tolist() == [0, 2, 4]


def test_new_window_state_starts_each_sequence_with_its_prompt_and_its_window():
    stop_ids = torch.tensor([[2, -1], [5, 6], [-1, -1]])
    state = wk.new_window_state([5, 3, 0], max_new=[8, 2, 0], window=torch.tensor([4, 4, 3]),
                                mask_id=9, stop_ids=stop_ids)
    assert state.win_len.tolist() == [4, 2, 0]  # never past max_new
    assert state.ctx_len.tolist() == [5, 3, 0]
    assert tuple(state.win_tokens.shape) == (3, 8)  # twice the widest window
    assert bool((state.win_tokens == 9).all()) and bool(state.win_mask.all())
    assert tuple(state.out_tokens.shape) == (3, 8) and state.out_len.tolist() == [0, 0, 0]
    assert not bool(state.finished.any()) and state.max_new.tolist() == [8, 2, 0]
    assert torch.equal(state.stop_ids, stop_ids)
    dtypes = {name: getattr(state, name).dtype for name in vars(state)}
    assert dtypes == {"win_tokens": torch.int64, "win_mask": torch.bool,
                      "win_len": torch.int32, "ctx_len": torch.int32,
                      "out_tokens": torch.int64, "out_len": torch.int32,
                      "finished": torch.bool, "stop_ids": torch.int64,
                      "max_new": torch.int32}
    wide = wk.new_window_state(torch.tensor([1]), torch.tensor([3]), 2, mask_id=0,
                               max_output=7, slots=5)
    assert tuple(wide.win_tokens.shape) == (1, 5) and tuple(wide.out_tokens.shape) == (1, 7)
    assert tuple(wide.stop_ids.shape) == (1, 0)


@pytest.mark.parametrize("call, message", [
    (lambda: wk.new_window_state([1, 2], [3], 2, mask_id=0), "`max_new` has 1"),
    (lambda: wk.new_window_state([1, -2], [3, 3], 2, mask_id=0), "`prompt_len[1]`"),
    (lambda: wk.new_window_state([1], [3], 2, mask_id=-1), "`mask_id`"),
    (lambda: wk.new_window_state([1], [3], 4, mask_id=0, slots=3), "`slots`"),
    (lambda: wk.new_window_state([1], [3], 2, mask_id=0,
                                 stop_ids=torch.zeros(2, 1, dtype=torch.int64)), "`stop_ids`"),
    (lambda: wk.paged_slots(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 3), 4),
     "`block_table`"),
    (lambda: wk.paged_slots(torch.zeros(2, 1, dtype=torch.int32),
                            torch.zeros(3, 3, dtype=torch.int64), 4), "`positions`"),
    (lambda: wk.paged_slots(torch.zeros(2, 1, dtype=torch.int32),
                            torch.zeros(2, 3, dtype=torch.int64), 0), "`page_size`"),
    (lambda: wk.prefill_slots(torch.zeros(3, dtype=torch.int32),
                              torch.zeros(3, dtype=torch.int32),
                              torch.zeros(3, 1, dtype=torch.int32), 4, 2), "`query_start`"),
    (lambda: wk.prefill_slots(torch.zeros(3, dtype=torch.int32),
                              torch.zeros(2, dtype=torch.int32),
                              torch.zeros(2, 1, dtype=torch.int32), 4, -1), "`num_rows`"),
    (lambda: wk.mask_rows(torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                          torch.zeros(4, dtype=torch.int64), 0), "`window`"),
    (lambda: wk.mask_rows(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                          torch.zeros(4, dtype=torch.int64), 2), "`query_start`"),
])
def test_bad_arguments_are_refused_naming_them(call, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("[", r"\[")):
        call()


def test_a_step_through_mask_rows_selects_what_a_step_over_every_packed_row_selects():
    """The docstring's claim: logits for every packed row, with ``cu_rows = query_start``
    and ``row_pos = -1`` on the filled rows, give the same tokens and selection."""
    torch.manual_seed(0)
    window, vocab, mask_id = 4, 50, 49
    state = wk.new_window_state([3, 6, 2], max_new=[10, 10, 10], window=window,
                                mask_id=mask_id)
    state.win_mask[0, 1] = False
    state.win_tokens[0, 1] = 7
    state.win_mask[1, 0] = state.win_mask[1, 3] = False
    state.win_tokens[1, 0], state.win_tokens[1, 3] = 3, 4
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4)
    num_rows = int(state.win_len.sum())
    _, positions, _, _, query_start, n_filled = wk.reorder_window(
        state.win_tokens, state.win_mask, state.win_len, state.ctx_len, block_table, 4,
        num_rows)
    all_logits = torch.randn(num_rows, vocab)
    parameters = dict(temperature=torch.tensor([0.0, 0.8, 1.2]),
                      top_k=torch.tensor([0, 5, 0], dtype=torch.int32),
                      top_p=torch.tensor([1.0, 1.0, 0.9]),
                      threshold=torch.tensor([0.5, 2.0, 0.1]),
                      penalty=torch.tensor([0.1, 0.0, 1.0]),
                      seed=torch.tensor([1, 2, 3]))

    rows, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, window)
    token, selected, _ = wk.select_tokens(all_logits[rows], cu_rows, row_pos, **parameters)

    row = torch.arange(num_rows)
    sequence = torch.searchsorted(query_start[1:].long(), row, right=True)
    is_mask = row >= (query_start[:-1] + n_filled).long()[sequence]
    every_pos = torch.where(is_mask, positions, -1)
    every_token, every_selected, _ = wk.select_tokens(all_logits, query_start, every_pos,
                                                      **parameters)
    kept = row_pos >= 0
    assert kept.sum() == is_mask.sum() > 0
    assert torch.equal(token[kept], every_token[is_mask])
    assert torch.equal(selected[kept], every_selected[is_mask])
    assert not bool(selected[~kept].any())
