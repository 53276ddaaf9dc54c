"""Reference RMSNorm, RoPE and KV append (docs/contracts.md, "rope_cache and rope_kv_append").

Rotary position embedding in the split-halves ("NeoX", ``rotate_half``) form: a head vector
``x`` of even size ``D`` is cut into ``x1 = x[:D/2]`` and ``x2 = x[D/2:]``; pair ``i`` (the
entries ``x1[i]`` and ``x2[i]``) is rotated by the angle ``pos * theta**(-2i/D)``:

    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

The table ``cos_sin[pos]`` holds the ``D/2`` cosines followed by the ``D/2`` sines.
Everything here is computed in float64, one token and one head at a time.
"""

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * weight / sqrt(mean(x^2) + eps)`` over the last dimension, in float64."""
    x = x.to(torch.float64)
    mean_square = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(mean_square + eps) * weight.to(torch.float64)


def rope_cache(max_pos: int, head_dim: int, theta: float) -> torch.Tensor:
    """``[max_pos, head_dim]`` fp32 table: cosines then sines of ``pos * theta**(-2i/D)``."""
    half = head_dim // 2
    rows = []
    for pos in range(max_pos):
        angles = [pos * theta ** (-2.0 * i / head_dim) for i in range(half)]
        rows.append([math.cos(a) for a in angles] + [math.sin(a) for a in angles])
    table = torch.tensor(rows, dtype=torch.float64).reshape(max_pos, head_dim)
    return table.to(torch.float32)


def apply_rope(x: torch.Tensor, cos_sin_rows: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., D]`` by the table rows ``cos_sin_rows [..., D]`` (broadcast), float64."""
    x = x.to(torch.float64)
    cos_sin_rows = cos_sin_rows.to(torch.float64)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_sin_rows[..., :half], cos_sin_rows[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
    """Per token: optional per-head RMSNorm of q and k, RoPE at ``positions[t]``, then the
    rotated k and the plain v are written (cast to the cache dtype) at flat cache slot
    ``slot_mapping[t]`` unless that slot is outside ``[0, num_pages * page_size)``.

    A position outside ``[0, max_pos)`` makes the token's rotated q and both of its cache
    writes NaN. Returns the rotated q as float64 ``[N, Hq, D]``; mutates the caches.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    max_pos = cos_sin.shape[0]
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    q_out = torch.empty(num_tokens, q_heads, head_dim, dtype=torch.float64)
    for t in range(num_tokens):
        pos = int(positions[t])
        position_valid = 0 <= pos < max_pos
        if position_valid:
            rows = cos_sin[pos].to(torch.float64)
        else:
            rows = torch.full((head_dim,), math.nan, dtype=torch.float64)

        for h in range(q_heads):
            x = q[t, h].to(torch.float64)
            if q_norm_weight is not None:
                x = rms_norm(x, q_norm_weight, eps)
            q_out[t, h] = apply_rope(x, rows)

        slot = int(slot_mapping[t])
        if not 0 <= slot < num_pages * page_size:
            continue  # dropped write
        page, offset = slot // page_size, slot % page_size
        for h in range(kv_heads):
            x = k[t, h].to(torch.float64)
            if k_norm_weight is not None:
                x = rms_norm(x, k_norm_weight, eps)
            k_cache[page, offset, h] = apply_rope(x, rows).to(k_cache.dtype)
            value = v[t, h].to(torch.float64)
            if not position_valid:
                value = torch.full_like(value, math.nan)
            v_cache[page, offset, h] = value.to(v_cache.dtype)
    return q_out
