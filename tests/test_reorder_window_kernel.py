"""The Triton kernel of reorder_window, called through its launcher (Triton's interpreter when
there is no GPU), against reference/window.py and the PyTorch implementation, with every
output between guard bands. GPU-only checks (large batches, CUDA-graph replay with changed
inputs) are marked ``cuda``."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from reference.window import reorder_window as reorder_reference
from tests.kernel_harness import guarded
from tests.test_reorder_window import live_rows, random_window_state
from wedlm_kernels.ops import reorder as reorder_ops
from wedlm_kernels.ops.reorder import (
    kernel_variants,
    reorder_window_into,
    reorder_window_torch,
    reorder_window_triton,
)

ON_GPU = torch.cuda.is_available()
# where the kernel runs, as the `kernel_device` fixture (hypothesis tests cannot take
# function-scoped fixtures): the GPU, else Triton's interpreter on the CPU
DEVICE = "cuda" if ON_GPU else "cpu"
MASK = 99
OUTPUTS = ("input_ids", "positions", "slot_mapping", "order", "query_start", "n_filled")
UNWRITTEN = -777  # initial value of every output element: no valid output takes it


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _on_device(args):
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


def _strided(tensor):
    """The same values in a non-contiguous layout: column-major for 2-D, stride 2 for 1-D."""
    if tensor.dim() == 2:
        return tensor.t().contiguous().t()
    wide = tensor.new_zeros(2 * tensor.shape[0] + 1)
    wide[1::2] = tensor
    return wide[1::2]


def run_kernel(args):
    """The kernel into outputs between guard bands; checks the bands, returns CPU outputs.
    ``args`` end with ``num_rows``."""
    win_tokens, num_rows = args[0], args[-1]
    batch = win_tokens.shape[0]
    shapes = [((num_rows,), torch.int64)] * 3 + [((num_rows,), torch.int32),
                                                 ((batch + 1,), torch.int32),
                                                 ((batch,), torch.int32)]
    outputs = [
        guarded(torch.full(shape, UNWRITTEN, dtype=dtype, device=win_tokens.device))
        for shape, dtype in shapes
    ]
    assert reorder_window_into(*args, *(o.tensor for o in outputs)) is None
    for name, output in zip(OUTPUTS, outputs):
        output.check(name)
    return [o.tensor.cpu() for o in outputs]


def assert_outputs_equal(actual, expected, label):
    for name, a, e in zip(OUTPUTS, actual, expected):
        a, e = a.cpu(), e.cpu()
        assert a.dtype == e.dtype, f"{label} {name}"
        assert torch.equal(a, e), f"{label} {name}:\n{a}\n!=\n{e}"


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(0, 4),
    window=st.integers(1, 8),
    page_size=st.integers(1, 17),
    strided=st.booleans(),
    rows=st.sampled_from(["live", "padding", "too few"]),
)
@example(seed=0, batch=0, window=1, page_size=1, strided=False, rows="live")
@example(seed=1, batch=1, window=1, page_size=1, strided=True, rows="padding")
@example(seed=2, batch=4, window=8, page_size=17, strided=False, rows="too few")
def test_kernel_matches_reference_and_torch_on_random_windows(
    seed, batch, window, page_size, strided, rows
):
    # random filled/mask patterns, junk past win_len, sparse, narrow or missing page tables;
    # exactly the live rows, 17 padding rows more (more than one padding tile), or too few
    args = random_window_state(seed, batch, window, page_size)
    num_rows = {"live": live_rows(args), "padding": live_rows(args) + 17,
                "too few": live_rows(args) // 2}[rows]
    expected = reorder_reference(*args, num_rows)
    assert_outputs_equal(reorder_window_torch(*args, num_rows), expected, "torch")
    device_args = _on_device(args)
    if strided:
        device_args[:5] = [_strided(a) for a in device_args[:5]]
    assert_outputs_equal(run_kernel(device_args + [num_rows]), expected, "kernel")


def test_worked_example_orders_filled_first_at_logical_positions_and_physical_slots():
    # the worked example of the streaming step: L = 10, window [a, M, c, M, M], S = 8
    a, c = 5, 7
    win_tokens = torch.tensor([[a, MASK, c, MASK, MASK, MASK, MASK, MASK]])
    ids, positions, slots, order, query_start, n_filled = run_kernel(_on_device(
        [win_tokens, win_tokens == MASK, _i32([5]), _i32([10]), _i32([[6, 0, 9, 2, 4]]), 4, 7]
    ))
    assert order.tolist() == [0, 2, 1, 3, 4, 0, 0]
    assert ids.tolist() == [a, c, MASK, MASK, MASK, 0, 0]
    assert positions.tolist() == [10, 12, 11, 13, 14, 0, 0]
    # physical rows 0..4 write positions 10..14: page 9 offsets 2, 3; page 2 offsets 0..2
    assert slots.tolist() == [38, 39, 8, 9, 10, -1, -1]
    assert query_start.tolist() == [0, 5] and n_filled.tolist() == [2]


def test_win_len_is_clamped_to_zero_and_the_capacity():
    win_tokens = torch.tensor([[MASK, 3, 4, MASK], [MASK, 5, MASK, 6]])
    win_mask = win_tokens == MASK
    ids, positions, slots, order, query_start, n_filled = run_kernel(_on_device(
        [win_tokens, win_mask, _i32([-3, 9]), _i32([1, 2]), _i32([[0, 1], [2, 3]]), 3, 4]
    ))
    assert query_start.tolist() == [0, 0, 4]
    assert order.tolist() == [1, 3, 0, 2]
    assert ids.tolist() == [5, 6, MASK, MASK]
    assert positions.tolist() == [3, 5, 2, 4]
    # sequence 1: positions 2..5 -> page 0 offset 2, then page 1 offsets 0..2 (pages 2, 3)
    assert slots.tolist() == [8, 9, 10, 11]
    assert n_filled.tolist() == [0, 2]


def test_page_table_edges_drop_writes_and_large_page_ids_use_int64_slots():
    # odd page size 3; positions 4..9 -> pages 1, 1, 2, 2, 2, 3 (offsets 1, 2, 0, 1, 2, 0)
    big = 2**30 + 7  # page id * page size > 2^31
    win_tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    block_table = _i32([[0, big, -1], [5, 8, 9]])  # row 0: page 2 missing; both: no page 3
    *_, slots, _, _, _ = run_kernel(_on_device(
        [win_tokens, torch.zeros(2, 6, dtype=torch.bool), _i32([6, 6]), _i32([4, 4]),
         block_table, 3, 12]
    ))
    assert slots.tolist() == [3 * big + 1, 3 * big + 2, -1, -1, -1, -1,
                              25, 26, 27, 28, 29, -1]


def test_rows_at_negative_positions_get_slot_minus_one_like_the_reference():
    # ctx_len < 0 is invalid input (rejected in debug mode); without the check, rows at
    # negative positions must drop their write rather than wrap into page 0
    win_tokens = torch.tensor([[1, 2, 3, 4, 5]])
    args = [win_tokens, torch.zeros(1, 5, dtype=torch.bool), _i32([5]), _i32([-3]),
            _i32([[4, 6]]), 2, 5]
    *_, slots, _, _, _ = run_kernel(_on_device(args))
    assert slots.tolist() == [-1, -1, -1, 8, 9]
    assert_outputs_equal(run_kernel(_on_device(args)), reorder_reference(*args), "kernel")


def test_empty_page_table_drops_every_write():
    win_tokens = torch.tensor([[1, MASK, 2]])
    ids, positions, slots, order, _, n_filled = run_kernel(_on_device(
        [win_tokens, win_tokens == MASK, _i32([3]), _i32([0]),
         torch.empty(1, 0, dtype=torch.int32), 16, 3]
    ))
    assert slots.tolist() == [-1, -1, -1]
    assert order.tolist() == [0, 2, 1] and positions.tolist() == [0, 2, 1]


def test_capacity_that_is_not_a_power_of_two_uses_only_its_slots():
    # window 3 -> S = 6, one sequence, page size 5; slots 4 and 5 are past win_len (junk)
    win_tokens = torch.tensor([[MASK, 11, MASK, 12, 13, MASK]])
    win_mask = torch.tensor([[True, False, True, False, False, True]])
    ids, positions, slots, order, _, n_filled = run_kernel(_on_device(
        [win_tokens, win_mask, _i32([4]), _i32([8]), _i32([[3, 1, 4]]), 5, 4]
    ))
    assert order.tolist() == [1, 3, 0, 2]
    assert ids.tolist() == [11, 12, MASK, MASK]
    assert positions.tolist() == [9, 11, 8, 10]
    # positions 8, 9 at page index 1 (id 1) offsets 3, 4; 10, 11 at index 2 (id 4) offsets 0, 1
    assert slots.tolist() == [8, 9, 20, 21]
    assert n_filled.tolist() == [2]


def test_capacity_above_the_kernel_tile_falls_back_to_the_pytorch_implementation():
    args = random_window_state(3, 2, reorder_ops.MAX_KERNEL_SLOTS // 2 + 1, 16)
    assert args[0].shape[1] > reorder_ops.MAX_KERNEL_SLOTS
    expected = reorder_reference(*args, live_rows(args))
    assert_outputs_equal(reorder_window_triton(*_on_device(args), live_rows(args)), expected,
                         "launcher")


def test_launcher_returns_fresh_outputs_equal_to_the_reference():
    args = random_window_state(11, 3, 4, 5)
    device_args = _on_device(args)
    outputs = reorder_window_triton(*device_args, live_rows(args) + 3)
    assert all(o.is_contiguous() for o in outputs)
    assert not any(o.data_ptr() == a.data_ptr() for o in outputs for a in device_args[:5])
    assert_outputs_equal(outputs, reorder_reference(*args, live_rows(args) + 3), "launcher")


def test_row_offsets_are_summed_over_more_sequences_than_one_step_holds():
    """300 sequences (more than the 256 summed per loop step) of 0..3 live slots."""
    g = torch.Generator().manual_seed(4)
    batch, slots = 300, 4
    win_tokens = torch.randint(0, 50, (batch, slots), generator=g)
    win_mask = torch.rand(batch, slots, generator=g) < 0.5
    win_len = torch.randint(0, slots, (batch,), generator=g).to(torch.int32)
    args = [win_tokens, win_mask, win_len, torch.zeros(batch, dtype=torch.int32),
            torch.arange(batch, dtype=torch.int32)[:, None], 8]
    num_rows = int(win_len.sum()) + 2
    assert_outputs_equal(run_kernel(_on_device(args) + [num_rows]),
                         reorder_window_torch(*args, num_rows), "kernel")


def test_kernel_variants_cover_every_tile_the_launcher_picks():
    compiled = {(v.constexprs["BLOCK_SLOTS"], v.num_warps) for v in kernel_variants()}
    for slots in range(reorder_ops.MAX_KERNEL_SLOTS + 1):
        block = reorder_ops._block_slots(slots)
        assert block >= slots and (block, reorder_ops._num_warps(block)) in compiled


def _random_gpu_case(generator, batch, window, page_size):
    slots = 2 * window
    pages = (4096 + slots) // page_size + 1
    win_tokens = torch.randint(0, 151936, (batch, slots), generator=generator)
    win_mask = torch.rand(batch, slots, generator=generator) < 0.6
    win_len = torch.randint(-1, slots + 2, (batch,), generator=generator).to(torch.int32)
    ctx_len = torch.randint(0, 4096, (batch,), generator=generator).to(torch.int32)
    block_table = torch.randperm(batch * pages, generator=generator).view(batch, pages)
    block_table[torch.rand(batch, pages, generator=generator) < 0.05] = -1
    return [win_tokens, win_mask, win_len, ctx_len, block_table.to(torch.int32), page_size]


@pytest.mark.cuda
@pytest.mark.parametrize("window, page_size", [(16, 16), (16, 256), (64, 16), (5, 7)])
def test_large_batches_match_the_pytorch_implementation_on_gpu(window, page_size):
    generator = torch.Generator().manual_seed(window * 1000 + page_size)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a
            for a in _random_gpu_case(generator, 512, window, page_size)]
    num_rows = 512 * 2 * window
    assert_outputs_equal(run_kernel(args + [num_rows]), reorder_window_torch(*args, num_rows),
                         "kernel")


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_inputs_matches_eager():
    generator = torch.Generator().manual_seed(0)
    batch, window, page_size = 64, 16, 16
    num_rows = batch * 2 * window
    static = [a.cuda() if isinstance(a, torch.Tensor) else a
              for a in _random_gpu_case(generator, batch, window, page_size)] + [num_rows]
    reorder_window_triton(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = reorder_window_triton(*static)
    for _ in range(3):
        fresh = _random_gpu_case(generator, batch, window, page_size)
        for target, source in zip(static[:5], fresh[:5]):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        assert_outputs_equal(outputs, reorder_window_torch(*static), "replay")
