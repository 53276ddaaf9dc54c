"""commit_window: commit, stop and length rules, window shift, fill and refill.

The last op of a decode step (docs/algorithm.md section 4, steps 2 and 7; docs/contracts.md
"commit_window" rules 1-8). It updates the whole decoder state in place without a host
synchronisation, so a step can be captured in a CUDA graph.

The op has a vectorised PyTorch implementation (``commit_window_torch``) and a Triton kernel
(``commit_window_triton``: one launch, one program per sequence).
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
# (a shape decision, made without reading tensor values). Selected rows are matched against
# the window slots BLOCK_ROWS rows at a time.
MIN_BLOCK_SLOTS = 16
MAX_KERNEL_SLOTS = 512
BLOCK_ROWS = 16


def commit_window(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    token: torch.Tensor,
    selected: torch.Tensor,
    out_tokens: torch.Tensor,
    out_len: torch.Tensor,
    finished: torch.Tensor,
    stop_ids: torch.Tensor,
    max_new: torch.Tensor,
    window: int,
    mask_id: int,
    blockwise: bool = False,
    commit_limit: torch.Tensor | None = None,
) -> None:
    """Commit the leading filled run, write the selected tokens and refill the window.

    The window state on entry is the one fed to the forward; ``cu_rows``, ``row_pos``,
    ``token`` and ``selected`` are the ``select_tokens`` inputs and outputs of that forward.
    A sequence is active iff ``finished[b]`` is False and ``win_len[b] > 0``; inactive
    sequences are not touched. For an active sequence, with ``limit = min(max(max_new[b],
    0), T)``:

    1. the leading run of filled live slots is committed (block-wise: only when the whole
       block of ``min(window, win_len)`` slots is filled), stopping at the length limit; a
       stop token is committed and ends the run; the sequence finishes on a stop token or
       when ``out_len == limit`` (then ``win_len = 0``);
    2. otherwise the window shifts left by the committed slots and each selected row with
       ``row_pos >= 0`` writes its token into the mask slot ``row_pos - ctx_len`` (new
       ``ctx_len``) if that slot is live and still a mask;
    3. if committing the new leading run would finish the sequence, it is committed now
       (early finish: no further forward is needed) and ``win_len = 0``;
    4. otherwise the window is refilled with as many masks as its leading run:
       ``win_len = min(n + run, limit - out_len, S)`` (never past ``prompt_len + max_new``).

    With ``commit_limit``, a sequence commits at most ``commit_limit[b]`` leading slots of
    the window it was fed in this call, rules 1 and 3 together (the runs they commit are
    cut there; the refill of rule 4 still counts the whole run). A grammar-constrained
    front end passes the slots its walk validated, so that a draft is never committed
    before the grammar has accepted it (docs/requests.md, "Structured outputs").

    Slots ``>= win_len`` of active sequences end as ``mask_id``/True. ``out_tokens`` is only
    written at columns ``[old out_len, new out_len)``.

    Parameters
    ----------
    win_tokens : torch.Tensor
        ``[B, S]`` int64, contiguous; window tokens (mutated).
    win_mask : torch.Tensor
        ``[B, S]`` bool, contiguous; True where a slot is a mask (mutated).
    win_len : torch.Tensor
        ``[B]`` int32, contiguous; live slots, ``<= S`` (mutated).
    ctx_len : torch.Tensor
        ``[B]`` int32, contiguous; committed tokens incl. the prompt (mutated).
    cu_rows : torch.Tensor
        ``[B+1]`` int32; rows ``cu_rows[b] .. cu_rows[b+1]-1`` belong to sequence ``b``
        (non-decreasing, within ``[0, R]``).
    row_pos : torch.Tensor
        ``[R]`` int64; absolute position each row predicts, -1 for padding rows.
    token : torch.Tensor
        ``[R]`` int64; the sampled token of each row.
    selected : torch.Tensor
        ``[R]`` bool; rows whose token is written into the window.
    out_tokens : torch.Tensor
        ``[B, T]`` int64, contiguous; generated tokens (mutated).
    out_len : torch.Tensor
        ``[B]`` int32, contiguous; generated tokens so far, ``<= T`` (mutated).
    finished : torch.Tensor
        ``[B]`` bool, contiguous; finished sequences (mutated).
    stop_ids : torch.Tensor
        ``[B, K]`` int64; stop token ids, negative entries are padding (``K`` may be 0).
    max_new : torch.Tensor
        ``[B]`` int32; maximum generated tokens per sequence.
    window : int
        ``W > 0``, the block size of block-wise decoding (``blockwise``). Streaming reads no
        window size here: each sequence keeps the live length it was admitted with (its
        first ``win_len``, see :func:`wedlm_kernels.new_window_state`), as the refill
        appends as many masks as were committed.
    mask_id : int
        The mask token id (``>= 0``), written into freed slots.
    blockwise : bool
        The block-wise baseline instead of streaming.
    commit_limit : torch.Tensor or None
        ``[B]`` int32; the most leading slots of the fed window sequence ``b`` may commit in
        this call, the early finish included (negative: none). None: no limit.

    Returns
    -------
    None
        The seven state tensors are updated in place.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> M = 99  # docs/algorithm.md's worked example: window [a, M, c, M, M] at L = 10
    >>> win_tokens = torch.tensor([[5, M, 7, M, M, M, M, M]])
    >>> win_mask, win_len = win_tokens == M, torch.tensor([5], dtype=torch.int32)
    >>> ctx_len, out_len = torch.tensor([10], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    >>> out_tokens, finished = torch.zeros(1, 8, dtype=torch.int64), torch.tensor([False])
    >>> wk.commit_window(win_tokens, win_mask, win_len, ctx_len,
    ...     torch.tensor([0, 3], dtype=torch.int32), torch.tensor([11, 13, 14]),
    ...     torch.tensor([21, 23, 24]), torch.tensor([True, True, False]),
    ...     out_tokens, out_len, finished, torch.full((1, 1), -1),
    ...     torch.tensor([8], dtype=torch.int32), window=4, mask_id=M)
    >>> out_tokens[0, :1].tolist(), win_tokens[0, :win_len[0]].tolist(), ctx_len.tolist()
    ([5], [21, 7, 23, 99, 99, 99, 99], [11])
    """
    dims = Dims()
    check_tensor("win_tokens", win_tokens, torch.int64, ("B", "S"), dims, contiguous=True)
    check_tensor("win_mask", win_mask, torch.bool, ("B", "S"), dims, contiguous=True)
    check_tensor("win_len", win_len, torch.int32, ("B",), dims, contiguous=True)
    check_tensor("ctx_len", ctx_len, torch.int32, ("B",), dims, contiguous=True)
    check_tensor("cu_rows", cu_rows, torch.int32, ("B+1",), dims)
    check_tensor("row_pos", row_pos, torch.int64, ("R",), dims)
    check_tensor("token", token, torch.int64, ("R",), dims)
    check_tensor("selected", selected, torch.bool, ("R",), dims)
    check_tensor("out_tokens", out_tokens, torch.int64, ("B", "T"), dims, contiguous=True)
    check_tensor("out_len", out_len, torch.int32, ("B",), dims, contiguous=True)
    check_tensor("finished", finished, torch.bool, ("B",), dims, contiguous=True)
    check_tensor("stop_ids", stop_ids, torch.int64, ("B", "K"), dims)
    check_tensor("max_new", max_new, torch.int32, ("B",), dims)
    if commit_limit is not None:
        check_tensor("commit_limit", commit_limit, torch.int32, ("B",), dims)
    check_same_device(
        win_tokens=win_tokens, win_mask=win_mask, win_len=win_len, ctx_len=ctx_len,
        cu_rows=cu_rows, row_pos=row_pos, token=token, selected=selected,
        out_tokens=out_tokens, out_len=out_len, finished=finished, stop_ids=stop_ids,
        max_new=max_new, commit_limit=commit_limit,
    )
    check_int("window", window, minimum=1)
    check_int("mask_id", mask_id, minimum=0)
    if not isinstance(blockwise, bool):
        raise TypeError(f"`blockwise` must be a bool, got {type(blockwise).__name__}")
    if _backend.DEBUG:
        _debug_checks(win_len, ctx_len, cu_rows, row_pos, selected, out_len, dims)
    _dispatch.call(
        "commit_window", win_tokens, win_mask, win_len, ctx_len, cu_rows, row_pos, token,
        selected, out_tokens, out_len, finished, stop_ids, max_new, window, mask_id, blockwise,
        commit_limit,
    )


def _debug_checks(
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    selected: torch.Tensor,
    out_len: torch.Tensor,
    dims: Dims,
) -> None:
    """Value checks of WEDLM_KERNELS_DEBUG=1 (they synchronise with the device)."""
    slots, capacity, rows = dims["S"], dims["T"], dims["R"]
    debug_check((win_len >= 0) & (win_len <= slots), "win_len must be within [0, S]")
    debug_check(ctx_len >= 0, "ctx_len must be >= 0")
    debug_check((out_len >= 0) & (out_len <= capacity), "out_len must be within [0, T]")
    debug_check(
        (cu_rows[:-1] <= cu_rows[1:]).all() & (cu_rows[0] >= 0) & (cu_rows[-1] <= rows),
        "cu_rows must be non-decreasing within [0, R]",
    )
    # duplicate selected positions within a sequence: distinct (sequence, position) keys.
    # searchsorted gives b + 1 for the rows of sequence b, 0 and B + 1 outside every sequence.
    row_seq = torch.searchsorted(
        cu_rows.contiguous(), torch.arange(rows, dtype=torch.int32, device=cu_rows.device),
        right=True,
    ).to(torch.int64)
    in_sequence = (row_seq >= 1) & (row_seq <= cu_rows.shape[0] - 1)
    chosen = selected & (row_pos >= 0) & in_sequence
    keys = torch.stack([row_seq[chosen], row_pos[chosen]], dim=1)
    debug_check(
        torch.unique(keys, dim=0).shape[0] == keys.shape[0],
        "selected rows of a sequence must predict distinct positions (row_pos)",
    )


def _effective_run(
    win_mask: torch.Tensor, live_len: torch.Tensor, window: int, blockwise: bool,
    room: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rule 1: per sequence, the leading run of filled live slots that counts as committable.

    ``win_mask`` ``[B, C]``, ``live_len`` ``[B]`` int64 (``<= C``). Streaming: the run;
    block-wise: ``min(window, live_len)`` if the run covers that block, else 0. ``room``
    ``[B]`` int64: the run is cut at that many slots first (``commit_limit``).
    """
    slot = torch.arange(win_mask.shape[1], device=win_mask.device)
    not_filled = win_mask | (slot >= live_len.unsqueeze(1))
    # the run is the number of slots before the first slot that is not a filled live slot
    run = (torch.cumsum(not_filled.to(torch.int64), dim=1) == 0).sum(dim=1)
    if room is not None:
        run = torch.minimum(run, room)
    if not blockwise:
        return run
    block = live_len.clamp(max=window)
    return torch.where(run >= block, block, 0)


def _commit_count(
    tokens: torch.Tensor,
    eff: torch.Tensor,
    out_len: torch.Tensor,
    limit: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 2 without writing: ``(committed, finishes)`` per sequence.

    Slot ``s`` of ``tokens`` ``[B, C]`` is committed iff ``s < eff`` (the run), ``s <
    limit - out_len`` (length rule) and no stop token precedes it in the window (a stop
    token itself is committed). The sequence finishes on a committed stop token or when the
    output reaches ``limit``.
    """
    slot = torch.arange(tokens.shape[1], device=tokens.device)
    is_stop = ((tokens.unsqueeze(2) == stop_ids.unsqueeze(1)) & (stop_ids.unsqueeze(1) >= 0)).any(
        dim=2
    )
    stops_before = torch.cumsum(is_stop.to(torch.int64), dim=1) - is_stop.to(torch.int64)
    taken = (
        (slot < eff.unsqueeze(1))
        & (slot < (limit - out_len).unsqueeze(1))
        & (stops_before == 0)
    )
    committed = taken.sum(dim=1)
    finishes = (taken & is_stop).any(dim=1) | (out_len + committed >= limit)
    return committed, finishes


def _append(
    out_tokens: torch.Tensor, out_len: torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor
) -> torch.Tensor:
    """Output columns ``out_len + i`` (``i < committed``) take window slot ``i``.

    A full-row select over the ``T`` columns: every column reads at most one window slot,
    so no two writes race and columns outside the committed range keep their value.
    """
    column = torch.arange(out_tokens.shape[1], device=out_tokens.device)
    offset = column - out_len.unsqueeze(1)  # [B, T]: window slot feeding each column
    write = (offset >= 0) & (offset < committed.unsqueeze(1))
    source = torch.gather(tokens, 1, offset.clamp(0, tokens.shape[1] - 1))
    return torch.where(write, source, out_tokens)


def commit_window_torch(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    token: torch.Tensor,
    selected: torch.Tensor,
    out_tokens: torch.Tensor,
    out_len: torch.Tensor,
    finished: torch.Tensor,
    stop_ids: torch.Tensor,
    max_new: torch.Tensor,
    window: int,
    mask_id: int,
    blockwise: bool = False,
    commit_limit: torch.Tensor | None = None,
) -> None:
    batch, slots = win_tokens.shape
    if batch == 0:
        return
    device = win_tokens.device
    capacity = out_tokens.shape[1]
    # Work on a window with one extra "sink" slot per sequence (always a mask): shifted-in
    # slots and dropped fill writes land there, and it keeps every gather in bounds (S = 0).
    sink = slots
    tokens = torch.cat([win_tokens, win_tokens.new_full((batch, 1), mask_id)], dim=1)
    masks = torch.cat([win_mask, win_mask.new_ones((batch, 1))], dim=1)
    slot = torch.arange(slots + 1, device=device)

    active = ~finished & (win_len > 0)
    live_len = win_len.to(torch.int64).clamp(0, slots)
    limit = max_new.to(torch.int64).clamp(0, capacity)
    length = out_len.to(torch.int64)
    context = ctx_len.to(torch.int64)

    # the slots each sequence may still commit in this call (commit_limit); None: any
    room = None if commit_limit is None else commit_limit.to(torch.int64).clamp(min=0)

    # 1-3. commit the leading run as fed to the forward
    eff = _effective_run(masks, live_len, window, blockwise, room)
    committed, finishes = _commit_count(tokens, eff, length, limit, stop_ids)
    committed = torch.where(active, committed, 0)
    outputs = _append(out_tokens, length, tokens, committed)
    length = length + committed
    context = context + committed
    finished_now = active & finishes
    keep = active & ~finished_now  # sequences that go on to shift, fill and refill

    # 4. shift left by the committed slots; slots past the remaining live ones are masks
    live_len = live_len - committed
    source = (slot + committed.unsqueeze(1)).clamp(max=sink)
    beyond = slot >= live_len.unsqueeze(1)
    tokens = torch.where(beyond, mask_id, torch.gather(tokens, 1, source))
    masks = beyond | torch.gather(masks, 1, source)

    # 5. fill: row r belongs to the sequence b with cu_rows[b] <= r < cu_rows[b+1]
    rows = row_pos.shape[0]
    row = torch.arange(rows, dtype=cu_rows.dtype, device=device)
    row_seq = torch.searchsorted(cu_rows.contiguous(), row, right=True).to(torch.int64) - 1
    seq = row_seq.clamp(0, batch - 1)
    belongs = (
        (row_seq >= 0) & (row_seq < batch) & (cu_rows[seq] <= row) & (row < cu_rows[seq + 1])
    )
    target = row_pos - context[seq]  # the slot after the shift
    fill = (
        belongs & selected & (row_pos >= 0) & keep[seq]
        & (target >= 0) & (target < live_len[seq])
    )
    flat_index = seq * (slots + 1) + torch.where(fill, target, sink)
    fill = fill & masks.reshape(-1)[flat_index]  # only slots that are still masks
    flat_index = seq * (slots + 1) + torch.where(fill, target, sink)
    tokens = tokens.reshape(-1).scatter(0, flat_index, torch.where(fill, token, mask_id))
    masks = masks.reshape(-1).scatter(0, flat_index, ~fill)
    tokens, masks = tokens.view(batch, slots + 1), masks.view(batch, slots + 1)

    # 6. early finish: commit the new leading run now if committing it finishes the sequence
    # (within commit_limit; the refill of rule 7 counts the whole run)
    eff = _effective_run(masks, live_len, window, blockwise)
    eff_early = eff if room is None else _effective_run(
        masks, live_len, window, blockwise, room - committed)
    early_count, early = _commit_count(tokens, eff_early, length, limit, stop_ids)
    early = keep & early
    early_count = torch.where(early, early_count, 0)
    outputs = _append(outputs, length, tokens, early_count)
    length = length + early_count
    context = context + early_count
    keep = keep & ~early

    # 7. refill with eff masks (the slots past live_len already are), within limit and S
    refilled = torch.minimum(live_len + eff, limit - length).clamp(max=slots)
    new_len = torch.where(keep, refilled, torch.where(active, 0, win_len.to(torch.int64)))

    # 8. slots >= win_len of an active sequence are masks; inactive sequences keep everything
    reset = slot[:slots] >= new_len.unsqueeze(1)
    new_tokens = torch.where(reset, mask_id, tokens[:, :slots])
    new_masks = reset | masks[:, :slots]
    keep_old = ~active.unsqueeze(1)
    win_tokens.copy_(torch.where(keep_old, win_tokens, new_tokens))
    win_mask.copy_(torch.where(keep_old, win_mask, new_masks))
    win_len.copy_(new_len.to(torch.int32))
    ctx_len.copy_(context.to(torch.int32))
    out_tokens.copy_(outputs)
    out_len.copy_(length.to(torch.int32))
    finished.copy_(finished | finished_now | early)


@triton.jit
def _commit_window_kernel(
    win_tokens_ptr,  # [B, S] int64, contiguous, mutated
    win_mask_ptr,  # [B, S] bool, contiguous, mutated
    win_len_ptr,  # [B] int32, mutated
    ctx_len_ptr,  # [B] int32, mutated
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    token_ptr,  # [R] int64
    selected_ptr,  # [R] bool
    out_tokens_ptr,  # [B, T] int64, contiguous, mutated
    out_len_ptr,  # [B] int32, mutated
    finished_ptr,  # [B] bool, mutated
    stop_ids_ptr,  # [B, K] int64
    max_new_ptr,  # [B] int32
    commit_limit_ptr,  # [B] int32 (read iff HAS_COMMIT_LIMIT)
    slots,  # S
    rows,  # R
    capacity,  # T
    stops,  # K
    window,
    mask_id,
    blockwise,  # 0 or 1
    stride_cu_rows, stride_row_pos, stride_token, stride_selected,
    stride_stop_b, stride_stop_k, stride_max_new, stride_commit_limit,
    BLOCK_SLOTS: tl.constexpr,  # power of two >= S
    BLOCK_ROWS: tl.constexpr,
    HAS_COMMIT_LIMIT: tl.constexpr,
):
    # One program per sequence b, following the numbered rules of docs/contracts.md
    # "commit_window". The window lives in registers ([BLOCK_SLOTS] lanes, lane s = slot s)
    # from its loads to the final stores, so the in-place shift has no read-after-write
    # hazard. The prefix rules are cumulative sums over the lanes: the leading run is the
    # number of lanes before the first lane that is not a filled live slot, and slot s of
    # the run is committed iff s < run, s < limit - out_len and no stop token precedes it.
    # Inactive sequences run the same code with every store masked off. With a commit
    # limit, both commits (rules 2 and 6) take at most `room` more slots; the refill (rule
    # 7) still counts the whole run.
    b = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BLOCK_SLOTS)  # [BLOCK_SLOTS]
    slot64 = slot.to(tl.int64)
    in_window = slot < slots
    state_row = b * slots
    out_row = b * capacity
    stop_ids_row = stop_ids_ptr + b * stride_stop_b

    win_len = tl.load(win_len_ptr + b)
    active = (tl.load(finished_ptr + b) == 0) & (win_len > 0)
    live_len = tl.minimum(win_len, slots)
    ctx_len = tl.load(ctx_len_ptr + b)
    out_len = tl.load(out_len_ptr + b)
    limit = tl.minimum(tl.maximum(tl.load(max_new_ptr + b * stride_max_new), 0), capacity)

    live = slot < live_len
    tokens = tl.load(win_tokens_ptr + state_row + slot64, mask=live, other=mask_id)
    is_mask = tl.load(win_mask_ptr + state_row + slot64, mask=live, other=1) != 0

    keep = active  # the sequence goes on (rules 3 and 6 end it)
    if HAS_COMMIT_LIMIT:
        room = tl.maximum(tl.load(commit_limit_ptr + b * stride_commit_limit), 0)
    for phase in tl.static_range(2):
        # phase 0: rules 1-2 on the window fed to the forward; phase 1: rule 6 (early
        # finish) on the shifted and filled window, whose run is committed only if that
        # finishes the sequence. Both end with eff = the effective run of their window.
        not_filled = (is_mask | (slot >= live_len)).to(tl.int32)
        run = tl.sum((tl.cumsum(not_filled, axis=0) == 0).to(tl.int32), axis=0)
        block = tl.minimum(live_len, window)
        eff = tl.where(blockwise != 0, tl.where(run >= block, block, 0), run)
        eff_commit = eff
        if HAS_COMMIT_LIMIT:
            capped = tl.minimum(run, room)
            eff_commit = tl.where(blockwise != 0, tl.where(capped >= block, block, 0), capped)

        # a scalar loop over the stop ids: K = 0 needs no empty tile
        is_stop = tl.full([BLOCK_SLOTS], 0, dtype=tl.int1)
        for k in range(0, stops):
            stop_id = tl.load(stop_ids_row + k * stride_stop_k)
            is_stop = is_stop | ((tokens == stop_id) & (stop_id >= 0))
        stop = is_stop.to(tl.int32)
        stops_before = tl.cumsum(stop, axis=0) - stop
        taken = (slot < eff_commit) & (slot < limit - out_len) & (stops_before == 0)
        count = tl.sum(taken.to(tl.int32), axis=0)
        stopped = tl.max((taken & is_stop).to(tl.int32), axis=0) != 0
        finishes = stopped | (out_len + count >= limit)
        if phase == 0:
            commits = keep
        else:
            commits = keep & finishes

        # output column out_len + s takes slot s of the committed run
        column = out_len.to(tl.int64) + slot64
        tl.store(out_tokens_ptr + out_row + column, tokens,
                 mask=commits & taken & (column >= 0) & (column < capacity))
        count = tl.where(commits, count, 0)
        out_len += count
        ctx_len += count
        if HAS_COMMIT_LIMIT:
            room -= count
        keep = keep & ~(commits & finishes)

        if phase == 0:
            # 4. shift left by the committed slots: lane s takes slot s + count (memory
            # still holds the window fed to the forward); lanes past the live slots are masks
            live_len -= count
            live = slot < live_len
            source = state_row + slot64 + count
            tokens = tl.load(win_tokens_ptr + source, mask=live, other=mask_id)
            is_mask = tl.load(win_mask_ptr + source, mask=live, other=1) != 0

            # 5. fill: a selected row of b predicting position p writes slot p - ctx_len
            # (the new ctx_len) if it is a live mask slot. Rows are matched against all
            # lanes at once ([BLOCK_ROWS, BLOCK_SLOTS]); valid input has distinct
            # positions, so at most one row hits a slot (else one of their tokens lands).
            row_begin = tl.maximum(tl.load(cu_rows_ptr + b * stride_cu_rows), 0)
            row_end = tl.minimum(tl.load(cu_rows_ptr + (b + 1) * stride_cu_rows), rows)
            row_end = tl.where(keep, row_end, row_begin)  # only a continuing sequence fills
            hit = tl.full([BLOCK_SLOTS], 0, dtype=tl.int1)
            fill_token = tl.full([BLOCK_SLOTS], -9223372036854775808, dtype=tl.int64)
            for start in range(row_begin, row_end, BLOCK_ROWS):
                row = (start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # [BLOCK_ROWS]
                in_rows = row < row_end
                row_pos = tl.load(row_pos_ptr + row * stride_row_pos, mask=in_rows, other=-1)
                chosen = tl.load(selected_ptr + row * stride_selected, mask=in_rows,
                                 other=0) != 0
                sampled = tl.load(token_ptr + row * stride_token, mask=in_rows, other=0)
                target = row_pos - ctx_len
                fills = in_rows & chosen & (row_pos >= 0) & (target >= 0) & (target < live_len)
                # [BLOCK_ROWS, BLOCK_SLOTS]: row r writes lane s
                match = fills[:, None] & (target[:, None] == slot64[None, :])
                hit = hit | (tl.max(match.to(tl.int32), axis=0) != 0)
                fill_token = tl.maximum(
                    fill_token,
                    tl.max(tl.where(match, sampled[:, None], -9223372036854775808), axis=0),
                )
            write = hit & is_mask
            tokens = tl.where(write, fill_token, tokens)
            is_mask = is_mask & ~write

    # 7. refill with eff masks (lanes past live_len already are), within limit and S
    new_len = tl.where(keep, tl.minimum(tl.minimum(live_len + eff, limit - out_len), slots), 0)

    # 8. slots >= win_len are masks. The barrier: every lane has loaded before any store.
    reset = slot >= new_len
    tl.debug_barrier()
    tl.store(win_tokens_ptr + state_row + slot64, tl.where(reset, mask_id, tokens),
             mask=active & in_window)
    tl.store(win_mask_ptr + state_row + slot64, reset | is_mask, mask=active & in_window)
    tl.store(win_len_ptr + b, new_len, mask=active)
    tl.store(ctx_len_ptr + b, ctx_len, mask=active)
    tl.store(out_len_ptr + b, out_len, mask=active)
    tl.store(finished_ptr + b, active, mask=active & ~keep)


def _block_slots(slots: int) -> int:
    return max(MIN_BLOCK_SLOTS, next_power_of_2(slots))


def _num_warps(block_slots: int) -> int:
    return 1 if block_slots <= 64 else 4


def commit_window_triton(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    token: torch.Tensor,
    selected: torch.Tensor,
    out_tokens: torch.Tensor,
    out_len: torch.Tensor,
    finished: torch.Tensor,
    stop_ids: torch.Tensor,
    max_new: torch.Tensor,
    window: int,
    mask_id: int,
    blockwise: bool = False,
    commit_limit: torch.Tensor | None = None,
) -> None:
    batch, slots = win_tokens.shape
    if slots > MAX_KERNEL_SLOTS:
        commit_window_torch(
            win_tokens, win_mask, win_len, ctx_len, cu_rows, row_pos, token, selected,
            out_tokens, out_len, finished, stop_ids, max_new, window, mask_id, blockwise,
            commit_limit,
        )
        return None
    if batch == 0:
        return None
    block_slots = _block_slots(slots)
    _commit_window_kernel[(batch,)](
        win_tokens, win_mask, win_len, ctx_len, cu_rows, row_pos, token, selected,
        out_tokens, out_len, finished, stop_ids, max_new,
        max_new if commit_limit is None else commit_limit,
        slots, row_pos.shape[0], out_tokens.shape[1], stop_ids.shape[1],
        window, mask_id, int(blockwise),
        cu_rows.stride(0), row_pos.stride(0), token.stride(0), selected.stride(0),
        stop_ids.stride(0), stop_ids.stride(1), max_new.stride(0),
        0 if commit_limit is None else commit_limit.stride(0),
        BLOCK_SLOTS=block_slots,
        BLOCK_ROWS=BLOCK_ROWS,
        HAS_COMMIT_LIMIT=commit_limit is not None,
        num_warps=_num_warps(block_slots),
    )
    return None


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation ``commit_window_triton`` launches: one per slot tile size, with
    and without a commit limit."""
    pointers = {
        "win_tokens_ptr": torch.int64, "win_mask_ptr": torch.bool, "win_len_ptr": torch.int32,
        "ctx_len_ptr": torch.int32, "cu_rows_ptr": torch.int32, "row_pos_ptr": torch.int64,
        "token_ptr": torch.int64, "selected_ptr": torch.bool, "out_tokens_ptr": torch.int64,
        "out_len_ptr": torch.int32, "finished_ptr": torch.bool, "stop_ids_ptr": torch.int64,
        "max_new_ptr": torch.int32, "commit_limit_ptr": torch.int32,
    }
    scalars = (
        "slots", "rows", "capacity", "stops", "window", "mask_id", "blockwise",
        "stride_cu_rows", "stride_row_pos", "stride_token", "stride_selected",
        "stride_stop_b", "stride_stop_k", "stride_max_new", "stride_commit_limit",
    )
    signature = {name: POINTER_TYPES[dtype] for name, dtype in pointers.items()}
    signature.update({name: "i32" for name in scalars})
    signature.update(BLOCK_SLOTS="constexpr", BLOCK_ROWS="constexpr",
                     HAS_COMMIT_LIMIT="constexpr")
    variants = []
    block_slots = MIN_BLOCK_SLOTS
    while block_slots <= _block_slots(MAX_KERNEL_SLOTS):
        for limited in (False, True):
            variants.append(KernelVariant(
                name=f"block_slots={block_slots},commit_limit={limited}",
                kernel=_commit_window_kernel, signature=signature,
                constexprs={"BLOCK_SLOTS": block_slots, "BLOCK_ROWS": BLOCK_ROWS,
                            "HAS_COMMIT_LIMIT": limited},
                num_warps=_num_warps(block_slots),
            ))
        block_slots *= 2
    return variants


def commit_window_fake(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    token: torch.Tensor,
    selected: torch.Tensor,
    out_tokens: torch.Tensor,
    out_len: torch.Tensor,
    finished: torch.Tensor,
    stop_ids: torch.Tensor,
    max_new: torch.Tensor,
    window: int,
    mask_id: int,
    blockwise: bool = False,
    commit_limit: torch.Tensor | None = None,
) -> None:
    return None
