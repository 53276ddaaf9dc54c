"""paged_attention against reference/attention.py and against PyTorch's scaled_dot_product_attention
on the same keys and values stored densely."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import attention as ref
from tests.attention_inputs import padded, uneven_packed_case
from tests.numerics import ATTENTION_KERNEL_TOLERANCE, ATTENTION_TOLERANCE, assert_close
from wedlm_kernels import _backend
from wedlm_kernels.ops import attention as attention_ops

# the op and the reference in the padded form [B, S, Hq, D] with q_len rows per sequence
# (two padding rows after the packed rows, which must come back as zeros)
attention = padded(wk.paged_attention, extra_rows=2)
reference = padded(ref.paged_attention)
# the two PyTorch paths (CPU tensors take the per-sequence one through wk.paged_attention)
TORCH_PATHS = {
    "per_sequence": padded(attention_ops.paged_attention_torch_per_sequence, extra_rows=2),
    "gathered": padded(attention_ops.paged_attention_torch_gathered, extra_rows=2),
}

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the op's tolerance: the kernel's where WEDLM_KERNELS_BACKEND=interpret runs it on CPU
# tensors (its probabilities enter P @ V rounded to fp16/bf16), else the PyTorch path's
OP_TOLERANCE = (ATTENTION_KERNEL_TOLERANCE if _backend.BACKEND == "interpret"
                else ATTENTION_TOLERANCE)


def _paged(dense_k, dense_v, page_size, page_ids, num_pages, generator):
    """Store dense ``[L, Hkv, D]`` keys/values of one sequence in the given pages of fresh
    random caches; return the caches."""
    length, kv_heads, head_dim = dense_k.shape
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator)
    for pos in range(length):
        page = page_ids[pos // page_size]
        k_cache[page, pos % page_size] = dense_k[pos]
        v_cache[page, pos % page_size] = dense_v[pos]
    return k_cache.to(dense_k.dtype), v_cache.to(dense_v.dtype)


def _sdpa(q, keys, values, mask=None, is_causal=False):
    """SDPA over ``q [S, Hq, D]`` and dense ``keys/values [L, Hkv, D]``; GQA by repeating KV
    heads (head h reads KV head h // group)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=is_causal, scale=q.shape[-1] ** -0.5,
    )
    return out[0].transpose(0, 1)


def _table(rows, width):
    return torch.tensor(rows, dtype=torch.int32).view(-1, width)


def _lengths(values):
    return torch.tensor(values, dtype=torch.int32)


@given(
    dtype=st.sampled_from(DTYPES),
    head_dim=st.sampled_from([8, 16, 64, 80, 96, 128]),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    page_size=st.sampled_from([1, 3, 16, 64]),
    rows=st.integers(1, 6),
    sequences=st.lists(
        st.tuples(
            st.sampled_from(["zero", "one", "boundary", "boundary-1", "any"]),
            st.sampled_from(["zero", "one", "all", "any", "over", "negative"]),
            st.integers(0, 2**16),
        ),
        min_size=1, max_size=3,
    ),
    extra_pages=st.integers(0, 2),
    unused_entries=st.sampled_from(["minus_one", "garbage"]),
    strided_q=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(dtype=torch.float32, head_dim=8, kv_heads=1, group=1, page_size=1, rows=1,
         sequences=[("zero", "one", 0)], extra_pages=0, unused_entries="minus_one",
         strided_q=False, seed=0)
@example(dtype=torch.float16, head_dim=128, kv_heads=2, group=8, page_size=64, rows=6,
         sequences=[("boundary", "all", 2), ("boundary-1", "over", 5), ("any", "negative", 9)],
         extra_pages=2, unused_entries="garbage", strided_q=True, seed=1)
def test_matches_reference(
    dtype, head_dim, kv_heads, group, page_size, rows, sequences, extra_pages, unused_entries,
    strided_q, seed,
):
    g = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    ctx_len, q_len, needed_pages = [], [], []
    for ctx_kind, q_len_kind, draw in sequences:
        boundary = page_size * (1 + draw % 3)
        ctx = {"zero": 0, "one": 1, "boundary": boundary, "boundary-1": boundary - 1,
               "any": draw % (3 * page_size + 5)}[ctx_kind]
        live = {"zero": 0, "one": 1, "all": rows, "any": draw % (rows + 1), "over": rows + 3,
                "negative": -2}[q_len_kind]
        ctx_len.append(ctx)
        q_len.append(live)
        needed_pages.append(math.ceil((ctx + min(max(live, 0), rows)) / page_size))
    width = max(needed_pages) + extra_pages
    num_pages = sum(needed_pages) + 2
    # scattered, non-consecutive page ids; entries past a sequence's needs are unused
    free_pages = torch.randperm(num_pages, generator=g).tolist()
    table = []
    for needed in needed_pages:
        own = [free_pages.pop() for _ in range(needed)]
        filler = -1 if unused_entries == "minus_one" else num_pages - 1
        table += own + [filler] * (width - needed)
    batch = len(sequences)
    if strided_q:
        q = torch.randn(batch, q_heads, rows, head_dim + 3, generator=g).to(dtype)
        q = q.transpose(1, 2)[..., :head_dim]
    else:
        q = torch.randn(batch, rows, q_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(dtype)
    block_table = torch.tensor(table, dtype=torch.int32).reshape(batch, width)
    args = (q, k_cache, v_cache, block_table, _lengths(ctx_len), _lengths(q_len), head_dim**-0.5)

    out = attention(*args)

    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    expected = reference(*args)
    assert not expected.isnan().any()  # every needed page is covered here
    assert_close(out, expected, OP_TOLERANCE, dtype)
    # the graph-safe path CUDA tensors take with the PyTorch backend, on the same case
    gathered = TORCH_PATHS["gathered"](*args)
    assert gathered.shape == q.shape and gathered.dtype == dtype
    assert_close(gathered, expected, ATTENTION_TOLERANCE, dtype)


@pytest.mark.parametrize("group", [1, 4])
def test_equals_sdpa_with_bottom_right_causal_mask_on_the_dense_cache(group):
    g = torch.Generator().manual_seed(0)
    ctx, rows, kv_heads, head_dim, page_size = 13, 5, 2, 32, 4
    length = ctx + rows
    dense_k = torch.randn(length, kv_heads, head_dim, generator=g)
    dense_v = torch.randn(length, kv_heads, head_dim, generator=g)
    page_ids = [6, 1, 9, 3, 0]  # scattered, covers 20 positions
    k_cache, v_cache = _paged(dense_k, dense_v, page_size, page_ids, 10, g)
    q = torch.randn(1, rows, kv_heads * group, head_dim, generator=g)
    out = attention(
        q, k_cache, v_cache, _table(page_ids, 5), _lengths([ctx]), _lengths([rows]),
        head_dim**-0.5,
    )
    # row j sees key positions 0 .. ctx + j
    mask = torch.arange(length)[None, :] <= ctx + torch.arange(rows)[:, None]
    expected = _sdpa(q[0], dense_k, dense_v, mask=mask)
    torch.testing.assert_close(out[0], expected, rtol=2e-5, atol=2e-5)


def test_prefill_equals_plain_causal_sdpa():
    g = torch.Generator().manual_seed(1)
    prompt, kv_heads, q_heads, head_dim, page_size = 11, 2, 4, 16, 3
    dense_k = torch.randn(prompt, kv_heads, head_dim, generator=g)
    dense_v = torch.randn(prompt, kv_heads, head_dim, generator=g)
    page_ids = [2, 7, 4, 0]
    k_cache, v_cache = _paged(dense_k, dense_v, page_size, page_ids, 8, g)
    q = torch.randn(1, prompt, q_heads, head_dim, generator=g)
    out = attention(
        q, k_cache, v_cache, _table(page_ids, 4), _lengths([0]), _lengths([prompt]),
        head_dim**-0.5,
    )
    expected = _sdpa(q[0], dense_k, dense_v, is_causal=True)
    torch.testing.assert_close(out[0], expected, rtol=2e-5, atol=2e-5)


def test_scattered_page_ids_read_their_own_pages():
    # position t holds the constant value t in v: the single-position row 0 returns it.
    page_size, head_dim = 2, 4
    page_ids = [5, 0, 3]
    v_cache = torch.full((6, page_size, 1, head_dim), -100.0)
    for pos in range(6):
        v_cache[page_ids[pos // page_size], pos % page_size] = float(pos)
    k_cache = torch.zeros_like(v_cache)  # uniform weights over the visible positions
    q = torch.randn(1, 3, 1, head_dim)
    out = attention(
        q, k_cache, v_cache, _table(page_ids, 3), _lengths([3]), _lengths([3]), 1.0
    )
    # row j averages positions 0 .. 3 + j: mean = (3 + j) / 2
    for j in range(3):
        torch.testing.assert_close(out[0, j], torch.full((1, head_dim), (3 + j) / 2))


def test_gqa_query_head_h_reads_kv_head_h_div_group():
    g = torch.Generator().manual_seed(2)
    q_heads, kv_heads, head_dim = 8, 2, 16
    q = torch.randn(1, 3, q_heads, head_dim, generator=g)
    k_cache = torch.randn(2, 4, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(2, 4, kv_heads, head_dim, generator=g)
    args = (_table([1, 0], 2), _lengths([4]), _lengths([3]), 0.25)
    before = attention(q, k_cache, v_cache, *args)
    v_changed = v_cache.clone()
    v_changed[:, :, 1] = 0.0
    after = attention(q, k_cache, v_changed, *args)
    # heads 0..3 read KV head 0 (unchanged), heads 4..7 read KV head 1 (now zero)
    assert torch.equal(after[:, :, :4], before[:, :, :4])
    assert (after[:, :, 4:] == 0).all() and (before[:, :, 4:] != 0).all()


@pytest.mark.parametrize("path", list(TORCH_PATHS))
def test_single_visible_position_returns_its_value(path):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 2, 8, generator=g)
    k_cache = torch.randn(1, 4, 1, 8, generator=g)
    v_cache = torch.randn(1, 4, 1, 8, generator=g)
    out = TORCH_PATHS[path](
        q, k_cache, v_cache, _table([0], 1), _lengths([0]), _lengths([1]), 0.5
    )
    torch.testing.assert_close(out[0, 0], v_cache[0, 0].expand(2, 8))
    assert (out[0, 1] == 0).all()


@pytest.mark.parametrize("q_len, live_rows", [(0, 0), (-3, 0), (2, 2), (4, 4), (9, 4)])
@pytest.mark.parametrize("path", list(TORCH_PATHS))
def test_rows_at_or_past_q_len_are_zero(q_len, live_rows, path):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 2, 8, generator=g)
    k_cache = torch.randn(3, 4, 1, 8, generator=g)
    v_cache = torch.randn(3, 4, 1, 8, generator=g)
    args = (q, k_cache, v_cache, _table([2, 0], 2), _lengths([3]), _lengths([q_len]), 0.3)
    out = TORCH_PATHS[path](*args)
    assert (out[0, live_rows:] == 0).all()
    assert (out[0, :live_rows] != 0).all()
    assert_close(out, reference(*args), ATTENTION_TOLERANCE, torch.float32)


@pytest.mark.parametrize(
    "block_table, width",
    [
        ([1, -1], 2),  # negative page id
        ([1, 3], 2),  # page id >= num_pages
        ([1], 1),  # page index >= P
    ],
)
@pytest.mark.parametrize("path", list(TORCH_PATHS))
def test_needed_position_without_a_page_gives_a_nan_row(block_table, width, path):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 2, 8, generator=g)
    k_cache = torch.randn(3, 4, 1, 8, generator=g)
    v_cache = torch.randn(3, 4, 1, 8, generator=g)
    # ctx 2: rows 0, 1 need positions <= 3 (page 0); rows 2..5 need page 1 as well
    args = (q, k_cache, v_cache, _table(block_table, width), _lengths([2]), _lengths([6]), 0.3)
    out = TORCH_PATHS[path](*args)
    assert out[0, :2].isfinite().all()
    assert out[0, 2:].isnan().all()
    assert_close(out, reference(*args), ATTENTION_TOLERANCE, torch.float32)


@pytest.mark.parametrize("path", list(TORCH_PATHS))
def test_cache_contents_outside_the_visible_positions_are_never_read(path):
    g = torch.Generator().manual_seed(6)
    ctx, rows, head_dim = 5, 4, 8
    k_cache = torch.full((4, 4, 1, head_dim), math.nan)
    v_cache = torch.full((4, 4, 1, head_dim), math.inf)
    page_ids = [3, 1, 0]
    for pos in range(ctx + rows):
        k_cache[page_ids[pos // 4], pos % 4] = torch.randn(1, head_dim, generator=g)
        v_cache[page_ids[pos // 4], pos % 4] = torch.randn(1, head_dim, generator=g)
    v_cache[page_ids[(ctx + 2) // 4], (ctx + 2) % 4, 0, 3] = math.nan  # row 2's own value
    q = torch.randn(1, rows, 2, head_dim, generator=g)
    args = (q, k_cache, v_cache, _table(page_ids, 3), _lengths([ctx]), _lengths([rows]), 0.3)
    out = TORCH_PATHS[path](*args)
    # rows 0, 1 do not see position ctx + 2; rows 2, 3 do, in element 3 only
    assert out[0, :2].isfinite().all()
    assert out[0, 2:, :, 3].isnan().all()
    assert out[0, 2:, :, [0, 1, 2, 4, 5, 6, 7]].isfinite().all()
    assert_close(out, reference(*args), ATTENTION_TOLERANCE, torch.float32)


def test_inputs_are_not_modified_and_the_output_is_fresh():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k_cache = torch.randn(4, 2, 2, 8, generator=g)
    v_cache = torch.randn(4, 2, 2, 8, generator=g)
    args = (q, k_cache, v_cache, _table([0, 1, 2, 3], 2), _lengths([1, 0]), _lengths([3, 2]), 0.3)
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = attention(*args)
    for arg, copy in zip(args, copies):
        if isinstance(arg, torch.Tensor):
            assert torch.equal(arg, copy)
    assert all(out.data_ptr() != a.data_ptr() for a in args[:3])


# ---------------------------------------------------------------------------- validation


def _valid_args(**override):
    # 2 sequences of 3 and 2 rows after 1 and 0 committed positions, and one padding row
    args = dict(
        q=torch.randn(6, 4, 8), k_cache=torch.zeros(4, 2, 2, 8),
        v_cache=torch.zeros(4, 2, 2, 8), block_table=_table([0, 1, 2, 3], 2),
        query_start=_lengths([0, 3, 5]), ctx_len=_lengths([1, 0]), scale=0.3,
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override, error, name",
    [
        (dict(q=[[0.0]]), TypeError, "`q`"),
        (dict(q=torch.zeros(6, 4, 8, dtype=torch.int64)), TypeError, "`q`"),
        (dict(k_cache=torch.zeros(4, 2, 2, 8).half()), TypeError, "`k_cache`"),
        (dict(v_cache=torch.zeros(4, 2, 2, 8).bfloat16()), TypeError, "`v_cache`"),
        (dict(block_table=_table([0, 1, 2, 3], 2).long()), TypeError, "`block_table`"),
        (dict(query_start=_lengths([0, 3, 5]).long()), TypeError, "`query_start`"),
        (dict(ctx_len=_lengths([1, 0]).long()), TypeError, "`ctx_len`"),
        (dict(scale="0.3"), TypeError, "`scale`"),
        (dict(scale=float("nan")), ValueError, "`scale`"),
        (dict(scale=float("inf")), ValueError, "`scale`"),
        (dict(q=torch.randn(2, 3, 4, 8)), ValueError, "`q`"),
        (dict(q=torch.randn(6, 4, 16)[..., ::2]), ValueError, "`q`"),
        (dict(q=torch.randn(6, 3, 8)), ValueError, "`q`.*`k_cache`"),
        (dict(k_cache=torch.zeros(4, 2, 2, 6)), ValueError, "`k_cache`"),
        (dict(k_cache=torch.zeros(4, 8, 2, 2).transpose(1, 3)), ValueError, "`k_cache`"),
        (dict(k_cache=torch.zeros(0, 2, 2, 8), v_cache=torch.zeros(0, 2, 2, 8)),
         ValueError, "`k_cache`"),
        (dict(v_cache=torch.zeros(4, 2, 1, 8)), ValueError, "`v_cache`"),
        (dict(v_cache=torch.zeros(4, 2, 8, 2).transpose(2, 3)), ValueError, "`v_cache`"),
        (dict(block_table=_table([0, 1, 2, 3, 0, 1], 2)), ValueError, "`query_start`"),
        (dict(query_start=_lengths([0, 5])), ValueError, "`query_start`"),
        (dict(ctx_len=_lengths([1, 0, 0])), ValueError, "`ctx_len`"),
    ],
)
def test_paged_attention_rejects_bad_arguments(override, error, name):
    with pytest.raises(error, match=name):
        wk.paged_attention(**_valid_args(**override))


def test_arguments_are_checked_once_per_signature_and_every_new_signature_is_checked(
        monkeypatch):
    """A decode loop's repeated calls pay the checks once per signature (dtypes, shapes,
    strides, devices, scale); a call that differs in any of them is checked again."""
    from wedlm_kernels.ops import attention as attention_module
    from wedlm_kernels.ops._validate import CheckedSignatures

    calls = []
    check = attention_module._check_arguments
    monkeypatch.setattr(attention_module, "_check_arguments",
                        lambda *args: calls.append(1) or check(*args))
    monkeypatch.setattr(attention_module, "_CHECKED", CheckedSignatures())
    for _ in range(3):
        wk.paged_attention(**_valid_args())
    assert len(calls) == 1
    wk.paged_attention(**_valid_args(scale=0.25))  # another scale
    assert len(calls) == 2
    with pytest.raises(TypeError, match="`v_cache`"):  # another dtype
        wk.paged_attention(**_valid_args(v_cache=torch.zeros(4, 2, 2, 8).half()))
    with pytest.raises(ValueError, match="`q`"):  # another stride
        wk.paged_attention(**_valid_args(q=torch.randn(6, 4, 16)[..., ::2]))
    with pytest.raises(ValueError, match="`scale`"):
        wk.paged_attention(**_valid_args(scale=float("inf")))
    with pytest.raises(ValueError, match="`ctx_len`"):  # another shape
        wk.paged_attention(**_valid_args(ctx_len=_lengths([1, 0, 0])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_paged_attention_rejects_tensors_on_different_devices():
    with pytest.raises(ValueError, match="`ctx_len`"):
        wk.paged_attention(**_valid_args(ctx_len=_lengths([1, 0]).cuda()))


@pytest.mark.parametrize(
    "override, name",
    [
        (dict(ctx_len=_lengths([-1, 0])), "`ctx_len`"),
        (dict(query_start=_lengths([1, 3, 5])), "`query_start\\[0\\]`"),
        (dict(query_start=_lengths([0, 4, 3])), "`query_start` must be non-decreasing"),
        (dict(query_start=_lengths([0, 3, 7])), "`query_start\\[B\\]`"),
        (dict(ctx_len=_lengths([2, 0])), "`block_table`"),  # needs 5 positions = 3 pages
        (dict(block_table=_table([0, 4, 2, 3], 2)), "`block_table`"),
        (dict(block_table=_table([0, 1, -1, 3], 2)), "`block_table`"),
    ],
)
def test_debug_mode_rejects_uncovered_or_out_of_range_values(monkeypatch, override, name):
    monkeypatch.setattr(_backend, "DEBUG", True)
    with pytest.raises(ValueError, match=name):
        wk.paged_attention(**_valid_args(**override))


def test_debug_mode_accepts_unused_page_table_entries(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", True)
    wk.paged_attention(**_valid_args(block_table=_table([0, 1, 2, -1], 2),
                                     query_start=_lengths([0, 3, 4])))


# ---------------------------------------------------------------------------- packed layout


def test_packed_rows_of_uneven_sequences_and_padding_rows():
    """Sequences of 0, 70, 1 and 5 rows back to back, then 3 padding rows: each row equals
    the reference, padding rows are zero."""
    args = uneven_packed_case(torch.Generator().manual_seed(8))
    expected = ref.paged_attention(*args)
    for path in (attention_ops.paged_attention_torch_per_sequence,
                 attention_ops.paged_attention_torch_gathered):
        out = path(*args)
        assert (out[-3:] == 0).all() and out[:-3].isfinite().all()
        assert_close(out, expected, ATTENTION_TOLERANCE, torch.float32)
