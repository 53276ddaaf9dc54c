"""rope_cache and rope_kv_append against reference/rope.py, hand-computed rotations and the
Hugging Face Qwen3 q/k-norm + RoPE code."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import rope as ref
from tests.numerics import ROPE_TOLERANCE, assert_close
from tests.rope_inputs import eps_dominated_case
from wedlm_kernels import _backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, layout, generator):
    """q, k, v with the given memory layout: separate contiguous tensors, views of one fused
    projection (with padding columns so the row stride is odd), or head-major storage."""
    shapes = (q_heads, kv_heads, kv_heads)
    if layout == "fused":
        width = (q_heads + 2 * kv_heads) * head_dim
        qkv = torch.randn(num_tokens, width + 6, generator=generator).to(dtype)
        parts, start = [], 0
        for heads in shapes:
            parts.append(qkv[:, start : start + heads * head_dim].view(num_tokens, heads, head_dim))
            start += heads * head_dim
        return tuple(parts)
    if layout == "head_major":
        return tuple(
            torch.randn(heads, num_tokens, head_dim, generator=generator).to(dtype).transpose(0, 1)
            for heads in shapes
        )
    return tuple(
        torch.randn(num_tokens, heads, head_dim, generator=generator).to(dtype) for heads in shapes
    )


def _run_both(q, k, v, positions, cos_sin, cache_init, slot_mapping, q_norm, k_norm, eps=1e-6):
    """Run the op and the reference on separate copies of the initial caches."""
    k_cache, v_cache = cache_init[0].clone(), cache_init[1].clone()
    k_cache_ref, v_cache_ref = cache_init[0].clone(), cache_init[1].clone()
    q_out = wk.rope_kv_append(
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps
    )
    q_ref = ref.rope_kv_append(
        q, k, v, positions, cos_sin, k_cache_ref, v_cache_ref, slot_mapping, q_norm, k_norm, eps
    )
    return q_out, (k_cache, v_cache), q_ref, (k_cache_ref, v_cache_ref)


def _written_slots(slot_mapping, num_slots):
    mask = torch.zeros(num_slots, dtype=torch.bool)
    for slot in slot_mapping.tolist():
        if 0 <= slot < num_slots:
            mask[slot] = True
    return mask


@given(
    dtype=st.sampled_from(DTYPES),
    head_dim=st.sampled_from([8, 16, 64, 80, 96, 128, 256]),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    num_tokens=st.integers(0, 9),
    page_size=st.sampled_from([1, 3, 16, 64]),
    layout=st.sampled_from(["contiguous", "fused", "head_major"]),
    use_q_norm=st.booleans(),
    use_k_norm=st.booleans(),
    dropped=st.lists(st.sampled_from([-1, -1, -7, "end", "far"]), max_size=3),
    bad_positions=st.lists(st.sampled_from([-1, "max_pos", 10**9]), max_size=2),
    theta=st.sampled_from([10000.0, 1e6]),
    seed=st.integers(0, 2**31 - 1),
)
@example(dtype=torch.float32, head_dim=8, kv_heads=1, group=1,
         num_tokens=0, page_size=1, layout="contiguous", use_q_norm=False, use_k_norm=False,
         dropped=[], bad_positions=[], theta=10000.0, seed=0)
@example(dtype=torch.bfloat16, head_dim=256, kv_heads=2, group=8,
         num_tokens=9, page_size=3, layout="fused", use_q_norm=True, use_k_norm=True,
         dropped=[-1, "end", "far"], bad_positions=[-1, "max_pos"], theta=1e6, seed=1)
def test_matches_reference_and_writes_only_valid_slots(
    dtype, head_dim, kv_heads, group, num_tokens, page_size, layout,
    use_q_norm, use_k_norm, dropped, bad_positions, theta, seed,
):
    cache_dtype = dtype  # (the cache holds q's dtype)
    g = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    max_pos = 40
    q, k, v = _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, layout, g)
    num_pages = num_tokens // page_size + 2
    num_slots = num_pages * page_size
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens].clone()
    for i, bad in enumerate(dropped[:num_tokens]):
        slot_mapping[i] = {"end": num_slots, "far": num_slots + 5}.get(bad, bad)
    for i, bad in enumerate(bad_positions[:num_tokens]):
        positions[num_tokens - 1 - i] = max_pos if bad == "max_pos" else bad
    cos_sin = wk.rope_cache(max_pos, head_dim, theta)
    cache_init = tuple(
        torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(cache_dtype)
        for _ in range(2)
    )
    q_norm = torch.rand(head_dim, generator=g).to(dtype) + 0.5 if use_q_norm else None
    k_norm = torch.rand(head_dim, generator=g) + 0.5 if use_k_norm else None

    q_out, caches, q_ref, caches_ref = _run_both(
        q, k, v, positions, cos_sin, cache_init, slot_mapping, q_norm, k_norm
    )

    assert q_out.dtype == dtype and q_out.shape == q.shape and q_out.is_contiguous()
    assert_close(q_out, q_ref, ROPE_TOLERANCE, dtype)
    written = _written_slots(slot_mapping, num_slots)
    for cache, cache_ref, init in zip(caches, caches_ref, cache_init):
        flat, flat_ref = cache.view(num_slots, -1), cache_ref.view(num_slots, -1)
        flat_init = init.view(num_slots, -1)
        # both read the same input values and round once, to the cache dtype
        assert_close(flat[written], flat_ref[written], ROPE_TOLERANCE, cache_dtype)
        assert torch.equal(flat[~written], flat_init[~written])


def test_rope_cache_values_match_cos_and_sin_at_chosen_positions():
    head_dim, theta = 128, 1e6
    table = wk.rope_cache(2048, head_dim, theta)
    assert table.shape == (2048, head_dim) and table.dtype == torch.float32
    for pos, i in [(0, 0), (0, 63), (1, 0), (1, 5), (7, 1), (1000, 5), (2047, 63), (2047, 0)]:
        angle = pos * theta ** (-2 * i / head_dim)
        assert table[pos, i].item() == pytest.approx(math.cos(angle), abs=1e-7)
        assert table[pos, 64 + i].item() == pytest.approx(math.sin(angle), abs=1e-7)


def test_rope_cache_matches_reference_table():
    torch.testing.assert_close(
        wk.rope_cache(300, 80, 10000.0), ref.rope_cache(300, 80, 10000.0), rtol=0, atol=1e-7
    )


def test_rope_at_position_zero_is_identity():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, heads, 32, generator=g) for heads in (4, 2, 2))
    k_cache = torch.zeros(1, 4, 2, 32)
    v_cache = torch.zeros(1, 4, 2, 32)
    q_out = wk.rope_kv_append(
        q, k, v, torch.zeros(4, dtype=torch.int64), wk.rope_cache(8, 32, 1e6), k_cache, v_cache,
        torch.arange(4),
    )
    assert torch.equal(q_out, q)
    assert torch.equal(k_cache[0], k)
    assert torch.equal(v_cache[0], v)


def test_split_halves_rotation_by_hand():
    # D = 4: pair 0 is (x[0], x[2]) at angle p, pair 1 is (x[1], x[3]) at angle p / sqrt(theta).
    theta, pos = 100.0, 3
    q = torch.tensor([[[1.0, 0.0, 0.0, 2.0]]])
    k = torch.tensor([[[0.0, 1.0, 1.0, 0.0]]])
    v = torch.tensor([[[5.0, 6.0, 7.0, 8.0]]])
    k_cache = torch.zeros(1, 1, 1, 4)
    v_cache = torch.zeros(1, 1, 1, 4)
    q_out = wk.rope_kv_append(
        q, k, v, torch.tensor([pos]), wk.rope_cache(4, 4, theta), k_cache, v_cache,
        torch.tensor([0]),
    )
    a0, a1 = pos, pos / math.sqrt(theta)
    expected_q = [math.cos(a0), -2 * math.sin(a1), math.sin(a0), 2 * math.cos(a1)]
    expected_k = [-math.sin(a0), math.cos(a1), math.cos(a0), math.sin(a1)]
    torch.testing.assert_close(q_out[0, 0], torch.tensor(expected_q), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_cache[0, 0, 0], torch.tensor(expected_k), rtol=0, atol=1e-6)
    assert torch.equal(v_cache[0, 0, 0], v[0, 0])


@pytest.mark.parametrize("which", ["both", "q_only", "k_only"])
def test_norm_weights_apply_rms_norm_then_rope(which):
    g = torch.Generator().manual_seed(1)
    head_dim, eps = 64, 1e-5
    q, k, v = (torch.randn(3, heads, head_dim, generator=g) * 3 for heads in (4, 2, 2))
    positions = torch.tensor([5, 0, 17])
    cos_sin = wk.rope_cache(32, head_dim, 1e6)
    q_norm = torch.rand(head_dim, generator=g) + 0.5 if which != "k_only" else None
    k_norm = torch.rand(head_dim, generator=g) + 0.5 if which != "q_only" else None
    k_cache = torch.zeros(2, 2, 2, head_dim)
    v_cache = torch.zeros(2, 2, 2, head_dim)
    q_out = wk.rope_kv_append(
        q, k, v, positions, cos_sin, k_cache, v_cache, torch.tensor([3, 0, 1]),
        q_norm, k_norm, eps,
    )
    rows = cos_sin[positions][:, None, :]
    q_in = ref.rms_norm(q, q_norm, eps) if q_norm is not None else q
    k_in = ref.rms_norm(k, k_norm, eps) if k_norm is not None else k
    torch.testing.assert_close(q_out.double(), ref.apply_rope(q_in, rows), rtol=1e-5, atol=1e-5)
    k_expected = ref.apply_rope(k_in, rows)
    k_written = k_cache.view(4, 2, head_dim)[[3, 0, 1]]
    torch.testing.assert_close(k_written.double(), k_expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache.view(4, 2, head_dim)[[3, 0, 1]], v)


def test_rms_norm_eps_is_added_to_the_mean_square_of_q_and_k():
    """Inputs of about 1e-3 with eps = 1e-2: the result is decided by eps."""
    args, q_expected, k_expected = eps_dominated_case()
    q_out = wk.rope_kv_append(*args)
    k_cache = args[5]
    tokens, kv_heads, head_dim = k_expected.shape
    k_written = k_cache.view(-1, kv_heads, head_dim)[:tokens]
    torch.testing.assert_close(q_out.double(), q_expected, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(k_written.double(), k_expected, rtol=2e-5, atol=1e-7)


def test_qk_norm_before_rope_matches_hugging_face_qwen3():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    g = torch.Generator().manual_seed(2)
    tokens, q_heads, kv_heads, head_dim, theta, eps = 6, 4, 2, 64, 1e6, 1e-6
    config = Qwen3Config(
        hidden_size=q_heads * head_dim, num_attention_heads=q_heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps), Qwen3RMSNorm(head_dim, eps)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    q = torch.randn(tokens, q_heads, head_dim, generator=g) * 2
    k = torch.randn(tokens, kv_heads, head_dim, generator=g) * 2
    v = torch.randn(tokens, kv_heads, head_dim, generator=g)
    positions = torch.tensor([0, 3, 1, 40, 17, 63])

    with torch.no_grad():
        cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
        q_hf, k_hf = apply_rotary_pos_emb(
            q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None], cos, sin
        )
    k_cache = torch.zeros(tokens, 1, kv_heads, head_dim)
    v_cache = torch.zeros(tokens, 1, kv_heads, head_dim)
    q_out = wk.rope_kv_append(
        q, k, v, positions, wk.rope_cache(64, head_dim, theta), k_cache, v_cache,
        torch.arange(tokens), q_norm.weight.detach(), k_norm.weight.detach(), eps,
    )
    # HF computes the angles in fp32 (error ~ pos * 6e-8 rad), this library in float64.
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_cache[:, 0], k_hf[0].transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_fused_qkv_projection_views_are_accepted():
    g = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, head_dim, hidden = 5, 8, 2, 16, 48
    x = torch.randn(tokens, hidden, generator=g)
    weight = torch.randn(hidden, (q_heads + 2 * kv_heads) * head_dim, generator=g)
    qkv = x @ weight
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    positions = torch.tensor([4, 2, 9, 0, 1])
    cos_sin = wk.rope_cache(16, head_dim, 1e4)
    cache_init = (torch.zeros(2, 4, kv_heads, head_dim), torch.zeros(2, 4, kv_heads, head_dim))
    q_out, caches, q_ref, caches_ref = _run_both(
        q, k, v, positions, cos_sin, cache_init, torch.tensor([7, 1, 2, 6, 3]), None, None
    )
    # values are O(50) here: relative tolerance only
    torch.testing.assert_close(q_out.double(), q_ref, rtol=1e-5, atol=1e-4)
    for cache, cache_ref in zip(caches, caches_ref):
        torch.testing.assert_close(cache, cache_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bad_slot", [-1, -3, 8, 1000])
def test_padding_and_out_of_range_slots_drop_the_write(bad_slot):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 2, 8, generator=g) for _ in range(3))
    k_cache = torch.randn(2, 4, 2, 8, generator=g)
    v_cache = torch.randn(2, 4, 2, 8, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.tensor([bad_slot, 5, bad_slot])
    q_out = wk.rope_kv_append(
        q, k, v, torch.tensor([1, 2, 3]), wk.rope_cache(8, 8, 1e4), k_cache, v_cache,
        slot_mapping,
    )
    q_ref = ref.rope_kv_append(
        q, k, v, torch.tensor([1, 2, 3]), wk.rope_cache(8, 8, 1e4), k_before.clone(),
        v_before.clone(), slot_mapping,
    )
    torch.testing.assert_close(q_out.double(), q_ref, rtol=1e-5, atol=1e-5)  # q still rotated
    changed = (k_cache != k_before).any(-1).any(-1).view(-1)
    assert changed.tolist() == [i == 5 for i in range(8)]
    assert torch.equal(v_cache.view(8, 2, 8)[5], v[1])
    assert torch.equal(v_cache.view(8, 2, 8)[[0, 1, 2, 3, 4, 6, 7]],
                      v_before.view(8, 2, 8)[[0, 1, 2, 3, 4, 6, 7]])


def test_all_slots_dropped_leaves_the_cache_unchanged():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1, 8, generator=g).half() for _ in range(3))
    k_cache = torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64).half()
    v_cache = torch.randn(1, 2, 1, 8, generator=g).half()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    wk.rope_kv_append(
        q, k, v, torch.tensor([0, 1]), wk.rope_cache(4, 8, 1e4), k_cache, v_cache,
        torch.tensor([-1, -1]),
    )
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("bad_position", [-1, 16, 10**12])
def test_out_of_range_position_is_loud(bad_position):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 2, 8, generator=g) for _ in range(3))
    k_cache = torch.zeros(1, 4, 2, 8)
    v_cache = torch.zeros(1, 4, 2, 8)
    q_out = wk.rope_kv_append(
        q, k, v, torch.tensor([3, bad_position, 15]), wk.rope_cache(16, 8, 1e4), k_cache,
        v_cache, torch.tensor([0, 1, 2]),
    )
    assert q_out[1].isnan().all() and k_cache[0, 1].isnan().all() and v_cache[0, 1].isnan().all()
    assert q_out[[0, 2]].isfinite().all()
    assert k_cache[0, [0, 2]].isfinite().all() and v_cache[0, [0, 2]].isfinite().all()
    assert (k_cache[0, 3] == 0).all() and (v_cache[0, 3] == 0).all()


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_a_cache_of_another_dtype_than_q_is_refused_naming_both(name):
    """The one cache contract: rope_kv_append writes what paged_attention reads, q's dtype
    (an fp32 q with a bf16 cache would write, then attention would refuse it)."""
    q, k, v = (torch.randn(2, 1, 16) for _ in range(3))
    caches = {"k_cache": torch.zeros(1, 2, 1, 16), "v_cache": torch.zeros(1, 2, 1, 16)}
    caches[name] = caches[name].bfloat16()
    with pytest.raises(TypeError, match=rf"`{name}` must have q's dtype float32, got bfloat16"):
        wk.rope_kv_append(q, k, v, torch.tensor([0, 0]), wk.rope_cache(1, 16, 1e4),
                          caches["k_cache"], caches["v_cache"], torch.tensor([1, 0]))
    assert not caches["k_cache"].any() and not caches["v_cache"].float().any()
    with pytest.raises(TypeError, match="`k_cache` must have dtype float32, got bfloat16"):
        wk.paged_attention(q, caches["k_cache"].bfloat16(), caches["v_cache"].bfloat16(),
                           torch.zeros(1, 1, dtype=torch.int32),
                           torch.tensor([0, 2], dtype=torch.int32),
                           torch.zeros(1, dtype=torch.int32), scale=0.25)


def test_q_out_is_a_fresh_contiguous_tensor():
    q = torch.randn(3, 2, 8)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    q_before = q.clone()
    q_out = wk.rope_kv_append(
        q, k, v, torch.tensor([0, 0, 0]), wk.rope_cache(2, 8, 1e4), torch.zeros(1, 3, 1, 8),
        torch.zeros(1, 3, 1, 8), torch.tensor([0, 1, 2]),
    )
    assert q_out.data_ptr() != q.data_ptr() and q_out.is_contiguous()
    assert torch.equal(q, q_before)


def test_zero_tokens_return_an_empty_q_and_write_nothing():
    k_cache = torch.randn(1, 2, 1, 8)
    before = k_cache.clone()
    q_out = wk.rope_kv_append(
        torch.empty(0, 2, 8), torch.empty(0, 1, 8), torch.empty(0, 1, 8),
        torch.empty(0, dtype=torch.int64), wk.rope_cache(2, 8, 1e4), k_cache,
        torch.zeros(1, 2, 1, 8), torch.empty(0, dtype=torch.int64),
    )
    assert q_out.shape == (0, 2, 8) and torch.equal(k_cache, before)


# ---------------------------------------------------------------------------- validation


def _valid_args(**override):
    args = dict(
        q=torch.randn(3, 4, 8), k=torch.randn(3, 2, 8), v=torch.randn(3, 2, 8),
        positions=torch.tensor([0, 1, 2]), cos_sin=wk.rope_cache(4, 8, 1e4),
        k_cache=torch.zeros(2, 2, 2, 8), v_cache=torch.zeros(2, 2, 2, 8),
        slot_mapping=torch.tensor([0, 1, 2]), q_norm_weight=None, k_norm_weight=None, eps=1e-6,
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override, error, name",
    [
        (dict(q=[[0.0]]), TypeError, "`q`"),
        (dict(q=torch.zeros(3, 4, 8, dtype=torch.int32)), TypeError, "`q`"),
        (dict(k=torch.randn(3, 2, 8).half()), TypeError, "`k`"),
        (dict(v=torch.randn(3, 2, 8).double()), TypeError, "`v`"),
        (dict(positions=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "`positions`"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "`slot_mapping`"),
        (dict(cos_sin=wk.rope_cache(4, 8, 1e4).half()), TypeError, "`cos_sin`"),
        (dict(k_cache=torch.zeros(2, 2, 2, 8, dtype=torch.float64),
              v_cache=torch.zeros(2, 2, 2, 8, dtype=torch.float64)), TypeError, "`k_cache`"),
        (dict(v_cache=torch.zeros(2, 2, 2, 8).half()), TypeError, "`v_cache`"),
        (dict(q_norm_weight=torch.ones(8, dtype=torch.int64)), TypeError, "`q_norm_weight`"),
        (dict(q=torch.randn(3, 4, 7), k=torch.randn(3, 2, 7), v=torch.randn(3, 2, 7)),
         ValueError, "`q`"),
        (dict(q=torch.randn(3, 4, 16)[..., ::2]), ValueError, "`q`"),
        (dict(k=torch.randn(4, 2, 8)), ValueError, "`k`"),
        (dict(k=torch.randn(3, 2, 16)[..., ::2]), ValueError, "`k`"),
        (dict(v=torch.randn(3, 3, 8)), ValueError, "`v`"),
        (dict(positions=torch.tensor([0, 1])), ValueError, "`positions`"),
        (dict(slot_mapping=torch.tensor([[0, 1, 2]])), ValueError, "`slot_mapping`"),
        (dict(cos_sin=wk.rope_cache(4, 16, 1e4)), ValueError, "`cos_sin`"),
        (dict(cos_sin=torch.empty(0, 8)), ValueError, "`cos_sin`"),
        (dict(k_cache=torch.zeros(2, 2, 3, 8)), ValueError, "`k_cache`"),
        (dict(k_cache=torch.zeros(2, 2, 8, 2).transpose(2, 3)), ValueError, "`k_cache`"),
        (dict(k_cache=torch.zeros(0, 2, 2, 8), v_cache=torch.zeros(0, 2, 2, 8)),
         ValueError, "`k_cache`"),
        (dict(v_cache=torch.zeros(2, 3, 2, 8)), ValueError, "`v_cache`"),
        (dict(k_norm_weight=torch.ones(4)), ValueError, "`k_norm_weight`"),
        (dict(eps=0.0), ValueError, "`eps`"),
        (dict(eps=float("nan")), ValueError, "`eps`"),
        (dict(eps="1e-6"), TypeError, "`eps`"),
    ],
)
def test_rope_kv_append_rejects_bad_arguments(override, error, name):
    with pytest.raises(error, match=name):
        wk.rope_kv_append(**_valid_args(**override))


@pytest.mark.parametrize(
    "args, error, name",
    [
        ((0, 8, 1e4), ValueError, "`max_pos`"),
        ((4, 7, 1e4), ValueError, "`head_dim`"),
        ((4, 0, 1e4), ValueError, "`head_dim`"),
        ((4.0, 8, 1e4), TypeError, "`max_pos`"),
        ((4, 8, 0.0), ValueError, "`theta`"),
        ((4, 8, -1e4), ValueError, "`theta`"),
        ((4, 8, float("inf")), ValueError, "`theta`"),
    ],
)
def test_rope_cache_rejects_bad_arguments(args, error, name):
    with pytest.raises(error, match=name):
        wk.rope_cache(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_rope_kv_append_rejects_tensors_on_different_devices():
    with pytest.raises(ValueError, match="`k_cache`"):
        wk.rope_kv_append(**_valid_args(k_cache=torch.zeros(2, 2, 2, 8, device="cuda")))


@pytest.mark.parametrize(
    "override, name",
    [
        (dict(positions=torch.tensor([0, 4, 1])), "`positions`"),
        (dict(positions=torch.tensor([0, -1, 1])), "`positions`"),
        (dict(slot_mapping=torch.tensor([0, 4, 1])), "`slot_mapping`"),
        (dict(slot_mapping=torch.tensor([0, -2, 1])), "`slot_mapping`"),
        (dict(slot_mapping=torch.tensor([3, -1, 3])), "`slot_mapping`"),
    ],
)
def test_debug_mode_rejects_out_of_range_values(monkeypatch, override, name):
    monkeypatch.setattr(_backend, "DEBUG", True)
    with pytest.raises(ValueError, match=name):
        wk.rope_kv_append(**_valid_args(**override))


def test_debug_mode_accepts_padding_slots(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", True)
    wk.rope_kv_append(**_valid_args(slot_mapping=torch.tensor([-1, 3, -1])))
