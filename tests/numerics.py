"""How close is close enough: the tolerances of every op's tests and the fp32-aware checks of
``select_tokens``' tokens and selection, in one place.

Every op computes in fp32 (or rounds once to a 16-bit dtype) what ``reference/`` computes
in float64, so results differ by rounding; each table says, per dtype, the bound its tests
use and why it holds. Where a kernel rounds differently from the PyTorch implementation of
the same op, both bounds are kept, each named for what it compares.
"""

import math

import torch

from reference import philox
from reference import select as select_reference

# --------------------------------------------------------------------------- tolerance tables

# rope_kv_append, the kernel and the PyTorch implementation against the float64 reference:
# both normalise and rotate in fp32 and round once to the output dtype. Values are O(1..10).
# - fp32: norm and rotation errors are a few fp32 ulps (reduction order, rsqrt, fused
#   multiply-adds on the GPU), ~1e-6 relative.
# - fp16 / bf16: the reference rounds its float64 value, the op an fp32 one, so values
#   straddling a rounding boundary differ by one ulp: 2^-10 (fp16), 2^-7 (bf16) relative.
ROPE_TOLERANCE = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=1e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
}

# paged_attention's PyTorch implementation against the float64 reference. It takes q.k and
# the softmax in fp32 from the same low-precision inputs and rounds the output once; outputs
# are convex combinations of O(1) values.
# - fp32: dot products over D <= 256 and the softmax lose a few ulps (~1e-6 relative).
# - fp16: the final rounding is half an ulp, 2^-11 relative; 2e-3 leaves room for the rest.
# - bf16: half an ulp is 2^-8 relative.
ATTENTION_TOLERANCE = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-3),
}

# paged_attention's kernel against the float64 reference. As above, except that the kernel's
# probabilities enter P @ V rounded to the 16-bit dtype (errors average out over keys) before
# the output is rounded once: twice the absolute bound of the PyTorch implementation.
ATTENTION_KERNEL_TOLERANCE = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=5e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=4e-3),
}

# silu_mul against the float64 reference: one rounding of silu to the dtype, one of the
# product (2 ulps relative), plus fp32 error.
SILU_MUL_TOLERANCE = {
    torch.float32: dict(rtol=1e-6, atol=1e-7),
    torch.float16: dict(rtol=2e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4),
}

# silu_mul's kernel against the float64 reference: as above, except that fp32 allows for the
# GPU's approximate exp (a few ulps of sigmoid, carried by the product).
SILU_MUL_KERNEL_TOLERANCE = {
    torch.float32: dict(rtol=4e-6, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4),
}

# silu_mul's kernel against its PyTorch implementation: the kernel's fp32 silu (exp on the
# GPU is approximate) differs from PyTorch's by a few fp32 ulps. Rounded to a 16-bit dtype,
# silu may then differ by one ulp (up to 2^-10 relative, fp16), which the product carries
# and its own rounding can double: 2^-9 relative in fp16, 2^-6 in bf16.
SILU_MUL_KERNEL_VS_TORCH_TOLERANCE = {
    torch.float32: dict(rtol=2e-6, atol=1e-7),
    torch.float16: dict(rtol=2e-3, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict,
                 dtype: torch.dtype, **kwargs) -> None:
    """``actual`` equals ``expected`` within ``tolerance[dtype]``, both compared in float64
    on the CPU, NaN equal to NaN."""
    torch.testing.assert_close(actual.cpu().to(torch.float64), expected.cpu().to(torch.float64),
                               equal_nan=True, **tolerance[dtype], **kwargs)


# --------------------------------------------------------------------------- select_tokens

# Entropy (fp32 op against the float64 reference, or against the fp32 PyTorch
# implementation). The op sums exp(x - m) and exp(x - m) * (x - m) in fp32: the kernel per
# lane over V / BLOCK_V <= 8 terms, each rescaled when its lane's maximum grows, then across
# lanes and splits by trees; the PyTorch implementation pairwise. The relative error of
# each sum is about (8 + log2(V)) * 2^-24 ~ 1.2e-6, and log(s) adds ~1e-7 absolute (more
# with the GPU's approximate exp, ~2 ulp per term). H = log(s) - t / s is a sum of two
# non-negative terms, so rtol 1e-5 and atol 5e-6 leave a margin of about 5x.
ENTROPY_TOLERANCE = dict(rtol=1e-5, atol=5e-6)
# Top-p decisions: the op sums probability mass in fp32 (error ~1e-6 of the total), the
# reference in float64; a token within this much of the top-p boundary may go either way.
TOP_P_MARGIN = 1e-4
# Thresholds and fallback ties: random tests keep every threshold this far (relatively) from
# the adjusted entropies, and fallback rows this close to the smallest may be chosen.
DECISION_MARGIN = 1e-4
# Gumbel noise: two fp32 logs of exact inputs, a few ulps of |g| <= 17.4.
GUMBEL_TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def gumbel_near_tie(logits_row: torch.Tensor, temperature: float, seed: int, position: int,
                    token_a: int, token_b: int) -> bool:
    """Whether the float64 scores ``x / T + g`` of two tokens are equal at fp32 precision."""
    noise = philox.gumbel(seed, position, logits_row.shape[0])
    x = logits_row.double()
    score_a = float(x[token_a]) / temperature + float(noise[token_a])
    score_b = float(x[token_b]) / temperature + float(noise[token_b])
    return abs(score_a - score_b) <= 1e-5 * (1 + max(abs(score_a), abs(score_b)))


def assert_same_token(actual: int, expected: int, logits_row: torch.Tensor, temperature: float,
                      top_k: int, top_p: float, seed: int, position: int) -> None:
    """The op's token equals the reference's, or differs only by fp32 rounding of a sampled
    row: a near-tie of the two Gumbel scores, or a token whose top-p mass is within
    :data:`TOP_P_MARGIN` of ``top_p``. Greedy rows and padding rows must match exactly."""
    if actual == expected:
        return
    context = (position, actual, expected)
    assert position >= 0 and temperature > 0, context
    wider = select_reference.kept_tokens(logits_row, top_k, top_p + TOP_P_MARGIN)
    narrower = (wider if top_p >= 1
                else select_reference.kept_tokens(logits_row, top_k, top_p - TOP_P_MARGIN))
    assert wider[actual], context
    top_p_boundary = not (narrower[actual] and narrower[expected])
    near_tie = gumbel_near_tie(logits_row, temperature, seed, position, actual, expected)
    assert top_p_boundary or near_tie, context


def assert_selection(selected: torch.Tensor, expected_entropy: torch.Tensor,
                     expected_selected: torch.Tensor, cu_rows: list[int], row_pos: list[int],
                     threshold: list[float], penalty: list[float]) -> None:
    """The selection of every sequence equals the expected one where fp32 can decide it.

    Thresholds are kept :data:`DECISION_MARGIN` away from the adjusted entropies (see
    ``tests.select_inputs.choose_thresholds``), so a sequence with a row under its threshold
    must select exactly the expected rows. A sequence with none selects one row by the
    fallback (the smallest adjusted entropy, the first on ties); rows within
    :data:`DECISION_MARGIN` of the smallest are a tie fp32 cannot break, and any of them
    may be chosen. A sequence without valid rows selects nothing.
    """
    for b in range(len(cu_rows) - 1):
        rows = list(range(cu_rows[b], cu_rows[b + 1]))
        valid = [r for r in rows if row_pos[r] >= 0]
        if not valid:
            assert not selected[rows].any(), b
            continue
        nearest = min(row_pos[r] for r in valid)
        adjusted = {r: float(expected_entropy[r]) + penalty[b] * (row_pos[r] - nearest)
                    for r in valid}
        if any(a < threshold[b] for a in adjusted.values()):
            assert selected[rows].tolist() == expected_selected[rows].tolist(), b
            continue
        finite = [a for a in adjusted.values() if not math.isnan(a)]
        if finite:
            smallest = min(finite)
            tied = {r for r, a in adjusted.items()
                    if abs(a - smallest) <= DECISION_MARGIN * (1 + abs(smallest))}
        else:
            tied = {valid[0]}
        chosen = {r for r in rows if selected[r]}
        assert len(chosen) == 1 and chosen <= tied, (b, chosen, tied)
        if len(tied) == 1:
            assert selected[rows].tolist() == expected_selected[rows].tolist(), b
