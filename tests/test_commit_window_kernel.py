"""The Triton kernel of commit_window, called through its launcher (Triton's interpreter when
there is no GPU), against reference/window.py and the PyTorch implementation, with every
mutated state tensor between guard bands. GPU-only checks (large batches, CUDA-graph replay
with changed inputs) are marked ``cuda``."""

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.window import commit_window as commit_reference
from reference.window import reorder_window as reorder_reference
from tests.kernel_harness import guarded
from tests.test_commit_window import build_rows, random_commit_case, worked_example
from tests.test_reorder_window_kernel import run_kernel as run_reorder_kernel
from wedlm_kernels.ops import commit as commit_ops
from wedlm_kernels.ops.commit import commit_window_torch, commit_window_triton, kernel_variants

ON_GPU = torch.cuda.is_available()
# where the kernel runs, as the `kernel_device` fixture (hypothesis tests cannot take
# function-scoped fixtures): the GPU, else Triton's interpreter on the CPU
DEVICE = "cuda" if ON_GPU else "cpu"
MASK = 99
SENTINEL = -5  # out_tokens columns that were never written (as in worked_example)
STATE = ("win_tokens", "win_mask", "win_len", "ctx_len", "out_tokens", "out_len", "finished")
MUTATED = (0, 1, 2, 3, 8, 9, 10)  # argument positions of the state tensors
READ_ONLY = (4, 5, 6, 7, 11, 12)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _strided(tensor):
    """The same values in a non-contiguous layout: column-major for 2-D, stride 2 for 1-D."""
    if tensor.dim() == 2:
        return tensor.t().contiguous().t()
    wide = tensor.new_zeros(2 * tensor.shape[0] + 1)
    wide[1::2] = tensor
    return wide[1::2]


class KernelState:
    """commit_window arguments on the kernel's device, the state tensors between guard bands
    (contiguous views, as the op requires), optionally with strided read-only inputs."""

    def __init__(self, args, strided=False):
        self.args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        self.guards = {}
        for index in MUTATED:
            self.guards[index] = guarded(self.args[index])
            self.args[index] = self.guards[index].tensor
        if strided:
            for index in READ_ONLY + ((16,) if len(self.args) > 16 else ()):
                self.args[index] = _strided(self.args[index])

    def commit(self, rows=None):
        """Run the launcher (``rows`` replaces cu_rows, row_pos, token, selected); check bands."""
        if rows is not None:
            self.args[4:8] = [r.to(DEVICE) for r in rows]
        assert commit_window_triton(*self.args) is None
        for name, index in zip(STATE, MUTATED):
            self.guards[index].check(name)

    def state(self):
        return [self.args[index].cpu() for index in MUTATED]


def run_kernel(args, strided=False):
    """The kernel on a copy of ``args``; returns the seven state tensors on the CPU."""
    kernel = KernelState(args, strided)
    kernel.commit()
    for index in READ_ONLY:
        assert torch.equal(kernel.args[index].cpu(), args[index].cpu()), f"argument {index} changed"
    return kernel.state()


def run_reference(args):
    expected = _clone(args)
    commit_reference(*expected)
    return [expected[index] for index in MUTATED]


def run_torch(args):
    actual = _clone(args)
    commit_window_torch(*actual)
    return [actual[index] for index in MUTATED]


def assert_states_equal(actual, expected, label):
    for name, a, e in zip(STATE, actual, expected):
        a, e = a.cpu(), e.cpu()
        assert a.dtype == e.dtype, f"{label} {name}"
        assert torch.equal(a, e), f"{label} {name}:\n{a}\n!=\n{e}"


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(0, 4),
    window=st.integers(1, 6),
    blockwise=st.booleans(),
    strided=st.booleans(),
    limited=st.booleans(),
)
@example(seed=0, batch=0, window=1, blockwise=False, strided=False, limited=False)
@example(seed=1, batch=1, window=1, blockwise=True, strided=True, limited=True)
@example(seed=2, batch=4, window=6, blockwise=True, strided=False, limited=False)
@example(seed=3, batch=4, window=6, blockwise=False, strided=True, limited=True)
def test_kernel_matches_reference_and_torch_on_random_states(
    seed, batch, window, blockwise, strided, limited
):
    # active, finished and empty sequences, stop ids (K = 0..3), out_len near the capacity,
    # padding rows, rows outside every sequence, any window size (S = 2W), with and
    # without a commit limit
    args = random_commit_case(seed, batch, window, blockwise, limited)
    expected = run_reference(args)
    assert_states_equal(run_torch(args), expected, "torch")
    assert_states_equal(run_kernel(args, strided), expected, "kernel")


def test_worked_example_commits_a_fills_x_and_y_and_refills_to_seven_slots():
    # docs/algorithm.md section 4: fed [a, M, c, M, M] at L = 10; x, y selected at 11, 13
    win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished = run_kernel(
        worked_example()
    )
    assert out_tokens[0, :2].tolist() == [1, SENTINEL] and out_len.tolist() == [1]
    assert ctx_len.tolist() == [11] and win_len.tolist() == [7]
    assert win_tokens.tolist() == [[4, 3, 6, MASK, MASK, MASK, MASK, MASK]]
    assert win_mask.tolist() == [[False, False, False, True, True, True, True, True]]
    assert finished.tolist() == [False]


def test_early_finish_on_a_stop_token_in_the_new_run_drops_what_follows():
    # the new run is x c y with c a stop token: x and c are committed at once, y dropped
    win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished = run_kernel(
        worked_example(stop_ids=(3, -1))
    )
    assert out_tokens[0, :4].tolist() == [1, 4, 3, SENTINEL] and out_len.tolist() == [3]
    assert ctx_len.tolist() == [13] and win_len.tolist() == [0] and finished.tolist() == [True]
    assert win_tokens.tolist() == [[MASK] * 8] and win_mask.all()


def test_refill_stops_at_prompt_len_plus_max_new_and_blockwise_waits_for_a_whole_block():
    win_tokens, _, win_len, ctx_len, *_ = run_kernel(worked_example(max_new=6))
    assert ctx_len.tolist() == [11] and win_len.tolist() == [5]  # positions < 10 + 6
    assert win_tokens.tolist() == [[4, 3, 6, MASK, MASK, MASK, MASK, MASK]]
    # block-wise: the fed block [a, M, c, M] is incomplete, so nothing is committed; x and y
    # complete it, so the next forward carries it plus the next block's masks (4 + 4 slots)
    win_tokens, _, win_len, ctx_len, _, out_len, _ = run_kernel(worked_example(blockwise=True))
    assert out_len.tolist() == [0] and ctx_len.tolist() == [10] and win_len.tolist() == [8]
    assert win_tokens.tolist() == [[1, 4, 3, 6, MASK, MASK, MASK, MASK]]


def _one_sequence(window_tokens, win_len, ctx_len, rows, stop_ids, max_new, out_len=0,
                  window=3, capacity=8):
    """One sequence, S = 2 * window; ``rows``: (row_pos, token, selected) triples."""
    slots = 2 * window
    win_tokens = torch.tensor([list(window_tokens) + [MASK] * (slots - len(window_tokens))])
    return [
        win_tokens, win_tokens == MASK, _i32([win_len]), _i32([ctx_len]),
        _i32([0, len(rows)]), torch.tensor([r[0] for r in rows], dtype=torch.int64),
        torch.tensor([r[1] for r in rows], dtype=torch.int64),
        torch.tensor([r[2] for r in rows], dtype=torch.bool),
        torch.full((1, capacity), SENTINEL), _i32([out_len]), torch.tensor([False]),
        torch.tensor([list(stop_ids)], dtype=torch.int64).view(1, len(stop_ids)),
        _i32([max_new]), window, MASK, False,
    ]


def test_no_stop_ids_and_no_rows_commit_the_run_and_keep_the_masks():
    # K = 0, R = 0, window 3 (S = 6, not a power of two): fed [5, 6, M, M, 7] at L = 20
    args = _one_sequence([5, 6, MASK, MASK, 7], 5, 20, rows=[], stop_ids=[], max_new=50,
                         out_len=2)
    win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished = run_kernel(args)
    assert out_tokens.tolist() == [[SENTINEL, SENTINEL, 5, 6] + [SENTINEL] * 4]
    assert out_len.tolist() == [4] and ctx_len.tolist() == [22]
    # shifted [M, M, 7]; its leading run is 0, so nothing is appended
    assert win_len.tolist() == [3] and win_tokens.tolist() == [[MASK, MASK, 7] + [MASK] * 3]
    assert win_mask.tolist() == [[True, True, False, True, True, True]]
    assert finished.tolist() == [False]


def test_selected_rows_outside_the_live_mask_slots_are_ignored():
    # after committing slot 0 (ctx 11) the window is [M, c, M, M] with 4 live slots
    rows = [
        (10, 40, True),  # the committed position (slot -1 after the shift)
        (12, 41, True),  # a filled slot
        (15, 42, True),  # past the live window (inside the refilled part)
        (-1, 43, True),  # padding row
        (13, 44, False),  # not selected
        (11, 46, True),  # written
        (14, 45, True),  # written
    ]
    args = _one_sequence([1, MASK, 3, MASK, MASK], 5, 10, rows, stop_ids=[-1], max_new=100,
                         window=4)
    win_tokens, win_mask, win_len, *_ = run_kernel(args)
    assert win_tokens.tolist() == [[46, 3, MASK, 45, MASK, MASK, MASK, MASK]]
    assert win_mask.tolist() == [[False, False, True, False, True, True, True, True]]
    assert win_len.tolist() == [6]  # leading run 2: two masks appended


def test_stop_token_in_the_run_is_emitted_and_only_its_columns_are_written():
    rows = [(23, 30, True), (24, 31, True)]  # would fill the masks if the sequence went on
    args = _one_sequence([1, 8, 2, MASK, MASK], 5, 20, rows, stop_ids=[-1, 8], max_new=50,
                         out_len=3)
    win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished = run_kernel(args)
    assert out_tokens.tolist() == [[SENTINEL] * 3 + [1, 8] + [SENTINEL] * 3]
    assert out_len.tolist() == [5] and ctx_len.tolist() == [22]
    assert finished.tolist() == [True] and win_len.tolist() == [0]
    assert win_tokens.tolist() == [[MASK] * 6] and win_mask.all()


def test_output_capacity_bounds_the_commit_and_zero_capacity_finishes_at_once():
    args = _one_sequence([1, 2, 3, MASK], 4, 7, rows=[], stop_ids=[], max_new=100, out_len=2,
                         capacity=4)
    *_, out_tokens, out_len, finished = run_kernel(args)
    assert out_tokens.tolist() == [[SENTINEL, SENTINEL, 1, 2]] and finished.tolist() == [True]
    args = _one_sequence([1, MASK], 2, 7, rows=[(8, 4, True)], stop_ids=[3], max_new=5,
                         capacity=0)
    win_tokens, _, win_len, ctx_len, out_tokens, out_len, finished = run_kernel(args)
    assert out_tokens.shape == (1, 0) and out_len.tolist() == [0] and ctx_len.tolist() == [7]
    assert finished.tolist() == [True] and win_len.tolist() == [0]


def test_zero_slot_window_finishes_only_at_the_limit():
    args = [
        torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool), _i32([3, 3]),
        _i32([4, 4]), _i32([0, 0, 0]), torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool),
        torch.zeros(2, 3, dtype=torch.int64), _i32([3, 1]), torch.tensor([False, False]),
        torch.zeros(2, 0, dtype=torch.int64), _i32([3, 3]), 1, MASK, False,
    ]
    *_, win_len, ctx_len, _, out_len, finished = run_kernel(args)
    assert finished.tolist() == [True, False] and win_len.tolist() == [0, 0]
    assert out_len.tolist() == [3, 1] and ctx_len.tolist() == [4, 4]


def test_finished_and_empty_sequences_are_not_touched():
    win_tokens = torch.tensor([[1, 2, MASK, 5], [3, MASK, 7, 8], [MASK, MASK, 9, 9]])
    args = [
        win_tokens, win_tokens == MASK, _i32([3, 0, 2]), _i32([4, 6, 8]),
        _i32([0, 2, 4, 6]), torch.tensor([6, 7, 6, 7, 8, 9]), torch.tensor([1, 2, 3, 4, 5, 6]),
        torch.ones(6, dtype=torch.bool),
        torch.full((3, 5), SENTINEL), _i32([1, 2, 0]), torch.tensor([True, False, False]),
        torch.tensor([[1], [3], [-1]]), _i32([5, 5, 5]), 2, MASK, False,
    ]
    state = run_kernel(args)
    for name, index, after in zip(STATE, MUTATED, state):
        assert torch.equal(after[:2], args[index][:2]), name
    # the active one fills both masks and refills two
    assert state[0][2].tolist() == [5, 6, MASK, MASK] and state[2].tolist()[2] == 4


def _admit(rng, batch, window):
    """Decoding-loop admission: prompt committed, window = min(W, max_new) masks."""
    slots = 2 * window
    prompt = [rng.randint(0, 12) for _ in range(batch)]
    max_new = [rng.choice([0, 1, rng.randint(2, 8), rng.randint(8, 16)]) for _ in range(batch)]
    capacity = max(max_new) + rng.choice([0, 2]) if rng.random() < 0.8 else rng.randint(0, 16)
    stops = rng.randint(0, 2)
    return [
        torch.full((batch, slots), MASK), torch.ones(batch, slots, dtype=torch.bool),
        _i32([min(window, m) for m in max_new]), _i32(prompt),
        None, None, None, None,  # the rows of each step
        torch.full((batch, capacity), SENTINEL), torch.zeros(batch, dtype=torch.int32),
        torch.tensor([m <= 0 for m in max_new]),
        torch.tensor([[rng.choice([-1, rng.randrange(20)]) for _ in range(stops)]
                      for _ in range(batch)], dtype=torch.int64).view(batch, stops),
        _i32(max_new), window, MASK,
    ]


# Half the profile's examples: each is a whole decode (up to 40 steps of three kernels in
# the interpreter, every state compared), the suite's longest test at the full count.
@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 3),
    window=st.integers(1, 4),
    page_size=st.sampled_from([1, 3, 5, 16]),
    blockwise=st.booleans(),
)
@example(seed=0, batch=1, window=1, page_size=1, blockwise=False)
@example(seed=1, batch=3, window=4, page_size=16, blockwise=True)
def test_multi_step_decode_matches_reference_after_every_step(
    seed, batch, window, page_size, blockwise
):
    # the decode loop of both kernels: reorder_window -> random select_tokens rows of the
    # mask rows -> commit_window; the kernel state (between guard bands) and the reference
    # state are equal after every step, and every sequence finishes
    rng = random.Random(seed)
    args = _admit(rng, batch, window) + [blockwise]
    reference = _clone(args)
    kernel = KernelState(args)
    pages = (12 + 16 + 2 * window) // page_size + 1
    block_table = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed))
    block_table = block_table.to(torch.int32).view(batch, pages)
    for step in range(40):
        state = kernel.state()
        if bool((state[6] | (state[2] == 0)).all()):
            break
        num_rows = int(state[2].clamp(0, state[0].shape[1]).sum())
        reorder_args = [*state[:4], block_table, page_size, num_rows]
        reordered = run_reorder_kernel([a.to(DEVICE) if isinstance(a, torch.Tensor) else a
                                        for a in reorder_args])
        for actual, expected in zip(reordered, reorder_reference(*reference[:4], block_table,
                                                                 page_size, num_rows)):
            assert torch.equal(actual, expected)
        _, positions, _, _, query_start, n_filled = reordered
        groups = []
        for b in range(batch):  # select_tokens rows: the mask rows, row_pos = ctx_len + order
            first = int(query_start[b])
            live = 0 if bool(state[6][b]) else int(state[2][b])
            groups.append([int(positions[first + j]) for j in range(int(n_filled[b]), live)])
        rows = build_rows(rng, groups, vocab=20, select_rate=0.6 * rng.random())
        cu_rows, row_pos, _, selected = rows
        for b in range(batch):  # at least one selected mask row per sequence
            mine = [r for r in range(int(cu_rows[b]), int(cu_rows[b + 1])) if row_pos[r] >= 0]
            if mine and not any(bool(selected[r]) for r in mine):
                selected[rng.choice(mine)] = True
        reference[4:8] = rows
        commit_reference(*reference)
        kernel.commit(rows)
        assert_states_equal(kernel.state(), [reference[i] for i in MUTATED], f"step {step}")
    final = kernel.state()
    assert bool(final[6].all()) and not bool(final[2].any())


def test_capacity_above_the_kernel_tile_falls_back_to_the_pytorch_implementation():
    window = commit_ops.MAX_KERNEL_SLOTS // 2 + 1
    args = random_commit_case(5, 2, window, False)
    assert args[0].shape[1] > commit_ops.MAX_KERNEL_SLOTS
    assert_states_equal(run_kernel(args), run_reference(args), "launcher")


def test_kernel_variants_cover_every_tile_the_launcher_picks():
    compiled = {(v.constexprs["BLOCK_SLOTS"], v.constexprs["BLOCK_ROWS"], v.num_warps)
                for v in kernel_variants()}
    for slots in range(commit_ops.MAX_KERNEL_SLOTS + 1):
        block = commit_ops._block_slots(slots)
        assert block >= slots
        assert (block, commit_ops.BLOCK_ROWS, commit_ops._num_warps(block)) in compiled


def _gpu_case(seed, batch, window, blockwise, capacity=None, stops=3, rows=None):
    """A random state on the GPU; with ``capacity`` and ``rows`` given, out_tokens, stop_ids
    and the rows are padded to fixed shapes (SENTINEL columns, -1 stop ids and padding rows
    change no result), so that cases of different seeds fit one captured graph."""
    args = random_commit_case(seed, batch, window, blockwise)
    if capacity is not None:
        out_tokens, stop_ids = args[8], args[11]
        args[8] = torch.cat(
            [out_tokens, out_tokens.new_full((batch, capacity - out_tokens.shape[1]), SENTINEL)],
            dim=1,
        )
        args[11] = torch.cat(
            [stop_ids, stop_ids.new_full((batch, stops - stop_ids.shape[1]), -1)], dim=1
        )
        extra = rows - args[5].shape[0]
        args[5] = torch.cat([args[5], args[5].new_full((extra,), -1)])
        args[6] = torch.cat([args[6], args[6].new_zeros(extra)])
        args[7] = torch.cat([args[7], args[7].new_zeros(extra)])
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.cuda
@pytest.mark.parametrize("window", [16, 64, 5])
@pytest.mark.parametrize("blockwise", [False, True])
def test_large_batches_match_the_pytorch_implementation_on_gpu(window, blockwise):
    for seed in range(4):
        args = _gpu_case(seed, 256, window, blockwise)
        assert_states_equal(run_kernel(args), run_torch(args), f"seed {seed}")


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_inputs_matches_eager():
    # one launch captured on static tensors; each replay gets a new state and new rows
    batch, window = 64, 16
    shapes = dict(capacity=4 * 2 * window + 1, stops=3, rows=batch * (2 * window + 3) + 5)
    static = _gpu_case(0, batch, window, False, **shapes)
    commit_window_triton(*_clone(static))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        commit_window_triton(*static)
    for seed in range(1, 6):
        fresh = _gpu_case(seed, batch, window, False, **shapes)
        expected = run_torch(fresh)
        for target, source in zip(static, fresh):
            if isinstance(target, torch.Tensor):
                target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        assert_states_equal([static[i] for i in MUTATED], expected, f"replay {seed}")
