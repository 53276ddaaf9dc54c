"""RoPE table, and per-head RMSNorm + RoPE at logical positions + K/V append into a paged cache.

Rotary position embedding in the split-halves ("NeoX", ``rotate_half``) form: a head vector
of even size ``D`` is cut into ``x1 = x[:D/2]`` and ``x2 = x[D/2:]``, and pair ``i``
(``x1[i]``, ``x2[i]``) is rotated by the angle ``a_i = pos * theta**(-2i/D)``::

    y1 = x1 * cos(a) - x2 * sin(a)
    y2 = x2 * cos(a) + x1 * sin(a)

``cos_sin[pos]`` stores the ``D/2`` cosines followed by the ``D/2`` sines of that position.
Exact semantics: docs/contracts.md, "rope_cache and rope_kv_append".
"""

import math

import torch

from .. import _validate
from .._validate import (
    FLOAT_DTYPES,
    Dims,
    check_float,
    check_int,
    check_same_device,
    check_tensor,
    debug_check,
)


def rope_cache(
    max_pos: int, head_dim: int, theta: float, device: torch.device | None = None
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

    Returns
    -------
    cos_sin : torch.Tensor
        ``[max_pos, head_dim]`` float32, contiguous: ``cos_sin[p, :D/2] = cos(p * inv_freq)``,
        ``cos_sin[p, D/2:] = sin(p * inv_freq)`` with ``inv_freq_i = theta**(-2i/D)``. The
        angles are computed in float64 on the CPU (so every device gets the same bits) and
        stored as float32.

    Example
    -------
    >>> import wedlm_kernels as wk
    >>> cos_sin = wk.rope_cache(4096, 128, 1e6)
    >>> cos_sin.shape, cos_sin.dtype
    (torch.Size([4096, 128]), torch.float32)
    """
    check_int("max_pos", max_pos, minimum=1)
    check_int("head_dim", head_dim, minimum=1)
    if head_dim % 2 != 0:
        raise ValueError(f"`head_dim` must be even, got {head_dim}")
    check_float("theta", theta, positive=True)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -exponents)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).to(torch.float32)
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
        ``[num_pages, page_size, Hkv, D]`` float32, float16 or bfloat16, contiguous
        ("NHD" paged layout). **Mutated**: the rotated k of token ``t`` is written (cast to the
        cache dtype) at flat slot ``slot_mapping[t]``, i.e. page ``slot // page_size``, offset
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

    Example
    -------
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
    check_tensor(
        "k_cache", k_cache, FLOAT_DTYPES, ("num_pages", "page_size", "Hkv", "D"), dims,
        contiguous=True,
    )
    check_tensor(
        "v_cache", v_cache, k_cache.dtype, ("num_pages", "page_size", "Hkv", "D"), dims,
        contiguous=True,
    )
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
    if _validate.DEBUG:
        _debug_check_values(positions, dims["max_pos"], slot_mapping, k_cache)
    return torch.ops.wedlm.rope_kv_append(
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
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
