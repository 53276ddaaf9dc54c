"""The Triton kernels of paged_attention, called through their launcher (Triton's interpreter
when there is no GPU), against reference/attention.py and the PyTorch implementation, in both
schedules (query tiles, split-KV + combine); outputs between guard bands. GPU-only checks
(bf16, Qwen3-8B shapes, CUDA graphs, SDPA on the gathered cache, flash-attn) are marked
``cuda``."""

import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import attention as ref
from tests.attention_inputs import pack, padded, uneven_packed_case, unpack
from tests.kernel_harness import guarded
from tests.numerics import ATTENTION_KERNEL_TOLERANCE, assert_close
from wedlm_kernels.ops import _library
from wedlm_kernels.ops import attention as attention_ops
from wedlm_kernels.ops._triton import POINTER_TYPES
from wedlm_kernels.ops.attention import (
    LaunchConfig,
    kernel_variants,
    paged_attention_into,
    paged_attention_torch,
    paged_attention_triton,
    split_count,
)

ON_GPU = torch.cuda.is_available()
# where the kernel runs, as the `kernel_device` fixture (hypothesis tests cannot take
# function-scoped fixtures): the GPU, else Triton's interpreter on the CPU
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 -> bf16 casts truncate in the interpreter (the GPU rounds to nearest even): bf16 only
# on the GPU.
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())

OUT_SENTINEL = 777.0  # the output's initial value: an element the kernel skips stays at it
MERGES = ("combine", "last_program")  # how split partials are merged (paged_attention_into)
ORDERS = ("forward", "heaviest_first")  # the order query tiles start in


def schedules(splits: int) -> list[tuple[int, str | None]]:
    """``(num_splits, merge)``: one split, and ``splits`` merged either way."""
    return [(1, None), *((splits, merge) for merge in MERGES)]


def _lengths(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _table(rows):
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _caches(num_pages, page_size, kv_heads, head_dim, dtype, generator, fill=None):
    """Random (or ``fill``-valued) K and V caches on the kernel device."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    if fill is None:
        return tuple(torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
                     for _ in range(2))
    return tuple(torch.full(shape, fill, dtype=dtype, device=DEVICE) for _ in range(2))


def _run_kernel(args, **schedule):
    """The launch on the packed form of padded ``args`` (``(q [B, S, Hq, D], k_cache,
    v_cache, block_table, ctx_len, q_len, scale)``, two padding rows after the packed rows)
    into an output between guard bands, pre-filled with a sentinel; checks the bands and that
    no element kept the sentinel (every row, padding included, is written). Returns the
    output unpacked to ``[B, S, Hq, D]``."""
    q, k_cache, v_cache, block_table, ctx_len, q_len, scale = args
    packed, query_start = pack(q, q_len.cpu(), extra_rows=2)
    query_start = query_start.to(q.device)
    out = guarded(torch.full(packed.shape, OUT_SENTINEL, dtype=q.dtype, device=q.device))
    paged_attention_into(out.tensor, packed, k_cache, v_cache, block_table, query_start,
                         ctx_len, scale, **schedule)
    out.check("out")
    assert not (out.tensor == OUT_SENTINEL).any(), "an output element was not written"
    assert (out.tensor[-2:] == 0).all(), "padding rows must be zero"
    return unpack(out.tensor, query_start.cpu(), q.shape[1])


def _cpu(args):
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


# the reference and the PyTorch implementation in the padded form of _run_kernel's args
reference = padded(ref.paged_attention)
pytorch = padded(paged_attention_torch)
triton_launcher = padded(paged_attention_triton)


def _scattered_layout(ctx_len, q_len, rows, page_size, extra_pages, generator):
    """A page table of distinct, scattered page ids covering every needed position; unused
    table entries are -1."""
    needed = [math.ceil((c + min(max(n, 0), rows)) / page_size) for c, n in zip(ctx_len, q_len)]
    width = max(needed) + extra_pages
    num_pages = sum(needed) + 2
    free = torch.randperm(num_pages, generator=generator).tolist()
    table = [[free.pop() for _ in range(n)] + [-1] * (width - n) for n in needed]
    return table, num_pages


@given(
    dtype=st.sampled_from((torch.float32, torch.float16)),
    head_dim=st.sampled_from([16, 64, 80]),
    heads=st.sampled_from([(1, 1), (2, 1), (1, 4), (2, 4), (1, 8)]),  # (Hkv, G)
    page_size=st.sampled_from([4, 16, 64]),
    rows=st.integers(1, 7),
    sequences=st.lists(
        st.tuples(
            st.sampled_from(["zero", "one", "boundary", "boundary-1", "any"]),
            st.sampled_from(["zero", "one", "all", "any", "over", "negative"]),
            st.integers(0, 2**16),
        ),
        min_size=1, max_size=2,
    ),
    extra_pages=st.integers(0, 2),
    num_splits=st.sampled_from([None, 1, 2, 3]),
    merge=st.sampled_from(MERGES),
    order=st.sampled_from(ORDERS),
    block_n=st.sampled_from([None, 16]),
    strided_q=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
# the smallest case; a page-boundary context with the largest GQA group, split-KV and small
# key tiles; a window whose q_len is past S next to one whose q_len is negative
@example(dtype=torch.float32, head_dim=16, heads=(1, 1), page_size=4, rows=1,
         sequences=[("zero", "one", 0)], extra_pages=0, num_splits=None, merge="combine",
         order="forward", block_n=None, strided_q=False, seed=0)
@example(dtype=torch.float16, head_dim=80, heads=(1, 8), page_size=16, rows=7,
         sequences=[("boundary", "all", 2)], extra_pages=2, num_splits=3,
         merge="last_program", order="heaviest_first", block_n=16, strided_q=True, seed=1)
@example(dtype=torch.float32, head_dim=64, heads=(2, 4), page_size=4, rows=5,
         sequences=[("boundary-1", "over", 1), ("any", "negative", 7)], extra_pages=1,
         num_splits=2, merge="combine", order="heaviest_first", block_n=None, strided_q=False,
         seed=2)
def test_kernel_matches_reference_and_pytorch(
    dtype, head_dim, heads, page_size, rows, sequences, extra_pages, num_splits, merge, order,
    block_n, strided_q, seed,
):
    g = torch.Generator().manual_seed(seed)
    kv_heads, group = heads
    q_heads = kv_heads * group
    ctx_len, q_len = [], []
    for ctx_kind, q_len_kind, draw in sequences:
        boundary = page_size * (1 + draw % 3)
        ctx_len.append({"zero": 0, "one": 1, "boundary": boundary, "boundary-1": boundary - 1,
                        "any": draw % (3 * page_size + 5)}[ctx_kind])
        q_len.append({"zero": 0, "one": 1, "all": rows, "any": draw % (rows + 1),
                      "over": rows + 3, "negative": -2}[q_len_kind])
    table, num_pages = _scattered_layout(ctx_len, q_len, rows, page_size, extra_pages, g)
    batch = len(sequences)
    if strided_q:  # [B, Hq, S, D + 3] viewed as [B, S, Hq, D]
        q = torch.randn(batch, q_heads, rows, head_dim + 3, generator=g).to(dtype).to(DEVICE)
        q = q.transpose(1, 2)[..., :head_dim]
    else:
        q = torch.randn(batch, rows, q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, kv_heads, head_dim, dtype, g)
    args = (q, k_cache, v_cache, _table(table), _lengths(ctx_len), _lengths(q_len),
            head_dim**-0.5)

    out = _run_kernel(args, num_splits=num_splits, merge=merge, order=order, block_n=block_n)

    expected = reference(*_cpu(args))
    assert not expected.isnan().any()  # every needed page is covered here
    assert_close(out, expected, ATTENTION_KERNEL_TOLERANCE, dtype)
    assert_close(out, pytorch(*args), ATTENTION_KERNEL_TOLERANCE, dtype)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_count_changes_results_only_by_rounding(dtype, merge):
    # decode-shaped: 8 window rows over 300 positions in pages of 16, GQA 4
    g = torch.Generator().manual_seed(1)
    ctx, rows, kv_heads, group, head_dim, page_size = 292, 8, 1, 4, 64, 16
    table, num_pages = _scattered_layout([ctx], [rows], rows, page_size, 1, g)
    q = torch.randn(1, rows, kv_heads * group, head_dim, generator=g).to(dtype).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, kv_heads, head_dim, dtype, g)
    args = (q, k_cache, v_cache, _table(table), _lengths([ctx]), _lengths([rows]), 0.125)
    one = _run_kernel(args, num_splits=1).float()
    expected = reference(*_cpu(args))
    assert_close(one, expected, ATTENTION_KERNEL_TOLERANCE, dtype)
    for num_splits in (3, 40):  # 40 splits of 16 keys: the last 20 find no key
        split = _run_kernel(args, num_splits=num_splits, block_n=16, merge=merge).float()
        # the partial outputs are fp32; only the final rounding to q's dtype may differ
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else ATTENTION_KERNEL_TOLERANCE[dtype]
        torch.testing.assert_close(split, one, **tolerance)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("page_size,block_n", [(16, 16), (4, 16), (64, 16)])
@pytest.mark.parametrize("window", ["one tile", "rows ending in different splits"])
def test_splits_past_a_rows_keys_are_neither_written_nor_read(monkeypatch, page_size, block_n,
                                                             window, merge):
    """Partial buffers start as NaN (the merge's tickets, carved from the same fp32
    allocation, as garbage until zeroed): a split without keys of a row must be skipped by
    the attention kernel (no write) and by the merge (no read), or NaN reaches the output.
    12 splits of 16-key tiles. "one tile": 45 keys, splits 3.. hold nothing. "rows ending in
    different splits": 20 rows after 5 positions, GQA 2, 16-pair query tiles, so tile 0's
    rows end their keys in split 0 while later tiles reach split 1, and row 11 ends exactly
    at a split boundary (key 16). Pages of 16 and 64 load one page id per key tile, pages of
    4 one per key."""
    g = torch.Generator().manual_seed(21)
    if window == "one tile":
        ctx_len, q_len, rows, group, block_m = [40, 3], [5, 2], 5, 2, None
    else:
        ctx_len, q_len, rows, group, block_m = [5, 14], [20, 3], 20, 2, 16
    head_dim = 16
    table, num_pages = _scattered_layout(ctx_len, q_len, rows, page_size, 2, g)
    q = torch.randn(2, rows, group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, 1, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table(table), _lengths(ctx_len), _lengths(q_len), 0.3)
    empty = torch.empty

    def nan_filled(*shape, **options):
        tensor = empty(*shape, **options)
        return tensor.fill_(float("nan")) if tensor.dtype == torch.float32 else tensor

    monkeypatch.setattr(attention_ops.torch, "empty", nan_filled)
    out = _run_kernel(args, num_splits=12, block_n=block_n, block_m=block_m, merge=merge)
    monkeypatch.undo()
    expected = reference(*_cpu(args))
    assert not expected.isnan().any()
    assert_close(out, expected, ATTENTION_KERNEL_TOLERANCE, torch.float32)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the combine kernel was launched")


@pytest.mark.parametrize("order", ORDERS)
def test_the_last_program_merge_is_one_launch_and_equals_the_combine(monkeypatch, order):
    """merge="last_program": no combine launch; the output equals the combine's (the same
    merge, in the other launch), over two KV heads (a ticket per tile and KV head) and
    query tiles of two sequences and the padding rows."""
    g = torch.Generator().manual_seed(23)
    ctx_len, q_len, rows, kv_heads, group, head_dim, page_size = [37, 5], [6, 3], 6, 2, 3, 16, 4
    table, num_pages = _scattered_layout(ctx_len, q_len, rows, page_size, 1, g)
    q = torch.randn(2, rows, kv_heads * group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, kv_heads, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table(table), _lengths(ctx_len), _lengths(q_len), 0.3)
    combined = _run_kernel(args, num_splits=4, block_m=16, block_n=16, merge="combine",
                           order=order)
    monkeypatch.setattr(attention_ops, "_combine_splits_kernel", _NoLaunch())
    merged = _run_kernel(args, num_splits=4, block_m=16, block_n=16, merge="last_program",
                         order=order)
    assert torch.equal(merged, combined)
    assert_close(merged, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


@pytest.mark.parametrize("setting", [{"merge": "both"}, {"order": "backward"}])
def test_an_unknown_merge_or_order_is_refused_naming_it(setting):
    q = torch.zeros(2, 1, 16)
    cache = torch.zeros(1, 4, 1, 16)
    (name, value), = setting.items()
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        paged_attention_into(torch.empty_like(q), q, cache, cache, _table([[0]]).cpu(),
                             _lengths([0, 2]).cpu(), _lengths([0]).cpu(), 0.25, **setting)


def test_a_page_table_reaching_past_int32_positions_is_rejected():
    q = torch.zeros(4, 1, 16)
    cache = torch.zeros(1, 2**16, 1, 16)
    table = torch.zeros(1, 2**15, dtype=torch.int32)  # 2^31 positions
    with pytest.raises(ValueError, match="`block_table` addresses"):
        wk.paged_attention(q, cache, cache, table, _lengths([0, 4]).cpu(), _lengths([0]).cpu(),
                           0.25)


@pytest.mark.parametrize("order", ORDERS)
def test_prefill_query_tiles_match_the_reference(order):
    # 70 prompt rows x GQA 2 = 140 (row, head) pairs: three query tiles of 64, one pass
    g = torch.Generator().manual_seed(2)
    rows, kv_heads, group, head_dim, page_size = 70, 1, 2, 64, 16
    batch_ctx, batch_q_len = [0, 5], [70, 41]
    table, num_pages = _scattered_layout(batch_ctx, batch_q_len, rows, page_size, 0, g)
    q = torch.randn(2, rows, kv_heads * group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, kv_heads, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table(table), _lengths(batch_ctx), _lengths(batch_q_len),
            head_dim**-0.5)
    out = _run_kernel(args, block_m=64, num_splits=1, order=order)
    expected = reference(*_cpu(args))
    assert_close(out, expected, ATTENTION_KERNEL_TOLERANCE, torch.float32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("num_splits,block_m,merge", [
    (1, None, None), (3, 16, "combine"), (3, 16, "last_program"), (1, 64, None),
    (2, 32, "combine"), (2, 32, "last_program")])
def test_packed_rows_of_uneven_sequences_and_padding_rows(num_splits, block_m, merge, order):
    """Sequences of 0, 70, 1 and 5 rows back to back, then 3 padding rows, through every
    schedule: each row equals the reference and the padding rows are written as zeros."""
    args = uneven_packed_case(torch.Generator().manual_seed(8), DEVICE)
    q = args[0]
    out = guarded(torch.full(q.shape, OUT_SENTINEL, dtype=q.dtype, device=q.device))
    paged_attention_into(out.tensor, *args, num_splits=num_splits, block_m=block_m,
                         block_n=16, merge=merge, order=order)
    out.check("out")
    assert (out.tensor[-3:] == 0).all() and out.tensor[:-3].isfinite().all()
    assert_close(out.tensor, ref.paged_attention(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_programs_find_their_sequence_among_more_sequences_than_one_count_block(
        monkeypatch, num_splits, merge, order):
    """A program counts the sequences whose first tile precedes it _BLOCK_BATCH at a time
    (16 here): 41 sequences of 0-3 rows (empty ones included, at chunk edges too) span
    three count blocks; every row equals the reference, padding rows are zero."""
    monkeypatch.setattr(attention_ops, "_BLOCK_BATCH", 16)
    g = torch.Generator().manual_seed(21)
    lengths = torch.randint(0, 4, (41,), generator=g)
    lengths[[0, 15, 16, 31, 32, 40]] = torch.tensor([0, 0, 3, 0, 2, 0])
    ctx = torch.randint(0, 12, (41,), generator=g)
    page_size, kv_heads, group, head_dim = 4, 1, 2, 16
    width = int((ctx + lengths).max()) // page_size + 1
    pages = torch.randperm(41 * width, generator=g).view(41, width).to(torch.int32)
    caches = [torch.randn(41 * width, page_size, kv_heads, head_dim, generator=g)
              for _ in range(2)]
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    q = torch.randn(int(query_start[-1]) + 2, kv_heads * group, head_dim, generator=g)
    args = (q, *caches, pages, query_start.to(torch.int32), ctx.to(torch.int32),
            head_dim**-0.5)
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    out = guarded(torch.full(q.shape, OUT_SENTINEL, device=DEVICE))
    paged_attention_into(out.tensor, *args, num_splits=num_splits, merge=merge, order=order,
                         block_m=16, block_n=16)
    out.check("out")
    assert (out.tensor[-2:] == 0).all()
    assert_close(out.tensor, ref.paged_attention(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


def test_prefill_equals_causal_sdpa_on_the_gathered_cache():
    g = torch.Generator().manual_seed(3)
    prompt, kv_heads, group, head_dim, page_size = 37, 2, 4, 80, 16
    table, num_pages = _scattered_layout([0], [prompt], prompt, page_size, 1, g)
    q = torch.randn(1, prompt, kv_heads * group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, kv_heads, head_dim, torch.float32, g)
    out = _run_kernel((q, k_cache, v_cache, _table(table), _lengths([0]), _lengths([prompt]),
                       head_dim**-0.5))
    expected = _sdpa_on_gathered_cache(q, k_cache, v_cache, table[0], 0, prompt)
    torch.testing.assert_close(out[0], expected, rtol=2e-5, atol=2e-5)


def _sdpa_on_gathered_cache(q, k_cache, v_cache, page_ids, ctx, rows):
    """SDPA of ``q[0, :rows]`` over positions ``0 .. ctx + rows - 1`` copied densely out of the
    pages, with the bottom-right causal mask (row j sees ctx + j); GQA by repeating KV heads."""
    page_size = k_cache.shape[1]
    length = ctx + rows
    pages = torch.tensor(page_ids, device=q.device)
    keys = k_cache[pages].flatten(0, 1)[:length]  # [L, Hkv, D]
    values = v_cache[pages].flatten(0, 1)[:length]
    assert keys.shape[0] == length and page_size > 0
    group = q.shape[2] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = (torch.arange(length, device=q.device)[None, :]
            <= ctx + torch.arange(rows, device=q.device)[:, None])
    out = F.scaled_dot_product_attention(
        q[0, :rows].transpose(0, 1).float(), keys.float(), values.float(), attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
    )
    return out.transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_pages_smaller_than_a_key_tile_are_read_per_key(page_size, num_splits, merge):
    # position t holds the value t in v, k = 0: row j averages positions 0 .. ctx + j
    ctx, rows, head_dim = 9, 3, 16
    num_positions = ctx + rows
    page_ids = torch.randperm(num_positions, generator=torch.Generator().manual_seed(4))
    page_ids = page_ids[: math.ceil(num_positions / page_size)].tolist()
    num_pages = num_positions
    v_cache = torch.full((num_pages, page_size, 1, head_dim), math.nan)
    k_cache = torch.full((num_pages, page_size, 1, head_dim), math.nan)
    for pos in range(num_positions):
        v_cache[page_ids[pos // page_size], pos % page_size] = float(pos)
        k_cache[page_ids[pos // page_size], pos % page_size] = 0.0
    q = torch.randn(1, rows, 2, head_dim).to(DEVICE)
    out = _run_kernel((q, k_cache.to(DEVICE), v_cache.to(DEVICE), _table([page_ids]),
                       _lengths([ctx]), _lengths([rows]), 1.0), num_splits=num_splits, merge=merge)
    for j in range(rows):
        torch.testing.assert_close(out[0, j].cpu(), torch.full((2, head_dim), (ctx + j) / 2))


@pytest.mark.parametrize("num_splits, merge", schedules(3))
def test_gqa_query_head_h_reads_kv_head_h_div_group(num_splits, merge):
    g = torch.Generator().manual_seed(5)
    q_heads, kv_heads, head_dim, page_size = 8, 2, 16, 4
    q = torch.randn(1, 3, q_heads, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(3, page_size, kv_heads, head_dim, torch.float32, g)
    rest = (_table([[1, 0, 2]]), _lengths([6]), _lengths([3]), 0.25)
    before = _run_kernel((q, k_cache, v_cache, *rest), num_splits=num_splits, merge=merge)
    v_changed = v_cache.clone()
    v_changed[:, :, 1] = 0.0
    after = _run_kernel((q, k_cache, v_changed, *rest), num_splits=num_splits, merge=merge)
    # heads 0..3 read KV head 0 (unchanged), heads 4..7 read KV head 1 (now zero)
    assert torch.equal(after[:, :, :4], before[:, :, :4])
    assert (after[:, :, 4:] == 0).all() and (before[:, :, 4:] != 0).all()


@pytest.mark.parametrize("q_len, live_rows", [(0, 0), (-3, 0), (2, 2), (5, 5), (9, 5)])
@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_rows_at_or_past_q_len_are_zero(q_len, live_rows, num_splits, merge):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 5, 2, 16, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(3, 4, 1, 16, torch.float32, g)
    args = (q, k_cache, v_cache, _table([[2, 0, 1]]), _lengths([3]), _lengths([q_len]), 0.3)
    out = _run_kernel(args, num_splits=num_splits, merge=merge)
    assert (out[0, live_rows:] == 0).all()
    assert (out[0, :live_rows] != 0).all()
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


@pytest.mark.parametrize(
    "block_table",
    [
        [[1, -1, 0]],  # negative page id
        [[1, 3, 0]],  # page id >= num_pages
        [[1]],  # page index >= P
    ],
)
@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_needed_position_without_a_page_gives_a_nan_row(block_table, num_splits, merge):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 2, 16, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(3, 4, 1, 16, torch.float32, g)
    # ctx 2: rows 0, 1 need positions <= 3 (page 0); rows 2..5 need page 1 as well
    args = (q, k_cache, v_cache, _table(block_table), _lengths([2]), _lengths([6]), 0.3)
    out = _run_kernel(args, num_splits=num_splits, merge=merge, block_n=16)
    assert out[0, :2].isfinite().all()
    assert out[0, 2:].isnan().all()


@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_negative_ctx_len_rows_without_any_visible_key_are_nan(num_splits, merge):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 5, 1, 16, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(2, 4, 1, 16, torch.float32, g)
    args = (q, k_cache, v_cache, _table([[1, 0]]), _lengths([-2]), _lengths([5]), 0.3)
    out = _run_kernel(args, num_splits=num_splits, merge=merge)
    # row j sees positions 0 .. j - 2: rows 0 and 1 see nothing
    assert out[0, :2].isnan().all()
    assert out[0, 2:].isfinite().all()
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


def test_an_empty_page_table_makes_every_live_row_nan():
    q = torch.randn(2, 3, 2, 16).to(DEVICE)
    k_cache, v_cache = _caches(2, 4, 1, 16, torch.float32, torch.Generator().manual_seed(9))
    block_table = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    out = _run_kernel((q, k_cache, v_cache, block_table, _lengths([0, 4]), _lengths([2, 3]),
                       0.3))
    assert out[0, :2].isnan().all() and (out[0, 2] == 0).all() and out[1].isnan().all()


@pytest.mark.parametrize("num_splits, merge", schedules(2))
def test_a_visible_non_finite_value_makes_its_column_nan_in_full_and_diagonal_tiles(
        num_splits, merge):
    """ctx 40, 5 rows, key tiles of 16: keys 0..31 are in full tiles (every row sees them),
    32..44 in the diagonal tile. +inf at key 5 (column 3), -inf at key 20 (column 7), NaN at
    key 35 (column 9): every row sees them, so those columns are NaN in every row; +inf at
    key 42 (column 11) is seen by rows 2..4 only. Nothing else is non-finite."""
    g = torch.Generator().manual_seed(17)
    q = torch.randn(1, 5, 2, 16, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(3, 16, 1, 16, torch.float32, g)
    table = [[2, 0, 1]]
    for key, column, value in ((5, 3, math.inf), (20, 7, -math.inf), (35, 9, math.nan),
                               (42, 11, math.inf)):
        v_cache[table[0][key // 16], key % 16, 0, column] = value
    args = (q, k_cache, v_cache, _table(table), _lengths([40]), _lengths([5]), 0.3)
    out = _run_kernel(args, num_splits=num_splits, merge=merge, block_m=16, block_n=16)
    expected_nan = torch.zeros(5, 2, 16, dtype=torch.bool)
    expected_nan[:, :, [3, 7, 9]] = True
    expected_nan[2:, :, 11] = True
    assert torch.equal(out[0].isnan().cpu(), expected_nan)
    assert out[0][~expected_nan.to(out.device)].isfinite().all()
    torch_out = pytorch(*_cpu(args))[0]
    assert torch.equal(torch_out.isnan(), expected_nan)
    assert_close(out, pytorch(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


@pytest.mark.parametrize("num_splits, merge", schedules(3))
def test_cache_contents_outside_the_visible_positions_are_never_read(num_splits, merge):
    # Every cache entry a row does not see holds NaN/inf: the unused parts of the pages, the
    # window rows after the row (its diagonal key tile), other pages.
    g = torch.Generator().manual_seed(10)
    ctx, rows, head_dim, page_size = 21, 6, 16, 16
    k_cache = torch.full((4, page_size, 1, head_dim), math.nan)
    v_cache = torch.full((4, page_size, 1, head_dim), math.inf)
    page_ids = [3, 1]
    for pos in range(ctx + rows):
        k_cache[page_ids[pos // page_size], pos % page_size] = torch.randn(1, head_dim,
                                                                           generator=g)
        v_cache[page_ids[pos // page_size], pos % page_size] = torch.randn(1, head_dim,
                                                                           generator=g)
    v_cache[page_ids[(ctx + 2) // page_size], (ctx + 2) % page_size, 0, 3] = math.nan
    k_cache[page_ids[(ctx + 4) // page_size], (ctx + 4) % page_size, 0, 5] = math.nan
    q = torch.randn(1, rows, 2, head_dim, generator=g)
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), _table([page_ids]),
            _lengths([ctx]), _lengths([rows]), 0.3)
    out = _run_kernel(args, num_splits=num_splits, merge=merge, block_n=16).cpu()
    # rows 0, 1 see neither bad entry; rows 2, 3 see v's element 3 of position ctx + 2;
    # rows 4, 5 also see a NaN key (every score, so the whole row, is NaN)
    assert out[0, :2].isfinite().all()
    assert out[0, 2:4, :, 3].isnan().all()
    assert out[0, 2:4, :, [0, 1, 2, 4, 5, 6, 7]].isfinite().all()
    assert out[0, 4:].isnan().all()
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


def test_strided_block_table_query_start_and_ctx_len_are_read_through_their_strides():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(6, 2, 16, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(6, 4, 1, 16, torch.float32, g)
    wide_table = torch.tensor([[4, -5, 0, -5, 2], [1, -5, 5, -5, 3]], dtype=torch.int32,
                              device=DEVICE)
    starts = torch.tensor([[0, 7], [3, 7], [5, 7]], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([[5, 3], [0, 2]], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, wide_table[:, ::2], starts[:, 0], lengths[:, 0], 0.3)
    out = torch.full_like(q, OUT_SENTINEL)
    paged_attention_into(out, *args)
    contiguous = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    assert_close(out, paged_attention_torch(*contiguous), ATTENTION_KERNEL_TOLERANCE, torch.float32)
    assert (out[5:] == 0).all()


def _packed_args(dtype, generator):
    """Two sequences of 3 and 2 rows after 1 and 0 committed positions, one padding row."""
    q = torch.randn(6, 4, 16, generator=generator).to(dtype).to(DEVICE)
    k_cache, v_cache = _caches(4, 2, 2, 16, dtype, generator)
    return (q, k_cache, v_cache, _table([[0, 1], [2, 3]]), _lengths([0, 3, 5]),
            _lengths([1, 0]), 0.3)


def test_launcher_returns_a_fresh_contiguous_output_and_leaves_inputs_unchanged():
    args = _packed_args(torch.float16, torch.Generator().manual_seed(12))
    q = args[0]
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = paged_attention_triton(*args)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert all(out.data_ptr() != a.data_ptr() for a in args[:3])
    for arg, copy in zip(args, copies):
        if isinstance(arg, torch.Tensor):
            assert torch.equal(arg, copy)
    assert_close(out, paged_attention_torch(*args), ATTENTION_KERNEL_TOLERANCE, torch.float16)


def test_empty_shapes_return_empty_outputs():
    k_cache, v_cache = _caches(2, 4, 1, 16, torch.float32, torch.Generator().manual_seed(13))
    for batch, rows in ((0, 3), (2, 0)):
        q = torch.randn(rows, 2, 16, device=DEVICE)
        out = paged_attention_triton(q, k_cache, v_cache,
                                     torch.zeros(batch, 1, dtype=torch.int32, device=DEVICE),
                                     _lengths([0] * (batch + 1)), _lengths([1] * batch), 0.3)
        assert out.shape == q.shape
        if batch == 0:  # no sequence: every row is padding
            assert (out == 0).all()


@pytest.mark.parametrize("head_dim", [1, 264])
def test_head_dims_outside_2_to_256_use_the_pytorch_implementation(monkeypatch, head_dim):
    g = torch.Generator().manual_seed(14)
    q = torch.randn(1, 2, 1, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(1, 4, 1, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table([[0]]), _lengths([1]), _lengths([2]), 0.1)
    monkeypatch.setattr(attention_ops, "_paged_attention_kernel", None)  # never launched
    out = triton_launcher(*args)
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


def test_launcher_has_the_signature_of_the_pytorch_implementation_and_is_registered():
    assert inspect.signature(paged_attention_triton) == inspect.signature(paged_attention_torch)
    assert _library.triton_launcher("paged_attention") is paged_attention_triton


# ---------------------------------------------------------------------------- schedules


def test_split_kv_is_chosen_only_for_decode_steps_that_underfill_the_device():
    width = 132  # multiprocessors of an H100 / H200
    config = LaunchConfig(64, 64, 4, 3)
    long_context = 16384
    # one program without splitting, far below the target
    splits = split_count(True, 1, long_context, config, width)
    assert splits == min(attention_ops.SPLIT_TARGET_WAVES * width, attention_ops.MAX_SPLITS)
    # prefill never splits
    assert split_count(False, 1, long_context, config, width) == 1
    # a grid that already fills the device does not split
    assert split_count(True, 2 * width, long_context, config, width) == 1
    # never more splits than key tiles the page table can address
    assert split_count(True, 1, 3 * 64 - 1, config, width) == 3
    assert split_count(True, 1, 10, config, width) == 1


def test_decode_steps_average_at_most_64_rows_per_sequence():
    """Only decode steps split the keys: a step whose rows average more than 64 per
    sequence is prefill and runs one pass of query tiles, however few programs it has."""
    for num_rows, batch, decode in ((64, 1, True), (65, 1, False), (1024, 16, True),
                                    (1025, 16, False)):
        _, splits = attention_ops.schedule(torch.bfloat16, num_rows, batch, 8, 4, 128, 4096,
                                           132)
        assert (splits > 1) == decode, (num_rows, batch)


def test_a_sequence_pairs_stay_in_one_tile_unless_the_table_is_too_short_to_split():
    """Every query tile of a KV head reads all of that head's keys, so a decode step keeps a
    sequence's (row, head) pairs in one 64- or 128-pair tile and gets its programs from
    splitting the keys (a Qwen3-8B step: 8 KV heads, GQA 4, 132 multiprocessors, target 264
    programs); only a table too short for that (560 positions: 9 key tiles of 64) takes
    16-pair tiles, split up to one 32-key tile each. Many sequences keep 64-pair tiles and do
    not split."""
    config, splits = attention_ops.schedule(torch.bfloat16, 16, 1, 8, 4, 128, 16384, 132)
    assert (config.block_m, config.block_n, splits) == (64, 64, 33)  # 8 programs x 33
    config, splits = attention_ops.schedule(torch.bfloat16, 32, 1, 8, 4, 128, 16384, 132)
    assert (config.block_m, config.block_n, splits) == (128, 64, 33)  # 128 pairs: one tile
    config, splits = attention_ops.schedule(torch.bfloat16, 32, 1, 8, 4, 128, 35 * 16, 132)
    programs = 8 * attention_ops.working_tiles(32, 1, 4, 16)
    assert config.block_m == 16 and programs == 64
    assert splits == min(triton_cdiv(264, programs), triton_cdiv(35 * 16, 32))
    _, splits = attention_ops.schedule(torch.bfloat16, 32, 1, 8, 4, 128, 2 * 32, 132)
    assert splits == 2  # a table of two key tiles
    config, splits = attention_ops.schedule(torch.bfloat16, 16 * 16, 16, 8, 4, 128, 16384, 132)
    assert (config.block_m, splits) == (64, 3)  # 128 working programs
    config, splits = attention_ops.schedule(torch.bfloat16, 64 * 16, 64, 8, 4, 128, 35 * 16,
                                            132)
    assert config.block_m == 64 and splits == 1


def triton_cdiv(a, b):
    return -(-a // b)


def test_default_schedule_of_a_long_decode_window_splits_and_matches_the_reference():
    # B = 1, 1 KV head, 4 window rows over 1000 positions: the default schedule splits
    g = torch.Generator().manual_seed(15)
    ctx, rows, group, head_dim, page_size = 1000, 4, 2, 16, 64
    table, num_pages = _scattered_layout([ctx], [rows], rows, page_size, 0, g)
    capacity = len(table[0]) * page_size
    _, splits = attention_ops.schedule(torch.float32, rows + 2, 1, 1, group, head_dim, capacity,
                                       attention_ops._multiprocessors(torch.device(DEVICE)))
    assert splits > 1
    q = torch.randn(1, rows, group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, 1, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table(table), _lengths([ctx]), _lengths([rows]), 0.25)
    out = _run_kernel(args)
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


def test_the_fa2_split_rule_splits_a_long_decode_window_and_matches_the_reference(
        monkeypatch):
    """WEDLM_KERNELS_ATTENTION_SPLITS=fa2: the launcher takes the FA2 rule's split count
    (here more than one chunk) and the kernel stays exact."""
    from wedlm_kernels import _backend

    monkeypatch.setattr(_backend, "ATTENTION_SPLITS", "fa2")
    g = torch.Generator().manual_seed(16)
    ctx, rows, group, head_dim, page_size = 1000, 4, 2, 16, 64
    table, num_pages = _scattered_layout([ctx], [rows], rows, page_size, 0, g)
    capacity = len(table[0]) * page_size
    _, splits = attention_ops.schedule(torch.float32, rows + 2, 1, 1, group, head_dim, capacity,
                                       attention_ops._multiprocessors(torch.device(DEVICE)),
                                       "fa2")
    assert splits > 1
    seen = []
    original = attention_ops.schedule

    def recording(*args):
        result = original(*args)
        seen.append((args[-1], result[1]))
        return result

    monkeypatch.setattr(attention_ops, "schedule", recording)
    q = torch.randn(1, rows, group, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = _caches(num_pages, page_size, 1, head_dim, torch.float32, g)
    args = (q, k_cache, v_cache, _table(table), _lengths([ctx]), _lengths([rows]), 0.25)
    out = _run_kernel(args)
    assert seen and seen[-1] == ("fa2", splits)
    assert_close(out, reference(*_cpu(args)), ATTENTION_KERNEL_TOLERANCE, torch.float32)


# ---------------------------------------------------------------------------- variants


class _RecordingKernel:
    """Stands in for a @triton.jit kernel and records the specialisation of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages=3, **constexprs):
            types = [
                POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor)
                else "fp32" if isinstance(a, float) else "i32"
                for a in args
            ]
            self.launches.append((tuple(types), tuple(sorted(constexprs.items())), num_warps,
                                  num_stages))
        return launch


_PAGE_AND_GROUP = ("GROUP", "PAGE_SIZE")


def _without_page_and_group(constexprs: tuple) -> tuple:
    return tuple((name, value) for name, value in constexprs if name not in _PAGE_AND_GROUP)


@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 80, 96, 128, 192, 256])
def test_kernel_variants_list_every_specialisation_the_launcher_produces(monkeypatch, head_dim):
    """Every launch is a listed variant but for its page size and group, which the kernel is
    specialised on (the call's own: checked here) and the listed variants sample."""
    variants = kernel_variants()
    attention, combine = _RecordingKernel(), _RecordingKernel()
    monkeypatch.setattr(attention_ops, "_paged_attention_kernel", attention)
    monkeypatch.setattr(attention_ops, "_combine_splits_kernel", combine)
    monkeypatch.setattr(attention_ops, "_upcast", lambda q: False)  # as on a GPU
    for dtype, merge in itertools.product((torch.float32, torch.float16, torch.bfloat16),
                                          MERGES):
        for rows, batch, group, num_splits in ((16, 1, 4, 1), (16, 1, 4, 3), (32, 1, 4, 2),
                                               (64, 1, 2, None), (65, 1, 1, None),
                                               (512, 1, 4, None), (7, 1, 1, 2),
                                               (1024, 64, 4, None)):
            q = torch.zeros(rows, group, head_dim, dtype=dtype)
            cache = torch.zeros(1, 16, 1, head_dim, dtype=dtype)
            out = torch.empty_like(q)
            paged_attention_into(out, q, cache, cache,
                                 torch.zeros(batch, 4, dtype=torch.int32),
                                 torch.zeros(batch + 1, dtype=torch.int32),
                                 torch.zeros(batch, dtype=torch.int32), 0.1,
                                 num_splits=num_splits, merge=merge)
            constexprs = dict(attention.launches[-1][1])
            assert (constexprs["PAGE_SIZE"], constexprs["GROUP"]) == (16, group)
    for variant in variants:
        assert list(variant.signature) == list(inspect.signature(variant.kernel.fn).parameters)
        # Triton compiles an int argument equal to 1 as a constant unless told not to: only
        # head_dim (>= 2 here) is specialised, so "i32" is what every launch compiles
        unspecialised = (attention_ops.ATTENTION_UNSPECIALISED
                         if variant.name.startswith("attention_")
                         else attention_ops.COMBINE_UNSPECIALISED)
        integers = {name for name, kind in variant.signature.items() if kind == "i32"}
        assert integers - set(unspecialised) == {"head_dim"}
    listed = {
        (
            tuple(t for t in v.signature.values() if t != "constexpr"),
            _without_page_and_group(tuple(sorted(v.constexprs.items()))),
            v.num_warps,
            v.num_stages,
        )
        for v in variants
    }
    assert len(attention.launches) == 3 * 8 * 2 and len(combine.launches) >= 3 * 3
    for types, constexprs, num_warps, num_stages in attention.launches + combine.launches:
        launch = (types, _without_page_and_group(constexprs), num_warps, num_stages)
        assert launch in listed, launch


def test_compiled_variants_cover_both_page_lookups_of_every_tile():
    """The kernel is specialised on the page size: every (dtype, BLOCK_D, tile, merge) is
    listed with pages holding whole key tiles (one page id per tile) and pages smaller than
    a tile (one page id per key), so the sm_90 compile sees both branches of _tile_pages."""
    lookups = {}
    for variant in kernel_variants():
        if not variant.name.startswith("attention_"):
            continue
        constexprs = dict(variant.constexprs)
        tile = (variant.signature["q_ptr"], constexprs["BLOCK_D"], constexprs["BLOCK_M"],
                constexprs["BLOCK_N"], variant.num_warps, constexprs["MERGE_IN_KERNEL"])
        per_tile = constexprs["PAGE_SIZE"] % constexprs["BLOCK_N"] == 0
        lookups.setdefault(tile, set()).add(per_tile)
    assert len(lookups) >= 50
    assert {tile: found for tile, found in lookups.items() if found != {True, False}} == {}


# ---------------------------------------------------------------------------- GPU only


def _qwen3_decode_inputs(batch, rows, context, page_size, dtype, generator, q_len=None):
    """Qwen3-8B heads (32 q, 8 KV, head_dim 128): ``batch`` windows of ``rows`` rows after
    ``context`` committed positions, scattered pages."""
    q_heads, kv_heads, head_dim = 32, 8, 128
    pages_per_seq = math.ceil((context + rows) / page_size)
    num_pages = batch * pages_per_seq + 3
    table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_seq]
    q = torch.randn(batch, rows, q_heads, head_dim, generator=generator).to(dtype).cuda()
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim,
                          generator=generator).to(dtype).cuda()
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim,
                          generator=generator).to(dtype).cuda()
    q_len = [rows] * batch if q_len is None else q_len
    return (q, k_cache, v_cache, table.view(batch, pages_per_seq).int().cuda(),
            torch.full((batch,), context, dtype=torch.int32, device="cuda"),
            torch.tensor(q_len, dtype=torch.int32, device="cuda"), head_dim**-0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch, rows, context, page_size", [
    (1, 16, 4000, 16), (4, 32, 777, 64), (16, 16, 2048, 16), (2, 48, 9000, 64),
    (1, 1000, 0, 16), (2, 300, 129, 64),
])
def test_qwen3_shapes_match_pytorch_on_gpu(dtype, batch, rows, context, page_size):
    g = torch.Generator().manual_seed(20)
    q_len = [rows - 3 * b for b in range(batch)]
    args = _qwen3_decode_inputs(batch, rows, context, page_size, dtype, g, q_len)
    out = _run_kernel(args)
    assert_close(out, pytorch(*args), ATTENTION_KERNEL_TOLERANCE, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
def test_head_sizes_match_pytorch_on_gpu(dtype, head_dim):
    g = torch.Generator().manual_seed(21)
    for rows, context in ((16, 1500), (200, 50)):
        table, num_pages = _scattered_layout([context, 3], [rows, rows], rows, 16, 0, g)
        q = torch.randn(2, rows, 8, head_dim, generator=g).to(dtype).cuda()
        k_cache, v_cache = _caches(num_pages, 16, 2, head_dim, dtype, g)
        args = (q, k_cache, v_cache, _table(table), _lengths([context, 3]),
                _lengths([rows, rows - 5]), head_dim**-0.5)
        assert_close(_run_kernel(args), pytorch(*args), ATTENTION_KERNEL_TOLERANCE, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("rows, context", [(16, 3000), (512, 0)])
def test_bf16_equals_sdpa_on_the_gathered_cache_on_gpu(rows, context):
    g = torch.Generator().manual_seed(22)
    args = _qwen3_decode_inputs(1, rows, context, 16, torch.bfloat16, g)
    q, k_cache, v_cache, table = args[:4]
    out = triton_launcher(*args)
    expected = _sdpa_on_gathered_cache(q, k_cache, v_cache, table[0].tolist(), context, rows)
    assert_close(out[0], expected, ATTENTION_KERNEL_TOLERANCE, torch.bfloat16)


@pytest.mark.cuda
def test_kept_launch_handles_are_the_kernels_triton_picks(monkeypatch):
    """Launches through kept compiled handles (ops/_triton.CachedLaunch) at specialisations
    that differ in what Triton specialises on (dtype, head size and so BLOCK_D, one page id
    per key or per tile, one split or several merged either way, the default schedule's
    tiles): with WEDLM_KERNELS_DEBUG Triton's own choice is checked at every launch, and
    the outputs equal the PyTorch implementation's."""
    from wedlm_kernels import _backend

    monkeypatch.setattr(_backend, "DEBUG", True)
    g = torch.Generator().manual_seed(12)
    cases = []
    for dtype, head_dim, page_size, num_splits, merge in (
            (torch.bfloat16, 64, 16, 1, None), (torch.bfloat16, 32, 16, 1, None),
            (torch.float16, 64, 64, 3, "combine"), (torch.bfloat16, 128, 64, 4, "last_program"),
            (torch.float32, 64, 16, 2, "combine"), (torch.bfloat16, 128, 16, None, None),
            (torch.bfloat16, 64, 16, None, None)):
        ctx, rows = 200, 6
        table, num_pages = _scattered_layout([ctx, 37], [rows, rows], rows, page_size, 1, g)
        q = torch.randn(2, rows, 8, head_dim, generator=g).to(dtype).to(DEVICE)
        k_cache, v_cache = _caches(num_pages, page_size, 2, head_dim, dtype, g)
        cases.append(((q, k_cache, v_cache, _table(table), _lengths([ctx, 37]),
                       _lengths([rows, rows]), 0.125), dict(num_splits=num_splits, merge=merge)))
    for args, schedule in cases * 2:  # the second round reuses the kept handles
        out = _run_kernel(args, **schedule)
        assert_close(out, pytorch(*args), ATTENTION_KERNEL_TOLERANCE, args[0].dtype)


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_inputs_matches_eager():
    """A captured call replays with new q, caches, page table, row offsets and contexts (the
    number of packed rows, a shape, stays)."""
    g = torch.Generator().manual_seed(23)
    q, k_cache, v_cache, table, ctx_len, _, scale = _qwen3_decode_inputs(
        2, 16, 3000, 16, torch.bfloat16, g)
    static = [q.reshape(32, *q.shape[2:]), k_cache, v_cache, table,
              torch.tensor([0, 16, 25], dtype=torch.int32, device="cuda"), ctx_len, scale]

    def step():
        return paged_attention_triton(*static)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for context, starts in (([100, 2500], [0, 16, 19]), ([3000, 0], [0, 1, 17])):
        fresh = _qwen3_decode_inputs(2, 16, 3000, 16, torch.bfloat16, g)
        static[0].copy_(fresh[0].reshape(32, *fresh[0].shape[2:]))
        for target, source in zip(static[1:4], fresh[1:4]):
            target.copy_(source)
        static[4].copy_(torch.tensor(starts, dtype=torch.int32))
        static[5].copy_(torch.tensor(context, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(captured, eager)
        assert_close(captured, paged_attention_torch(*static), ATTENTION_KERNEL_TOLERANCE, torch.bfloat16)
