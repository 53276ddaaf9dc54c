"""The Triton kernel of rope_kv_append, called through its launcher (Triton's interpreter when
there is no GPU), against reference/rope.py and the PyTorch implementation; outputs and both
caches between guard bands. GPU-only checks (bf16, Qwen3-8B shapes, CUDA graphs, a cache of
more than 2^31 elements of real memory) are marked ``cuda``."""

import inspect
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import rope as ref
from tests.int64_checks import rope_kv_append_cache
from tests.kernel_harness import guarded
from tests.numerics import ROPE_TOLERANCE, assert_close
from tests.rope_inputs import eps_dominated_case
from wedlm_kernels.ops import rope as rope_ops
from wedlm_kernels.ops._triton import POINTER_TYPES
from wedlm_kernels.ops.rope import (
    kernel_variants,
    rope_kv_append_into,
    rope_kv_append_torch,
    rope_kv_append_triton,
)

ON_GPU = torch.cuda.is_available()
# where the kernel runs, as the `kernel_device` fixture (hypothesis tests cannot take
# function-scoped fixtures): the GPU, else Triton's interpreter on the CPU
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 -> bf16 casts truncate in the interpreter (the GPU rounds to nearest even): bf16 only
# on the GPU.
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
HEAD_DIMS = (8, 16, 64, 80, 96, 128, 256)

Q_SENTINEL = 12345.0  # q_out's initial value: an element the kernel skips stays at it


def _other_dtype(dtype):
    """A float dtype that is neither ``dtype`` nor fp32 (norm weights the launcher converts)."""
    return torch.bfloat16 if dtype == torch.float16 else torch.float16


def _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, layout, generator):
    """q, k, v as separate contiguous tensors, as views of one fused projection (with extra
    columns, so the token stride is odd), or head-major (token stride D, head stride N * D)."""
    heads = (q_heads, kv_heads, kv_heads)
    if layout == "fused":
        width = sum(heads) * head_dim
        qkv = torch.randn(num_tokens, width + 5, generator=generator).to(dtype).to(DEVICE)
        q, k, v = qkv[:, :width].split([h * head_dim for h in heads], dim=1)
        return tuple(x.unflatten(1, (-1, head_dim)) for x in (q, k, v))
    if layout == "head_major":
        return tuple(
            torch.randn(h, num_tokens, head_dim, generator=generator)
            .to(dtype).to(DEVICE).transpose(0, 1)
            for h in heads
        )
    return tuple(
        torch.randn(num_tokens, h, head_dim, generator=generator).to(dtype).to(DEVICE)
        for h in heads
    )


def _strided(values):
    """The same values as a non-contiguous 1-D view (stride 2)."""
    return torch.stack([values, torch.full_like(values, 987)], dim=1)[:, 0]


def _run_kernel_guarded(q, k, v, positions, cos_sin, cache_init, slot_mapping, q_norm, k_norm,
                        eps):
    """Launch into a q_out and caches that sit between guard bands; check the bands."""
    q_out = guarded(torch.full(q.shape, Q_SENTINEL, dtype=q.dtype, device=q.device))
    k_cache, v_cache = guarded(cache_init[0].clone()), guarded(cache_init[1].clone())
    rope_kv_append_into(
        q_out.tensor, q, k, v, positions, cos_sin, k_cache.tensor, v_cache.tensor,
        slot_mapping, q_norm, k_norm, eps,
    )
    q_out.check("q_out")
    k_cache.check("k_cache")
    v_cache.check("v_cache")
    return q_out.tensor, k_cache.tensor, v_cache.tensor


def _written_slots(slot_mapping, num_slots):
    written = torch.zeros(num_slots, dtype=torch.bool)
    for slot in slot_mapping.tolist():
        if 0 <= slot < num_slots:
            written[slot] = True
    return written


@given(
    dtype=st.sampled_from(DTYPES),
    head_dim=st.sampled_from(HEAD_DIMS),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4]),  # GQA ratio Hq / Hkv
    num_tokens=st.integers(1, 6),
    page_size=st.sampled_from([1, 3, 5, 16]),
    layout=st.sampled_from(["contiguous", "fused", "head_major"]),
    q_norm_kind=st.sampled_from([None, "q_dtype", "fp32", "other"]),
    k_norm_kind=st.sampled_from([None, "q_dtype", "fp32", "other"]),
    dropped=st.lists(st.sampled_from([-1, -1, -5, "end", "far"]), max_size=3),
    bad_positions=st.lists(st.sampled_from([-1, "max_pos", 10**12]), max_size=2),
    strided_indices=st.booleans(),
    wide_table=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(dtype=torch.float32, head_dim=8, kv_heads=1, group=1,
         num_tokens=1, page_size=1, layout="contiguous", q_norm_kind=None, k_norm_kind=None,
         dropped=[], bad_positions=[], strided_indices=False, wide_table=False, seed=0)
@example(dtype=torch.float16, head_dim=80, kv_heads=3, group=3,
         num_tokens=6, page_size=5, layout="fused", q_norm_kind="other", k_norm_kind="fp32",
         dropped=[-1, "end", "far"], bad_positions=[-1, "max_pos"], strided_indices=True,
         wide_table=True, seed=1)
def test_kernel_matches_reference_and_pytorch_and_writes_only_valid_slots(
    dtype, head_dim, kv_heads, group, num_tokens, page_size, layout, q_norm_kind,
    k_norm_kind, dropped, bad_positions, strided_indices, wide_table, seed,
):
    cache_dtype = dtype  # (the cache holds q's dtype)
    g = torch.Generator().manual_seed(seed)
    q_heads, max_pos, eps = kv_heads * group, 40, 1e-6
    q, k, v = _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, layout, g)
    num_pages = num_tokens // page_size + 2
    num_slots = num_pages * page_size
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens].clone()
    for i, bad in enumerate(dropped[:num_tokens]):
        slot_mapping[i] = {"end": num_slots, "far": 2**40}.get(bad, bad)
    for i, bad in enumerate(bad_positions[:num_tokens]):
        positions[num_tokens - 1 - i] = max_pos if bad == "max_pos" else bad
    cos_sin = wk.rope_cache(max_pos, head_dim, 1e4)
    if wide_table:  # a row stride larger than D
        cos_sin = torch.cat([cos_sin, torch.full((max_pos, 3), math.nan)], dim=1)[:, :head_dim]
    weight_dtype = {"q_dtype": dtype, "fp32": torch.float32, "other": _other_dtype(dtype)}
    q_norm, k_norm = (
        None if kind is None
        else (torch.rand(head_dim, generator=g) + 0.5).to(weight_dtype[kind]).to(DEVICE)
        for kind in (q_norm_kind, k_norm_kind)
    )
    cache_init = tuple(
        torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(cache_dtype)
        for _ in range(2)
    )
    inputs_before = [x.clone() for x in (q, k, v)]
    device_positions = positions.to(DEVICE)
    device_slots = slot_mapping.to(DEVICE)
    if strided_indices:
        device_positions, device_slots = _strided(device_positions), _strided(device_slots)
    device_cache_init = tuple(c.to(DEVICE) for c in cache_init)
    device_cos_sin = cos_sin.to(DEVICE)

    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, device_positions, device_cos_sin, device_cache_init, device_slots,
        q_norm, k_norm, eps,
    )
    torch_caches = tuple(c.clone() for c in device_cache_init)
    q_torch = rope_kv_append_torch(
        q, k, v, device_positions, device_cos_sin, *torch_caches, device_slots, q_norm, k_norm,
        eps,
    )
    ref_caches = tuple(c.clone() for c in cache_init)
    q_ref = ref.rope_kv_append(
        q.cpu(), k.cpu(), v.cpu(), positions, cos_sin, *ref_caches, slot_mapping,
        None if q_norm is None else q_norm.cpu(), None if k_norm is None else k_norm.cpu(), eps,
    )

    assert_close(q_out, q_torch, ROPE_TOLERANCE, dtype)
    assert_close(q_out, q_ref, ROPE_TOLERANCE, dtype)
    written = _written_slots(slot_mapping, num_slots)
    for cache, torch_cache, ref_cache, init in zip(
        (k_cache, v_cache), torch_caches, ref_caches, cache_init
    ):
        assert_close(cache, torch_cache, ROPE_TOLERANCE, cache_dtype)
        flat, flat_ref = cache.cpu().view(num_slots, -1), ref_cache.view(num_slots, -1)
        assert_close(flat[written], flat_ref[written], ROPE_TOLERANCE, cache_dtype)
        assert torch.equal(flat[~written], init.view(num_slots, -1)[~written])
    for before, after in zip(inputs_before, (q, k, v)):
        assert torch.equal(before, after)


def test_split_halves_rotation_by_hand():
    # D = 4: pair 0 is (x[0], x[2]) at angle p, pair 1 is (x[1], x[3]) at angle p / sqrt(theta).
    theta, pos = 100.0, 3
    q = torch.tensor([[[1.0, 0.0, 0.0, 2.0]]], device=DEVICE)
    k = torch.tensor([[[0.0, 1.0, 1.0, 0.0]]], device=DEVICE)
    v = torch.tensor([[[5.0, 6.0, 7.0, 8.0]]], device=DEVICE)
    k_cache = torch.zeros(2, 1, 1, 4, device=DEVICE)
    v_cache = torch.zeros(2, 1, 1, 4, device=DEVICE)
    q_out = rope_kv_append_triton(
        q, k, v, torch.tensor([pos], device=DEVICE), wk.rope_cache(4, 4, theta, DEVICE),
        k_cache, v_cache, torch.tensor([1], device=DEVICE),
    )
    a0, a1 = pos, pos / math.sqrt(theta)
    expected_q = [math.cos(a0), -2 * math.sin(a1), math.sin(a0), 2 * math.cos(a1)]
    expected_k = [-math.sin(a0), math.cos(a1), math.cos(a0), math.sin(a1)]
    torch.testing.assert_close(q_out[0, 0].cpu(), torch.tensor(expected_q), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_cache[1, 0, 0].cpu(), torch.tensor(expected_k), rtol=0, atol=1e-6)
    assert torch.equal(v_cache[1, 0, 0], v[0, 0])
    assert (k_cache[0] == 0).all() and (v_cache[0] == 0).all()


def test_rms_norm_by_hand_before_rotation_at_position_zero():
    # position 0 is the identity rotation; x = [3, 4, 0, 0] has mean(x^2) = 25 / 4, so
    # x * rsqrt(25/4 + eps) = [1.2, 1.6, 0, 0] (eps = 1e-6 changes it by ~1e-7 relative).
    q = torch.tensor([[[3.0, 4.0, 0.0, 0.0]]], device=DEVICE)
    weight = torch.tensor([1.0, 2.0, 3.0, 0.5], device=DEVICE)
    k_cache = torch.zeros(1, 1, 1, 4, device=DEVICE)
    v_cache = torch.zeros(1, 1, 1, 4, device=DEVICE)
    q_out = rope_kv_append_triton(
        q, q.clone(), q.clone(), torch.tensor([0], device=DEVICE), wk.rope_cache(1, 4, 1e4, DEVICE),
        k_cache, v_cache, torch.tensor([0], device=DEVICE), weight, None,
    )
    torch.testing.assert_close(q_out[0, 0].cpu(), torch.tensor([1.2, 3.2, 0.0, 0.0]))
    assert torch.equal(k_cache[0, 0, 0], q[0, 0])  # no k norm: k written as is


def test_rms_norm_eps_is_added_to_the_mean_square_of_q_and_k():
    """Inputs of about 1e-3 with eps = 1e-2: the result is decided by eps."""
    args, q_expected, k_expected = eps_dominated_case(DEVICE)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm, eps = args
    q_out, k_cache, _ = _run_kernel_guarded(q, k, v, positions, cos_sin, (k_cache, v_cache),
                                            slots, q_norm, k_norm, eps)
    tokens, kv_heads, head_dim = k_expected.shape
    k_written = k_cache.view(-1, kv_heads, head_dim)[:tokens]
    torch.testing.assert_close(q_out.cpu().double(), q_expected, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(k_written.cpu().double(), k_expected, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("bad_position", [-1, 16, 10**12, -(2**62)])
def test_out_of_range_position_makes_q_and_both_cache_rows_nan(bad_position):
    g = torch.Generator().manual_seed(6)
    head_dim = 80
    q, k, v = (torch.randn(3, heads, head_dim, generator=g).to(DEVICE) for heads in (4, 2, 2))
    norm = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE)
    cache_init = (torch.zeros(1, 4, 2, head_dim, device=DEVICE),) * 2
    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, torch.tensor([3, bad_position, 15], device=DEVICE),
        wk.rope_cache(16, head_dim, 1e4, DEVICE), cache_init,
        torch.tensor([0, 1, 2], device=DEVICE), norm, norm, 1e-6,
    )
    assert q_out[1].isnan().all() and k_cache[0, 1].isnan().all() and v_cache[0, 1].isnan().all()
    assert q_out[[0, 2]].isfinite().all()
    assert k_cache[0, [0, 2]].isfinite().all() and v_cache[0, [0, 2]].isfinite().all()
    assert (k_cache[0, 3] == 0).all() and (v_cache[0, 3] == 0).all()


def test_dropped_slots_leave_every_cache_element_unchanged_and_q_is_still_rotated():
    g = torch.Generator().manual_seed(5)
    num_pages, page_size, kv_heads, head_dim = 2, 3, 2, 16
    num_slots = num_pages * page_size
    q, k, v = (torch.randn(5, heads, head_dim, generator=g).to(DEVICE) for heads in (4, 2, 2))
    cache_init = tuple(
        torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).half().to(DEVICE)
        for _ in range(2)
    )
    slot_mapping = torch.tensor([-1, -2, num_slots, num_slots + 1, 2**62], device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 4], device=DEVICE)
    cos_sin = wk.rope_cache(8, head_dim, 1e4, DEVICE)
    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, positions, cos_sin, cache_init, slot_mapping, None, None, 1e-6
    )
    assert torch.equal(k_cache, cache_init[0]) and torch.equal(v_cache, cache_init[1])
    torch_caches = tuple(c.clone() for c in cache_init)
    q_torch = rope_kv_append_torch(q, k, v, positions, cos_sin, *torch_caches, slot_mapping)
    assert_close(q_out, q_torch, ROPE_TOLERANCE, torch.float32)


@pytest.mark.parametrize(
    "q_weight_dtype, k_weight_dtype",
    [
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, None),
        (None, torch.bfloat16),
    ],
)
def test_norm_weights_of_any_dtype_match_pytorch(q_weight_dtype, k_weight_dtype):
    g = torch.Generator().manual_seed(7)
    head_dim = 64
    q, k, v = (
        torch.randn(4, heads, head_dim, generator=g).half().to(DEVICE) for heads in (4, 2, 2)
    )
    q_norm, k_norm = (
        None if dtype is None else (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE)
        for dtype in (q_weight_dtype, k_weight_dtype)
    )
    positions = torch.tensor([3, 0, 9, 5], device=DEVICE)
    slot_mapping = torch.tensor([2, 0, -1, 5], device=DEVICE)
    cos_sin = wk.rope_cache(16, head_dim, 1e6, DEVICE)
    cache_init = (torch.zeros(2, 3, 2, head_dim, dtype=torch.half, device=DEVICE),) * 2
    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, positions, cos_sin, cache_init, slot_mapping, q_norm, k_norm, 1e-5
    )
    torch_caches = tuple(c.clone() for c in cache_init)
    q_torch = rope_kv_append_torch(
        q, k, v, positions, cos_sin, *torch_caches, slot_mapping, q_norm, k_norm, 1e-5
    )
    assert_close(q_out, q_torch, ROPE_TOLERANCE, torch.float16)
    assert_close(k_cache, torch_caches[0], ROPE_TOLERANCE, torch.float16)
    assert torch.equal(v_cache, torch_caches[1])


def test_launcher_returns_a_fresh_contiguous_q_in_q_dtype_and_leaves_inputs_unchanged():
    g = torch.Generator().manual_seed(8)
    q, k, v = _make_qkv(3, 6, 2, 16, torch.float16, "fused", g)
    before = [x.clone() for x in (q, k, v)]
    q_out = rope_kv_append_triton(
        q, k, v, torch.tensor([1, 0, 2], device=DEVICE), wk.rope_cache(4, 16, 1e4, DEVICE),
        torch.zeros(1, 4, 2, 16, device=DEVICE), torch.zeros(1, 4, 2, 16, device=DEVICE),
        torch.tensor([0, 3, 1], device=DEVICE),
    )
    assert q_out.shape == q.shape and q_out.dtype == torch.float16 and q_out.is_contiguous()
    assert q_out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    for x, x_before in zip((q, k, v), before):
        assert torch.equal(x, x_before)


def test_zero_tokens_return_an_empty_q_and_write_nothing():
    k_cache = torch.randn(1, 2, 1, 8, device=DEVICE)
    before = k_cache.clone()
    q_out = rope_kv_append_triton(
        torch.empty(0, 2, 8, device=DEVICE), torch.empty(0, 1, 8, device=DEVICE),
        torch.empty(0, 1, 8, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE),
        wk.rope_cache(2, 8, 1e4, DEVICE), k_cache, torch.zeros(1, 2, 1, 8, device=DEVICE),
        torch.empty(0, dtype=torch.int64, device=DEVICE),
    )
    assert q_out.shape == (0, 2, 8) and torch.equal(k_cache, before)


class _RecordingKernel:
    """Stands in for the @triton.jit kernel and records the specialisation of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            types = [
                POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor)
                else "fp32" if isinstance(a, float) else "i32"
                for a in args
            ]
            self.launches.append((types, constexprs, num_warps))
        return launch


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_kernel_variants_list_every_specialisation_the_launcher_produces(monkeypatch, head_dim):
    variants = kernel_variants()
    recorder = _RecordingKernel()
    monkeypatch.setattr(rope_ops, "_rope_kv_append_kernel", recorder)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    weight_choices = [None, torch.float32, torch.float16, torch.bfloat16]
    for dtype in dtypes:  # (the cache holds q's dtype)
        for q_weight_dtype in weight_choices:
            for k_weight_dtype in weight_choices:
                q = torch.zeros(1, 4, head_dim, dtype=dtype)
                k = torch.zeros(1, 2, head_dim, dtype=dtype)
                cache = torch.zeros(1, 1, 2, head_dim, dtype=dtype)
                q_norm, k_norm = (
                    None if w is None else torch.ones(head_dim, dtype=w)
                    for w in (q_weight_dtype, k_weight_dtype)
                )
                rope_kv_append_triton(
                    q, k, k, torch.zeros(1, dtype=torch.int64),
                    torch.zeros(1, head_dim), cache, cache,
                    torch.zeros(1, dtype=torch.int64), q_norm, k_norm,
                )
    for variant in variants:
        assert list(variant.signature) == list(inspect.signature(variant.kernel.fn).parameters)
    listed = {
        (
            tuple(t for t in v.signature.values() if t != "constexpr"),
            tuple(sorted(v.constexprs.items())),
            v.num_warps,
        )
        for v in variants
    }
    assert len(recorder.launches) == 3 * 16
    for types, constexprs, num_warps in recorder.launches:
        assert (tuple(types), tuple(sorted(constexprs.items())), num_warps) in listed


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_qwen3_decode_shapes_match_pytorch_on_gpu(dtype):
    cache_dtype = dtype  # (the cache holds q's dtype)
    g = torch.Generator().manual_seed(10)
    num_tokens, q_heads, kv_heads, head_dim, page_size = 64, 32, 8, 128, 16
    q, k, v = _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, "fused", g)
    q_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).cuda()
    k_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).cuda()
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).cuda()
    slot_mapping = torch.randperm(16 * page_size, generator=g)[:num_tokens].cuda()
    slot_mapping[-5:] = -1
    cos_sin = wk.rope_cache(4096, head_dim, 1e6, "cuda")
    cache_init = tuple(
        torch.randn(16, page_size, kv_heads, head_dim, generator=g).to(cache_dtype).cuda()
        for _ in range(2)
    )
    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, positions, cos_sin, cache_init, slot_mapping, q_norm, k_norm, 1e-6
    )
    torch_caches = tuple(c.clone() for c in cache_init)
    q_torch = rope_kv_append_torch(
        q, k, v, positions, cos_sin, *torch_caches, slot_mapping, q_norm, k_norm, 1e-6
    )
    assert_close(q_out, q_torch, ROPE_TOLERANCE, dtype)
    assert_close(k_cache, torch_caches[0], ROPE_TOLERANCE, cache_dtype)
    assert torch.equal(v_cache, torch_caches[1])  # a plain copy (cast) of v


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("page_size", [16, 256])
def test_prefill_shapes_match_pytorch_on_gpu(head_dim, page_size):
    g = torch.Generator().manual_seed(11)
    num_tokens, q_heads, kv_heads, dtype = 4096, 32, 8, torch.bfloat16
    q, k, v = _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, "fused", g)
    norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).cuda()
    num_pages = num_tokens // page_size + 1
    positions = torch.arange(num_tokens).cuda()
    slot_mapping = (torch.arange(num_tokens) + page_size).cuda()
    cos_sin = wk.rope_cache(num_tokens, head_dim, 1e6, "cuda")
    cache_init = (torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dtype,
                              device="cuda"),) * 2
    q_out, k_cache, v_cache = _run_kernel_guarded(
        q, k, v, positions, cos_sin, cache_init, slot_mapping, norm, norm, 1e-6
    )
    torch_caches = tuple(c.clone() for c in cache_init)
    q_torch = rope_kv_append_torch(
        q, k, v, positions, cos_sin, *torch_caches, slot_mapping, norm, norm, 1e-6
    )
    assert_close(q_out, q_torch, ROPE_TOLERANCE, dtype)
    assert_close(k_cache, torch_caches[0], ROPE_TOLERANCE, dtype)
    assert torch.equal(v_cache, torch_caches[1])


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_inputs_matches_eager():
    g = torch.Generator().manual_seed(12)
    num_tokens, q_heads, kv_heads, head_dim, page_size, dtype = 16, 32, 8, 128, 16, torch.bfloat16
    num_slots = 8 * page_size

    def draw():
        qkv = _make_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, "fused", g)
        positions = torch.randint(0, 512, (num_tokens,), generator=g).cuda()
        slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens].cuda()
        slot_mapping[-2:] = -1
        return (*qkv, positions, slot_mapping)

    static_q, static_k, static_v, static_positions, static_slots = draw()
    norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).cuda()
    cos_sin = wk.rope_cache(512, head_dim, 1e6, "cuda")
    k_cache = torch.zeros(8, page_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)

    def step():
        return rope_kv_append_triton(
            static_q, static_k, static_v, static_positions, cos_sin, k_cache, v_cache,
            static_slots, norm, norm, 1e-6,
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q_out = step()
    for _ in range(2):
        q, k, v, positions, slots = draw()
        for static, new in zip(
            (static_q, static_k, static_v, static_positions, static_slots),
            (q, k, v, positions, slots),
        ):
            static.copy_(new)
        k_cache.zero_()
        v_cache.zero_()
        graph.replay()
        torch_caches = (torch.zeros_like(k_cache), torch.zeros_like(v_cache))
        q_eager = rope_kv_append_torch(
            q, k, v, positions, cos_sin, *torch_caches, slots, norm, norm, 1e-6
        )
        assert_close(static_q_out, q_eager, ROPE_TOLERANCE, dtype)
        assert_close(k_cache, torch_caches[0], ROPE_TOLERANCE, dtype)
        assert torch.equal(v_cache, torch_caches[1])


@pytest.mark.cuda
def test_qwen3_cache_beyond_2_31_elements_on_gpu():
    free, _ = torch.cuda.mem_get_info()
    if free < 10 * 2**30:
        pytest.skip("needs 10 GiB of free GPU memory for two caches of 2^31 fp16 elements")
    rope_kv_append_cache("cuda", kv_heads=8, head_dim=128, page_size=16)
