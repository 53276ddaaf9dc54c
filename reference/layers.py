"""Reference of the decoder's gated activation (docs/contracts.md, "silu_mul")."""

import math

import torch


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [N, 2I]`` (gate = the first ``I`` columns), one
    element at a time in float64, with ``silu(g) = g / (1 + exp(-g))``. Returns float64
    ``[N, I]`` (no rounding to the input dtype)."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=torch.float64)
    for n in range(rows):
        for i in range(half):
            g, u = float(gate_up[n, i]), float(gate_up[n, half + i])
            silu = g / (1.0 + math.exp(-g)) if g > -700 else 0.0 * g
            out[n, i] = silu * u
    return out
