"""Reference window ops: `reorder_window` and `commit_window`, one sequence at a time.

Literal restatements of docs/contracts.md ("reorder_window", "commit_window") with Python
loops over plain lists. Step numbers in the comments are the numbered rules of that page.
"""

import torch


def reorder_window(
    win_tokens: torch.Tensor,
    win_mask: torch.Tensor,
    win_len: torch.Tensor,
    ctx_len: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    num_rows: int,
) -> tuple[torch.Tensor, ...]:
    """Reordered window rows, packed: ``(input_ids, positions, slot_mapping, order,
    query_start, n_filled)``.

    Shapes and dtypes as the op: ``[num_rows]`` int64 (ids, positions, slots), ``[num_rows]``
    int32 (order), ``[B+1]`` int32 (query_start) and ``[B]`` int32 (n_filled).
    """
    batch, slots = win_tokens.shape
    pages = block_table.shape[1]
    tokens, masks = win_tokens.tolist(), win_mask.tolist()
    lengths, contexts, tables = win_len.tolist(), ctx_len.tolist(), block_table.tolist()

    # padding rows: id 0, position 0, no cache write, slot 0 of no window
    input_ids, positions = [0] * num_rows, [0] * num_rows
    slot_mapping, order = [-1] * num_rows, [0] * num_rows
    query_start, n_filled = [0], [0] * batch
    for b in range(batch):
        n = min(max(lengths[b], 0), slots)
        first = query_start[-1]
        query_start.append(min(first + n, num_rows))
        ctx = contexts[b]
        # stable partition of the live slots: filled ones first, then the masks
        filled = [s for s in range(n) if not masks[b][s]]
        masked = [s for s in range(n) if masks[b][s]]
        n_filled[b] = len(filled)
        for j, slot in enumerate(filled + masked):
            row = first + j
            if row >= num_rows:  # more live slots than rows: the rest is not fed
                break
            order[row] = slot
            input_ids[row] = tokens[b][slot]
            positions[row] = ctx + slot  # logical position (RoPE)
            physical = ctx + j  # the cache slot of the physical row
            page_index = physical // page_size
            if 0 <= page_index < pages and tables[b][page_index] >= 0:
                slot_mapping[row] = tables[b][page_index] * page_size + physical % page_size

    device = win_tokens.device
    return (
        torch.tensor(input_ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        torch.tensor(order, dtype=torch.int32, device=device),
        torch.tensor(query_start, dtype=torch.int32, device=device),
        torch.tensor(n_filled, dtype=torch.int32, device=device),
    )


def _effective_run(masks: list[bool], n: int, window: int, blockwise: bool,
                   room: int | None = None) -> int:
    """Rule 1: the leading run of filled live slots (block-wise: only a whole block counts),
    cut at ``room`` slots first when given (``commit_limit``)."""
    run = 0
    while run < n and not masks[run] and (room is None or run < room):
        run += 1
    if not blockwise:
        return run
    block = min(window, n)
    return block if run >= block else 0


def _commit(
    tokens: list[int], eff: int, out_row: list[int], out_len: int, limit: int, stops: set[int]
) -> tuple[int, int, bool]:
    """Rule 2: append up to ``eff`` leading tokens; returns ``(committed, out_len, finished)``."""
    committed = 0
    stopped = False
    for token in tokens[:eff]:
        if out_len + 1 > limit:  # this token would exceed the length limit
            break
        if 0 <= out_len < len(out_row):
            out_row[out_len] = token
        out_len += 1
        committed += 1
        if token in stops:  # a stop token is emitted and ends the run
            stopped = True
            break
    return committed, out_len, stopped or out_len >= limit


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
    """Commit, stop and length rules, shift, fill, early finish and refill, in place.
    ``commit_limit`` (``[B]`` or None): the most leading slots of the fed window a sequence
    commits in this call, rules 2 and 6 together; the refill of rule 7 counts the whole run.

    Mutates ``win_tokens, win_mask, win_len, ctx_len, out_tokens, out_len, finished``.
    """
    batch, slots = win_tokens.shape
    capacity = out_tokens.shape[1]
    rows = row_pos.shape[0]
    tokens, masks = win_tokens.tolist(), win_mask.tolist()
    lengths, contexts = win_len.tolist(), ctx_len.tolist()
    outputs, out_lengths, done = out_tokens.tolist(), out_len.tolist(), finished.tolist()
    offsets, positions = cu_rows.tolist(), row_pos.tolist()
    sampled, chosen = token.tolist(), selected.tolist()
    stop_lists, limits = stop_ids.tolist(), max_new.tolist()
    rooms = [None] * batch if commit_limit is None else [max(v, 0) for v in commit_limit.tolist()]

    for b in range(batch):
        if done[b] or lengths[b] <= 0:  # inactive: not touched at all
            continue
        limit = min(max(limits[b], 0), capacity)
        n = min(lengths[b], slots)
        stops = {s for s in stop_lists[b] if s >= 0}
        window_tokens, window_masks = tokens[b][:n], masks[b][:n]

        # 1. leading run (as fed to the forward), within the commit limit
        eff = _effective_run(window_masks, n, window, blockwise, rooms[b])
        # 2. commit it with the stop and length rules
        committed, out_lengths[b], is_finished = _commit(
            window_tokens, eff, outputs[b], out_lengths[b], limit, stops
        )
        contexts[b] += committed
        if is_finished:
            # 3. finished: no live slots remain
            done[b] = True
            new_len = 0
        else:
            # 4. shift left by the committed slots
            window_tokens = window_tokens[committed:]
            window_masks = window_masks[committed:]
            n -= committed
            # 5. fill: selected rows of this sequence land in their (shifted) mask slots
            for r in range(max(offsets[b], 0), min(offsets[b + 1], rows)):
                if not chosen[r] or positions[r] < 0:
                    continue
                s = positions[r] - contexts[b]
                if 0 <= s < n and window_masks[s]:
                    window_tokens[s] = sampled[r]
                    window_masks[s] = False
            # 6. early finish: commit the new leading run now if that finishes the sequence
            # (the run within what the commit limit leaves; the refill counts all of it)
            eff = _effective_run(window_masks, n, window, blockwise)
            room = None if rooms[b] is None else rooms[b] - committed
            early = _effective_run(window_masks, n, window, blockwise, room)
            has_stop = any(t in stops for t in window_tokens[:early])
            if has_stop or out_lengths[b] + early >= limit:
                committed, out_lengths[b], _ = _commit(
                    window_tokens, early, outputs[b], out_lengths[b], limit, stops
                )
                contexts[b] += committed
                done[b] = True
                new_len = 0
            else:
                # 7. refill: eff new masks, clamped to the max_new limit and the capacity
                new_len = min(n + eff, limit - out_lengths[b], slots)
        # 8. every slot >= win_len is a mask; slots < win_len keep the shifted, filled window
        for s in range(slots):
            if s < new_len and s < n:
                tokens[b][s], masks[b][s] = window_tokens[s], window_masks[s]
            else:
                tokens[b][s], masks[b][s] = mask_id, True
        lengths[b] = new_len

    win_tokens.copy_(torch.tensor(tokens, dtype=torch.int64).view(batch, slots))
    win_mask.copy_(torch.tensor(masks, dtype=torch.bool).view(batch, slots))
    win_len.copy_(torch.tensor(lengths, dtype=torch.int32))
    ctx_len.copy_(torch.tensor(contexts, dtype=torch.int32))
    out_tokens.copy_(torch.tensor(outputs, dtype=torch.int64).view(batch, capacity))
    out_len.copy_(torch.tensor(out_lengths, dtype=torch.int32))
    finished.copy_(torch.tensor(done, dtype=torch.bool))
