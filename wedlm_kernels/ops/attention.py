"""Causal (bottom-right aligned) attention of packed query rows over a paged KV cache, GQA.

Queries are packed, as inference engines lay them out: the rows of sequence ``b`` are
``q[query_start[b] : query_start[b+1]]`` (``query_start`` holds cumulative row counts,
vLLM's ``query_start_loc``, flash-attn's ``cu_seqlens_q``). Row ``j`` of sequence ``b`` is the
query at cache position ``ctx_len[b] + j`` and attends to key positions
``0 .. ctx_len[b] + j``: the committed prefix plus the window rows up to and including
itself, the causal mask of varlen attention with ``q_len`` queries and ``ctx_len + q_len``
keys aligned at the bottom right. Query head ``h`` reads KV head ``h // (Hq // Hkv)``.
Exact semantics: docs/contracts.md, "paged_attention".
"""

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from . import _dispatch
from ._triton import POINTER_TYPES, CachedLaunch, KernelVariant, next_power_of_2
from ._validate import (
    FLOAT_DTYPES,
    CheckedSignatures,
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
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    r"""Attention of each sequence's packed query rows over its paged K/V, causal
    (bottom-right aligned), grouped-query.

    Parameters
    ----------
    q : torch.Tensor
        ``[N, Hq, D]`` float32, float16 or bfloat16, stride 1 in the last dimension (other
        strides arbitrary, e.g. a view of a fused qkv projection). Rows
        ``query_start[b] .. query_start[b+1] - 1`` belong to sequence ``b``; row
        ``query_start[b] + j`` sits at position ``ctx_len[b] + j``. Rows at or after
        ``query_start[B]`` are padding.
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
        ``P * page_size + N`` must not exceed ``2^31 - 2^16`` (positions are int32).
    query_start : torch.Tensor
        ``[B+1]`` int32: ``query_start[0] = 0``, non-decreasing, ``query_start[B] <= N``
        (checked with ``WEDLM_KERNELS_DEBUG=1``). ``q_len[b] = query_start[b+1] -
        query_start[b]``.
    ctx_len : torch.Tensor
        ``[B]`` int32: committed tokens in the cache before the sequence's rows.
    scale : float
        Finite softmax scale, usually ``D ** -0.5``.

    Returns
    -------
    out : torch.Tensor
        ``[N, Hq, D]`` in q's dtype, contiguous: ``softmax(scale * q.k) @ v`` over key
        positions ``0 .. ctx_len[b] + j`` (scores and softmax in float32); zeros on padding
        rows. Cache positions outside a row's range are never read, whatever they hold.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> q = torch.randn(7, 8, 64)                       # 4 + 3 rows, Hq=8, D=64
    >>> k_cache = torch.randn(6, 16, 2, 64)             # 6 pages of 16, Hkv=2
    >>> v_cache = torch.randn(6, 16, 2, 64)
    >>> block_table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    >>> query_start = torch.tensor([0, 4, 7], dtype=torch.int32)
    >>> ctx_len = torch.tensor([20, 0], dtype=torch.int32)
    >>> out = wk.paged_attention(q, k_cache, v_cache, block_table, query_start, ctx_len,
    ...                          64**-0.5)
    >>> out.shape
    torch.Size([7, 8, 64])
    """
    _CHECKED.check(_check_arguments, (q, k_cache, v_cache, block_table, query_start, ctx_len),
                   scale)
    if _backend.DEBUG:
        _debug_check_values(block_table, query_start, ctx_len, q.shape[0], k_cache)
    return _dispatch.call(
        "paged_attention", q, k_cache, v_cache, block_table, query_start, ctx_len, float(scale)
    )


# The argument signatures (dtypes, shapes, strides, devices, scale) that passed the checks:
# a decode loop's calls are checked once per shape.
_CHECKED = CheckedSignatures()


def _check_arguments(q, k_cache, v_cache, block_table, query_start, ctx_len, scale) -> None:
    dims = Dims()
    check_tensor("q", q, FLOAT_DTYPES, ("N", "Hq", "D"), dims, unit_last_stride=True)
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
    if dims["P"] * dims["page_size"] + dims["N"] > MAX_POSITIONS:
        raise ValueError(
            f"`block_table` addresses {dims['P']} x {dims['page_size']} positions: with "
            f"{dims['N']} query rows, at most {MAX_POSITIONS} (positions are int32)"
        )
    check_tensor("query_start", query_start, torch.int32, ("B+1",), dims)
    check_tensor("ctx_len", ctx_len, torch.int32, ("B",), dims)
    check_float("scale", scale)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        query_start=query_start, ctx_len=ctx_len,
    )


def _debug_check_values(
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    num_rows: int,
    k_cache: torch.Tensor,
) -> None:
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    debug_check(query_start[0] == 0, "`query_start[0]` must be 0")
    debug_check(query_start[1:] >= query_start[:-1], "`query_start` must be non-decreasing")
    debug_check(query_start[-1] <= num_rows, f"`query_start[B]` must be <= N = {num_rows}")
    debug_check(ctx_len >= 0, "`ctx_len` must be >= 0")
    q_len = (query_start[1:] - query_start[:-1]).long()
    needed_pages = (ctx_len.long() + q_len + page_size - 1) // page_size
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
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """PyTorch implementation of :func:`paged_attention`.

    CPU tensors take :func:`paged_attention_torch_per_sequence` (one gather of each
    sequence's visible keys, memory O(rows x visible keys) per head), other devices
    :func:`paged_attention_torch_gathered` (static shapes, no host read, graph-safe). Both
    compute the same float32 scores and softmax; the results agree to float32 rounding.
    """
    if q.device.type == "cpu":
        return paged_attention_torch_per_sequence(q, k_cache, v_cache, block_table,
                                                  query_start, ctx_len, scale)
    return paged_attention_torch_gathered(q, k_cache, v_cache, block_table, query_start,
                                          ctx_len, scale)


def _row_sequences(num_rows: int, batch: int, query_start: torch.Tensor,
                   ctx_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sequence, row_live, last_visible)`` per row: its sequence (clamped into [0, B)),
    whether it belongs to one (the last b with query_start[b] <= row; rows before
    query_start[0] or at or after query_start[B] are padding) and the last position it
    sees (0 .. last_visible)."""
    row = torch.arange(num_rows, device=query_start.device)
    starts = query_start.long()
    sequence = torch.searchsorted(starts, row, right=True) - 1
    row_live = (sequence >= 0) & (sequence < batch)
    sequence = sequence.clamp(0, batch - 1)
    last_visible = ctx_len.long()[sequence] + row - starts[sequence]
    return sequence, row_live, last_visible


def _page_slots(page_table: torch.Tensor, key_pos: torch.Tensor, page_size: int,
                num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(covered, slots)`` of key positions ``key_pos`` through ``page_table`` (one
    sequence's ``[P]`` row or the whole ``[B, P]`` table): whether each position's page id
    is a page of the cache, and its flat cache slot (out-of-range ids clamped, so that the
    gather stays in bounds; such positions are marked not covered)."""
    page_ids = page_table.long()[..., key_pos // page_size]
    covered = (page_ids >= 0) & (page_ids < num_pages)
    slots = page_ids.clamp(0, num_pages - 1) * page_size + key_pos % page_size
    return covered, slots


def _loud_rows(visible: torch.Tensor, covered: torch.Tensor, last_visible: torch.Tensor,
               capacity: int) -> torch.Tensor:
    """Rows whose output is NaN by the contract: one sees a position without a page, or
    past the page table, or no position at all."""
    return ((visible & ~covered).any(dim=-1) | (last_visible >= capacity)
            | (last_visible < 0))


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 attention of rows ``query [n, Hkv, G, D]`` over ``keys``/``values``
    (``[n, K, Hkv, D]`` per row, or ``[K, Hkv, D]`` shared by the rows) at the positions
    ``visible [n, K]``; returns ``[n, Hkv, G, D]``. Invisible positions get weight 0, but
    0 * NaN = NaN: non-finite values are summed as 0 and the output element is NaN only
    where a visible position holds one."""
    shared = keys.dim() == 3
    scores = torch.einsum("nhgd,khd->nhgk" if shared else "nhgd,nkhd->nhgk", query, keys)
    scores = (scores * scale).masked_fill(~visible[:, None, None], -math.inf)
    weights = torch.softmax(scores, dim=-1)
    finite = torch.isfinite(values)
    out = torch.einsum("nhgk,khd->nhgd" if shared else "nhgk,nkhd->nhgd", weights,
                       torch.where(finite, values, 0.0))
    poisoned = torch.einsum("nk,khd->nhd" if shared else "nk,nkhd->nhd", visible.float(),
                            (~finite).float()) > 0
    return torch.where(poisoned[:, :, None, :], math.nan, out)


def paged_attention_torch_per_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention` for CPU tensors: a loop over the sequences that gathers each
    one's visible keys once (positions ``0 .. max last_visible`` of its rows, within the
    page table) and attends its rows to them. Memory is O(rows x visible keys) per KV
    head; no row gets a copy of the cache. The loop reads sequence boundaries on the host,
    which costs nothing on the CPU (the CUDA path is :func:`paged_attention_torch_gathered`)."""
    num_rows, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    batch, width = block_table.shape
    group = q_heads // kv_heads
    capacity = width * page_size
    out = torch.zeros(num_rows, kv_heads, group, head_dim, dtype=torch.float32)
    if num_rows == 0 or batch == 0:
        return out.reshape(q.shape).to(q.dtype)
    sequence, row_live, last_visible = _row_sequences(num_rows, batch, query_start, ctx_len)
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    query = q.reshape(num_rows, kv_heads, group, head_dim)
    live_sequences = torch.unique(sequence[row_live]).tolist()
    for b in live_sequences:
        rows = torch.nonzero(row_live & (sequence == b)).flatten()
        last = last_visible[rows]  # [n]
        # every row seeing a position past the table, or none, is NaN (loud) below
        length = int(last.max().clamp(-1, capacity - 1)) + 1
        key_pos = torch.arange(length)
        covered, slots = _page_slots(block_table[b], key_pos, page_size, num_pages)
        visible = key_pos[None, :] <= last[:, None]  # [n, length]
        rows_out = _attend(query[rows].float(), k_flat[slots].float(), v_flat[slots].float(),
                           visible, scale)
        loud = _loud_rows(visible, covered[None, :], last, capacity)
        out[rows] = torch.where(loud[:, None, None, None], math.nan, rows_out)
    return out.reshape(q.shape).to(q.dtype)


def paged_attention_torch_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention` in static shapes (no host read: graph-safe on any device).

    Gathers, for every row, all ``P * page_size`` positions its sequence's page table can
    address, masks the invisible ones and runs a float32 softmax. Memory is
    ``N * P * page_size * Hkv * D`` values: meant for small shapes and for checking.
    """
    num_rows, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    batch, width = block_table.shape
    group = q_heads // kv_heads
    capacity = width * page_size
    device = q.device
    if num_rows == 0 or batch == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=device)

    sequence, row_live, last_visible = _row_sequences(num_rows, batch, query_start, ctx_len)

    # The cache entries of positions 0 .. capacity-1 of every sequence; page ids out of
    # range are clamped for the gather and the positions marked as not covered.
    key_pos = torch.arange(capacity, device=device)
    covered, slots = _page_slots(block_table, key_pos, page_size, num_pages)  # [B, K]
    keys = k_cache.view(-1, kv_heads, head_dim)[slots][sequence].float()  # [N, K, Hkv, D]
    values = v_cache.view(-1, kv_heads, head_dim)[slots][sequence].float()
    visible = key_pos[None, :] <= last_visible[:, None]  # [N, K]
    row_loud = _loud_rows(visible, covered[sequence], last_visible, capacity)

    # Scores [N, Hkv, G, K]: query head h = n * G + g reads KV head n.
    query = q.float().reshape(num_rows, kv_heads, group, head_dim)
    out = _attend(query, keys, values, visible, scale).reshape(num_rows, q_heads, head_dim)
    out = torch.where(row_loud[:, None, None], math.nan, out)
    out = torch.where(row_live[:, None, None], out, 0.0)
    return out.to(q.dtype).contiguous()


def paged_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------- Triton kernel
#
# The math: FlashAttention-2's online softmax, in base 2. For one query row with scores
# s_t = scale * q.k_t over its visible keys t = 0 .. ctx + j,
#     out = sum_t exp(s_t - m) v_t / sum_t exp(s_t - m),   m = max_t s_t.
# With x_t = s_t * log2(e) (scale and log2(e) folded into one multiplier, exp(s) = 2^x), keys
# are visited in tiles of BLOCK_N keeping a running maximum m, denominator l and numerator
# acc, all fp32:
#     m' = max(m, max_t x_t),   alpha = 2^(m - m'),
#     l <- alpha * l + sum_t 2^(x_t - m'),   acc <- alpha * acc + sum_t 2^(x_t - m') v_t,
# and out = acc / l after the last tile.
#
# GQA: the rows of a tile (the M dimension of both products) are (query row, query head)
# pairs of ONE sequence and ONE KV head, flattened as pair = j * G + g for query head
# kv_head * G + g (G = Hq / Hkv), so every K/V tile is loaded once for all G query heads.
#
# Programs over packed rows: sequence b needs cdiv(q_len_b * G, BLOCK_M) tiles. Its tiles
# get the program ids from first_tile(b) = (query_start[b] * G) // BLOCK_M + b on, which
# leaves room for them (first_tile(b+1) - first_tile(b) >= floor(q_len_b G / BLOCK_M) + 1);
# a program finds its sequence by counting the b with first_tile(b) <= its id, and one past
# the last tile of its sequence writes nothing. The padding rows query_start[B] .. N-1 form a last
# pseudo-sequence whose programs write zeros, so the grid has (N G) // BLOCK_M + B + 1
# programs per KV head: fixed by the shapes, as a CUDA graph needs. With heaviest_first the
# ids are taken in reverse (id -> programs - 1 - id): a GPU starts lower ids first, and a
# sequence's last tiles see the most keys, so the longest programs start first and the
# short ones fill the tail (prefill under the causal mask).
#
# Causal mask: row j sees keys 0 .. ctx + j. Keys below ctx + first_row + 1 are visible to
# every row of the tile (the "full" loop, no mask); the remaining keys up to
# ctx + last_live_row are masked per row (the "diagonal" loop). Keys past that are not read.
#
# Split-KV ("flash-decoding"): when there are few query tiles (decode windows) each
# sequence's keys are cut into num_splits chunks, one program each. num_splits is fixed by
# the launcher from shapes (an upper bound, so a call can be captured in a CUDA graph); the
# chunk size is computed on the device from the sequence's own key count,
#     keys_per_split = max(ceil(ceil(K / num_splits) / BLOCK_N), 1) * BLOCK_N,
#     K = clamp(ctx + q_len, 0, capacity) (the keys of the sequence's last row),
# so the keys are spread over the splits whatever the page table's capacity, and a split
# that starts past a tile's last key exits without reading or writing anything. A program
# stores its normalised partial output o_s = acc_s / l_s and lse_s = m_s + log2(l_s); the
# merge combines, per row, the splits that hold keys of that row:
#     out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s.
# The merge (_merge_program) runs in a second launch, the combine kernel, or, with
# MERGE_IN_KERNEL, in the attention launch itself: every split program of a query tile
# (those without keys and the padding tiles' too) takes a ticket of its (tile, KV head), an
# atomic count zeroed before the launch, after its partials are stored; the program that
# draws the last ticket (num_splits - 1) has seen every other program's stores (the atomic
# is acquire-release, after a barrier of the program's threads) and merges the tile.
#
# Contract details (docs/contracts.md, "paged_attention"):
# - position t lives at page block_table[b, t // page_size], offset t % page_size. When
#   pages hold a multiple of BLOCK_N positions a key tile lies in one page and its page id
#   is loaded once; otherwise it is gathered per key, so any page size works. PAGE_SIZE and
#   GROUP are compile-time constants (an engine runs one of each): the divisions by them,
#   per key tile and per row, compile to shifts or multiplications. A
#   key whose page index is >= P or whose page id is outside [0, num_pages) is "not
#   covered": it is not loaded, and a row that needs it is NaN.
# - cache entries a row does not see are never read into its result: in the diagonal loop
#   their scores are -inf (probability exactly 0), and since 0 * NaN = NaN, non-finite
#   values are zeroed for the P @ V product and put back as NaN only into the output
#   elements of the rows that see them (row j sees a non-finite value in column d iff the
#   first key holding one there is <= ctx + j). In the full loop every loaded key is
#   visible to every row; a non-finite V value there leaves its column of acc non-finite,
#   and every non-finite element of acc becomes NaN after the loops.
# - padding rows are zero; a row with ctx + j < 0 (no visible key) or
#   ctx + j >= P * page_size (a needed position beyond the page table) is NaN.
# - positions are int32: the public function requires P * page_size + N <= 2^31 - 2^16, so
#   ctx + q_len and every split end (at most 64 splits of 64 keys past the keys) fit; every
#   address is computed in int64.

_LOG2_E = 1.4426950408889634

# Triton turns an integer argument equal to 1 into a compile-time constant. These arguments
# (sizes and strides that are 1 in some calls: one KV head, one sequence, a single split,
# ...) are kept as plain i32 so that each dtype, tile configuration, page size and group is
# ONE compiled specialisation. head_dim stays specialised (its divisibility by 16 lets K/V rows
# load as 16-byte vectors); the launcher hands head sizes below 2 to the PyTorch
# implementation, so it is never 1.
ATTENTION_UNSPECIALISED = (
    "q_row_stride", "q_head_stride", "table_batch_stride", "table_page_stride",
    "query_start_stride", "ctx_len_stride", "num_rows", "num_sequences", "kv_heads",
    "table_width", "num_pages", "num_splits", "heaviest_first",
)
COMBINE_UNSPECIALISED = (
    "query_start_stride", "ctx_len_stride", "num_rows", "num_sequences", "kv_heads", "group",
    "page_size", "table_width", "num_splits",
)


@triton.jit
def _program_sequence(
    query_start_ptr, query_start_stride, num_rows, num_sequences, group, heaviest_first,
    BLOCK_M: tl.constexpr, BLOCK_BATCH: tl.constexpr,
):
    """``(sequence, tile, first_row, q_len)`` of this program (axis 0; with
    ``heaviest_first`` the ids are taken in reverse, so that a sequence's last tiles, which
    see the most keys, start first): the last b in
    [0, B] with first_tile(b) = (query_start[b] * G) // BLOCK_M + b <= program id; b = B is
    the padding rows' pseudo-sequence (rows query_start[B] .. N-1). first_tile is
    increasing, so b + 1 is the number of sequences whose first tile is <= the program id:
    counted BLOCK_BATCH sequences at a time (independent loads, no dependent chain as in a
    binary search)."""
    program = tl.program_id(0)
    program = tl.where(heaviest_first != 0, tl.num_programs(0) - 1 - program, program)
    count = tl.zeros([], dtype=tl.int32)
    for chunk in range(0, num_sequences + 1, BLOCK_BATCH):
        b = chunk + tl.arange(0, BLOCK_BATCH)
        in_batch = b <= num_sequences
        start = tl.load(query_start_ptr + b.to(tl.int64) * query_start_stride, mask=in_batch,
                        other=0)
        first_tile = (start.to(tl.int64) * group) // BLOCK_M + b
        count += tl.sum((in_batch & (first_tile <= program)).to(tl.int32), axis=0)
    sequence = count - 1  # -1 only when query_start[0] > 0 (invalid input): nothing to do
    safe = tl.maximum(sequence, 0).to(tl.int64)
    first_row = tl.minimum(tl.maximum(tl.load(query_start_ptr + safe * query_start_stride), 0),
                           num_rows)
    next_start = tl.load(query_start_ptr + tl.minimum(safe + 1, num_sequences)
                         * query_start_stride)
    end_row = tl.where(sequence < num_sequences, next_start, num_rows)
    q_len = tl.where(sequence >= 0, tl.minimum(tl.maximum(end_row, first_row), num_rows)
                     - first_row, 0)
    tile = program - ((first_row * group) // BLOCK_M + sequence)
    return sequence, tile, first_row, q_len


@triton.jit
def _merge_program(
    partial_out_ptr, partial_lse_ptr, query_start_ptr, ctx_len_ptr, out_ptr,
    query_start_stride, ctx_len_stride, num_rows, num_sequences, kv_heads, group, head_dim,
    page_size, table_width, num_splits, heaviest_first,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_BATCH: tl.constexpr,
):
    """Merge the split partials of this program's query tile (axis 0, ``BLOCK_M`` pairs)
    and KV head (axis 1), its sequence and context found as the attention kernel finds
    them, into ``out``: padding rows zero, rows without a visible key or past the page table
    NaN. Partials are read past the L1 cache (``.cg``): other programs of the launch may
    have written them."""
    sequence, tile, first_row_of_sequence, live = _program_sequence(
        query_start_ptr, query_start_stride, num_rows, num_sequences, group, heaviest_first,
        BLOCK_M, BLOCK_BATCH)
    kv_head = tl.program_id(1)
    is_sequence = (sequence >= 0) & (sequence < num_sequences)
    batch = tl.where(is_sequence, sequence, 0).to(tl.int64)
    capacity = table_width * page_size
    ctx = tl.load(ctx_len_ptr + batch * ctx_len_stride, mask=is_sequence, other=0)
    ctx = tl.minimum(tl.maximum(ctx, -live - 1), capacity)
    pair = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = pair // group
    q_head = kv_head * group + pair % group
    row_live = (pair < live * group) & (tile >= 0) & (sequence >= 0)
    packed_row = (first_row_of_sequence + row).to(tl.int64)
    last_key = ctx + row
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim

    # the chunking of the attention kernel: row j's keys 0 .. ctx + j lie in its first
    # cdiv(ctx + j + 1, keys_per_split) splits, which are the ones written for it
    sequence_keys = tl.minimum(tl.maximum(ctx + live, 0), capacity)
    keys_per_split = tl.maximum(tl.cdiv(tl.cdiv(sequence_keys, num_splits), BLOCK_N), 1) * BLOCK_N
    row_keys = tl.minimum(tl.maximum(last_key + 1, 0), capacity)
    row_splits = tl.where(is_sequence, tl.cdiv(row_keys, keys_per_split), 0)  # [BLOCK_M]
    pairs = num_rows * group
    base = kv_head.to(tl.int64) * num_splits * pairs + packed_row * group + pair % group
    lse_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    for split in range(num_splits):
        lse = tl.load(partial_lse_ptr + base + split * pairs, cache_modifier=".cg",
                      mask=row_live & (split < row_splits), other=-float("inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_ref = tl.where(lse_max == -float("inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    for split in range(num_splits):
        offsets = base + split * pairs
        read = row_live & (split < row_splits)
        lse = tl.load(partial_lse_ptr + offsets, cache_modifier=".cg", mask=read,
                      other=-float("inf"))
        weight = tl.exp2(lse - lse_ref)  # 0 for a split without keys of the row
        partial = tl.load(partial_out_ptr + offsets[:, None] * head_dim + d[None, :],
                          cache_modifier=".cg", mask=read[:, None] & d_mask[None, :],
                          other=0.0)
        acc += weight[:, None] * partial  # a NaN partial stays NaN, even with weight 0
        denominator += weight

    out = acc / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
    row_nan = (last_key < 0) | (last_key >= capacity)
    out = tl.where(row_nan[:, None], float("nan"), out)
    out = tl.where(is_sequence, out, 0.0)  # the padding rows' pseudo-sequence: zeros
    out_offsets = (packed_row * (kv_heads * group) + q_head)[:, None] * head_dim + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & d_mask[None, :])


@triton.jit
def _tile_pages(table_row_ptr, table_page_stride, start, n, stop, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Page ids of the key tile at ``start`` (keys ``start + n``) of a loop that ends at
    ``stop``: one id when pages hold whole tiles (``PAGE_SIZE % BLOCK_N == 0``), else one
    per key; -1 (not covered) for keys at or past ``stop`` (no table entry past the loop is
    read)."""
    if PAGE_SIZE % BLOCK_N == 0:
        # (the stride widened, not the page index: in Triton's interpreter start is a
        # Python int where the loop hands it over)
        return tl.load(table_row_ptr + table_page_stride.to(tl.int64) * (start // PAGE_SIZE),
                       mask=start < stop, other=-1)
    else:
        keys = start + n
        return tl.load(table_row_ptr + (keys // PAGE_SIZE).to(tl.int64) * table_page_stride,
                       mask=keys < stop, other=-1)


@triton.jit(do_not_specialize=ATTENTION_UNSPECIALISED)
def _paged_attention_kernel(
    q_ptr,  # [N, Hq, D], unit last stride
    k_cache_ptr,  # [num_pages * page_size, Hkv, D] contiguous
    v_cache_ptr,  # [num_pages * page_size, Hkv, D] contiguous
    block_table_ptr,  # [B, P] int32
    query_start_ptr,  # [B + 1] int32
    ctx_len_ptr,  # [B] int32
    out_ptr,  # [N, Hq, D] contiguous, q's dtype (written when num_splits == 1)
    partial_out_ptr,  # [Hkv, num_splits, N * G, D] fp32 (written when num_splits > 1)
    partial_lse_ptr,  # [Hkv, num_splits, N * G] fp32 (written when num_splits > 1)
    arrivals_ptr,  # [Hkv, programs] int32, zero at launch (MERGE_IN_KERNEL, num_splits > 1)
    q_row_stride,
    q_head_stride,
    table_batch_stride,
    table_page_stride,
    query_start_stride,
    ctx_len_stride,
    num_rows,  # N
    num_sequences,  # B
    kv_heads,  # Hkv
    head_dim,  # D
    table_width,  # P
    num_pages,
    num_splits,
    heaviest_first,  # 1: program ids in reverse (a sequence's heaviest tiles first)
    scale_log2,  # scale * log2(e)
    BLOCK_M: tl.constexpr,  # (row, head) pairs per program
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # next_power_of_2(D), at least 16
    PAGE_SIZE: tl.constexpr,  # positions per page (its divisions compile to shifts or products)
    GROUP: tl.constexpr,  # G = Hq / Hkv, query heads per KV head
    UPCAST: tl.constexpr,  # compute in fp32 (bf16 in Triton's interpreter)
    BLOCK_BATCH: tl.constexpr,  # sequences counted at a time to find a program's sequence
    MERGE_IN_KERNEL: tl.constexpr,  # the last split program of a tile merges its splits
):
    sequence, tile, first_row_of_sequence, live = _program_sequence(
        query_start_ptr, query_start_stride, num_rows, num_sequences, GROUP, heaviest_first,
        BLOCK_M, BLOCK_BATCH)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    is_sequence = (sequence >= 0) & (sequence < num_sequences)
    batch = tl.where(is_sequence, sequence, 0).to(tl.int64)

    capacity = table_width * PAGE_SIZE  # positions the page table can address
    # clamping keeps ctx + row in int32 and changes no outcome (NaN stays NaN)
    ctx = tl.load(ctx_len_ptr + batch * ctx_len_stride, mask=is_sequence, other=0)
    ctx = tl.minimum(tl.maximum(ctx, -live - 1), capacity)

    pair = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], within the sequence
    row = pair // GROUP  # j, within the sequence
    q_head = kv_head * GROUP + pair % GROUP
    row_live = (pair < live * GROUP) & (tile >= 0) & (sequence >= 0)
    packed_row = (first_row_of_sequence + row).to(tl.int64)  # [BLOCK_M]
    last_key = ctx + row  # [BLOCK_M]: the row sees keys 0 .. last_key
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim

    # Keys [split_start, full_stop) are visible to every row of the tile (whole tiles only);
    # keys [full_stop, diagonal_end) are masked per row. Padding programs read none.
    first_row = (tile * BLOCK_M) // GROUP
    last_row = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, live - 1)
    key_end = tl.minimum(tl.maximum(ctx + last_row + 1, 0), capacity)
    key_end = tl.where((last_row >= first_row) & is_sequence, key_end, 0)
    full_end = tl.minimum(tl.maximum(ctx + first_row + 1, 0), key_end)
    sequence_keys = tl.minimum(tl.maximum(ctx + live, 0), capacity)  # keys of the last row
    keys_per_split = tl.maximum(tl.cdiv(tl.cdiv(sequence_keys, num_splits), BLOCK_N), 1) * BLOCK_N
    split_start = split * keys_per_split
    split_end = split_start + keys_per_split
    has_keys = (num_splits == 1) | (split_start < key_end)  # else: no row here reads this split

    q_offsets = (packed_row[:, None] * q_row_stride
                 + q_head.to(tl.int64)[:, None] * q_head_stride + d[None, :])
    q = tl.load(q_ptr + q_offsets,
                mask=(row_live & has_keys & is_sequence)[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    full_stop = split_start + tl.maximum(
        (tl.minimum(full_end, split_end) - split_start) // BLOCK_N, 0) * BLOCK_N
    diagonal_end = tl.minimum(key_end, split_end)

    table_row_ptr = block_table_ptr + batch * table_batch_stride
    slot_stride = kv_heads * head_dim  # positions are rows of [Hkv, D]
    head_offset = kv_head.to(tl.int64) * head_dim + d[None, :]  # [1, BLOCK_D]
    n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # per key of a tile, the first position without a page (2^31 - 1: none) in both loops:
    # row j needs a key without a page iff the first one is <= last_key[j] (every key of the
    # full loop is <= every row's last key, a diagonal key is visible to row j iff it is
    # <= last_key[j]), so no [BLOCK_M, BLOCK_N] mask is needed
    first_uncovered = tl.full([BLOCK_N], 2**31 - 1, tl.int32)

    # The page ids of a key tile are loaded one iteration ahead (loop-carried): the K/V
    # addresses of a tile then depend on no load of its own iteration, so the software
    # pipeliner sees K and V as direct loads and gives them all num_stages - 1 stages
    # (an indirect load chain splits them between the page-id load and the K/V loads).
    next_page = _tile_pages(table_row_ptr, table_page_stride, split_start, n, full_stop,
                            PAGE_SIZE, BLOCK_N)
    for start in range(split_start, full_stop, BLOCK_N):
        keys = start + n  # [BLOCK_N] positions and their pages
        page = next_page
        next_page = _tile_pages(table_row_ptr, table_page_stride, start + BLOCK_N, n,
                                full_stop, PAGE_SIZE, BLOCK_N)
        covered = (page >= 0) & (page < num_pages) & (n >= 0)  # [BLOCK_N]
        slot = tl.where(covered, page, 0).to(tl.int64) * PAGE_SIZE + keys % PAGE_SIZE
        kv_offsets = slot[:, None] * slot_stride + head_offset
        kv_mask = covered[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        first_uncovered = tl.minimum(first_uncovered, tl.where(covered, 2**31 - 1, keys))
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [M, N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # The diagonal loop runs one or two key tiles where a query tile holds at most BLOCK_N
    # rows (BLOCK_M / G, starting anywhere in a key tile), more for many rows of one head
    # (128 x 64 at G = 1, 64 x 16 at head size 256). A 2-deep ring already has both in
    # flight; a third buffer would take the 64 x 64 tile past the shared memory of two
    # programs per multiprocessor. Its non-finite bookkeeping stays inline: behind a
    # tile-level flag (a cold path, tried three ways) the 64 x 64 tile spills on Triton 3.6.
    next_page = _tile_pages(table_row_ptr, table_page_stride, full_stop, n, diagonal_end,
                            PAGE_SIZE, BLOCK_N)
    for start in tl.range(full_stop, diagonal_end, BLOCK_N, num_stages=2):
        keys = start + n
        in_range = keys < diagonal_end
        page = next_page
        next_page = _tile_pages(table_row_ptr, table_page_stride, start + BLOCK_N, n,
                                diagonal_end, PAGE_SIZE, BLOCK_N)
        covered = in_range & (page >= 0) & (page < num_pages)
        slot = tl.where(covered, page, 0).to(tl.int64) * PAGE_SIZE + keys % PAGE_SIZE
        kv_offsets = slot[:, None] * slot_stride + head_offset
        kv_mask = covered[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = (keys[None, :] <= last_key[:, None]) & in_range[None, :]  # [M, N]
        first_uncovered = tl.minimum(first_uncovered, tl.where(covered, 2**31 - 1, keys))
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        finite = (v == v) & (tl.abs(v) < float("inf"))
        v_finite = tl.where(finite, v, 0.0).to(v.dtype)
        # row j sees key n iff n <= last_key[j] (and n in range), so it sees a non-finite
        # value in column d iff the first in-range key holding one there is <= last_key[j]
        first_non_finite = tl.min(
            tl.where(finite | (in_range[:, None] == 0), 2**31 - 1, keys[:, None]), axis=0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v_finite, input_precision="ieee")
        acc = tl.where(first_non_finite[None, :] <= last_key[:, None], float("nan"), acc)
        m_i = m_new

    # (a key of the last diagonal tile at or past diagonal_end counts as uncovered; it
    # is past key_end, so past every row's last key, or the tile would end at the split's
    # end: the bound below only restates that, and ptxas allocates the 16 x 32 tile at head
    # size 128 without a spill with it)
    row_nan = tl.min(first_uncovered, axis=0) <= tl.minimum(last_key, diagonal_end - 1)
    # the full loop multiplies V as loaded: a visible +-inf there leaves inf (or NaN) in its
    # column of acc, which the contract makes NaN like the diagonal loop's
    acc = tl.where((acc == acc) & (tl.abs(acc) < float("inf")), acc, float("nan"))
    normalised = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0: no key in range
    pair_mask = row_live[:, None] & d_mask[None, :]
    if num_splits == 1:
        row_nan = row_nan | (last_key < 0) | (last_key >= capacity)
        out = tl.where(row_nan[:, None], float("nan"), normalised)
        out = tl.where(is_sequence, out, 0.0)  # the padding rows' pseudo-sequence: zeros
        out_offsets = (packed_row * (kv_heads * GROUP) + q_head)[:, None] * head_dim + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=pair_mask)
    elif has_keys & is_sequence:
        partial = tl.where(row_nan[:, None], float("nan"), normalised)
        lse = tl.where(l_i == 0.0, -float("inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        packed_pair = packed_row * GROUP + pair % GROUP  # [BLOCK_M]
        base = (kv_head.to(tl.int64) * num_splits + split) * (num_rows * GROUP) + packed_pair
        tl.store(partial_lse_ptr + base, lse, mask=row_live)
        tl.store(partial_out_ptr + base[:, None] * head_dim + d[None, :], partial, mask=pair_mask)
    if MERGE_IN_KERNEL:
        if num_splits > 1:
            tl.debug_barrier()  # every thread's stores land before the arrival
            ticket = kv_head.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(arrivals_ptr + ticket, 1) == num_splits - 1:  # the last one
                # (from the arguments again: nothing of the above stays live for it through
                # the key loops, where registers are short)
                _merge_program(partial_out_ptr, partial_lse_ptr, query_start_ptr, ctx_len_ptr,
                               out_ptr, query_start_stride, ctx_len_stride, num_rows,
                               num_sequences, kv_heads, GROUP, head_dim, PAGE_SIZE,
                               table_width, num_splits, heaviest_first, BLOCK_M, BLOCK_N,
                               BLOCK_D, BLOCK_BATCH)


@triton.jit(do_not_specialize=COMBINE_UNSPECIALISED)
def _combine_splits_kernel(
    partial_out_ptr,  # [Hkv, num_splits, N * G, D] fp32
    partial_lse_ptr,  # [Hkv, num_splits, N * G] fp32
    query_start_ptr,  # [B + 1] int32
    ctx_len_ptr,  # [B] int32
    out_ptr,  # [N, Hq, D] contiguous, q's dtype
    query_start_stride,
    ctx_len_stride,
    num_rows,
    num_sequences,
    kv_heads,
    group,
    head_dim,
    page_size,
    table_width,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the attention kernel's key tile (its chunking of the keys)
    BLOCK_D: tl.constexpr,
    BLOCK_BATCH: tl.constexpr,
):
    _merge_program(partial_out_ptr, partial_lse_ptr, query_start_ptr, ctx_len_ptr, out_ptr,
                   query_start_stride, ctx_len_stride, num_rows, num_sequences, kv_heads, group,
                   head_dim, page_size, table_width, num_splits, 0, BLOCK_M, BLOCK_N, BLOCK_D,
                   BLOCK_BATCH)


# ---------------------------------------------------------------------------- launcher
#
# Tiles (BLOCK_M pairs x BLOCK_N keys x BLOCK_D): fp16/bf16 products run on tensor cores with
# 128 x 64 tiles and 8 warps where a sequence has more than 64 (row, head) pairs per KV head
# (prefill, and windows of more than 64 / G rows) at heads of 65..128, 64 x 64 with 4 warps
# for the shorter windows and small heads, 64 x 16 for heads of 256. Measured on an
# H200 (bench/results/nvidia-h200/paged_attention.json against gpu_check/
# paged_attention_quick.json, head_dim 128, bf16): 64 x 64 with 4 warps took 1.46 ms at
# B=64, q 16, context 16384 (70% of copy bandwidth), where 64 x 32 with 8 warps took 3.36 ms,
# although ptxas reported then that the 64-key tiles spilled registers at head_dim 128 and
# the 32-key ones did not; prefill 128 x 64 was 1.3x faster than 128 x 32. (Those runs were
# of the kernel before packed rows, which spilled 150 bytes in the 64 x 64 tile; the key
# loops of this one load page ids a tile ahead and track uncovered positions per key slot,
# and on Triton 3.6 no tile at head_dim 128 spills, with two K/V tiles in flight,
# bench/results/sm90_compile/paged_attention.md; it has not run on a GPU yet.) fp32 takes
# exact fp32 products ("ieee", no TF32) with small tiles.
#
# Schedules, chosen from shapes only (no value is read on the host, so a call can be captured
# in a CUDA graph): "decode" when the rows average at most MAX_DECODE_ROWS per sequence, else
# "prefill".
# - query tiles: grid ((N G) // BLOCK_M + B + 1, Hkv), one pass over the keys per tile; used
#   for prefill and whenever the tiles that hold rows already fill the GPU;
# - split-KV: for decode steps whose working programs (query tiles holding rows, times Hkv)
#   are below SPLIT_TARGET_WAVES per multiprocessor, grid (tiles, Hkv, num_splits) with
#   num_splits up to the number of key tiles the page table can address; each sequence's
#   keys are spread over the splits on the device (see the kernel), then the combine kernel
#   merges the splits. Every query tile of a KV head reads all of its keys, so the split
#   keeps a sequence's (row, head) pairs in one 64- or 128-pair tile where it can: 16-pair tiles
#   (fp16/bf16) are used only when even one split per key tile of the table leaves the GPU
#   short of the target (short tables). On the H200, 16-pair tiles with 6 splits read the
#   keys four times at B=1, q 16 and took 157 us at context 16384 where one 64-pair tile with
#   33 splits took 48 us; at context 512 they took 14.5 us against 23 us.

MAX_DECODE_ROWS = 64  # steps averaging up to this many rows per sequence may split the keys
MAX_POSITIONS = 2**31 - 2**16  # P * page_size + N: int32 positions with room for split ends
MAX_SPLITS = 64
SPLIT_TARGET_WAVES = 2  # programs per multiprocessor the split schedule aims for
MIN_KERNEL_HEAD_DIM = 2  # head sizes outside [2, 256] use the PyTorch implementation
MAX_KERNEL_HEAD_DIM = 256
_COMBINE_BLOCK_M = 16
# Sequences a program counts at a time to find its own (one element per thread of 4 warps).
_BLOCK_BATCH = 128
_INTERPRETER_MULTIPROCESSORS = 4  # the "device width" the split heuristic assumes on CPU


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def head_dim_block(head_dim: int) -> int:
    """BLOCK_D of a head size: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def launch_config(
    dtype: torch.dtype, head_dim: int, pairs_per_sequence: int, few_programs: bool = False
) -> LaunchConfig:
    """Tile sizes for q's dtype, the head size and the (row, head) pairs a sequence has per KV
    head (its rows times the GQA group, on average); ``few_programs``: a decode step too
    small for the default tiles to fill the GPU even with the most splits (see
    :func:`schedule`)."""
    block_d = head_dim_block(head_dim)
    if dtype == torch.float32:
        return LaunchConfig(16, 16, 4, 2) if block_d >= 64 else LaunchConfig(32, 32, 4, 2)
    if few_programs:
        return LaunchConfig(16, 32, 4, 2)
    if block_d >= 256:
        return LaunchConfig(64, 16, 8, 2)
    if block_d <= 64 or pairs_per_sequence <= 64:
        return LaunchConfig(64, 64, 4, 3)
    return LaunchConfig(128, 64, 8, 3)


def launch_configs(dtype: torch.dtype, block_d: int) -> list[LaunchConfig]:
    """Every configuration :func:`launch_config` gives for q's dtype and a BLOCK_D."""
    configs = {launch_config(dtype, block_d, pairs, few)
               for pairs in (64, 65) for few in (False, True)}
    return sorted(configs, key=lambda c: (c.block_m, c.block_n, c.num_warps))


_MULTIPROCESSORS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_MULTIPROCESSORS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


def query_tiles(num_rows: int, batch: int, group: int, block_m: int) -> int:
    """Programs per KV head that cover every sequence's (row, head) pairs and the padding
    rows (see the kernel's program mapping)."""
    return (num_rows * group) // block_m + batch + 1


def working_tiles(num_rows: int, batch: int, group: int, block_m: int) -> int:
    """Query tiles per KV head that hold rows (the others exit at once), as estimated from
    shapes: the pairs in whole tiles, at least one tile per sequence."""
    return max(triton.cdiv(num_rows * group, block_m), batch)


@functools.lru_cache(maxsize=1024)
def schedule(
    dtype: torch.dtype, num_rows: int, batch: int, kv_heads: int, group: int, head_dim: int,
    capacity: int, multiprocessors: int, rule: str = "measured",
) -> tuple[LaunchConfig, int]:
    """``(tile configuration, num_splits)`` of a call, from its shapes alone (cached).
    ``rule``: the split rule, ``"measured"`` (:func:`split_count`) or ``"fa2"``
    (:func:`fa2_split_count`; the ``WEDLM_KERNELS_ATTENTION_SPLITS`` setting)."""
    decode = num_rows <= MAX_DECODE_ROWS * max(batch, 1)
    pairs_per_sequence = triton.cdiv(num_rows, max(batch, 1)) * group
    config = launch_config(dtype, head_dim, pairs_per_sequence)
    programs = kv_heads * working_tiles(num_rows, batch, group, config.block_m)
    if rule == "fa2":
        slots = multiprocessors * residency(config)
        splits = fa2_split_count(programs, slots, triton.cdiv(capacity, config.block_n),
                                 fa2_split_limit(capacity, config)) if decode else 1
        return config, splits
    most_splits = split_limit(capacity, config)
    if decode and programs * most_splits < SPLIT_TARGET_WAVES * multiprocessors:
        config = launch_config(dtype, head_dim, pairs_per_sequence, few_programs=True)
        programs = kv_heads * working_tiles(num_rows, batch, group, config.block_m)
    return config, split_count(decode, programs, capacity, config, multiprocessors)


# FlashAttention-2's split rule (its ``num_splits_heuristic``), adapted to this kernel: the
# programs a launch can hold at once are the multiprocessors times the residency the
# compiled kernel allows (registers, shared memory), and a split must read at least
# KEYS_PER_PAIR keys for each (row, head) pair of its tile, or its partial outputs (fp32,
# per pair) cost as much as the keys it reads.
FA2_FILL = 0.8  # no split when the programs fill this fraction of the slots
FA2_EFFICIENCY = 0.85  # the fewest splits within this fraction of the best wave efficiency
KEYS_PER_PAIR = 8
# Programs per sm_90 multiprocessor of each tile (bf16/fp16, head_dim 128, from the sm_90
# compile: registers per thread and shared memory; tests/test_kernels_compile_sm90.py checks
# these against ptxas). A configuration not listed counts as one.
RESIDENCY_SM90 = {(16, 32, 4): 3, (64, 64, 4): 2, (128, 64, 8): 1}


def residency(config: LaunchConfig) -> int:
    """Programs of ``config``'s tile one multiprocessor holds at once (sm_90, compiled)."""
    return RESIDENCY_SM90.get((config.block_m, config.block_n, config.num_warps), 1)


def fa2_split_limit(capacity: int, config: LaunchConfig) -> int:
    """The most key chunks the FA2 rule may use: each at least KEYS_PER_PAIR keys per pair
    of the tile (``capacity // (KEYS_PER_PAIR * block_m)``), at most MAX_SPLITS; 1 (no
    split) for tables shorter than two such chunks."""
    return max(1, min(capacity // (KEYS_PER_PAIR * config.block_m), MAX_SPLITS))


def fa2_split_count(programs: int, slots: int, key_tiles: int, most_splits: int) -> int:
    """FlashAttention-2's split count for ``programs`` working programs on ``slots``
    resident program slots (multiprocessors x residency), a sequence of ``key_tiles`` key
    tiles and at most ``most_splits`` chunks.

    No split when the programs already fill ``FA2_FILL`` of the slots. Otherwise, over the
    split counts ``s`` up to ``min(most_splits, slots, key_tiles)`` that change the tiles
    per chunk (``cdiv(key_tiles, s) != cdiv(key_tiles, s - 1)``; the others are the same
    schedule with an empty chunk), the wave efficiency ``w / ceil(w)`` with
    ``w = programs * s / slots`` (how full the last wave is); the answer is the fewest
    splits within ``FA2_EFFICIENCY`` of the best."""
    if programs >= FA2_FILL * slots:
        return 1
    most = min(most_splits, slots, key_tiles)
    if most <= 1:
        return 1
    eligible = [s for s in range(1, most + 1)
                if s == 1 or triton.cdiv(key_tiles, s) != triton.cdiv(key_tiles, s - 1)]

    def efficiency(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in eligible)
    return next(s for s in eligible if efficiency(s) >= FA2_EFFICIENCY * best)


def split_count(
    decode: bool, programs: int, capacity: int, config: LaunchConfig, multiprocessors: int
) -> int:
    """How many key chunks the split-KV schedule uses (1: the query-tile schedule) for
    ``programs`` working programs: enough for SPLIT_TARGET_WAVES per multiprocessor, at most
    one per key tile the page table can address."""
    target = SPLIT_TARGET_WAVES * multiprocessors
    if not decode or programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), split_limit(capacity, config)))


def split_limit(capacity: int, config: LaunchConfig) -> int:
    """The most key chunks a call may split into: one per key tile the page table can
    address, at most MAX_SPLITS."""
    return min(triton.cdiv(capacity, config.block_n), MAX_SPLITS)


_CACHED_LAUNCHES: dict[object, CachedLaunch] = {}


def _launch(kernel, grid: tuple, *args, **options) -> None:
    """``kernel[grid](*args, **options)``; on CUDA tensors through the compiled handle of
    the launch's specialisation (:class:`CachedLaunch`: tens of microseconds of host time
    less per launch, checked against Triton's own choice under ``WEDLM_KERNELS_DEBUG``)."""
    if not args[0].is_cuda:
        kernel[grid](*args, **options)
        return
    launch = _CACHED_LAUNCHES.get(kernel)
    if launch is None:
        launch = _CACHED_LAUNCHES[kernel] = CachedLaunch(kernel)
    launch(grid, *args, **options)


@functools.cache
def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor standing in for a buffer the launch neither reads nor writes
    (the partials of a one-split launch, the tickets of a merge by the combine kernel)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _upcast(q: torch.Tensor) -> bool:
    """Compute in fp32: bf16 arithmetic and bf16 tl.dot are wrong in Triton's interpreter."""
    return q.device.type != "cuda" and q.dtype == torch.bfloat16


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton launcher of :func:`paged_attention` (arguments validated by the caller); the
    PyTorch implementation for head sizes outside ``[2, 256]``."""
    if not MIN_KERNEL_HEAD_DIM <= q.shape[-1] <= MAX_KERNEL_HEAD_DIM:
        return paged_attention_torch(q, k_cache, v_cache, block_table, query_start, ctx_len,
                                     scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    paged_attention_into(out, q, k_cache, v_cache, block_table, query_start, ctx_len, scale)
    return out


def paged_attention_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    merge: str | None = None,
    order: str | None = None,
) -> None:
    """The kernel launch itself, writing into a given contiguous ``out [N, Hq, D]`` of q's
    dtype (tests hand it a tensor between guard bands). ``num_splits`` forces the schedule
    (1: query tiles, more: split-KV with that many chunks) and ``block_m``/``block_n`` the
    tile sizes (powers of two, at least 16); by default all three follow the shapes.
    ``merge``: how split partials are merged, ``"combine"`` (a second launch) or
    ``"last_program"`` (in the attention launch); by default the
    ``WEDLM_KERNELS_ATTENTION_MERGE`` setting. ``order``: the order the query tiles are
    started in, ``"forward"`` or ``"heaviest_first"`` (a sequence's last tiles, which see the
    most keys, first); by default the ``WEDLM_KERNELS_ATTENTION_ORDER`` setting."""
    num_rows, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    batch, table_width = block_table.shape
    if out.numel() == 0:
        return
    group = q_heads // kv_heads
    config, default_splits = schedule(q.dtype, num_rows, batch, kv_heads, group, head_dim,
                                      table_width * page_size, _multiprocessors(q.device),
                                      _backend.ATTENTION_SPLITS)
    block_m = block_m or config.block_m
    block_n = block_n or config.block_n
    num_splits = num_splits or default_splits
    merge = merge or _backend.ATTENTION_MERGE
    if merge not in _backend.ATTENTION_MERGES:
        raise ValueError(f"merge={merge!r} is not one of {', '.join(_backend.ATTENTION_MERGES)}")
    merge_in_kernel = merge == "last_program" and num_splits > 1
    order = order or _backend.ATTENTION_ORDER
    if order not in _backend.ATTENTION_ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(_backend.ATTENTION_ORDERS)}")
    programs = query_tiles(num_rows, batch, group, block_m)
    if num_splits > 1:  # one allocation for the partials (and the tickets of the merge)
        pairs = kv_heads * num_splits * num_rows * group
        tickets = kv_heads * programs if merge_in_kernel else 0
        buffer = torch.empty(pairs * (head_dim + 1) + tickets, dtype=torch.float32,
                             device=q.device)
        partial_out, partial_lse, arrivals = buffer.split([pairs * head_dim, pairs, tickets])
        arrivals = (arrivals.view(torch.int32).zero_() if merge_in_kernel
                    else _unused(q.device, torch.int32))
    else:
        partial_out = partial_lse = _unused(q.device, torch.float32)
        arrivals = _unused(q.device, torch.int32)
    block_d = head_dim_block(head_dim)
    grid = (programs, kv_heads, num_splits)
    _launch(
        _paged_attention_kernel, grid,
        q, k_cache, v_cache, block_table, query_start, ctx_len, out, partial_out, partial_lse,
        arrivals, q.stride(0), q.stride(1), block_table.stride(0), block_table.stride(1),
        query_start.stride(0), ctx_len.stride(0),
        num_rows, batch, kv_heads, head_dim, table_width, num_pages, num_splits,
        int(order == "heaviest_first"), float(scale) * _LOG2_E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PAGE_SIZE=page_size, GROUP=group,
        UPCAST=_upcast(q), BLOCK_BATCH=_BLOCK_BATCH, MERGE_IN_KERNEL=merge_in_kernel,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1 and not merge_in_kernel:
        combine_grid = (query_tiles(num_rows, batch, group, _COMBINE_BLOCK_M), kv_heads)
        _launch(
            _combine_splits_kernel, combine_grid,
            partial_out, partial_lse, query_start, ctx_len, out, query_start.stride(0),
            ctx_len.stride(0), num_rows, batch, kv_heads, group, head_dim, page_size,
            table_width, num_splits,
            BLOCK_M=_COMBINE_BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d,
            BLOCK_BATCH=_BLOCK_BATCH, num_warps=4,
        )


# ---------------------------------------------------------------------------- variants

_HEAD_DIM_BLOCKS = (16, 32, 64, 128, 256)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _attention_variant(
    dtype: torch.dtype, block_d: int, config: LaunchConfig, page_size: int, group: int,
    merge_in_kernel: bool = False,
) -> KernelVariant:
    pointer = POINTER_TYPES[dtype]
    signature = {
        "q_ptr": pointer, "k_cache_ptr": pointer, "v_cache_ptr": pointer,
        "block_table_ptr": "*i32", "query_start_ptr": "*i32", "ctx_len_ptr": "*i32",
        "out_ptr": pointer, "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
        "arrivals_ptr": "*i32",
    }
    for name in (
        "q_row_stride", "q_head_stride", "table_batch_stride", "table_page_stride",
        "query_start_stride", "ctx_len_stride", "num_rows", "num_sequences", "kv_heads",
        "head_dim", "table_width", "num_pages", "num_splits", "heaviest_first",
    ):
        signature[name] = "i32"
    signature.update(scale_log2="fp32", BLOCK_M="constexpr", BLOCK_N="constexpr",
                     BLOCK_D="constexpr", PAGE_SIZE="constexpr", GROUP="constexpr",
                     UPCAST="constexpr", BLOCK_BATCH="constexpr", MERGE_IN_KERNEL="constexpr")
    return KernelVariant(
        name=(f"attention_{_SHORT[dtype]}_d{block_d}_m{config.block_m}_n{config.block_n}"
              f"_w{config.num_warps}_p{page_size}_g{group}"
              f"{'_merged' if merge_in_kernel else ''}"),
        kernel=_paged_attention_kernel,
        signature=signature,
        constexprs={"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": block_d,
                    "PAGE_SIZE": page_size, "GROUP": group, "UPCAST": False,
                    "BLOCK_BATCH": _BLOCK_BATCH, "MERGE_IN_KERNEL": merge_in_kernel},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        divisible_by_16=("head_dim",),
    )


def _combine_variant(dtype: torch.dtype, block_d: int, block_n: int) -> KernelVariant:
    signature = {
        "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "query_start_ptr": "*i32",
        "ctx_len_ptr": "*i32", "out_ptr": POINTER_TYPES[dtype],
    }
    for name in ("query_start_stride", "ctx_len_stride", "num_rows", "num_sequences",
                 "kv_heads", "group", "head_dim", "page_size", "table_width", "num_splits"):
        signature[name] = "i32"
    signature.update(BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr",
                     BLOCK_BATCH="constexpr")
    return KernelVariant(
        name=f"combine_{_SHORT[dtype]}_d{block_d}_n{block_n}",
        kernel=_combine_splits_kernel,
        signature=signature,
        constexprs={"BLOCK_M": _COMBINE_BLOCK_M, "BLOCK_N": block_n, "BLOCK_D": block_d,
                    "BLOCK_BATCH": _BLOCK_BATCH},
        num_warps=4,
        divisible_by_16=("head_dim",),
    )


# The page sizes and query heads per KV head the compiled variants are checked at. The
# attention kernel is specialised on both (an engine runs one page size and one model, so
# one of each): every tile at pages of 8 (one page id per key: no key tile lies in one
# page) and 64 (one page id per key tile, every BLOCK_N) with a group of 4; the fp16 and
# bf16 tiles at head size 128 also at the benchmarked pages of 16, and the bf16 ones, with
# split partials merged by the combine launch (the default), at a page of one position, no
# GQA (1), an odd group (Qwen2.5-7B's 7) and 8. (Each compile takes seconds: the sample
# keeps the sm_90 compile test within its share of CI.)
_VARIANT_PAGE_SIZES = (8, 64)
_VARIANT_GROUP = 4
_BENCHMARK_PAGE_AND_GROUP = (16, 4)
_EXTRA_PAGES_AND_GROUPS = ((1, 4), (16, 1), (16, 7), (16, 8))


def kernel_variants() -> list[KernelVariant]:
    """The specialisations :func:`paged_attention_triton` launches on a GPU, as compiled by
    the tests: q dtype x BLOCK_D (head sizes up to 256) x every tile configuration of
    :func:`launch_config` (decode windows with few or many programs, longer query ranges) x
    the merge of split partials (a combine launch or in the kernel) x page sizes and GQA
    groups (``_VARIANT_PAGE_SIZES`` with ``_VARIANT_GROUP``: both page lookups of every tile;
    ``_BENCHMARK_PAGE_AND_GROUP`` at head size 128 in fp16 and bf16, and
    ``_EXTRA_PAGES_AND_GROUPS`` there in bf16 without the in-launch merge; the kernel is
    specialised on both, and other values compile the same code with other constants, which
    ptxas may allocate differently), plus the combine kernel per dtype, BLOCK_D and
    BLOCK_N. (On the CPU, Triton's interpreter additionally runs bf16 with UPCAST, never
    compiled.)"""
    variants = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for block_d in _HEAD_DIM_BLOCKS:
            sizes = [((page_size, _VARIANT_GROUP), merge)
                     for page_size in _VARIANT_PAGE_SIZES for merge in (False, True)]
            if block_d == 128 and dtype != torch.float32:
                sizes += [(_BENCHMARK_PAGE_AND_GROUP, merge) for merge in (False, True)]
            if block_d == 128 and dtype == torch.bfloat16:
                sizes += [(page_and_group, False) for page_and_group in _EXTRA_PAGES_AND_GROUPS]
            for config in launch_configs(dtype, block_d):
                for (page_size, group), merge_in_kernel in sizes:
                    variant = _attention_variant(dtype, block_d, config, page_size, group,
                                                 merge_in_kernel)
                    variants[variant.name] = variant
                variant = _combine_variant(dtype, block_d, config.block_n)
                variants[variant.name] = variant
    return list(variants.values())
