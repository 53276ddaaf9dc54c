"""Reference paged attention (docs/contracts.md, "paged_attention").

Queries are packed: the rows of sequence ``b`` are ``q[query_start[b] : query_start[b+1]]``;
its ``j``-th row sits at position ``ctx_len[b] + j`` and attends to key positions
``0 .. ctx_len[b] + j`` (inclusive; the bottom-right aligned causal mask). Position ``t`` lives
in the cache at page ``block_table[b, t // page_size]``, offset ``t % page_size``. Query head
``h`` reads KV head ``h // (Hq // Hkv)``. The softmax of ``scale * q.k`` is taken in float64.
"""

import math

import torch


def _read_position(cache: torch.Tensor, block_table_row: torch.Tensor, pos: int):
    """The ``[Hkv, D]`` float64 entry of position ``pos``, or ``None`` if it is not covered."""
    num_pages, page_size = cache.shape[0], cache.shape[1]
    page_index = pos // page_size
    if page_index >= block_table_row.shape[0]:
        return None
    page = int(block_table_row[page_index])
    if not 0 <= page < num_pages:
        return None
    return cache[page, pos % page_size].to(torch.float64)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float64 ``[N, Hq, D]``: the attention of every sequence's rows; zeros for rows outside
    every sequence; NaN rows where a needed position is not covered by ``block_table`` or no
    position is visible at all (``ctx_len + j < 0``)."""
    num_rows, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.zeros(num_rows, q_heads, head_dim, dtype=torch.float64)
    for b in range(block_table.shape[0]):
        first, end = int(query_start[b]), min(int(query_start[b + 1]), num_rows)
        ctx = int(ctx_len[b])
        # the sequence's keys and values in position order, read through its page table
        keys, values = [], []
        for pos in range(max(ctx + end - first, 0)):
            keys.append(_read_position(k_cache, block_table[b], pos))
            values.append(_read_position(v_cache, block_table[b], pos))
        for j, row in enumerate(range(first, end)):
            visible = range(ctx + j + 1)  # key positions 0 .. ctx_len + j
            if len(visible) == 0 or any(keys[pos] is None for pos in visible):
                out[row] = math.nan
                continue
            row_keys = torch.stack([keys[pos] for pos in visible])  # [n, Hkv, D]
            row_values = torch.stack([values[pos] for pos in visible])
            for h in range(q_heads):
                kv_head = h // group
                scores = row_keys[:, kv_head] @ q[row, h].to(torch.float64) * scale
                weights = torch.softmax(scores, dim=0)
                out[row, h] = weights @ row_values[:, kv_head]
    return out
