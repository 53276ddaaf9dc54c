"""What an engine builds around the ops for a batch: the window state of its sequences, the
positions and cache slots of packed prefill rows, and the mask rows of a packed decode step.

Vectorised PyTorch on the batch's device. :func:`paged_slots`, :func:`prefill_slots` and
:func:`mask_rows` read no value on the host (they can run inside a CUDA graph or under
``torch.compile``); :func:`new_window_state` allocates, once per admitted batch, and reads
lengths on the host only where the caller leaves a width to it. ``docs/integrating.md``
shows them in a whole decode loop (``examples/engine_loop.py``).

Example, one streaming step of a batch of two prompts (``model`` is the engine's own)::

    state = wk.new_window_state([5, 3], max_new=[32, 32], window=4, mask_id=mask_id)
    # prefill: the prompts' rows, packed, at positions 0 .. L - 1
    query_start = torch.tensor([0, 5, 8], dtype=torch.int32)
    positions, slot_mapping = wk.prefill_slots(query_start, torch.zeros(2, dtype=torch.int32),
                                               block_table, page_size, num_rows=8)
    # a decode step
    input_ids, positions, slot_mapping, _, query_start, n_filled = wk.reorder_window(
        state.win_tokens, state.win_mask, state.win_len, state.ctx_len, block_table,
        page_size, num_rows)
    hidden = model(input_ids, positions, slot_mapping, query_start, state.ctx_len)
    rows, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, window=4)
    token, selected, _ = wk.select_tokens(lm_head(hidden[rows]), cu_rows, row_pos, ...)
    wk.commit_window(state.win_tokens, state.win_mask, state.win_len, state.ctx_len, cu_rows,
                     row_pos, token, selected, state.out_tokens, state.out_len,
                     state.finished, state.stop_ids, state.max_new, window=4,
                     mask_id=mask_id)
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .ops._validate import Dims, check_int, check_same_device, check_tensor

_INT = (torch.int32, torch.int64)


def _lengths(value: Sequence[int] | torch.Tensor, name: str, device) -> torch.Tensor:
    """A ``[B]`` int32 tensor of non-negative lengths (a sequence of ints is checked here;
    a tensor's values are not read)."""
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, _INT, (None,))
        return value.to(device=device, dtype=torch.int32)
    values = [check_int(f"{name}[{i}]", item, minimum=0) for i, item in enumerate(value)]
    return torch.tensor(values, dtype=torch.int32, device=device)


@dataclass
class WindowState:
    """The decode state of a batch that :func:`reorder_window` reads and
    :func:`commit_window` advances in place, one row per sequence (``docs/contracts.md``).
    Sizes: B sequences, S window slots (the window's capacity, ``2 W`` for streaming with a
    window of W mask slots), T output tokens at most, K stop ids at most.

    Parameters
    ----------
    win_tokens : torch.Tensor
        ``[B, S]`` int64, window tokens in logical slot order (the mask id at masks).
    win_mask : torch.Tensor
        ``[B, S]`` bool, True where the slot is still a mask.
    win_len : torch.Tensor
        ``[B]`` int32, live window slots (0: finished, or an AR sequence).
    ctx_len : torch.Tensor
        ``[B]`` int32, committed tokens, prompt included (the cached positions).
    out_tokens : torch.Tensor
        ``[B, T]`` int64, generated tokens.
    out_len : torch.Tensor
        ``[B]`` int32, generated tokens so far.
    finished : torch.Tensor
        ``[B]`` bool.
    stop_ids : torch.Tensor
        ``[B, K]`` int64 stop token ids, -1 padded.
    max_new : torch.Tensor
        ``[B]`` int32, each sequence's output length limit.
    """

    win_tokens: torch.Tensor  # [B, S] int64: window tokens in logical order (mask_id at masks)
    win_mask: torch.Tensor  # [B, S] bool: True where the slot is still a mask
    win_len: torch.Tensor  # [B] int32: live slots (0: finished, or an AR sequence)
    ctx_len: torch.Tensor  # [B] int32: committed tokens, prompt included (cached K/V)
    out_tokens: torch.Tensor  # [B, T] int64: generated tokens
    out_len: torch.Tensor  # [B] int32
    finished: torch.Tensor  # [B] bool
    stop_ids: torch.Tensor  # [B, K] int64, -1 padded
    max_new: torch.Tensor  # [B] int32: the length limit of each sequence's output


def new_window_state(
    prompt_len: Sequence[int] | torch.Tensor,
    max_new: Sequence[int] | torch.Tensor,
    window: int | torch.Tensor,
    mask_id: int,
    *,
    stop_ids: torch.Tensor | None = None,
    max_output: int | None = None,
    slots: int | None = None,
    device: torch.device | str | None = None,
) -> WindowState:
    """The window state of a newly admitted batch, before its first decode step.

    Each sequence starts with its prompt committed (``ctx_len = prompt_len``; prefill its
    K/V at positions ``0 .. prompt_len - 1``, see :func:`prefill_slots`) and a window of
    ``min(window, max_new)`` mask slots. That first ``win_len`` is the sequence's window:
    :func:`commit_window` refills to at most the run it commits, so a sequence keeps the
    window it started with (``commit_window``'s ``window`` argument is the block size of
    block-wise decoding only).

    Parameters
    ----------
    prompt_len : sequence of int or torch.Tensor
        ``[B]``, each prompt's length (ints, or an int32/int64 tensor).
    max_new : sequence of int or torch.Tensor
        ``[B]``, each sequence's output length limit.
    window : int or torch.Tensor
        Mask slots per sequence, an int or a ``[B]`` int32/int64 tensor (per-sequence
        windows); 0 gives a sequence no window (AR decoding).
    mask_id : int
        The mask token's id, written into every window slot.
    stop_ids : torch.Tensor or None
        ``[B, K]`` int64 stop ids, -1 padded (default: none, ``K = 0``).
    max_output : int or None
        T, the width of ``out_tokens`` (default: the largest ``max_new``, read on the
        host).
    slots : int or None
        S, the window's capacity (default: twice the widest window, read on the host when
        ``window`` is a tensor); at least the widest window.
    device : torch.device, str or None
        Where the state lives (default: the device of ``stop_ids`` or of a tensor argument,
        else the CPU).

    Returns
    -------
    WindowState
        Fresh tensors.

    Examples
    --------
    >>> import wedlm_kernels as wk
    >>> state = wk.new_window_state([5, 3], max_new=[8, 2], window=4, mask_id=7)
    >>> state.win_len.tolist(), state.ctx_len.tolist(), tuple(state.win_tokens.shape)
    ([4, 2], [5, 3], (2, 8))
    """
    if device is None:
        tensors = [t for t in (stop_ids, prompt_len, max_new, window)
                   if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
    device = torch.device(device)
    prompt = _lengths(prompt_len, "prompt_len", device)
    limit = _lengths(max_new, "max_new", device)
    batch = prompt.shape[0]
    if limit.shape[0] != batch:
        raise ValueError(f"`max_new` has {limit.shape[0]} entries, `prompt_len` {batch}")
    check_int("mask_id", mask_id, minimum=0)
    if isinstance(window, torch.Tensor):
        check_tensor("window", window, _INT, (batch,))
        windows = window.to(device=device, dtype=torch.int32).clamp(min=0)
        widest = int(windows.max()) if batch else 0
    else:
        widest = check_int("window", window, minimum=0)
        windows = torch.full((batch,), widest, dtype=torch.int32, device=device)
    if slots is None:
        slots = 2 * widest
    elif check_int("slots", slots, minimum=0) < widest:
        raise ValueError(f"`slots` ({slots}) must hold the widest window ({widest})")
    if max_output is None:
        max_output = int(limit.max()) if batch else 0
    check_int("max_output", max_output, minimum=0)
    if stop_ids is None:
        stop_ids = torch.full((batch, 0), -1, dtype=torch.int64, device=device)
    else:
        check_tensor("stop_ids", stop_ids, torch.int64, (batch, None))
        stop_ids = stop_ids.to(device)
    return WindowState(
        win_tokens=torch.full((batch, slots), mask_id, dtype=torch.int64, device=device),
        win_mask=torch.ones((batch, slots), dtype=torch.bool, device=device),
        win_len=torch.minimum(windows, limit),
        ctx_len=prompt.clone(),
        out_tokens=torch.zeros((batch, max_output), dtype=torch.int64, device=device),
        out_len=torch.zeros(batch, dtype=torch.int32, device=device),
        finished=torch.zeros(batch, dtype=torch.bool, device=device),
        stop_ids=stop_ids,
        max_new=limit,
    )


def paged_slots(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flat cache slot of each position through its sequence's block table: position
    ``p`` of sequence ``b`` lives at slot ``block_table[b, p // page_size] * page_size +
    p % page_size`` (``rope_kv_append``'s ``slot_mapping``).

    Parameters
    ----------
    block_table : torch.Tensor
        ``[B, P]`` int32, cache pages of each sequence (negative: none).
    positions : torch.Tensor
        ``[B, S]`` int32 or int64, logical positions; row b belongs to sequence b.
    page_size : int
        Positions per cache page, ``> 0``.
    valid : torch.Tensor or None
        ``[B, S]`` bool, False for positions that get no slot (default: all valid).

    Returns
    -------
    torch.Tensor
        ``[B, S]`` int64 slots; -1 where ``valid`` is False, the position is negative, or
        its page lies past the table or is negative (``rope_kv_append`` writes nothing
        there).

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> block_table = torch.tensor([[3, 0], [1, -1]], dtype=torch.int32)
    >>> wk.paged_slots(block_table, torch.tensor([[0, 5], [2, 4]]), page_size=4).tolist()
    [[12, 1], [6, -1]]
    """
    dims = Dims()
    check_tensor("block_table", block_table, torch.int32, ("B", "P"), dims)
    check_tensor("positions", positions, _INT, ("B", "S"), dims)
    if valid is not None:
        check_tensor("valid", valid, torch.bool, ("B", "S"), dims)
    check_same_device(block_table=block_table, positions=positions, valid=valid)
    page_size = check_int("page_size", page_size, minimum=1)
    num_pages = block_table.shape[1]
    position = positions.long()
    page_index = position.div(page_size, rounding_mode="floor")
    covered = (position >= 0) & (page_index < num_pages)
    if num_pages == 0:
        return torch.full_like(position, -1)
    pages = block_table.gather(1, page_index.clamp(0, num_pages - 1)).long()
    covered = covered & (pages >= 0)
    if valid is not None:
        covered = covered & valid
    return torch.where(covered, pages * page_size + position % page_size, -1)


def prefill_slots(
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions and cache slots of packed prefill rows (whole prompts, or the chunks
    of a chunked prefill).

    Sequence b owns the packed rows ``query_start[b] .. query_start[b+1] - 1``; its i-th
    row is at position ``ctx_len[b] + i`` (``ctx_len``: tokens already in the cache, 0 for a
    whole prompt). Rows past ``query_start[B]`` (padding up to ``num_rows``) get position 0
    and slot -1.

    Parameters
    ----------
    query_start : torch.Tensor
        ``[B + 1]`` int32, non-decreasing packed-row offsets.
    ctx_len : torch.Tensor
        ``[B]`` int32, tokens already cached per sequence.
    block_table : torch.Tensor
        ``[B, P]`` int32, cache pages of each sequence (negative: none).
    page_size : int
        Positions per cache page, ``> 0``.
    num_rows : int
        N, the packed rows, at least ``query_start[B]`` (a Python int: no value is read on
        the host).

    Returns
    -------
    The two tensors are returned as a tuple ``(positions, slot_mapping)``:

    positions : torch.Tensor
        ``[N]`` int64, each row's position (the RoPE position and the cos/sin row).
    slot_mapping : torch.Tensor
        ``[N]`` int64, each row's cache slot (``rope_kv_append``'s), -1 on padding rows
        and where the page is missing.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> block_table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    >>> query_start = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> ctx_len = torch.tensor([0, 2], dtype=torch.int32)
    >>> positions, slots = wk.prefill_slots(query_start, ctx_len, block_table, page_size=2,
    ...                                     num_rows=6)
    >>> positions.tolist(), slots.tolist()
    ([0, 1, 2, 2, 3, 0], [0, 1, 2, -1, -1, -1])
    """
    dims = Dims()
    check_tensor("ctx_len", ctx_len, torch.int32, ("B",), dims)
    check_tensor("query_start", query_start, torch.int32, ("B+1",), dims)
    check_tensor("block_table", block_table, torch.int32, ("B", "P"), dims)
    check_same_device(query_start=query_start, ctx_len=ctx_len, block_table=block_table)
    check_int("page_size", page_size, minimum=1)
    check_int("num_rows", num_rows, minimum=0)
    batch = ctx_len.shape[0]
    device = query_start.device
    rows = torch.arange(num_rows, device=device)
    if batch == 0:
        return torch.zeros_like(rows), torch.full_like(rows, -1)
    starts = query_start.long()
    # the sequence of row r: the last b with query_start[b] <= r
    sequence = torch.searchsorted(starts[1:].contiguous(), rows, right=True)
    in_batch = (sequence < batch) & (rows >= starts[0])
    sequence = sequence.clamp(max=batch - 1)
    positions = torch.where(in_batch, ctx_len.long()[sequence] + rows - starts[sequence], 0)
    slots = paged_slots(block_table.index_select(0, sequence), positions[:, None], page_size,
                        in_batch[:, None])[:, 0]
    return positions, slots


def mask_rows(
    query_start: torch.Tensor,
    n_filled: torch.Tensor,
    positions: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a packed decode step that ``select_tokens`` reads: each sequence's mask
    rows, ``window`` per sequence.

    After :func:`reorder_window`, sequence b's packed rows are its filled slots, then its
    masks: rows ``query_start[b] + n_filled[b] .. query_start[b+1] - 1`` are masks, and a
    mask row predicts its own logical position (its RoPE position). This gathers them into
    ``window`` fixed rows per sequence (a shape that depends on no value), the unused ones
    padding with ``row_pos = -1``; a sequence with more mask rows than ``window`` has its
    first ``window`` predicted.

    (Computing logits for every packed row instead, with ``cu_rows = query_start`` and
    ``row_pos`` -1 on the filled rows, gives the same tokens: padding rows are never
    selected and take no part in a sequence's selection. It costs the LM head on the
    filled rows too.)

    Parameters
    ----------
    query_start : torch.Tensor
        ``[B + 1]`` int32, packed-row offsets (``reorder_window``'s).
    n_filled : torch.Tensor
        ``[B]`` int32, filled rows per sequence (``reorder_window``'s).
    positions : torch.Tensor
        ``[N]`` int32 or int64, logical position of each packed row (``reorder_window``'s).
    window : int
        W, mask rows kept per sequence (the decode window), ``> 0``.

    Returns
    -------
    The three tensors are returned as a tuple ``(rows, cu_rows, row_pos)``:

    rows : torch.Tensor
        ``[B * W]`` int64, the packed row of each kept row, in ``[0, N)`` (a padding row
        repeats a valid index): gather the hidden states for the LM head, ``hidden[rows]``.
    cu_rows : torch.Tensor
        ``[B + 1]`` int32, ``0, W, 2W, ...``.
    row_pos : torch.Tensor
        ``[B * W]`` int64, the position each row predicts, -1 on padding rows
        (``select_tokens``' and ``commit_window``'s ``row_pos``).

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> query_start = torch.tensor([0, 4, 6], dtype=torch.int32)  # 4 rows, then 2
    >>> n_filled = torch.tensor([1, 0], dtype=torch.int32)
    >>> positions = torch.tensor([10, 11, 12, 13, 7, 8])
    >>> rows, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, window=3)
    >>> rows.tolist(), cu_rows.tolist(), row_pos.tolist()
    ([1, 2, 3, 4, 5, 5], [0, 3, 6], [11, 12, 13, 7, 8, -1])
    """
    dims = Dims()
    check_tensor("n_filled", n_filled, torch.int32, ("B",), dims)
    check_tensor("query_start", query_start, torch.int32, ("B+1",), dims)
    check_tensor("positions", positions, _INT, ("N",), dims)
    check_same_device(query_start=query_start, n_filled=n_filled, positions=positions)
    window = check_int("window", window, minimum=1)
    batch, num_rows = n_filled.shape[0], positions.shape[0]
    device = query_start.device
    mask_row = ((query_start[:-1] + n_filled)[:, None].long()
                + torch.arange(window, device=device))  # [B, W]
    is_mask = (mask_row < query_start[1:, None]).reshape(-1)
    rows = mask_row.clamp(0, max(num_rows - 1, 0)).reshape(-1)
    if num_rows:
        row_pos = torch.where(is_mask, positions.long().index_select(0, rows), -1)
    else:
        row_pos = torch.full_like(rows, -1)
    cu_rows = torch.arange(0, batch * window + 1, window, dtype=torch.int32, device=device)
    return rows, cu_rows, row_pos
