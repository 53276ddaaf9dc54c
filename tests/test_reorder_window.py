"""reorder_window: the stable filled-first partition, logical positions, physical cache slots,
the live rows of all sequences packed back to back."""

import random

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference.window import reorder_window as reorder_reference
from wedlm_kernels import _backend

MASK = 99
OUTPUTS = ("input_ids", "positions", "slot_mapping", "order", "query_start", "n_filled")


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def random_window_state(seed: int, batch: int, window: int, page_size: int):
    """Random windows (any filled/mask pattern, junk past win_len) and sparse page tables:
    the op's arguments up to ``page_size`` (``num_rows`` is for the caller to add)."""
    rng = random.Random(seed)
    slots = 2 * window
    tokens, masks, lengths, contexts = [], [], [], []
    for _ in range(batch):
        lengths.append(rng.choice([0, slots, rng.randint(0, slots)]))
        contexts.append(rng.randint(0, 40))
        mask_rate = rng.choice([0.0, 0.3, 0.7, 1.0, rng.random()])
        row_masks = [rng.random() < mask_rate for _ in range(slots)]
        masks.append(row_masks)
        tokens.append([MASK if m else rng.randrange(50) for m in row_masks])
        for s in range(lengths[-1], slots):  # slots past win_len hold anything
            tokens[-1][s], masks[-1][s] = rng.randrange(200), rng.random() < 0.5
    needed = max((c + slots + page_size - 1) // page_size for c in contexts) if batch else 0
    pages = max(0, needed + rng.choice([0, 0, 1, -1, -2]))  # sometimes too narrow
    pool = rng.sample(range(4 * batch * max(pages, 1) + 8), batch * pages)
    table = [pool[b * pages : (b + 1) * pages] for b in range(batch)]
    for row in table:
        for p in range(pages):
            if rng.random() < 0.1:
                row[p] = -1  # no page
    return (
        torch.tensor(tokens, dtype=torch.int64).view(batch, slots),
        torch.tensor(masks, dtype=torch.bool).view(batch, slots),
        _i32(lengths),
        _i32(contexts),
        torch.tensor(table, dtype=torch.int32).view(batch, pages),
        page_size,
    )


def live_rows(args) -> int:
    """The live slots of a batch: the rows its packed outputs need."""
    return int(args[2].clamp(0, args[0].shape[1]).sum())


def assert_outputs_equal(actual, expected):
    for name, a, e in zip(OUTPUTS, actual, expected):
        assert a.dtype == e.dtype, name
        assert torch.equal(a, e), f"{name}:\n{a}\n!=\n{e}"


def rows_of(outputs, b: int) -> dict[str, list[int]]:
    """The packed rows of sequence ``b`` as lists, per output name."""
    query_start = outputs[4]
    first, end = int(query_start[b]), int(query_start[b + 1])
    return {name: t[first:end].tolist() for name, t in zip(OUTPUTS[:4], outputs[:4])}


@pytest.fixture(params=["op", "reference"])
def reorder(request):
    """The hand-computed cases pin the op and the reference alike."""
    return wk.reorder_window if request.param == "op" else reorder_reference


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(0, 5),
    window=st.integers(1, 8),
    page_size=st.integers(1, 16),
    padding_rows=st.integers(0, 3),
)
@example(seed=0, batch=0, window=1, page_size=1, padding_rows=0)
@example(seed=1, batch=1, window=1, page_size=1, padding_rows=2)
@example(seed=2, batch=5, window=8, page_size=16, padding_rows=0)
def test_matches_reference_on_random_windows_and_page_tables(seed, batch, window, page_size,
                                                             padding_rows):
    args = random_window_state(seed, batch, window, page_size)
    num_rows = live_rows(args) + padding_rows
    assert_outputs_equal(wk.reorder_window(*args, num_rows),
                         reorder_reference(*args, num_rows))


@given(seed=st.integers(0, 2**32 - 1), window=st.integers(1, 8), page_size=st.integers(1, 16))
def test_order_is_a_stable_filled_first_partition_that_keeps_the_leading_run(
    seed, window, page_size
):
    args = random_window_state(seed, 4, window, page_size)
    win_tokens, win_mask, win_len = args[:3]
    outputs = wk.reorder_window(*args, live_rows(args))
    n_filled = outputs[5]
    for b in range(4):
        n = int(win_len[b])
        rows = rows_of(outputs, b)["order"]
        assert sorted(rows) == list(range(n))
        filled = [s for s in range(n) if not win_mask[b, s]]
        assert int(n_filled[b]) == len(filled)
        assert rows[: len(filled)] == filled  # ascending filled slots
        assert rows[len(filled) :] == [s for s in range(n) if win_mask[b, s]]
        run = 0
        while run < n and not win_mask[b, run]:
            run += 1
        assert rows[:run] == list(range(run))  # prefix cacheability: the run stays in place


def test_worked_example_orders_filled_first_at_logical_positions_and_physical_slots(reorder):
    # the worked example of the streaming step: L = 10, window [a, M, c, M, M], S = 8, pages of 4
    a, c = 5, 7
    win_tokens = torch.tensor([[a, MASK, c, MASK, MASK, MASK, MASK, MASK]])
    block_table = _i32([[6, 0, 9, 2, 4]])
    ids, positions, slots, order, query_start, n_filled = reorder(
        win_tokens, win_tokens == MASK, _i32([5]), _i32([10]), block_table, 4, 5
    )
    assert order.tolist() == [0, 2, 1, 3, 4]
    assert ids.tolist() == [a, c, MASK, MASK, MASK]
    assert positions.tolist() == [10, 12, 11, 13, 14]
    # physical rows 0..4 write positions 10..14: page 9 offsets 2, 3; page 2 offsets 0..2
    assert slots.tolist() == [38, 39, 8, 9, 10]
    assert query_start.tolist() == [0, 5] and n_filled.tolist() == [2]


def test_sequences_are_packed_back_to_back_then_padding_rows(reorder):
    win_tokens = torch.tensor([[MASK, 3, MASK, 4, 5, 6], [7, 8, 9, 10, 11, 12],
                               [MASK, 20, 21, 22, 23, 24]])
    win_mask = win_tokens == MASK
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4)
    ids, positions, slots, order, query_start, n_filled = reorder(
        win_tokens, win_mask, _i32([3, 0, 2]), _i32([5, 2, 0]), block_table, 4, 8
    )
    assert query_start.tolist() == [0, 3, 3, 5]  # the empty sequence holds no row
    assert order.tolist() == [1, 0, 2, 1, 0, 0, 0, 0]
    assert ids.tolist() == [3, MASK, MASK, 20, MASK, 0, 0, 0]
    assert positions.tolist() == [6, 5, 7, 1, 0, 0, 0, 0]
    assert slots.tolist() == [5, 6, 7, 32, 33, -1, -1, -1]
    assert n_filled.tolist() == [1, 0, 1]


def test_rows_past_the_page_table_or_on_a_negative_page_get_slot_minus_one(reorder):
    win_tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    block_table = _i32([[3, -1, 5]])  # page 1 missing, pages >= 3 not in the table
    *_, slots, _, _, _ = reorder(
        win_tokens, torch.zeros(1, 6, dtype=torch.bool), _i32([6]), _i32([3]), block_table, 2,
        6,
    )
    # positions 3..8 -> pages 1, 2, 2, 3, 3, 4 (offsets 1, 0, 1, 0, 1, 0)
    assert slots.tolist() == [-1, 10, 11, -1, -1, -1]


def test_empty_page_table_drops_every_write(reorder):
    win_tokens = torch.tensor([[1, MASK, 2]])
    *_, slots, _, _, _ = reorder(
        win_tokens, win_tokens == MASK, _i32([3]), _i32([0]),
        torch.empty(1, 0, dtype=torch.int32), 16, 3,
    )
    assert slots.tolist() == [-1, -1, -1]


def test_slots_past_win_len_are_never_read(reorder):
    args = list(random_window_state(7, 3, 4, 3))
    args[2] = _i32([2, 5, 0])
    first = reorder(*args, 7)
    junk_tokens, junk_mask = args[0].clone(), args[1].clone()
    for b, n in enumerate([2, 5, 0]):
        junk_tokens[b, n:] = 1234
        junk_mask[b, n:] = ~junk_mask[b, n:]
    second = reorder(junk_tokens, junk_mask, *args[2:], 7)
    assert_outputs_equal(second, first)


def test_win_len_is_clamped_to_zero_and_the_capacity(reorder, monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", False)  # out-of-range values, defined behaviour
    win_tokens = torch.tensor([[MASK, 1, 2], [MASK, 1, 2]])
    block_table = _i32([[0, 1], [2, 3]])
    ids, positions, slots, order, query_start, n_filled = reorder(
        win_tokens, win_tokens == MASK, _i32([-2, 9]), _i32([1, 1]), block_table, 2, 3
    )
    assert query_start.tolist() == [0, 0, 3]
    assert order.tolist() == [1, 2, 0]
    assert ids.tolist() == [1, 2, MASK]
    assert positions.tolist() == [2, 3, 1]
    assert slots.tolist() == [5, 6, 7]
    assert n_filled.tolist() == [0, 2]


def test_rows_past_num_rows_are_dropped_and_query_start_is_clamped(reorder, monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", False)  # too few rows: defined behaviour
    win_tokens = torch.tensor([[1, MASK, 2], [3, 4, MASK]])
    block_table = _i32([[0, 1], [2, 3]])
    ids, _, slots, _, query_start, n_filled = reorder(
        win_tokens, win_tokens == MASK, _i32([3, 3]), _i32([0, 0]), block_table, 2, 4
    )
    assert query_start.tolist() == [0, 3, 4]
    assert ids.tolist() == [1, 2, MASK, 3]
    assert slots.tolist() == [0, 1, 2, 4]
    assert n_filled.tolist() == [2, 2]


@pytest.mark.parametrize("batch, slots, num_rows", [(0, 4, 0), (0, 4, 3), (3, 0, 2), (0, 0, 0)])
def test_empty_batch_or_window_gives_padding_rows_only(reorder, batch, slots, num_rows):
    args = (
        torch.zeros(batch, slots, dtype=torch.int64), torch.zeros(batch, slots, dtype=torch.bool),
        torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32),
        torch.zeros(batch, 2, dtype=torch.int32), 4, num_rows,
    )
    outputs = reorder(*args)
    assert [tuple(t.shape) for t in outputs] == [(num_rows,)] * 4 + [(batch + 1,), (batch,)]
    assert [t.dtype for t in outputs] == [torch.int64] * 3 + [torch.int32] * 3
    assert outputs[2].tolist() == [-1] * num_rows
    assert not outputs[4].any() and not outputs[5].any()


def test_outputs_are_fresh_tensors_and_inputs_are_unchanged():
    args = random_window_state(3, 3, 4, 5)
    before = [a.clone() for a in args[:5]]
    outputs = wk.reorder_window(*args, live_rows(args))
    for a, b in zip(args[:5], before):
        assert torch.equal(a, b)
    for out in outputs:
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args[:5])


def _valid_args():
    args = list(random_window_state(0, 2, 3, 4))
    return args + [live_rows(args)]


@pytest.mark.parametrize(
    "index, name, bad",
    [
        (0, "win_tokens", torch.zeros(2, 6, dtype=torch.int32)),
        (1, "win_mask", torch.zeros(2, 6, dtype=torch.int64)),
        (2, "win_len", torch.zeros(2, dtype=torch.int64)),
        (3, "ctx_len", torch.zeros(2, dtype=torch.int64)),
        (4, "block_table", torch.zeros(2, 3, dtype=torch.int64)),
        (5, "page_size", 4.0),
        (6, "num_rows", 12.0),
    ],
)
def test_wrong_dtype_or_type_is_a_type_error_naming_the_argument(index, name, bad):
    args = _valid_args()
    args[index] = bad
    with pytest.raises(TypeError, match=name):
        wk.reorder_window(*args)


@pytest.mark.parametrize(
    "index, name, bad",
    [
        (1, "win_mask", torch.zeros(2, 5, dtype=torch.bool)),
        (2, "win_len", torch.zeros(3, dtype=torch.int32)),
        (3, "ctx_len", torch.zeros(2, 1, dtype=torch.int32)),
        (4, "block_table", torch.zeros(3, 4, dtype=torch.int32)),
        (5, "page_size", 0),
        (6, "num_rows", -1),
    ],
)
def test_wrong_shape_batch_page_size_or_rows_is_a_value_error_naming_the_argument(index, name,
                                                                                 bad):
    args = _valid_args()
    args[index] = bad
    with pytest.raises(ValueError, match=name):
        wk.reorder_window(*args)


def test_strided_inputs_are_accepted():
    args = _valid_args()
    wide_tokens = torch.zeros(2, 12, dtype=torch.int64)
    wide_tokens[:, ::2] = args[0]
    expected = wk.reorder_window(*args)
    assert_outputs_equal(wk.reorder_window(wide_tokens[:, ::2], *args[1:]), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices_are_a_value_error():
    args = _valid_args()
    args[2] = args[2].cuda()
    with pytest.raises(ValueError, match="win_len"):
        wk.reorder_window(*args)


def test_debug_mode_rejects_win_len_above_capacity_negative_ctx_len_and_too_few_rows(
        monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", True)
    args = _valid_args()
    args[4] = torch.arange(2 * 12, dtype=torch.int32).view(2, 12)  # pages for 40 + 6 slots
    wk.reorder_window(*args)
    args[2] = _i32([7, 1])
    with pytest.raises(ValueError, match="win_len"):
        wk.reorder_window(*args)
    args[2], args[3] = _i32([6, 1]), _i32([0, -1])
    with pytest.raises(ValueError, match="ctx_len"):
        wk.reorder_window(*args)
    args[3], args[6] = _i32([0, 1]), 6
    with pytest.raises(ValueError, match="num_rows"):
        wk.reorder_window(*args)


def test_debug_mode_rejects_a_block_table_without_a_page_for_every_window_position(
        monkeypatch):
    """ctx_len + win_len positions need that many pages of the sequence's block_table row,
    each with an id >= 0; without debug mode the writes past them are dropped (slot -1)."""
    monkeypatch.setattr(_backend, "DEBUG", True)
    tokens, mask = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.bool)
    win_len, ctx_len = _i32([4, 2]), _i32([5, 0])  # 9 and 2 positions: 3 and 1 pages of 4
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)  # page 2 of b=1 unused
    wk.reorder_window(tokens, mask, win_len, ctx_len, table, 4, 6)
    with pytest.raises(ValueError, match="`block_table` has 2 pages per sequence, too few"):
        wk.reorder_window(tokens, mask, win_len, ctx_len, table[:, :2], 4, 6)
    missing = torch.tensor([[0, -1, 2], [3, 4, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page id >= 0 for every page the window writes"):
        wk.reorder_window(tokens, mask, win_len, ctx_len, missing, 4, 6)
    monkeypatch.setattr(_backend, "DEBUG", False)
    slot_mapping = wk.reorder_window(tokens, mask, win_len, ctx_len, table[:, :2], 4, 6)[2]
    assert slot_mapping.tolist() == [5, 6, 7, -1, 12, 13]  # position 8 has no page
