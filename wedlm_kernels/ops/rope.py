"""RoPE table, and per-head RMSNorm + RoPE at logical positions + K/V append into a paged cache.

Rotary position embedding in the split-halves ("NeoX", ``rotate_half``) form: a head vector
of even size ``D`` is cut into ``x1 = x[:D/2]`` and ``x2 = x[D/2:]``, and pair ``i``
(``x1[i]``, ``x2[i]``) is rotated by the angle ``a_i = pos * theta**(-2i/D)``::

    y1 = x1 * cos(a) - x2 * sin(a)
    y2 = x2 * cos(a) + x1 * sin(a)

``cos_sin[pos]`` stores the ``D/2`` cosines followed by the ``D/2`` sines of that position.
Exact semantics: docs/contracts.md, "rope_cache and rope_kv_append".

Two implementations of the op: ``rope_kv_append_torch`` (vectorised PyTorch, the CPU
fallback) and ``rope_kv_append_triton`` (one fused Triton kernel launch per call).
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from . import _dispatch
from ._triton import POINTER_TYPES, KernelVariant, next_power_of_2
from ._validate import (
    FLOAT_DTYPES,
    Dims,
    check_float,
    check_int,
    check_same_device,
    check_tensor,
    debug_check,
)


@dataclass(frozen=True)
class YarnScaling:
    r"""YaRN RoPE scaling (Peng et al. 2023), as Qwen3 configures it for long contexts
    (``"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 32768}``), and as transformers and vLLM compute it.

    The math, once: the plain frequencies are ``f_i = theta**(-2i/D)``, ``i < D/2``. Pair
    ``i`` turns ``r_i = L / (2 pi / f_i)`` times over the ``L =
    original_max_position_embeddings`` trained positions. Pairs that turn often (high
    frequency, ``r_i > beta_fast``) keep ``f_i`` (extrapolation); pairs that turn rarely
    (``r_i < beta_slow``) take ``f_i / factor`` (interpolation, as position interpolation
    would); a linear ramp blends the two between the pair indices ``low`` and ``high``
    where ``r_i`` crosses ``beta_fast`` and ``beta_slow``:
    ``index(r) = D * ln(L / (2 pi r)) / (2 ln theta)``, floored and ceiled when
    ``truncate``, clamped to ``[0, D - 1]``, and
    ``ramp_i = clamp((i - low) / (high - low), 0, 1)`` (``high += 0.001`` when equal).
    Then ``f'_i = f_i / factor * ramp_i + f_i * (1 - ramp_i)``, and the table's cosines and
    sines are multiplied by ``attention_factor`` (default ``0.1 * ln(factor) + 1``, 1 for
    ``factor <= 1``), which sharpens attention over the longer context.

    Parameters
    ----------
    factor : float
        Context extension factor, ``>= 1``.
    original_max_position_embeddings : int
        ``L``, the trained context length, ``>= 1``.
    beta_fast, beta_slow : float
        Turn counts bounding the ramp (defaults 32 and 1), ``> 0``.
    attention_factor : float or None
        Scale of cos and sin, ``> 0``; None for the default above.
    truncate : bool
        Round the ramp's bounds to whole pair indices (the default, as transformers and
        vLLM do).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_float("factor", self.factor)
        if not 1.0 <= self.factor < math.inf:
            raise ValueError(f"`factor` must be a finite number >= 1, got {self.factor!r}")
        check_int("original_max_position_embeddings", self.original_max_position_embeddings,
                  minimum=1)
        for name in ("beta_fast", "beta_slow"):
            check_float(name, getattr(self, name), positive=True)
        if self.attention_factor is not None:
            check_float("attention_factor", self.attention_factor, positive=True)
        if not isinstance(self.truncate, bool):
            raise TypeError(f"`truncate` must be a bool, got {self.truncate!r}")

    @property
    def scale(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """The ``D/2`` scaled frequencies ``f'_i``, float64."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        plain = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -exponents)

        def pair_index(turns: float) -> float:
            return (head_dim * math.log(self.original_max_position_embeddings
                                        / (turns * 2 * math.pi))) / (2 * math.log(theta))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)
                ).clamp(0, 1)
        return plain / self.factor * ramp + plain * (1 - ramp)


def rope_cache(
    max_pos: int, head_dim: int, theta: float, device: torch.device | None = None,
    yarn: YarnScaling | None = None,
) -> torch.Tensor:
    r"""Build the RoPE table used by :func:`rope_kv_append`.

    Parameters
    ----------
    max_pos : int
        Number of positions (rows), ``>= 1``. Positions ``0 .. max_pos - 1`` are valid.
    head_dim : int
        Head size ``D``, even and ``> 0``.
    theta : float
        RoPE base (``rope_theta`` of the model config, e.g. ``1e6`` for Qwen3), ``> 0``.
    device : torch.device, optional
        Where to put the table (default: CPU).
    yarn : YarnScaling, optional
        YaRN scaling (:class:`YarnScaling`): its frequencies, and cos and sin times its
        attention factor. None: plain RoPE.

    Returns
    -------
    cos_sin : torch.Tensor
        ``[max_pos, head_dim]`` float32, contiguous: ``cos_sin[p, :D/2] = cos(p * inv_freq)``,
        ``cos_sin[p, D/2:] = sin(p * inv_freq)`` with ``inv_freq_i = theta**(-2i/D)`` (with
        ``yarn``: its frequencies, and both halves times its attention factor). The angles
        are computed in float64 on the CPU (so every device gets the same bits) and stored
        as float32.

    Examples
    --------
    >>> import wedlm_kernels as wk
    >>> cos_sin = wk.rope_cache(4096, 128, 1e6)
    >>> cos_sin.shape, cos_sin.dtype
    (torch.Size([4096, 128]), torch.float32)
    >>> long = wk.rope_cache(8, 128, 1e6, yarn=wk.YarnScaling(4.0, 32768))
    >>> round(float(long[0, 0]), 4)  # cos(0) times the attention factor 0.1 * ln(4) + 1
    1.1386
    """
    check_int("max_pos", max_pos, minimum=1)
    check_int("head_dim", head_dim, minimum=1)
    if head_dim % 2 != 0:
        raise ValueError(f"`head_dim` must be even, got {head_dim}")
    check_float("theta", theta, positive=True)
    if yarn is not None and not isinstance(yarn, YarnScaling):
        raise TypeError(f"`yarn` must be a YarnScaling or None, got {type(yarn).__name__}")
    if yarn is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -exponents)
        scale = 1.0
    else:
        inv_freq, scale = yarn.inv_freq(head_dim, theta), yarn.scale
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1) * scale
    table = table.to(torch.float32)
    return table.to(device) if device is not None else table


def rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Optional per-head RMSNorm (Qwen3 ``q_norm``/``k_norm``), RoPE at logical positions,
    and the append of the rotated k and the plain v into a paged KV cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[N, Hq, D]`` float32, float16 or bfloat16; stride 1 in the last dimension, other
        strides arbitrary (a view of a fused qkv projection is fine). ``D`` even.
    k : torch.Tensor
        ``[N, Hkv, D]``, q's dtype, stride 1 in the last dimension.
    v : torch.Tensor
        ``[N, Hkv, D]``, q's dtype, stride 1 in the last dimension.
    positions : torch.Tensor
        ``[N]`` int64: the RoPE (logical) position of each token. A position outside
        ``[0, max_pos)`` is loud: the token's rotated q and both of its cache writes are NaN.
    cos_sin : torch.Tensor
        ``[max_pos, D]`` float32 with stride 1 in the last dimension, from :func:`rope_cache`.
    k_cache : torch.Tensor
        ``[num_pages, page_size, Hkv, D]``, q's dtype (the cache :func:`paged_attention`
        reads with q; another dtype is refused), contiguous ("NHD" paged layout).
        **Mutated**: the rotated k of token ``t`` is written (rounded once from float32) at
        flat slot ``slot_mapping[t]``, i.e. page ``slot // page_size``, offset
        ``slot % page_size``.
    v_cache : torch.Tensor
        Like ``k_cache`` (same shape and dtype). **Mutated**: receives v (not rotated, not
        normalised) at the same slots.
    slot_mapping : torch.Tensor
        ``[N]`` int64 flat cache slots. A slot outside ``[0, num_pages * page_size)`` (e.g. -1
        for padding rows) drops that token's write; its q is still returned. Valid slots
        must be distinct (otherwise which write lands is unspecified).
    q_norm_weight : torch.Tensor, optional
        ``[D]`` float weight of the per-head RMSNorm applied to q before RoPE.
    k_norm_weight : torch.Tensor, optional
        ``[D]`` float weight of the per-head RMSNorm applied to k before RoPE.
    eps : float
        RMSNorm epsilon, ``> 0``: ``x * rsqrt(mean(x^2) + eps) * weight``.

    Returns
    -------
    q_out : torch.Tensor
        ``[N, Hq, D]`` in q's dtype, contiguous: the normalised and rotated q. Norm and
        rotation are computed in float32 and rounded once.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> tokens, q_heads, kv_heads, head_dim = 3, 4, 2, 64
    >>> qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    >>> q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    >>> q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    >>> k_cache = torch.zeros(8, 16, kv_heads, head_dim)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> q_out = wk.rope_kv_append(q, k, v, torch.tensor([5, 7, 6]),
    ...                           wk.rope_cache(128, head_dim, 1e6), k_cache, v_cache,
    ...                           torch.tensor([21, 22, -1]))
    >>> q_out.shape
    torch.Size([3, 4, 64])
    """
    dims = Dims()
    check_tensor("q", q, FLOAT_DTYPES, ("N", "Hq", "D"), dims, unit_last_stride=True)
    if dims["D"] == 0 or dims["D"] % 2 != 0:
        raise ValueError(f"`q` must have an even, nonzero head_dim (last dimension), got {dims['D']}")
    check_tensor("k", k, q.dtype, ("N", "Hkv", "D"), dims, unit_last_stride=True)
    check_tensor("v", v, q.dtype, ("N", "Hkv", "D"), dims, unit_last_stride=True)
    check_tensor("positions", positions, torch.int64, ("N",), dims)
    check_tensor("cos_sin", cos_sin, torch.float32, ("max_pos", "D"), dims, unit_last_stride=True)
    if dims["max_pos"] < 1:
        raise ValueError("`cos_sin` must have at least one row (position)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(cache, torch.Tensor) and cache.dtype != q.dtype:
            raise TypeError(
                f"`{name}` must have q's dtype {str(q.dtype).replace('torch.', '')}, got "
                f"{str(cache.dtype).replace('torch.', '')}: paged_attention reads the cache "
                "with q, in one dtype (docs/contracts.md, 'The paged cache')")
        check_tensor(name, cache, q.dtype, ("num_pages", "page_size", "Hkv", "D"), dims,
                     contiguous=True)
    if dims["num_pages"] < 1 or dims["page_size"] < 1:
        raise ValueError(f"`k_cache` must hold at least one slot, got shape {list(k_cache.shape)}")
    check_tensor("slot_mapping", slot_mapping, torch.int64, ("N",), dims)
    if q_norm_weight is not None:
        check_tensor("q_norm_weight", q_norm_weight, FLOAT_DTYPES, ("D",), dims)
    if k_norm_weight is not None:
        check_tensor("k_norm_weight", k_norm_weight, FLOAT_DTYPES, ("D",), dims)
    check_float("eps", eps, positive=True)
    check_same_device(
        q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
    )
    if _backend.DEBUG:
        _debug_check_values(positions, dims["max_pos"], slot_mapping, k_cache)
    return _dispatch.call(
        "rope_kv_append", q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
        q_norm_weight, k_norm_weight, float(eps),
    )


def _debug_check_values(
    positions: torch.Tensor, max_pos: int, slot_mapping: torch.Tensor, k_cache: torch.Tensor
) -> None:
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    debug_check(
        ((positions >= 0) & (positions < max_pos)).all(),
        f"`positions` must lie in [0, {max_pos}) (the rows of `cos_sin`)",
    )
    debug_check(
        ((slot_mapping >= -1) & (slot_mapping < num_slots)).all(),
        f"`slot_mapping` must be -1 or lie in [0, {num_slots}) (num_pages * page_size)",
    )
    valid_slots = torch.sort(torch.where(slot_mapping >= 0, slot_mapping, -1)).values
    repeated = (valid_slots[1:] == valid_slots[:-1]) & (valid_slots[1:] >= 0)
    debug_check(~repeated.any(), "`slot_mapping` must not repeat a slot (except -1)")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of fp32 ``x [..., D]`` (identity without a weight)."""
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-halves rotation of fp32 ``x [N, H, D]`` by ``cos, sin [N, 1, D/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _append(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [N, Hkv, D]`` (cast to the cache dtype) into ``cache`` at the flat slots.

    Writes to slots outside ``[0, num_slots)`` are dropped without a host sync and without
    a data-dependent shape: every token writes somewhere, and an invalid one is redirected
    to a slot whose final value it cannot change. If any token is valid, an invalid token
    writes the first valid token's row to that token's slot (a duplicate write of the same
    bits, so the result does not depend on write order). If none is valid, it writes slot
    0's current value back to slot 0.
    """
    num_slots = cache.shape[0] * cache.shape[1]
    flat = cache.view(num_slots, cache.shape[2], cache.shape[3])
    rows = rows.to(cache.dtype)
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)
    any_valid = valid.any()
    first_valid = torch.argmax(valid.to(torch.int32)).reshape(1)  # 0 when none is valid
    fallback_slot = torch.where(any_valid, slot_mapping.index_select(0, first_valid), 0)
    fallback_row = torch.where(
        any_valid, rows.index_select(0, first_valid), flat.index_select(0, fallback_slot)
    )
    target = torch.where(valid, slot_mapping, fallback_slot)
    source = torch.where(valid[:, None, None], rows, fallback_row)
    flat.index_copy_(0, target, source)


def rope_kv_append_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Vectorised PyTorch implementation of :func:`rope_kv_append` (all tokens and heads)."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    half = q.shape[-1] // 2
    max_pos = cos_sin.shape[0]

    # Table rows at the positions; an out-of-range position gets a NaN row (loud).
    position_valid = (positions >= 0) & (positions < max_pos)
    rows = cos_sin.index_select(0, positions.clamp(0, max_pos - 1)).float()
    rows = torch.where(position_valid[:, None], rows, math.nan)
    cos, sin = rows[:, None, :half], rows[:, None, half:]

    q_out = _rotate(_rms_norm(q.float(), q_norm_weight, eps), cos, sin).to(q.dtype)
    k_rotated = _rotate(_rms_norm(k.float(), k_norm_weight, eps), cos, sin)
    v_written = torch.where(position_valid[:, None, None], v.float(), math.nan)
    _append(k_cache, slot_mapping, k_rotated)
    _append(v_cache, slot_mapping, v_written)
    return q_out


def rope_kv_append_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------- Triton kernel
#
# One launch per call. Program (token t, head group g) handles HEADS_PER_PROGRAM heads of one
# token as a [HEADS_PER_PROGRAM, BLOCK_HALF] tile per half of the head vector:
#   groups 0 .. cdiv(Hq, HEADS_PER_PROGRAM) - 1    : q heads   -> q_out
#   the following cdiv(Hkv, HEADS_PER_PROGRAM) groups: k and v heads -> k_cache, v_cache
# Per head, in fp32: optional RMSNorm over the D entries of the head,
#   x <- x * rsqrt(mean(x^2) + eps) * weight,
# then the split-halves rotation with (cos, sin) = cos_sin[position] (pair i is (x1[i], x2[i])):
#   y1 = x1 * cos - x2 * sin,   y2 = x2 * cos + x1 * sin.
# An out-of-range position turns cos and sin (and the written v) into NaN; an out-of-range
# slot masks the whole k/v program (no load, no store). Cache addresses are computed in int64
# (slot * Hkv * D can exceed 2^31 elements).


@triton.jit(do_not_specialize=["apply_q_norm", "apply_k_norm"])
def _rope_kv_append_kernel(
    q_ptr,  # [N, Hq, D], unit last stride
    k_ptr,  # [N, Hkv, D], unit last stride
    v_ptr,  # [N, Hkv, D], unit last stride
    positions_ptr,  # [N] int64
    cos_sin_ptr,  # [max_pos, D] fp32, unit last stride
    k_cache_ptr,  # [num_slots, Hkv, D] contiguous (num_slots = num_pages * page_size)
    v_cache_ptr,  # [num_slots, Hkv, D] contiguous
    slot_mapping_ptr,  # [N] int64
    q_norm_weight_ptr,  # [D] contiguous (never read unless apply_q_norm)
    k_norm_weight_ptr,  # [D] contiguous (never read unless apply_k_norm)
    q_out_ptr,  # [N, Hq, D] contiguous
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    positions_stride,
    slot_mapping_stride,
    cos_sin_stride,
    q_heads,
    kv_heads,
    half,  # D / 2
    max_pos,
    num_slots,
    eps,
    apply_q_norm,
    apply_k_norm,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(D / 2)
):
    token = tl.program_id(0).to(tl.int64)
    head_group = tl.program_id(1)
    q_groups = (q_heads + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    head_dim = 2 * half
    half_offsets = tl.arange(0, BLOCK_HALF)
    half_mask = half_offsets < half
    head_offsets = tl.arange(0, HEADS_PER_PROGRAM)

    position = tl.load(positions_ptr + token * positions_stride)
    position_valid = (position >= 0) & (position < max_pos)
    table_row = cos_sin_ptr + tl.where(position_valid, position, 0) * cos_sin_stride
    cos = tl.load(table_row + half_offsets, mask=half_mask, other=0.0)
    sin = tl.load(table_row + half + half_offsets, mask=half_mask, other=0.0)
    cos = tl.where(position_valid, cos, float("nan"))
    sin = tl.where(position_valid, sin, float("nan"))

    if head_group < q_groups:
        heads = (head_group * HEADS_PER_PROGRAM + head_offsets).to(tl.int64)  # [HEADS]
        mask = (heads < q_heads)[:, None] & half_mask[None, :]  # [HEADS, BLOCK_HALF]
        source = (
            q_ptr + token * q_token_stride + heads[:, None] * q_head_stride
            + half_offsets[None, :]
        )
        x1 = tl.load(source, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(source + half, mask=mask, other=0.0).to(tl.float32)
        if apply_q_norm:
            inv_rms = tl.rsqrt(
                (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps
            )[:, None]
            weight1 = tl.load(q_norm_weight_ptr + half_offsets, mask=half_mask, other=0.0)
            weight2 = tl.load(q_norm_weight_ptr + half + half_offsets, mask=half_mask, other=0.0)
            x1 = x1 * inv_rms * weight1.to(tl.float32)[None, :]
            x2 = x2 * inv_rms * weight2.to(tl.float32)[None, :]
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
        target = q_out_ptr + (token * q_heads + heads[:, None]) * head_dim + half_offsets[None, :]
        tl.store(target, y1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(target + half, y2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token * slot_mapping_stride)
        slot_valid = (slot >= 0) & (slot < num_slots)
        heads = ((head_group - q_groups) * HEADS_PER_PROGRAM + head_offsets).to(tl.int64)
        mask = (heads < kv_heads)[:, None] & half_mask[None, :] & slot_valid

        k_source = (
            k_ptr + token * k_token_stride + heads[:, None] * k_head_stride
            + half_offsets[None, :]
        )
        x1 = tl.load(k_source, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_source + half, mask=mask, other=0.0).to(tl.float32)
        if apply_k_norm:  # the same norm and rotation as for q
            inv_rms = tl.rsqrt(
                (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps
            )[:, None]
            weight1 = tl.load(k_norm_weight_ptr + half_offsets, mask=half_mask, other=0.0)
            weight2 = tl.load(k_norm_weight_ptr + half + half_offsets, mask=half_mask, other=0.0)
            x1 = x1 * inv_rms * weight1.to(tl.float32)[None, :]
            x2 = x2 * inv_rms * weight2.to(tl.float32)[None, :]
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
        # int64: slot * Hkv * D exceeds 2^31 in large caches
        cache_offsets = (
            (tl.where(slot_valid, slot, 0) * kv_heads + heads[:, None]) * head_dim
            + half_offsets[None, :]
        )
        tl.store(k_cache_ptr + cache_offsets, y1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(
            k_cache_ptr + cache_offsets + half, y2.to(k_cache_ptr.dtype.element_ty), mask=mask
        )

        v_source = (
            v_ptr + token * v_token_stride + heads[:, None] * v_head_stride
            + half_offsets[None, :]
        )
        v1 = tl.load(v_source, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_source + half, mask=mask, other=0.0).to(tl.float32)
        v1 = tl.where(position_valid, v1, float("nan"))
        v2 = tl.where(position_valid, v2, float("nan"))
        tl.store(v_cache_ptr + cache_offsets, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(
            v_cache_ptr + cache_offsets + half, v2.to(v_cache_ptr.dtype.element_ty), mask=mask
        )


# Grid (N, cdiv(Hq, HEADS_PER_PROGRAM) + cdiv(Hkv, HEADS_PER_PROGRAM)): each program handles a
# [HEADS_PER_PROGRAM, BLOCK_HALF] tile of 256 elements per half (HEADS_PER_PROGRAM = 4 for
# head_dim 128) with 2 warps (16-byte accesses in fp32, 8-byte ones in fp16/bf16 when the
# strides are multiples of 16 elements). The cos/sin row and the norm weights are loaded once
# per program and reused by its heads. Decode (N = 16..64 tokens, 32 q + 8 kv heads) gets
# N * (8 + 2) = 160..640 programs, enough to reach every SM; prefill (N = 4096) gets 40960
# programs of 1-2 KiB each, many resident per SM, without a loop over tokens.
_TILE_ELEMENTS = 256
_MAX_HEADS_PER_PROGRAM = 16
_NUM_WARPS = 2


def _launch_config(head_dim: int) -> tuple[int, int]:
    """(BLOCK_HALF, HEADS_PER_PROGRAM) for a head size."""
    block_half = next_power_of_2(head_dim // 2)
    heads_per_program = max(1, min(_MAX_HEADS_PER_PROGRAM, _TILE_ELEMENTS // block_half))
    return block_half, heads_per_program


def _kernel_norm_weights(
    q: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two norm-weight arguments of the kernel, contiguous and of one dtype: the weights'
    own dtype when they share one that is q's dtype or fp32, else fp32 (an exact conversion).
    A missing weight is replaced by a tensor of that dtype that the kernel never reads."""
    if q_norm_weight is None and k_norm_weight is None:
        return q, q
    given = [weight for weight in (q_norm_weight, k_norm_weight) if weight is not None]
    dtypes = {weight.dtype for weight in given}
    shared = dtypes.pop() if len(dtypes) == 1 else None
    weight_dtype = shared if shared in (q.dtype, torch.float32) else torch.float32
    q_weight = q_norm_weight if q_norm_weight is not None else k_norm_weight
    k_weight = k_norm_weight if k_norm_weight is not None else q_norm_weight
    return (
        q_weight.to(weight_dtype).contiguous(),
        k_weight.to(weight_dtype).contiguous(),
    )


def rope_kv_append_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton launcher of :func:`rope_kv_append` (arguments validated by the caller)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rope_kv_append_into(
        q_out, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
        q_norm_weight, k_norm_weight, eps,
    )
    return q_out


def rope_kv_append_into(
    q_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """The launch itself, writing the rotated q into a given contiguous ``q_out [N, Hq, D]``
    of q's dtype (tests hand it a tensor between guard bands)."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    block_half, heads_per_program = _launch_config(head_dim)
    q_weight, k_weight = _kernel_norm_weights(q, q_norm_weight, k_norm_weight)
    grid = (
        num_tokens,
        triton.cdiv(q_heads, heads_per_program) + triton.cdiv(kv_heads, heads_per_program),
    )
    _rope_kv_append_kernel[grid](
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_weight, k_weight, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        positions.stride(0), slot_mapping.stride(0), cos_sin.stride(0),
        q_heads, kv_heads, head_dim // 2, cos_sin.shape[0], k_cache.shape[0] * k_cache.shape[1],
        float(eps), int(q_norm_weight is not None), int(k_norm_weight is not None),
        HEADS_PER_PROGRAM=heads_per_program, BLOCK_HALF=block_half, num_warps=_NUM_WARPS,
    )


# head sizes whose kernel specialisations are compiled for sm_90 by the test suite: the
# supported model head sizes (64, 80, 96, 128, 256 -> BLOCK_HALF 32, 64, 128) and the small
# sizes of the interpreter tests (8, 16 -> BLOCK_HALF 4, 8, fp32 only)
_MODEL_HEAD_DIMS = (64, 80, 96, 128, 256)
_TEST_HEAD_DIMS = (8, 16)


def _variant(dtype, cache_dtype, weight_dtype, head_dim) -> KernelVariant:
    block_half, heads_per_program = _launch_config(head_dim)
    pointer, cache_pointer = POINTER_TYPES[dtype], POINTER_TYPES[cache_dtype]
    signature = {
        "q_ptr": pointer, "k_ptr": pointer, "v_ptr": pointer, "positions_ptr": "*i64",
        "cos_sin_ptr": "*fp32", "k_cache_ptr": cache_pointer, "v_cache_ptr": cache_pointer,
        "slot_mapping_ptr": "*i64", "q_norm_weight_ptr": POINTER_TYPES[weight_dtype],
        "k_norm_weight_ptr": POINTER_TYPES[weight_dtype], "q_out_ptr": pointer,
    }
    for name in (
        "q_token_stride", "q_head_stride", "k_token_stride", "k_head_stride", "v_token_stride",
        "v_head_stride", "positions_stride", "slot_mapping_stride", "cos_sin_stride",
        "q_heads", "kv_heads", "half", "max_pos", "num_slots",
    ):
        signature[name] = "i32"
    signature.update(
        eps="fp32", apply_q_norm="i32", apply_k_norm="i32",
        HEADS_PER_PROGRAM="constexpr", BLOCK_HALF="constexpr",
    )
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return KernelVariant(
        name=(
            f"{short[dtype]}_cache{short[cache_dtype]}_weight{short[weight_dtype]}"
            f"_block{block_half}"
        ),
        kernel=_rope_kv_append_kernel,
        signature=signature,
        constexprs={"HEADS_PER_PROGRAM": heads_per_program, "BLOCK_HALF": block_half},
        num_warps=_NUM_WARPS,
    )


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation :func:`rope_kv_append_triton` produces for the supported head
    sizes: q/k/v and cache dtype x norm-weight dtype (q's or fp32; also the dummy when no
    weight is given) x BLOCK_HALF. The norm flags are runtime arguments, not constexprs."""
    variants = {}
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for weight_dtype in dict.fromkeys((dtype, torch.float32)):
            for head_dim in _MODEL_HEAD_DIMS:
                variant = _variant(dtype, dtype, weight_dtype, head_dim)
                variants[variant.name] = variant
    for head_dim in _TEST_HEAD_DIMS:
        variant = _variant(torch.float32, torch.float32, torch.float32, head_dim)
        variants[variant.name] = variant
    return list(variants.values())
