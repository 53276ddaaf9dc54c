"""reorder_window: the topological reordering of the decode window (docs/algorithm.md section 3).

Each sequence's live window slots are fed filled-first (a stable partition), at their
logical RoPE positions, while their K/V goes to the cache slots of their physical rows.

The op has a vectorised PyTorch implementation (``reorder_window_torch``) and a Triton
kernel (``reorder_window_triton``: one launch, one program per sequence).
"""

import torch
import triton
import triton.language as tl

from .. import _backend
from . import _dispatch
from ._triton import POINTER_TYPES, KernelVariant, next_power_of_2
from ._validate import Dims, check_int, check_same_device, check_tensor, debug_check

# The kernel holds one sequence's whole window in a tile of BLOCK_SLOTS lanes: window
# capacities up to MAX_KERNEL_SLOTS use the kernel, larger ones the PyTorch implementation
# (a shape decision, made without reading tensor values).
MIN_BLOCK_SLOTS = 16
MAX_KERNEL_SLOTS = 512


def reorder_window(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each sequence's window for the forward and pack the live rows of all
    sequences back to back: filled slots first, then masks.

    For sequence ``b`` with ``n = clamp(win_len[b], 0, S)`` live slots and ``L = ctx_len[b]``
    committed tokens, its rows are ``query_start[b] .. query_start[b+1] - 1``; its ``j``-th
    row carries slot ``order[row]``, where the slots are the filled live slots in ascending
    order followed by the mask slots in ascending order. Row ``j`` is fed at its logical
    position ``L + order[row]`` and its K/V is written to the cache slot of position
    ``L + j`` (its physical index). Rows at or after ``query_start[B]`` are padding.

    Parameters
    ----------
    win_tokens : torch.Tensor
        ``[B, S]`` int64, window tokens in logical slot order (masks hold the mask id).
        Slots ``>= win_len`` are never read.
    win_mask : torch.Tensor
        ``[B, S]`` bool, True where a slot is still a mask.
    win_len : torch.Tensor
        ``[B]`` int32, live slots per sequence (clamped to ``[0, S]``).
    ctx_len : torch.Tensor
        ``[B]`` int32, committed tokens per sequence (prompt included).
    block_table : torch.Tensor
        ``[B, P]`` int32, page ids of each sequence (negative: no page).
    page_size : int
        Positions per cache page, ``> 0``.
    num_rows : int
        ``R >= 0``, rows of the packed outputs: at least the live slots of the batch
        (checked with ``WEDLM_KERNELS_DEBUG=1``; rows past ``R`` are dropped and
        ``query_start`` is clamped to ``R``). A CUDA graph is captured per value.

    Returns
    -------
    The six tensors are returned as a tuple
    ``(input_ids, positions, slot_mapping, order, query_start, n_filled)``, all fresh:

    input_ids : torch.Tensor
        ``[R]`` int64: the token of the row's slot; 0 on padding rows.
    positions : torch.Tensor
        ``[R]`` int64: ``L + order[row]``; 0 on padding rows.
    slot_mapping : torch.Tensor
        ``[R]`` int64: ``block_table[b, (L+j) // page_size] * page_size + (L+j) % page_size``;
        -1 on padding rows and where the page index is outside ``[0, P)`` or the page id is
        negative (the K/V write is then dropped).
    order : torch.Tensor
        ``[R]`` int32: the window slot fed by each row; 0 on padding rows.
    query_start : torch.Tensor
        ``[B+1]`` int32: cumulative live rows, ``query_start[0] = 0``.
    n_filled : torch.Tensor
        ``[B]`` int32: filled live slots; the mask rows of ``b`` are
        ``query_start[b] + n_filled[b] .. query_start[b+1] - 1``.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> M = 99
    >>> win_tokens = torch.tensor([[5, M, 7, M, M, M, M, M]])
    >>> ids, pos, slots, order, query_start, n_filled = wk.reorder_window(
    ...     win_tokens, win_tokens == M, torch.tensor([5], dtype=torch.int32),
    ...     torch.tensor([10], dtype=torch.int32),
    ...     torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), 4, num_rows=5)
    >>> order.tolist(), pos.tolist(), slots.tolist(), query_start.tolist()
    ([0, 2, 1, 3, 4], [10, 12, 11, 13, 14], [10, 11, 12, 13, 14], [0, 5])
    """
    dims = Dims()
    check_tensor("win_tokens", win_tokens, torch.int64, ("B", "S"), dims)
    check_tensor("win_mask", win_mask, torch.bool, ("B", "S"), dims)
    check_tensor("win_len", win_len, torch.int32, ("B",), dims)
    check_tensor("ctx_len", ctx_len, torch.int32, ("B",), dims)
    check_tensor("block_table", block_table, torch.int32, ("B", "P"), dims)
    check_same_device(
        win_tokens=win_tokens, win_mask=win_mask, win_len=win_len, ctx_len=ctx_len,
        block_table=block_table,
    )
    check_int("page_size", page_size, minimum=1)
    check_int("num_rows", num_rows, minimum=0)
    if _backend.DEBUG:
        debug_check((win_len >= 0) & (win_len <= dims["S"]), "win_len must be within [0, S]")
        debug_check(ctx_len >= 0, "ctx_len must be >= 0")
        debug_check(win_len.clamp(0, dims["S"]).sum() <= num_rows,
                    "`num_rows` must be at least the live slots of the batch (sum of win_len)")
        # every K/V write of the window needs a page: ctx_len + n positions, page ids >= 0
        needed_pages = (ctx_len.long() + win_len.clamp(0, dims["S"]) + page_size - 1) // page_size
        debug_check(needed_pages <= dims["P"],
                    f"`block_table` has {dims['P']} pages per sequence, too few for "
                    f"ctx_len + win_len positions at page_size {page_size}")
        page_index = torch.arange(dims["P"], device=block_table.device)
        debug_check((block_table >= 0) | (page_index[None, :] >= needed_pages[:, None]),
                    "`block_table` must hold a page id >= 0 for every page the window writes")
    return _dispatch.call(
        "reorder_window", win_tokens, win_mask, win_len, ctx_len, block_table, page_size,
        num_rows,
    )


def reorder_window_torch(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, slots = win_tokens.shape
    pages = block_table.shape[1]
    device = win_tokens.device
    slot = torch.arange(slots, device=device).expand(batch, slots)  # [B, S]
    live_len = win_len.to(torch.int64).clamp(0, slots).unsqueeze(1)  # [B, 1]
    ctx = ctx_len.to(torch.int64).unsqueeze(1)  # [B, 1]

    # Stable partition by ranks: a filled live slot s goes to row (#filled live slots before
    # s); a mask slot to n_filled + (#mask slots before s); a non-live slot s stays at row s.
    # The ranks form a permutation of 0..S-1, so scattering the slot indices inverts it.
    live = slot < live_len
    filled = live & ~win_mask
    masked = live & win_mask
    filled_before = torch.cumsum(filled.to(torch.int64), dim=1) - filled.to(torch.int64)
    masked_before = torch.cumsum(masked.to(torch.int64), dim=1) - masked.to(torch.int64)
    n_filled = filled.sum(dim=1, keepdim=True)
    rank = torch.where(filled, filled_before, torch.where(masked, n_filled + masked_before, slot))
    order = torch.empty((batch, slots), dtype=torch.int64, device=device)
    order.scatter_(1, rank, slot)  # order[b, rank[b, s]] = s

    # per sequence and physical row j < n: id, logical position, cache slot of L + j
    input_ids = torch.gather(win_tokens, 1, order)
    positions = ctx + order
    physical = ctx + slot
    page_index = torch.div(physical, page_size, rounding_mode="floor")
    if pages == 0:
        slot_mapping = torch.full_like(physical, -1)
    else:
        in_table = (page_index >= 0) & (page_index < pages)
        page_id = torch.gather(block_table, 1, page_index.clamp(0, pages - 1)).to(torch.int64)
        writable = in_table & (page_id >= 0)
        slot_mapping = torch.where(writable, page_id * page_size + physical % page_size, -1)

    # pack: row r belongs to the first b whose rows end after r, as its row r - start[b]
    ends = torch.cumsum(live_len.squeeze(1), dim=0).clamp(max=num_rows)  # [B]
    query_start = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    row = torch.arange(num_rows, device=device)
    sequence = torch.searchsorted(ends, row, right=True)  # B: a padding row
    is_live = sequence < batch
    sequence = sequence.clamp(max=max(batch - 1, 0))
    j = (row - query_start[sequence]).clamp(0, max(slots - 1, 0))

    def packed(values: torch.Tensor, padding: int) -> torch.Tensor:
        if batch == 0 or slots == 0:
            return torch.full((num_rows,), padding, dtype=values.dtype, device=device)
        return torch.where(is_live, values[sequence, j], padding)

    return (
        packed(input_ids, 0),
        packed(positions, 0),
        packed(slot_mapping, -1),
        packed(order, 0).to(torch.int32),
        query_start,
        n_filled.squeeze(1).to(torch.int32),
    )


@triton.jit
def _reorder_window_kernel(
    win_tokens_ptr,  # [B, S] int64
    win_mask_ptr,  # [B, S] bool
    win_len_ptr,  # [B] int32
    ctx_len_ptr,  # [B] int32
    block_table_ptr,  # [B, P] int32
    input_ids_ptr,  # [R] int64, output
    positions_ptr,  # [R] int64, output
    slot_mapping_ptr,  # [R] int64, output
    order_ptr,  # [R] int32, output
    query_start_ptr,  # [B + 1] int32, output
    n_filled_ptr,  # [B] int32, output
    batch,  # B
    slots,  # S
    pages,  # P
    page_size,
    num_rows,  # R
    stride_tokens_b, stride_tokens_s,
    stride_mask_b, stride_mask_s,
    stride_win_len, stride_ctx_len,
    stride_table_b, stride_table_p,
    BLOCK_SLOTS: tl.constexpr,  # power of two >= S
    BLOCK_BATCH: tl.constexpr,  # sequences summed per step for the row offsets
):
    # Programs 0 .. B-1: one sequence each. Stable partition by ranks: with n live slots, a
    # filled live slot s goes to physical row rank(s) = #filled live slots before s, a mask
    # slot to n_filled + #mask slots before s. The sequence's rows start at
    # query_start[b] = sum of the live slots of the sequences before it (summed here, so no
    # launch waits for another), and the kernel scatters each slot's row values to packed
    # row query_start[b] + rank(s). Physical row j writes its K/V at position L + j, so the
    # slot mapping is computed per row j without the permutation.
    # Programs B ..: the padding rows query_start[B] .. R-1, BLOCK_SLOTS rows each; the
    # first of them also writes query_start[B].
    program = tl.program_id(0)
    b = tl.minimum(program, batch).to(tl.int64)
    before = tl.full([], 0, tl.int64)  # live slots of the sequences before b
    sequences = tl.arange(0, BLOCK_BATCH)
    for first in range(0, batch, BLOCK_BATCH):
        index = first + sequences
        lengths = tl.load(win_len_ptr + index.to(tl.int64) * stride_win_len,
                          mask=index < b, other=0)
        before += tl.sum(tl.minimum(tl.maximum(lengths, 0), slots).to(tl.int64), axis=0)
    start = tl.minimum(before, num_rows)
    slot = tl.arange(0, BLOCK_SLOTS)  # [BLOCK_SLOTS]
    slot64 = slot.to(tl.int64)

    if program < batch:
        live_len = tl.minimum(tl.maximum(tl.load(win_len_ptr + b * stride_win_len), 0), slots)
        ctx = tl.load(ctx_len_ptr + b * stride_ctx_len).to(tl.int64)
        live = slot < live_len
        tokens = tl.load(win_tokens_ptr + b * stride_tokens_b + slot64 * stride_tokens_s,
                         mask=live, other=0)
        is_mask = tl.load(win_mask_ptr + b * stride_mask_b + slot64 * stride_mask_s,
                          mask=live, other=0) != 0
        filled = (live & ~is_mask).to(tl.int32)
        masked = (live & is_mask).to(tl.int32)
        filled_before = tl.cumsum(filled, axis=0) - filled
        masked_before = tl.cumsum(masked, axis=0) - masked
        n_filled = tl.sum(filled, axis=0)
        rank = tl.where(filled != 0, filled_before, n_filled + masked_before)

        scatter = before + rank.to(tl.int64)  # [BLOCK_SLOTS]: packed row of slot s
        fed = live & (scatter < num_rows)
        tl.store(order_ptr + scatter, slot, mask=fed)
        tl.store(input_ids_ptr + scatter, tokens, mask=fed)
        tl.store(positions_ptr + scatter, ctx + slot64, mask=fed)
        tl.store(query_start_ptr + b, start.to(tl.int32))
        tl.store(n_filled_ptr + b, n_filled)

        # physical row j (= slot lane j) writes position L + j; physical >= 0 makes the
        # truncating integer division and remainder the floor ones of the contract
        physical = ctx + slot64
        page_index = physical // page_size
        in_table = live & (physical >= 0) & (page_index < pages)
        page_id = tl.load(block_table_ptr + b * stride_table_b + page_index * stride_table_p,
                          mask=in_table, other=-1).to(tl.int64)
        writable = in_table & (page_id >= 0)
        slot_mapping = tl.where(writable, page_id * page_size + physical % page_size, -1)
        row = before + slot64
        tl.store(slot_mapping_ptr + row, slot_mapping, mask=live & (row < num_rows))
    else:
        if program == batch:
            tl.store(query_start_ptr + batch, start.to(tl.int32))
        row = start + (program - batch) * BLOCK_SLOTS + slot64
        padding = row < num_rows
        tl.store(order_ptr + row, tl.zeros([BLOCK_SLOTS], tl.int32), mask=padding)
        tl.store(input_ids_ptr + row, tl.zeros([BLOCK_SLOTS], tl.int64), mask=padding)
        tl.store(positions_ptr + row, tl.zeros([BLOCK_SLOTS], tl.int64), mask=padding)
        tl.store(slot_mapping_ptr + row, tl.full([BLOCK_SLOTS], -1, tl.int64), mask=padding)


_BLOCK_BATCH = 256


def _block_slots(slots: int) -> int:
    return max(MIN_BLOCK_SLOTS, next_power_of_2(slots))


def _num_warps(block_slots: int) -> int:
    return 1 if block_slots <= 64 else 4


def reorder_window_triton(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, slots = win_tokens.shape
    if slots > MAX_KERNEL_SLOTS:
        return reorder_window_torch(win_tokens, win_mask, win_len, ctx_len, block_table,
                                    page_size, num_rows)
    outputs = (
        win_tokens.new_empty((num_rows,), dtype=torch.int64),  # input_ids
        win_tokens.new_empty((num_rows,), dtype=torch.int64),  # positions
        win_tokens.new_empty((num_rows,), dtype=torch.int64),  # slot_mapping
        win_tokens.new_empty((num_rows,), dtype=torch.int32),  # order
        win_tokens.new_empty((batch + 1,), dtype=torch.int32),  # query_start
        win_tokens.new_empty((batch,), dtype=torch.int32),  # n_filled
    )
    reorder_window_into(win_tokens, win_mask, win_len, ctx_len, block_table, page_size,
                        num_rows, *outputs)
    return outputs


def reorder_window_into(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    order: torch.Tensor,
    query_start: torch.Tensor,
    n_filled: torch.Tensor,
) -> None:
    """Launch the kernel into given contiguous outputs (``S <= MAX_KERNEL_SLOTS``).

    ``reorder_window_triton`` allocates the outputs and calls this; tests pass outputs
    placed between guard bands.
    """
    batch, slots = win_tokens.shape
    block_slots = _block_slots(slots)
    grid = (batch + triton.cdiv(num_rows, block_slots) + 1,)  # sequences, then padding tiles
    _reorder_window_kernel[grid](
        win_tokens, win_mask, win_len, ctx_len, block_table,
        input_ids, positions, slot_mapping, order, query_start, n_filled,
        batch, slots, block_table.shape[1], page_size, num_rows,
        win_tokens.stride(0), win_tokens.stride(1),
        win_mask.stride(0), win_mask.stride(1),
        win_len.stride(0), ctx_len.stride(0),
        block_table.stride(0), block_table.stride(1),
        BLOCK_SLOTS=block_slots, BLOCK_BATCH=_BLOCK_BATCH,
        num_warps=_num_warps(block_slots),
    )


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation ``reorder_window_triton`` launches: one per slot tile size."""
    pointers = {
        "win_tokens_ptr": torch.int64, "win_mask_ptr": torch.bool, "win_len_ptr": torch.int32,
        "ctx_len_ptr": torch.int32, "block_table_ptr": torch.int32,
        "input_ids_ptr": torch.int64, "positions_ptr": torch.int64,
        "slot_mapping_ptr": torch.int64, "order_ptr": torch.int32,
        "query_start_ptr": torch.int32, "n_filled_ptr": torch.int32,
    }
    scalars = (
        "batch", "slots", "pages", "page_size", "num_rows", "stride_tokens_b",
        "stride_tokens_s", "stride_mask_b", "stride_mask_s", "stride_win_len",
        "stride_ctx_len", "stride_table_b", "stride_table_p",
    )
    signature = {name: POINTER_TYPES[dtype] for name, dtype in pointers.items()}
    signature.update({name: "i32" for name in scalars})
    signature["BLOCK_SLOTS"] = "constexpr"
    signature["BLOCK_BATCH"] = "constexpr"
    variants = []
    block_slots = MIN_BLOCK_SLOTS
    while block_slots <= _block_slots(MAX_KERNEL_SLOTS):
        variants.append(KernelVariant(
            name=f"block_slots={block_slots}", kernel=_reorder_window_kernel,
            signature=signature,
            constexprs={"BLOCK_SLOTS": block_slots, "BLOCK_BATCH": _BLOCK_BATCH},
            num_warps=_num_warps(block_slots),
        ))
        block_slots *= 2
    return variants


def reorder_window_fake(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = win_tokens.shape[0]
    return (
        win_tokens.new_empty((num_rows,), dtype=torch.int64),
        win_tokens.new_empty((num_rows,), dtype=torch.int64),
        win_tokens.new_empty((num_rows,), dtype=torch.int64),
        win_tokens.new_empty((num_rows,), dtype=torch.int32),
        win_tokens.new_empty((batch + 1,), dtype=torch.int32),
        win_tokens.new_empty((batch,), dtype=torch.int32),
    )
