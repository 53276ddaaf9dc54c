"""reorder_window: the topological reordering of the decode window (ALGORITHM.md section 3).

Each sequence's live window slots are fed filled-first (a stable partition), at their
logical RoPE positions, while their K/V goes to the cache slots of their physical rows.

The op has a vectorised PyTorch implementation (``reorder_window_torch``) and a Triton
kernel (``reorder_window_triton``: one launch, one program per sequence).
"""

import torch
import triton
import triton.language as tl

from .. import _dispatch, _validate
from .._validate import Dims, check_int, check_same_device, check_tensor, debug_check
from ._triton import POINTER_TYPES, KernelVariant, next_power_of_2

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each sequence's window for the forward: filled slots first, then masks.

    For sequence ``b`` with ``n = clamp(win_len[b], 0, S)`` live slots and ``L = ctx_len[b]``
    committed tokens, physical row ``j < n`` carries slot ``order[b, j]``, where ``order``
    lists the filled live slots in ascending order followed by the mask slots in ascending
    order. Row ``j`` is fed at its logical position ``L + order[b, j]`` and its K/V is
    written to the cache slot of position ``L + j``. Rows ``j >= n`` are padding.

    Args:
        win_tokens: ``[B, S]`` int64, window tokens in logical slot order (masks hold the
            mask id). Slots ``>= win_len`` are never read.
        win_mask: ``[B, S]`` bool, True where a slot is still a mask.
        win_len: ``[B]`` int32, live slots per sequence (clamped to ``[0, S]``).
        ctx_len: ``[B]`` int32, committed tokens per sequence (prompt included).
        block_table: ``[B, P]`` int32, page ids of each sequence (negative: no page).
        page_size: positions per cache page, ``> 0``.

    Returns:
        ``(input_ids, positions, slot_mapping, order, n_filled)``, all fresh tensors:

        - ``input_ids`` ``[B, S]`` int64: ``win_tokens[b, order[b, j]]``; 0 on padding rows.
        - ``positions`` ``[B, S]`` int64: ``L + order[b, j]``; ``L`` on padding rows.
        - ``slot_mapping`` ``[B, S]`` int64: ``block_table[b, (L+j) // page_size] * page_size
          + (L+j) % page_size``; -1 on padding rows and where the page index is outside
          ``[0, P)`` or the page id is negative (the K/V write is then dropped).
        - ``order`` ``[B, S]`` int32: the slot fed by each row; ``j`` on padding rows.
        - ``n_filled`` ``[B]`` int32: filled live slots; mask rows are ``n_filled .. n-1``.

    Example:
        >>> import torch, wedlm_kernels as wk
        >>> M = 99
        >>> win_tokens = torch.tensor([[5, M, 7, M, M, M, M, M]])
        >>> ids, pos, slots, order, n_filled = wk.reorder_window(
        ...     win_tokens, win_tokens == M, torch.tensor([5], dtype=torch.int32),
        ...     torch.tensor([10], dtype=torch.int32),
        ...     torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), 4)
        >>> order[0, :5].tolist(), pos[0, :5].tolist(), slots[0, :5].tolist()
        ([0, 2, 1, 3, 4], [10, 12, 11, 13, 14], [10, 11, 12, 13, 14])
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
    if _validate.DEBUG:
        debug_check((win_len >= 0) & (win_len <= dims["S"]), "win_len must be within [0, S]")
        debug_check(ctx_len >= 0, "ctx_len must be >= 0")
    return _dispatch.call(
        "reorder_window", win_tokens, win_mask, win_len, ctx_len, block_table, page_size
    )


def reorder_window_torch(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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

    # after the partition, row j is live iff j < n (the same test as for slots)
    input_ids = torch.where(live, torch.gather(win_tokens, 1, order), 0)
    positions = ctx + torch.where(live, order, 0)

    # physical row j writes its K/V at position L + j
    physical = ctx + slot
    page_index = torch.div(physical, page_size, rounding_mode="floor")
    if pages == 0:
        slot_mapping = torch.full_like(physical, -1)
    else:
        in_table = (page_index >= 0) & (page_index < pages)
        page_id = torch.gather(block_table, 1, page_index.clamp(0, pages - 1)).to(torch.int64)
        writable = live & in_table & (page_id >= 0)
        slot_mapping = torch.where(writable, page_id * page_size + physical % page_size, -1)

    return (
        input_ids,
        positions,
        slot_mapping,
        order.to(torch.int32),
        n_filled.squeeze(1).to(torch.int32),
    )


@triton.jit
def _reorder_window_kernel(
    win_tokens_ptr,  # [B, S] int64
    win_mask_ptr,  # [B, S] bool
    win_len_ptr,  # [B] int32
    ctx_len_ptr,  # [B] int32
    block_table_ptr,  # [B, P] int32
    input_ids_ptr,  # [B, S] int64, contiguous output
    positions_ptr,  # [B, S] int64, contiguous output
    slot_mapping_ptr,  # [B, S] int64, contiguous output
    order_ptr,  # [B, S] int32, contiguous output
    n_filled_ptr,  # [B] int32, output
    slots,  # S
    pages,  # P
    page_size,
    stride_tokens_b, stride_tokens_s,
    stride_mask_b, stride_mask_s,
    stride_win_len, stride_ctx_len,
    stride_table_b, stride_table_p,
    BLOCK_SLOTS: tl.constexpr,  # power of two >= S
):
    # One program per sequence b. Stable partition by ranks: with n live slots, a filled live
    # slot s goes to physical row rank(s) = #filled live slots before s, a mask slot to
    # n_filled + #mask slots before s, and a slot s >= n stays at row s (a padding row). The
    # ranks are a permutation of 0..S-1, so the kernel scatters each slot's row values to
    # row rank(s) instead of inverting the permutation. Physical row j writes its K/V at
    # position L + j, so the slot mapping is computed per row j without the permutation.
    b = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BLOCK_SLOTS)  # [BLOCK_SLOTS]
    in_window = slot < slots
    live_len = tl.minimum(tl.maximum(tl.load(win_len_ptr + b * stride_win_len), 0), slots)
    ctx = tl.load(ctx_len_ptr + b * stride_ctx_len).to(tl.int64)

    live = slot < live_len
    slot64 = slot.to(tl.int64)
    tokens = tl.load(win_tokens_ptr + b * stride_tokens_b + slot64 * stride_tokens_s,
                     mask=live, other=0)
    is_mask = tl.load(win_mask_ptr + b * stride_mask_b + slot64 * stride_mask_s,
                      mask=live, other=0) != 0
    filled = (live & ~is_mask).to(tl.int32)
    masked = (live & is_mask).to(tl.int32)
    filled_before = tl.cumsum(filled, axis=0) - filled
    masked_before = tl.cumsum(masked, axis=0) - masked
    n_filled = tl.sum(filled, axis=0)
    rank = tl.where(filled != 0, filled_before,
                    tl.where(masked != 0, n_filled + masked_before, slot))

    row_base = b * slots
    scatter = row_base + rank.to(tl.int64)  # [BLOCK_SLOTS]: output element of slot s
    tl.store(order_ptr + scatter, slot, mask=in_window)
    tl.store(input_ids_ptr + scatter, tl.where(live, tokens, 0), mask=in_window)
    tl.store(positions_ptr + scatter, ctx + tl.where(live, slot64, 0), mask=in_window)
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
    tl.store(slot_mapping_ptr + row_base + slot64, slot_mapping, mask=in_window)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, slots = win_tokens.shape
    if slots > MAX_KERNEL_SLOTS:
        return reorder_window_torch(win_tokens, win_mask, win_len, ctx_len, block_table, page_size)
    outputs = (
        win_tokens.new_empty((batch, slots), dtype=torch.int64),  # input_ids
        win_tokens.new_empty((batch, slots), dtype=torch.int64),  # positions
        win_tokens.new_empty((batch, slots), dtype=torch.int64),  # slot_mapping
        win_tokens.new_empty((batch, slots), dtype=torch.int32),  # order
        win_tokens.new_empty((batch,), dtype=torch.int32),  # n_filled
    )
    reorder_window_into(win_tokens, win_mask, win_len, ctx_len, block_table, page_size,
                               *outputs)
    return outputs


def reorder_window_into(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    order: torch.Tensor,
    n_filled: torch.Tensor,
) -> None:
    """Launch the kernel into given contiguous outputs (``S <= MAX_KERNEL_SLOTS``).

    ``reorder_window_triton`` allocates the outputs and calls this; tests pass outputs
    placed between guard bands.
    """
    batch, slots = win_tokens.shape
    if batch == 0:
        return
    block_slots = _block_slots(slots)
    _reorder_window_kernel[(batch,)](
        win_tokens, win_mask, win_len, ctx_len, block_table,
        input_ids, positions, slot_mapping, order, n_filled,
        slots, block_table.shape[1], page_size,
        win_tokens.stride(0), win_tokens.stride(1),
        win_mask.stride(0), win_mask.stride(1),
        win_len.stride(0), ctx_len.stride(0),
        block_table.stride(0), block_table.stride(1),
        BLOCK_SLOTS=block_slots,
        num_warps=_num_warps(block_slots),
    )


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation ``reorder_window_triton`` launches: one per slot tile size."""
    pointers = {
        "win_tokens_ptr": torch.int64, "win_mask_ptr": torch.bool, "win_len_ptr": torch.int32,
        "ctx_len_ptr": torch.int32, "block_table_ptr": torch.int32,
        "input_ids_ptr": torch.int64, "positions_ptr": torch.int64,
        "slot_mapping_ptr": torch.int64, "order_ptr": torch.int32, "n_filled_ptr": torch.int32,
    }
    scalars = (
        "slots", "pages", "page_size", "stride_tokens_b", "stride_tokens_s", "stride_mask_b",
        "stride_mask_s", "stride_win_len", "stride_ctx_len", "stride_table_b", "stride_table_p",
    )
    signature = {name: POINTER_TYPES[dtype] for name, dtype in pointers.items()}
    signature.update({name: "i32" for name in scalars})
    signature["BLOCK_SLOTS"] = "constexpr"
    variants = []
    block_slots = MIN_BLOCK_SLOTS
    while block_slots <= _block_slots(MAX_KERNEL_SLOTS):
        variants.append(KernelVariant(
            name=f"block_slots={block_slots}", kernel=_reorder_window_kernel,
            signature=signature, constexprs={"BLOCK_SLOTS": block_slots},
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, slots = win_tokens.shape
    return (
        win_tokens.new_empty((batch, slots), dtype=torch.int64),
        win_tokens.new_empty((batch, slots), dtype=torch.int64),
        win_tokens.new_empty((batch, slots), dtype=torch.int64),
        win_tokens.new_empty((batch, slots), dtype=torch.int32),
        win_tokens.new_empty((batch,), dtype=torch.int32),
    )
