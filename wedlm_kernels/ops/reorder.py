"""reorder_window: the topological reordering of the decode window (ALGORITHM.md section 3).

Each sequence's live window slots are fed filled-first (a stable partition), at their
logical RoPE positions, while their K/V goes to the cache slots of their physical rows.
"""

import torch

from .. import _validate
from .._validate import Dims, check_int, check_same_device, check_tensor, debug_check


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
    return torch.ops.wedlm.reorder_window(
        win_tokens, win_mask, win_len, ctx_len, block_table, page_size
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
