"""rope_kv_append cases shared by the op and kernel tests."""

import torch

import wedlm_kernels as wk
from reference import rope as ref


def eps_dominated_case(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Inputs whose RMSNorm is decided by ``eps``: q and k entries of about 1e-3 (mean square
    ~1e-6) with ``eps = 1e-2``, so ``rsqrt(mean(x^2) + eps)`` is ~10 where dropping eps would
    give ~1000. Returns ``(args, q_expected, k_expected)``: the op's arguments (empty caches,
    slots 0..N-1) and the float64 reference's rotated q ``[N, Hq, D]`` and k ``[N, Hkv, D]``."""
    g = torch.Generator().manual_seed(31)
    tokens, q_heads, kv_heads, head_dim, eps = 3, 4, 2, 16, 1e-2
    q, k, v = (
        (torch.randn(tokens, heads, head_dim, generator=g) * 1e-3).to(dtype)
        for heads in (q_heads, kv_heads, kv_heads)
    )
    q_norm = torch.rand(head_dim, generator=g) + 0.5
    k_norm = torch.rand(head_dim, generator=g) + 0.5
    positions = torch.tensor([4, 0, 9])
    cos_sin = wk.rope_cache(16, head_dim, 1e4)
    rows = cos_sin[positions][:, None, :]
    q_expected = ref.apply_rope(ref.rms_norm(q, q_norm, eps), rows)
    k_expected = ref.apply_rope(ref.rms_norm(k, k_norm, eps), rows)
    for x, weight, expected in ((q, q_norm, q_expected), (k, k_norm, k_expected)):
        without_eps = ref.apply_rope(ref.rms_norm(x, weight, 1e-12), rows)
        assert without_eps.abs().amax() > 20 * expected.abs().amax(), "eps must dominate"
    caches = [torch.zeros(2, 2, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    args = tuple(
        t.to(device) for t in (q, k, v, positions, cos_sin, *caches, torch.arange(tokens))
    ) + (q_norm.to(device), k_norm.to(device), eps)
    return args, q_expected, k_expected
