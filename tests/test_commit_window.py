"""commit_window: commit with stop and length rules, shift, fill, early finish and refill."""

import random

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference.window import commit_window as commit_reference
from reference.window import reorder_window as reorder_reference
from wedlm_kernels import _backend

MASK = 99
SENTINEL = -5
STATE = ("win_tokens", "win_mask", "win_len", "ctx_len", "out_tokens", "out_len", "finished")
# argument positions of commit_window
MUTATED = (0, 1, 2, 3, 8, 9, 10)
READ_ONLY = (4, 5, 6, 7, 11, 12)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def assert_states_equal(actual_args, expected_args):
    for name, index in zip(STATE, MUTATED):
        a, e = actual_args[index], expected_args[index]
        assert a.dtype == e.dtype, name
        assert torch.equal(a, e), f"{name}:\n{a}\n!=\n{e}"


def mask_rows(win_mask, win_len, ctx_len, b):
    """Positions predicted by the mask rows of sequence b's window (select_tokens rows)."""
    n = max(0, min(int(win_len[b]), win_mask.shape[1]))
    return [int(ctx_len[b]) + s for s in range(n) if win_mask[b, s]]


def build_rows(rng, row_groups, lead=0, trail=0, select_rate=0.5, vocab=12):
    """cu_rows/row_pos/token/selected from per-sequence row positions, padding rows mixed in."""
    positions = [rng.randrange(60) for _ in range(lead)]
    offsets = [lead]
    for group in row_groups:
        group = group + [-1] * rng.choice([0, 0, 1, 2])  # padding rows inside a sequence
        rng.shuffle(group)
        positions += group
        offsets.append(len(positions))
    positions += [rng.randrange(60) for _ in range(trail)]  # rows after cu_rows[B]
    selected = [rng.random() < select_rate for _ in positions]
    return (
        _i32(offsets),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor([rng.randrange(vocab) for _ in positions], dtype=torch.int64),
        torch.tensor(selected, dtype=torch.bool),
    )


def random_commit_case(seed: int, batch: int, window: int, blockwise: bool,
                       limited: bool = False):
    """A random decoder state plus select_tokens rows consistent with it (mask rows only);
    ``limited``: with a random ``commit_limit`` (argument 16: negative, zero, within the
    window, past it)."""
    rng = random.Random(seed)
    slots, vocab = 2 * window, 24
    capacity = rng.choice([window, rng.randint(0, 3 * slots), rng.randint(2 * slots, 4 * slots)])
    stops_per_seq = rng.randint(0, 3)
    tokens, masks, lengths, contexts, outputs, out_lengths = [], [], [], [], [], []
    done, stops, limits = [], [], []
    for _ in range(batch):
        kind = rng.choices(["active", "finished", "empty"], weights=[6, 1, 1])[0]
        n = 0 if kind == "empty" else rng.randint(1 if kind == "active" else 0, slots)
        run = rng.randint(0, n)  # a leading filled run, then a random pattern
        if blockwise and rng.random() < 0.5:
            run = rng.choice([min(window, n), n])
        mask_rate = rng.choice([0.2, 0.5, 0.9, rng.random()])
        row_masks = [s >= run and (s >= n or rng.random() < mask_rate) for s in range(slots)]
        if run < n:
            row_masks[run] = True
        row_tokens = [MASK if m else rng.randrange(vocab) for m in row_masks]
        for s in range(n, slots):  # slots past win_len hold anything
            row_tokens[s], row_masks[s] = rng.randrange(vocab), rng.random() < 0.5
        near_capacity = max(0, capacity - rng.randint(1, 3))
        out_length = rng.choice([0, 0, rng.randint(0, capacity), near_capacity])
        tokens.append(row_tokens)
        masks.append(row_masks)
        lengths.append(n)
        contexts.append(rng.randint(0, 30))
        outputs.append([rng.randrange(vocab) for _ in range(out_length)]
                       + [SENTINEL] * (capacity - out_length))
        out_lengths.append(out_length)
        done.append(kind == "finished")
        stops.append([rng.choice([-1, rng.randrange(vocab)]) for _ in range(stops_per_seq)])
        limits.append(rng.choices(
            [0, out_length, out_length + rng.randint(1, 4), out_length + rng.randint(0, 2 * slots),
             1000], weights=[1, 1, 4, 4, 8])[0])
    win_tokens = torch.tensor(tokens, dtype=torch.int64).view(batch, slots)
    win_mask = torch.tensor(masks, dtype=torch.bool).view(batch, slots)
    win_len, ctx_len = _i32(lengths), _i32(contexts)
    row_groups = [mask_rows(win_mask, win_len, ctx_len, b) for b in range(batch)]
    rows = build_rows(rng, row_groups, lead=rng.choice([0, 0, 2]), trail=rng.choice([0, 0, 3]),
                      select_rate=rng.random())
    case = [
        win_tokens, win_mask, win_len, ctx_len, *rows,
        torch.tensor(outputs, dtype=torch.int64).view(batch, capacity), _i32(out_lengths),
        torch.tensor(done, dtype=torch.bool),
        torch.tensor(stops, dtype=torch.int64).view(batch, stops_per_seq), _i32(limits),
        window, MASK, blockwise,
    ]
    if limited:
        case.append(_i32([rng.choice([-1, 0, rng.randint(0, slots), rng.randint(0, 3), 1000])
                          for _ in range(batch)]))
    return case


@pytest.fixture(params=["op", "reference"])
def commit(request):
    """The hand-computed cases pin the op and the reference alike."""
    return wk.commit_window if request.param == "op" else commit_reference


def run_both(args):
    """Run the op and the reference on copies of ``args``; return (op_args, reference_args)."""
    op_args, ref_args = _clone(args), _clone(args)
    assert wk.commit_window(*op_args) is None
    commit_reference(*ref_args)
    return op_args, ref_args


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(0, 5),
    window=st.integers(1, 8),
    blockwise=st.booleans(),
    limited=st.booleans(),
)
@example(seed=0, batch=0, window=1, blockwise=False, limited=False)
@example(seed=1, batch=1, window=1, blockwise=True, limited=True)
@example(seed=2, batch=5, window=8, blockwise=True, limited=False)
@example(seed=3, batch=5, window=8, blockwise=False, limited=True)
def test_matches_reference_on_random_states(seed, batch, window, blockwise, limited):
    args = random_commit_case(seed, batch, window, blockwise, limited)
    op_args, ref_args = run_both(args)
    assert_states_equal(op_args, ref_args)
    for index in READ_ONLY:
        assert torch.equal(op_args[index], args[index])
    # out_tokens only changes at [old out_len, new out_len); the rest keeps its values
    old_len, new_len = args[9].tolist(), op_args[9].tolist()
    for b in range(batch):
        assert torch.equal(op_args[8][b, :old_len[b]], args[8][b, :old_len[b]])
        assert torch.equal(op_args[8][b, new_len[b]:], args[8][b, new_len[b]:])
        committed = new_len[b] - old_len[b]
        assert int(op_args[3][b]) - int(args[3][b]) == committed  # ctx_len follows out_len
        assert 0 <= committed <= max(0, int(args[2][b]))
        if limited:
            assert committed <= max(0, int(args[16][b]))


def worked_example(max_new=100, stop_ids=(-1,), blockwise=False):
    """docs/algorithm.md's worked example: W = 4, L = 10, fed window [a, M, c, M, M]; the mask
    rows predict 11, 13, 14 and the ones at 11 (x) and 13 (y) are selected."""
    a, c, x, y, z = 1, 3, 4, 6, 7
    win_tokens = torch.tensor([[a, MASK, c, MASK, MASK, MASK, MASK, MASK]])
    return [
        win_tokens, win_tokens == MASK, _i32([5]), _i32([10]),
        _i32([0, 3]), torch.tensor([11, 13, 14]), torch.tensor([x, y, z]),
        torch.tensor([True, True, False]),
        torch.full((1, 12), SENTINEL), _i32([0]), torch.tensor([False]),
        torch.tensor([list(stop_ids)]), _i32([max_new]), 4, MASK, blockwise,
    ]


def test_worked_example_commits_a_fills_x_and_y_and_refills_to_seven_slots(commit):
    args = worked_example()
    commit(*args)
    win_tokens, win_mask, win_len, ctx_len, *_ = args
    assert args[8][0, :2].tolist() == [1, SENTINEL] and args[9].tolist() == [1]
    assert ctx_len.tolist() == [11] and win_len.tolist() == [7]
    assert win_tokens.tolist() == [[4, 3, 6, MASK, MASK, MASK, MASK, MASK]]
    assert win_mask.tolist() == [[False, False, False, True, True, True, True, True]]
    assert args[10].tolist() == [False]


def test_refill_never_extends_past_prompt_len_plus_max_new(commit):
    args = worked_example(max_new=6)  # prompt 10 + max_new 6: positions < 16
    commit(*args)
    assert args[3].tolist() == [11] and args[2].tolist() == [5]  # not 7
    assert args[0].tolist() == [[4, 3, 6, MASK, MASK, MASK, MASK, MASK]]


def test_early_finish_commits_the_new_run_without_another_forward(commit):
    args = worked_example(max_new=4)  # a, then x c y reach max_new
    commit(*args)
    assert args[8][0, :5].tolist() == [1, 4, 3, 6, SENTINEL] and args[9].tolist() == [4]
    assert args[3].tolist() == [14] and args[2].tolist() == [0]
    assert args[10].tolist() == [True]
    assert args[0].tolist() == [[MASK] * 8] and args[1].all()


def test_early_finish_stops_at_the_limit_inside_the_new_run(commit):
    args = worked_example(max_new=3)
    commit(*args)
    assert args[8][0, :4].tolist() == [1, 4, 3, SENTINEL] and args[9].tolist() == [3]
    assert args[3].tolist() == [13] and args[10].tolist() == [True]


def test_early_finish_on_a_stop_token_in_the_new_run_drops_what_follows(commit):
    args = worked_example(stop_ids=(3, -1))  # c is a stop token
    commit(*args)
    assert args[8][0, :4].tolist() == [1, 4, 3, SENTINEL] and args[9].tolist() == [3]
    assert args[2].tolist() == [0] and args[10].tolist() == [True]


def test_commit_limit_cuts_the_commit_and_the_early_finish_but_not_the_refill(commit):
    # unlimited, max_new 4 finishes early with a x c y (the test above); a limit of 2
    # commits a, and x (one more) would not finish: the step goes on, x c y filled
    args = worked_example(max_new=4) + [_i32([2])]
    commit(*args)
    assert args[8][0, :2].tolist() == [1, SENTINEL] and args[9].tolist() == [1]
    assert args[10].tolist() == [False] and args[3].tolist() == [11]
    assert args[2].tolist() == [3]  # refilled by the whole run, within max_new
    assert args[0][0, :3].tolist() == [4, 3, 6] and not args[1][0, :3].any()


def test_commit_limit_of_zero_or_less_commits_nothing_and_hides_a_stop_in_the_new_run(commit):
    for limit in (0, -3):
        args = worked_example(stop_ids=(3, -1)) + [_i32([limit])]  # c is a stop token
        commit(*args)
        assert args[9].tolist() == [0] and args[3].tolist() == [10]
        assert args[10].tolist() == [False]
        # nothing shifted: a x c y filled, the run of 4 refills 4 masks (capacity 8)
        assert args[0].tolist() == [[1, 4, 3, 6, MASK, MASK, MASK, MASK]]
        assert args[2].tolist() == [8]


def test_commit_limit_at_the_fed_run_still_finishes_early_on_what_was_fed(commit):
    # the limit counts the fed window's slots: 1 (a) then 2 more in the early finish
    args = worked_example(max_new=3) + [_i32([3])]
    commit(*args)
    assert args[8][0, :4].tolist() == [1, 4, 3, SENTINEL] and args[9].tolist() == [3]
    assert args[10].tolist() == [True] and args[2].tolist() == [0]


def test_blockwise_block_past_the_commit_limit_is_not_committed(commit):
    block = _single([5, 6, 7, 8, MASK], 5, 0, 0, 20, [-1], window=4, blockwise=True)
    commit(*(block + [_i32([3])]))
    assert block[9].tolist() == [0] and block[0][0, :4].tolist() == [5, 6, 7, 8]
    whole = _single([5, 6, 7, 8, MASK], 5, 0, 0, 20, [-1], window=4, blockwise=True)
    commit(*(whole + [_i32([4])]))
    assert whole[9].tolist() == [4] and whole[8][0, :4].tolist() == [5, 6, 7, 8]


def _single(window_tokens, win_len, ctx_len, out_len, max_new, stop_ids, rows=(), window=4,
            blockwise=False, capacity=12):
    """One sequence; ``rows``: (row_pos, token, selected) triples."""
    slots = 2 * window
    win_tokens = torch.tensor([list(window_tokens) + [MASK] * (slots - len(window_tokens))])
    return [
        win_tokens, win_tokens == MASK, _i32([win_len]), _i32([ctx_len]),
        _i32([0, len(rows)]), torch.tensor([r[0] for r in rows], dtype=torch.int64),
        torch.tensor([r[1] for r in rows], dtype=torch.int64),
        torch.tensor([r[2] for r in rows], dtype=torch.bool),
        torch.full((1, capacity), SENTINEL), _i32([out_len]), torch.tensor([False]),
        torch.tensor([list(stop_ids)], dtype=torch.int64).view(1, len(stop_ids)),
        _i32([max_new]), window, MASK, blockwise,
    ]


def test_stop_token_inside_the_run_is_emitted_and_drops_the_rest(commit):
    args = _single([1, 8, 2, MASK, MASK], 5, ctx_len=20, out_len=3, max_new=50,
                   stop_ids=[-1, 8], rows=[(23, 5, True), (24, 6, True)])
    commit(*args)
    assert args[8][0, :6].tolist() == [SENTINEL] * 3 + [1, 8, SENTINEL]
    assert args[9].tolist() == [5] and args[3].tolist() == [22]
    assert args[10].tolist() == [True] and args[2].tolist() == [0]
    assert args[0].tolist() == [[MASK] * 8] and args[1].all()


def test_max_new_reached_mid_run_commits_up_to_the_limit_and_finishes(commit):
    args = _single([1, 2, 3, MASK], 4, ctx_len=7, out_len=3, max_new=5, stop_ids=[])
    commit(*args)
    assert args[8][0, 3:6].tolist() == [1, 2, SENTINEL] and args[9].tolist() == [5]
    assert args[3].tolist() == [9] and args[10].tolist() == [True] and args[2].tolist() == [0]


def test_output_capacity_bounds_max_new(commit):
    args = _single([1, 2, 3, MASK], 4, ctx_len=7, out_len=2, max_new=100, stop_ids=[], capacity=4)
    commit(*args)
    assert args[8].tolist() == [[SENTINEL, SENTINEL, 1, 2]] and args[10].tolist() == [True]


def test_max_new_zero_finishes_an_active_sequence_without_committing(commit):
    args = _single([1, MASK], 2, ctx_len=7, out_len=0, max_new=0, stop_ids=[],
                   rows=[(8, 4, True)])
    commit(*args)
    assert args[9].tolist() == [0] and args[3].tolist() == [7]
    assert args[10].tolist() == [True] and args[2].tolist() == [0]


def test_selected_rows_outside_the_live_mask_slots_are_ignored(commit):
    # after committing slot 0 (ctx 11) the window is [M, c, M, M] with live length 4
    args = _single([1, MASK, 3, MASK, MASK], 5, ctx_len=10, out_len=0, max_new=100,
                   stop_ids=[-1], rows=[
                       (10, 40, True),   # the committed position (slot -1 after the shift)
                       (12, 41, True),   # a filled slot
                       (15, 42, True),   # past the live window (inside the refilled part)
                       (-1, 43, True),   # padding row
                       (13, 44, False),  # not selected
                       (11, 46, True),   # written
                       (14, 45, True),   # written
                   ])
    commit(*args)
    assert args[0].tolist() == [[46, 3, MASK, 45, MASK, MASK, MASK, MASK]]
    assert args[1].tolist() == [[False, False, True, False, True, True, True, True]]
    assert args[2].tolist() == [6]  # leading run 2: two masks appended


def test_refill_is_capped_at_the_slot_capacity(commit):
    rows = [(10 + s, 20 + s, True) for s in range(8)]
    args = _single([MASK] * 8, 8, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1], rows=rows,
                   capacity=50)
    commit(*args)
    assert args[2].tolist() == [8] and args[9].tolist() == [0]
    assert args[0].tolist() == [list(range(20, 28))] and not args[1].any()


def test_rows_outside_the_sequence_row_ranges_are_ignored(commit):
    args = worked_example()
    # one leading row before cu_rows[0] and one trailing row after cu_rows[B], both selected
    args[4] = _i32([1, 4])
    args[5] = torch.tensor([14, 11, 13, 14, 14])
    args[6] = torch.tensor([9, 4, 6, 7, 9])
    args[7] = torch.tensor([True, True, True, False, True])
    commit(*args)
    assert args[0][0, :4].tolist() == [4, 3, 6, MASK]


def test_blockwise_partial_block_commits_and_refills_nothing(commit):
    rows = [(10, 4, True), (11, 5, True), (12, 6, False), (13, 7, True)]
    args = _single([MASK] * 4, 4, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1], rows=rows,
                   blockwise=True)
    commit(*args)
    assert args[0].tolist() == [[4, 5, MASK, 7, MASK, MASK, MASK, MASK]]
    assert args[2].tolist() == [4] and args[9].tolist() == [0] and args[3].tolist() == [10]
    # streaming refills by the leading run (2) instead
    args = _single([MASK] * 4, 4, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1], rows=rows)
    commit(*args)
    assert args[2].tolist() == [6]


def test_blockwise_partial_run_is_not_committed(commit):
    args = _single([1, 2, MASK, MASK], 4, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1],
                   blockwise=True)
    commit(*args)
    assert args[9].tolist() == [0] and args[0][0, :4].tolist() == [1, 2, MASK, MASK]
    args = _single([1, 2, MASK, MASK], 4, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1])
    commit(*args)
    assert args[9].tolist() == [2] and args[0][0, :2].tolist() == [MASK, MASK]


def test_blockwise_full_block_is_committed_by_the_next_forward_with_w_new_masks(commit):
    args = _single([1, 2, 3, MASK], 4, ctx_len=10, out_len=0, max_new=100, stop_ids=[-1],
                   rows=[(13, 4, True)], blockwise=True)
    commit(*args)
    # the block is complete: nothing committed yet, the next block's 4 masks are appended
    assert args[0].tolist() == [[1, 2, 3, 4, MASK, MASK, MASK, MASK]]
    assert args[2].tolist() == [8] and args[9].tolist() == [0]
    # that forward commits the whole block; the new window is the next block
    args[4:8] = [_i32([0, 4]), torch.tensor([14, 15, 16, 17]), torch.tensor([5, 6, 7, 8]),
                 torch.tensor([False, True, False, False])]
    commit(*args)
    assert args[8][0, :5].tolist() == [1, 2, 3, 4, SENTINEL] and args[3].tolist() == [14]
    assert args[0].tolist() == [[MASK, 6, MASK, MASK, MASK, MASK, MASK, MASK]]
    assert args[2].tolist() == [4] and args[10].tolist() == [False]


def test_finished_and_empty_sequences_are_not_touched(commit):
    win_tokens = torch.tensor([[1, 2, MASK, 5], [3, MASK, 7, 8], [MASK, MASK, 9, 9]])
    win_mask = win_tokens == MASK
    args = [
        win_tokens, win_mask, _i32([3, 0, 2]), _i32([4, 6, 8]),
        _i32([0, 2, 4, 6]), torch.tensor([6, 7, 6, 7, 8, 9]), torch.tensor([1, 2, 3, 4, 5, 6]),
        torch.ones(6, dtype=torch.bool),
        torch.full((3, 5), SENTINEL), _i32([1, 2, 0]), torch.tensor([True, False, False]),
        torch.tensor([[1], [3], [-1]]), _i32([5, 5, 5]), 2, MASK, False,
    ]
    before = _clone(args)
    commit(*args)
    for index in MUTATED:
        assert torch.equal(args[index][:2], before[index][:2])
    # the active one fills both masks and refills two
    assert args[0][2].tolist() == [5, 6, MASK, MASK] and args[2].tolist()[2] == 4


@pytest.mark.parametrize(
    "batch, window, capacity, rows, stops",
    [(0, 2, 4, 0, 1), (3, 2, 0, 2, 1), (2, 3, 5, 0, 0), (2, 1, 6, 3, 2)],
)
def test_degenerate_sizes_match_reference(batch, window, capacity, rows, stops):
    rng = random.Random(batch * 100 + window * 10 + capacity)
    slots = 2 * window
    win_tokens = torch.randint(0, 5, (batch, slots))
    win_tokens[:, slots // 2 :] = MASK
    args = [
        win_tokens, win_tokens == MASK, _i32([slots // 2 + 1] * batch), _i32([3] * batch),
        _i32([min(b, rows) for b in range(batch + 1)]),
        torch.tensor([3 + rng.randrange(slots) for _ in range(rows)], dtype=torch.int64),
        torch.randint(0, 5, (rows,)), torch.ones(rows, dtype=torch.bool),
        torch.full((batch, capacity), SENTINEL), _i32([0] * batch),
        torch.zeros(batch, dtype=torch.bool), torch.full((batch, stops), 2),
        _i32([4] * batch), window, MASK, False,
    ]
    op_args, ref_args = run_both(args)
    assert_states_equal(op_args, ref_args)


def test_zero_slot_window_finishes_only_at_the_limit(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", False)  # win_len > S: defined behaviour (n = 0)
    args = [
        torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool), _i32([3, 3]),
        _i32([4, 4]), _i32([0, 0, 0]), torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool),
        torch.zeros(2, 3, dtype=torch.int64), _i32([3, 1]), torch.tensor([False, False]),
        torch.zeros(2, 0, dtype=torch.int64), _i32([3, 3]), 1, MASK, False,
    ]
    op_args, ref_args = run_both(args)
    assert_states_equal(op_args, ref_args)
    assert op_args[10].tolist() == [True, False] and op_args[2].tolist() == [0, 0]


def _admit(rng, batch, window, vocab):
    """Decoding loop admission: prompt committed, window = min(W, max_new) masks."""
    slots = 2 * window
    prompt = [rng.randint(1, 12) for _ in range(batch)]
    max_new = [rng.choices([0, 1, rng.randint(2, 12), rng.randint(12, 32)], weights=[1, 1, 3, 5])[0]
               for _ in range(batch)]
    capacity = max(max_new) + rng.choice([0, 2]) if rng.random() < 0.8 else rng.randint(1, 32)
    state = [
        torch.full((batch, slots), MASK), torch.ones(batch, slots, dtype=torch.bool),
        _i32([min(window, m) for m in max_new]), _i32(prompt),
        torch.full((batch, capacity), SENTINEL), torch.zeros(batch, dtype=torch.int32),
        torch.tensor([m <= 0 for m in max_new]),
    ]
    stop_ids = torch.tensor([[rng.choice([-1, -1, rng.randrange(vocab)]) for _ in range(2)]
                             for _ in range(batch)])
    return state, prompt, _i32(max_new), stop_ids


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 4),
    window=st.integers(1, 6),
    blockwise=st.booleans(),
)
@example(seed=0, batch=1, window=1, blockwise=False)
@example(seed=1, batch=4, window=6, blockwise=True)
def test_random_decode_matches_reference_every_step_and_stays_consistent(
    seed, batch, window, blockwise
):
    rng = random.Random(seed)
    vocab = 64
    state, prompt, max_new, stop_ids = _admit(rng, batch, window, vocab)
    capacity = state[4].shape[1]
    limit = [min(int(m), capacity) for m in max_new]
    ref_state = _clone(state)
    block_table = torch.arange(batch * 8, dtype=torch.int32).view(batch, 8)  # 64 positions
    sampled = [{} for _ in range(batch)]  # position -> token written into the window
    for _step in range(80):
        win_tokens, win_mask, win_len, ctx_len = state[:4]
        if bool((state[6] | (win_len == 0)).all()):
            break
        num_rows = int(win_len.clamp(0, win_tokens.shape[1]).sum())
        reordered = wk.reorder_window(win_tokens, win_mask, win_len, ctx_len, block_table, 8,
                                      num_rows)
        expected = reorder_reference(*ref_state[:4], block_table, 8, num_rows)
        for actual, wanted in zip(reordered, expected):
            assert torch.equal(actual, wanted)
        _, positions, _, order, query_start, n_filled = reordered
        groups = []
        for b in range(batch):  # select_tokens rows: the mask rows, row_pos = ctx_len + order
            first = int(query_start[b])
            n = int(win_len[b]) if not bool(state[6][b]) else 0
            groups.append([int(positions[first + j]) for j in range(int(n_filled[b]), n)])
        cu_rows, row_pos, token, selected = build_rows(rng, groups, vocab=vocab,
                                                      select_rate=0.5 * rng.random())
        for b in range(batch):  # at least one selected mask per sequence
            rows = [r for r in range(int(cu_rows[b]), int(cu_rows[b + 1])) if row_pos[r] >= 0]
            if rows and not any(bool(selected[r]) for r in rows):
                selected[rng.choice(rows)] = True
            for r in rows:
                if selected[r]:
                    sampled[b][int(row_pos[r])] = int(token[r])
        rows = (cu_rows, row_pos, token, selected)
        wk.commit_window(*state[:4], *rows, *state[4:], stop_ids, max_new, window, MASK, blockwise)
        commit_reference(*ref_state[:4], *rows, *ref_state[4:], stop_ids, max_new, window, MASK,
                         blockwise)
        for name, a, e in zip(STATE, state, ref_state):
            assert torch.equal(a, e), name
        _check_consistent(state, prompt, limit, stop_ids, sampled)
    # with at least one token per step every sequence finishes
    assert bool(state[6].all()) and not bool(state[2].any())


def _check_consistent(state, prompt, limit, stop_ids, sampled):
    """Output + window tokens are exactly the sampled tokens at consecutive positions."""
    win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished = state
    for b in range(len(prompt)):
        produced = int(out_len[b])
        stops = {s for s in stop_ids[b].tolist() if s >= 0}
        assert int(ctx_len[b]) == prompt[b] + produced
        output = out_tokens[b, :produced].tolist()
        assert output == [sampled[b][prompt[b] + i] for i in range(produced)]
        assert not any(t in stops for t in output[:-1])  # a stop token can only end it
        assert (out_tokens[b, produced:] == SENTINEL).all()
        live = int(win_len[b])
        assert produced + live <= limit[b]  # never past prompt_len + max_new
        if bool(finished[b]):
            assert live == 0 and (produced == limit[b] or output[-1] in stops)
            continue
        assert live > 0
        for s in range(live):
            position = int(ctx_len[b]) + s
            if bool(win_mask[b, s]):
                assert int(win_tokens[b, s]) == MASK and position not in sampled[b]
            else:
                assert int(win_tokens[b, s]) == sampled[b][position]
        assert (win_tokens[b, live:] == MASK).all() and win_mask[b, live:].all()


def _valid_args():
    return worked_example() + [_i32([1000])]  # with a commit limit that limits nothing


@pytest.mark.parametrize(
    "index, name, bad",
    [
        (0, "win_tokens", torch.zeros(1, 8, dtype=torch.int32)),
        (1, "win_mask", torch.zeros(1, 8, dtype=torch.uint8)),
        (2, "win_len", torch.zeros(1, dtype=torch.int64)),
        (3, "ctx_len", torch.zeros(1, dtype=torch.int64)),
        (4, "cu_rows", torch.zeros(2, dtype=torch.int64)),
        (5, "row_pos", torch.zeros(3, dtype=torch.int32)),
        (6, "token", torch.zeros(3, dtype=torch.int32)),
        (7, "selected", torch.zeros(3, dtype=torch.int32)),
        (8, "out_tokens", torch.zeros(1, 12, dtype=torch.int32)),
        (9, "out_len", torch.zeros(1, dtype=torch.int64)),
        (10, "finished", torch.zeros(1, dtype=torch.int32)),
        (11, "stop_ids", torch.zeros(1, 1, dtype=torch.int32)),
        (12, "max_new", torch.zeros(1, dtype=torch.int64)),
        (13, "window", 4.0),
        (14, "mask_id", "99"),
        (15, "blockwise", 1),
        (16, "commit_limit", torch.zeros(1, dtype=torch.int64)),
        (16, "commit_limit", [3]),
    ],
)
def test_wrong_dtype_or_type_is_a_type_error_naming_the_argument(index, name, bad):
    args = _valid_args()
    args[index] = bad
    with pytest.raises(TypeError, match=name):
        wk.commit_window(*args)


@pytest.mark.parametrize(
    "index, name, bad",
    [
        (1, "win_mask", torch.zeros(1, 7, dtype=torch.bool)),
        (2, "win_len", torch.zeros(2, dtype=torch.int32)),
        (3, "ctx_len", torch.zeros(1, 1, dtype=torch.int32)),
        (4, "cu_rows", torch.zeros(1, dtype=torch.int32)),
        (6, "token", torch.zeros(4, dtype=torch.int64)),
        (7, "selected", torch.zeros(2, dtype=torch.bool)),
        (9, "out_len", torch.zeros(2, dtype=torch.int32)),
        (10, "finished", torch.zeros(2, dtype=torch.bool)),
        (11, "stop_ids", torch.zeros(2, 1, dtype=torch.int64)),
        (12, "max_new", torch.zeros(3, dtype=torch.int32)),
        (13, "window", 0),
        (14, "mask_id", -1),
        (16, "commit_limit", torch.zeros(2, dtype=torch.int32)),
    ],
)
def test_wrong_shape_batch_or_scalar_is_a_value_error_naming_the_argument(index, name, bad):
    args = _valid_args()
    args[index] = bad
    with pytest.raises(ValueError, match=name):
        wk.commit_window(*args)


@pytest.mark.parametrize(
    "index, name", [(0, "win_tokens"), (1, "win_mask"), (8, "out_tokens")]
)
def test_non_contiguous_mutated_state_is_a_value_error(index, name):
    args = _valid_args()
    wide = args[index].new_zeros(1, 2 * args[index].shape[1])
    wide[:, ::2] = args[index]
    args[index] = wide[:, ::2]  # same values, stride 2
    with pytest.raises(ValueError, match=f"`{name}` must be contiguous"):
        wk.commit_window(*args)


def test_strided_read_only_inputs_are_accepted():
    args = _valid_args()
    expected = _clone(args)
    wk.commit_window(*expected)
    wide_pos = torch.zeros(6, dtype=torch.int64)
    wide_pos[::2] = args[5]
    args[5] = wide_pos[::2]
    wk.commit_window(*args)
    assert_states_equal(args, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices_are_a_value_error():
    args = _valid_args()
    args[5] = args[5].cuda()
    with pytest.raises(ValueError, match="row_pos"):
        wk.commit_window(*args)


@pytest.mark.parametrize(
    "index, bad, message",
    [
        (2, _i32([9]), "win_len"),
        (3, _i32([-1]), "ctx_len"),
        (9, _i32([13]), "out_len"),
        (4, _i32([2, 1]), "cu_rows"),
        (4, _i32([0, 4]), "cu_rows"),
        (5, torch.tensor([11, 11, 14]), "distinct positions"),
    ],
)
def test_debug_mode_rejects_out_of_range_values(monkeypatch, index, bad, message):
    monkeypatch.setattr(_backend, "DEBUG", True)
    wk.commit_window(*_valid_args())
    args = _valid_args()
    args[index] = bad
    with pytest.raises(ValueError, match=message):
        wk.commit_window(*args)


def test_debug_mode_accepts_duplicates_that_are_not_selected_or_outside_sequences(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", True)
    args = _valid_args()
    args[5] = torch.tensor([11, 13, 13])  # the third row is not selected
    wk.commit_window(*args)
    args = _valid_args()
    args[4] = _i32([0, 2])  # the third row belongs to no sequence
    args[5], args[7] = torch.tensor([11, 13, 13]), torch.ones(3, dtype=torch.bool)
    wk.commit_window(*args)
