"""Padded <-> packed query layouts for the paged_attention tests.

paged_attention takes packed queries (the rows of all sequences back to back, with
cumulative offsets ``query_start``). Many tests are easiest to state per sequence as
``[B, S, Hq, D]`` with ``q_len`` live rows each (clamped to ``[0, S]``, so ``q_len`` may be
negative or exceed ``S``): :func:`padded` turns an implementation of the packed contract into
one of that padded form, packing the live rows (plus ``extra_rows`` padding rows at the end)
and unpacking the result with zeros in the rows that were not fed.
"""

import torch


def pack(q: torch.Tensor, q_len, extra_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, S, Hq, D]`` -> ``(packed [N, Hq, D], query_start [B+1] int32)``: the first
    ``clamp(q_len[b], 0, S)`` rows of each sequence, then ``extra_rows`` rows of garbage
    (padding). The packed tensor has q's dtype and device (and stride 1 in its last
    dimension)."""
    batch, rows = q.shape[:2]
    live = [min(max(int(n), 0), rows) for n in torch.as_tensor(q_len).tolist()]
    parts = [q[b, :live[b]] for b in range(batch)]
    if extra_rows:
        parts.append(torch.full((extra_rows, *q.shape[2:]), 1234.5, dtype=q.dtype,
                                device=q.device))
    packed = torch.cat(parts) if parts else q.new_empty((0, *q.shape[2:]))
    starts = [0]
    for n in live:
        starts.append(starts[-1] + n)
    return packed, torch.tensor(starts, dtype=torch.int32, device=q.device)


def unpack(out: torch.Tensor, query_start: torch.Tensor, rows: int) -> torch.Tensor:
    """``out [N, Hq, D]`` -> ``[B, S, Hq, D]`` with zeros in the rows no sequence fed."""
    starts = query_start.tolist()
    padded = out.new_zeros((len(starts) - 1, rows, *out.shape[1:]))
    for b in range(len(starts) - 1):
        padded[b, : starts[b + 1] - starts[b]] = out[starts[b]: starts[b + 1]]
    return padded


def padded(attention, extra_rows: int = 0):
    """``attention(q, k_cache, v_cache, block_table, query_start, ctx_len, scale, **options)``
    as ``f(q [B, S, Hq, D], k_cache, v_cache, block_table, ctx_len, q_len, scale,
    **options) -> [B, S, Hq, D]``."""

    def call(q, k_cache, v_cache, block_table, ctx_len, q_len, scale, **options):
        packed, query_start = pack(q, q_len, extra_rows)
        out = attention(packed, k_cache, v_cache, block_table, query_start.to(ctx_len.device),
                        ctx_len, scale, **options)
        return unpack(out, query_start, q.shape[1])

    return call


def uneven_packed_case(generator: torch.Generator, device: str = "cpu",
                       dtype: torch.dtype = torch.float32):
    """Packed arguments of sequences of 0, 70, 1 and 5 rows (one longer than any decode
    window, one empty) after 4, 0, 9 and 33 committed positions, back to back, then 3
    padding rows; scattered pages of 8, 2 KV heads, GQA 2, head_dim 16."""
    lengths, ctx = [0, 70, 1, 5], [4, 0, 9, 33]
    page_size, kv_heads, group, head_dim = 8, 2, 2, 16
    pages = [-(-(c + n) // page_size) for c, n in zip(ctx, lengths)]
    width = max(pages)
    ids = torch.randperm(sum(pages), generator=generator).tolist()
    table, taken = [], 0
    for n in pages:
        table.append(ids[taken: taken + n] + [-1] * (width - n))
        taken += n
    caches = [torch.randn(sum(pages), page_size, kv_heads, head_dim, generator=generator)
              .to(dtype).to(device) for _ in range(2)]
    q = torch.randn(sum(lengths) + 3, kv_heads * group, head_dim, generator=generator)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return (q.to(dtype).to(device), *caches, int32(table), int32(starts), int32(ctx),
            head_dim**-0.5)
