"""Causal (bottom-right aligned) attention of window rows over a paged KV cache, with GQA.

Row ``j`` of sequence ``b`` is the query at cache position ``ctx_len[b] + j`` and attends to
key positions ``0 .. ctx_len[b] + j``: the committed prefix plus the window rows up to and
including itself. That is the causal mask of varlen attention with ``q_len`` queries and
``ctx_len + q_len`` keys, aligned at the bottom right. Query head ``h`` reads KV head
``h // (Hq // Hkv)``. Exact semantics: docs/contracts.md, "paged_attention".
"""

import math

import torch

from .. import _validate
from .._validate import (
    FLOAT_DTYPES,
    Dims,
    check_float,
    check_same_device,
    check_tensor,
    debug_check,
)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    r"""Attention of ``q_len[b]`` query rows per sequence over its paged K/V, causal
    (bottom-right aligned), grouped-query.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, S, Hq, D]`` float32, float16 or bfloat16, stride 1 in the last dimension (other
        strides arbitrary). Row ``j`` of sequence ``b`` sits at position ``ctx_len[b] + j``.
    k_cache : torch.Tensor
        ``[num_pages, page_size, Hkv, D]``, q's dtype, contiguous ("NHD" paged layout).
        ``Hq`` must be a multiple of ``Hkv``. Not modified.
    v_cache : torch.Tensor
        Like ``k_cache``. Not modified.
    block_table : torch.Tensor
        ``[B, P]`` int32: position ``t`` of sequence ``b`` lives at page
        ``block_table[b, t // page_size]``, offset ``t % page_size``. Must cover positions
        ``< ctx_len[b] + q_len[b]``; a needed position that is not covered (page index
        ``>= P``, page id negative or ``>= num_pages``) makes that row NaN (loud).
    ctx_len : torch.Tensor
        ``[B]`` int32: committed tokens in the cache before the window.
    q_len : torch.Tensor
        ``[B]`` int32: live query rows (clamped to ``[0, S]``); rows ``j >= q_len[b]`` are zero.
    scale : float
        Finite softmax scale, usually ``D ** -0.5``.

    Returns
    -------
    out : torch.Tensor
        ``[B, S, Hq, D]`` in q's dtype, contiguous: ``softmax(scale * q.k) @ v`` over key
        positions ``0 .. ctx_len[b] + j`` (scores and softmax in float32). Cache positions
        outside that range are never read, whatever they hold.

    Example
    -------
    >>> import torch, wedlm_kernels as wk
    >>> q = torch.randn(2, 4, 8, 64)                    # B=2, S=4, Hq=8, D=64
    >>> k_cache = torch.randn(6, 16, 2, 64)             # 6 pages of 16, Hkv=2
    >>> v_cache = torch.randn(6, 16, 2, 64)
    >>> block_table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    >>> ctx_len = torch.tensor([20, 0], dtype=torch.int32)
    >>> q_len = torch.tensor([4, 3], dtype=torch.int32)
    >>> out = wk.paged_attention(q, k_cache, v_cache, block_table, ctx_len, q_len, 64**-0.5)
    >>> out.shape, bool((out[1, 3] == 0).all())
    (torch.Size([2, 4, 8, 64]), True)
    """
    dims = Dims()
    check_tensor("q", q, FLOAT_DTYPES, ("B", "S", "Hq", "D"), dims, unit_last_stride=True)
    cache_shape = ("num_pages", "page_size", "Hkv", "D")
    check_tensor("k_cache", k_cache, q.dtype, cache_shape, dims, contiguous=True)
    check_tensor("v_cache", v_cache, q.dtype, cache_shape, dims, contiguous=True)
    if dims["num_pages"] < 1 or dims["page_size"] < 1 or dims["Hkv"] < 1:
        raise ValueError(
            f"`k_cache` must have at least one page, slot and KV head, got shape "
            f"{list(k_cache.shape)}"
        )
    if dims["Hq"] % dims["Hkv"] != 0:
        raise ValueError(
            f"`q` has {dims['Hq']} heads, not a multiple of the {dims['Hkv']} KV heads of "
            f"`k_cache`"
        )
    check_tensor("block_table", block_table, torch.int32, ("B", "P"), dims)
    check_tensor("ctx_len", ctx_len, torch.int32, ("B",), dims)
    check_tensor("q_len", q_len, torch.int32, ("B",), dims)
    check_float("scale", scale)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, ctx_len=ctx_len,
        q_len=q_len,
    )
    if _validate.DEBUG:
        _debug_check_values(block_table, ctx_len, q_len, dims["S"], k_cache)
    return torch.ops.wedlm.paged_attention(
        q, k_cache, v_cache, block_table, ctx_len, q_len, float(scale)
    )


def _debug_check_values(
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    rows: int,
    k_cache: torch.Tensor,
) -> None:
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    debug_check(ctx_len >= 0, "`ctx_len` must be >= 0")
    debug_check((q_len >= 0) & (q_len <= rows), f"`q_len` must lie in [0, {rows}]")
    needed_pages = (ctx_len.long() + q_len.long() + page_size - 1) // page_size
    debug_check(
        needed_pages <= block_table.shape[1],
        "`block_table` must have a page for every position < ctx_len + q_len",
    )
    page_index = torch.arange(block_table.shape[1], device=block_table.device)
    needed = page_index[None, :] < needed_pages[:, None]
    in_range = (block_table >= 0) & (block_table < num_pages)
    debug_check(
        in_range | ~needed,
        f"`block_table` must hold page ids in [0, {num_pages}) for the positions in use",
    )


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Vectorised PyTorch implementation of :func:`paged_attention`.

    Gathers all ``P * page_size`` positions the page table can address (a static shape),
    masks the invisible ones per row, and runs a float32 softmax. Memory is
    ``B * Hq * S * P * page_size`` scores: meant for the CPU and for checking.
    """
    batch, rows, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    capacity = block_table.shape[1] * page_size
    device = q.device

    # The cache entries of positions 0 .. capacity-1 of every sequence; page ids out of
    # range are clamped for the gather and the positions marked as not covered.
    key_pos = torch.arange(capacity, device=device)
    page_ids = block_table.long()[:, key_pos // page_size]  # [B, K]
    covered = (page_ids >= 0) & (page_ids < num_pages)
    slots = (page_ids.clamp(0, num_pages - 1) * page_size + key_pos % page_size).reshape(-1)
    keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    values = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    keys = keys.view(batch, capacity, kv_heads, head_dim).float()
    values = values.view(batch, capacity, kv_heads, head_dim).float()

    # Row j sees positions 0 .. ctx_len + j (bottom-right aligned causal mask).
    row = torch.arange(rows, device=device)
    last_visible = ctx_len.long()[:, None] + row[None, :]  # [B, S]
    visible = key_pos[None, None, :] <= last_visible[:, :, None]  # [B, S, K]
    row_live = row[None, :] < q_len.long().clamp(0, rows)[:, None]
    row_loud = (
        (visible & ~covered[:, None, :]).any(dim=-1)
        | (last_visible >= capacity)
        | (last_visible < 0)
    )

    # Scores [B, Hkv, G, S, K]: query head h = n * G + g reads KV head n.
    query = q.float().reshape(batch, rows, kv_heads, group, head_dim)
    scores = torch.einsum("bsngd,bknd->bngsk", query, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    weights = torch.softmax(scores, dim=-1)

    # Invisible positions get weight 0, but 0 * NaN = NaN: non-finite values are summed as
    # 0 and the output element is set to NaN only where a visible position holds one.
    finite = torch.isfinite(values)
    out = torch.einsum("bngsk,bknd->bsngd", weights, torch.where(finite, values, 0.0))
    poisoned = torch.einsum("bsk,bknd->bsnd", visible.float(), (~finite).float()) > 0
    out = torch.where(poisoned[:, :, :, None, :], math.nan, out)
    out = out.reshape(batch, rows, q_heads, head_dim)
    out = torch.where(row_loud[:, :, None, None], math.nan, out)
    out = torch.where(row_live[:, :, None, None], out, 0.0)
    return out.to(q.dtype).contiguous()


def paged_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)
