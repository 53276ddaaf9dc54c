"""select_tokens: entropy, distance penalty, threshold selection and sampling.

One call handles every mask row of a decode step (ALGORITHM.md section 4, steps 3 to 6):
the entropy of each row's untempered softmax, the distance-adjusted entropy used to decide
which rows are committed this step, and a token for every row (greedy or top-k / top-p /
temperature sampling by the Gumbel-max trick on a stateless Philox4x32-10 stream).

The random stream depends only on (sequence seed, absolute position, vocabulary index), so
tokens do not depend on batch composition, row order, step count or how a kernel splits
the vocabulary. The Philox helpers below use plain int64 tensor arithmetic and are shared
by every implementation that needs the stream.
"""

import torch

from .. import _validate
from .._validate import FLOAT_DTYPES, Dims, check_same_device, check_tensor, debug_check

# Philox4x32-10 constants (Salmon et al., SC11): round multipliers and key increments.
PHILOX_MULTIPLIER_0 = 0xD2511F53
PHILOX_MULTIPLIER_1 = 0xCD9E8D57
PHILOX_WEYL_0 = 0x9E3779B9
PHILOX_WEYL_1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


def select_tokens(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, token and commit decision for every mask row of a decode step.

    Rows ``cu_rows[b] .. cu_rows[b+1]-1`` belong to sequence ``b``; row ``r`` predicts the
    token at absolute position ``row_pos[r]``. A row is valid iff it belongs to a sequence
    and ``row_pos[r] >= 0``; every other row is padding (token 0, not selected, entropy 0).

    Per valid row of sequence ``b``:

    - ``entropy`` = entropy in nats of the untempered softmax of the row (NaN for a row
      containing NaN or ``+inf``, or whose entries are all ``-inf``);
    - ``token``: greedy (first index of the maximum) if ``temperature[b] <= 0``; otherwise
      top-k on the raw logits (ties kept), top-p on the untempered softmax renormalised
      over the top-k survivors (keep ``v`` iff the probability of the strictly more
      probable tokens is ``< top_p``; the top token is always kept), then the Gumbel-max
      sample ``argmax(logits / temperature + g)`` with ``g`` from Philox4x32-10 keyed by
      ``seed[b]`` at counter ``(v, row_pos)``. NaN logits count as ``-inf``.
    - ``selected``: ``entropy + penalty[b] * (row_pos - min valid row_pos of b) <
      threshold[b]``; if no row of ``b`` passes, only the first row with the smallest such
      value (NaN rows only when all valid rows are NaN). ``threshold = -inf`` selects one
      row per sequence.

    Args:
        logits: ``[R, V]`` fp32, fp16 or bf16, stride 1 in the last dimension, ``V >= 1``.
        cu_rows: ``[B+1]`` int32, row offsets of the sequences (non-decreasing,
            ``cu_rows[0] >= 0``, ``cu_rows[B] <= R``; checked with ``WEDLM_KERNELS_DEBUG=1``).
        row_pos: ``[R]`` int64, absolute position predicted by each row; -1 marks padding.
        temperature: ``[B]`` fp32; ``<= 0`` means greedy.
        top_k: ``[B]`` int32; ``<= 0`` or ``>= V`` means off.
        top_p: ``[B]`` fp32; ``>= 1`` means off.
        threshold: ``[B]`` fp32, selection threshold on the adjusted entropy (strict).
        penalty: ``[B]`` fp32, adjusted-entropy increase per position of distance.
        seed: ``[B]`` int64, per-sequence seed (all 64 bits are used).

    Returns:
        ``(token, selected, entropy)``: fresh ``[R]`` tensors of dtype int64, bool and fp32.
        No argument is modified.

    Example:
        >>> import torch, wedlm_kernels as wk
        >>> logits = torch.tensor([[0.0, 5.0, 0.0], [1.0, 1.0, 1.0], [9.0, 0.0, 0.0]])
        >>> cu_rows = torch.tensor([0, 2, 3], dtype=torch.int32)
        >>> row_pos = torch.tensor([7, 8, 3])
        >>> f32 = lambda *v: torch.tensor(v, dtype=torch.float32)
        >>> token, selected, entropy = wk.select_tokens(
        ...     logits, cu_rows, row_pos, f32(0.0, 0.0), torch.tensor([0, 0], dtype=torch.int32),
        ...     f32(1.0, 1.0), f32(0.5, -float("inf")), f32(0.02, 0.02), torch.tensor([1, 2]))
        >>> token.tolist(), selected.tolist()
        ([1, 0, 0], [True, False, True])
    """
    dims = Dims()
    check_tensor("logits", logits, FLOAT_DTYPES, ("R", "V"), dims, unit_last_stride=True)
    if dims["V"] < 1:
        raise ValueError(f"`logits` must have a vocabulary of at least 1, got shape {list(logits.shape)}")
    check_tensor("cu_rows", cu_rows, torch.int32, (None,))
    if cu_rows.shape[0] < 1:
        raise ValueError("`cu_rows` must have B+1 >= 1 entries, got shape [0]")
    check_tensor("cu_rows", cu_rows, torch.int32, ("B+1",), dims)
    check_tensor("row_pos", row_pos, torch.int64, ("R",), dims)
    check_tensor("temperature", temperature, torch.float32, ("B",), dims)
    check_tensor("top_k", top_k, torch.int32, ("B",), dims)
    check_tensor("top_p", top_p, torch.float32, ("B",), dims)
    check_tensor("threshold", threshold, torch.float32, ("B",), dims)
    check_tensor("penalty", penalty, torch.float32, ("B",), dims)
    check_tensor("seed", seed, torch.int64, ("B",), dims)
    check_same_device(
        logits=logits, cu_rows=cu_rows, row_pos=row_pos, temperature=temperature,
        top_k=top_k, top_p=top_p, threshold=threshold, penalty=penalty, seed=seed,
    )
    if _validate.DEBUG:
        debug_check(cu_rows[0] >= 0, "cu_rows[0] must be >= 0")
        debug_check(cu_rows[1:] >= cu_rows[:-1], "cu_rows must be non-decreasing")
        debug_check(cu_rows[-1] <= dims["R"], f"cu_rows[-1] must be <= R = {dims['R']}")
    return torch.ops.wedlm.select_tokens(
        logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed
    )


# ----------------------------------------------------------------------------------------
# Philox4x32-10 in int64 tensor arithmetic.
#
# Every 32-bit word is held in an int64 tensor with a value in [0, 2**32). The 32x32-bit
# products of a round would need 64 unsigned bits, so the variable operand is split into
# 16-bit halves: with a = a_hi * 2**16 + a_lo, t = a_hi * m and s = a_lo * m stay below
# 2**48, and a * m = t * 2**16 + s gives
#     low word  = ((t mod 2**16) * 2**16 + s) mod 2**32
#     high word = (t + s // 2**16) // 2**16.
# ----------------------------------------------------------------------------------------


def _mul_hi_lo(word: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``word * multiplier`` without int64 overflow."""
    high_product = (word >> 16) * multiplier
    low_product = (word & 0xFFFF) * multiplier
    low = (((high_product & 0xFFFF) << 16) + low_product) & MASK32
    high = (high_product + (low_product >> 16)) >> 16
    return high, low


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on broadcastable int64 tensors holding 32-bit values (in [0, 2**32))."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + PHILOX_WEYL_0) & MASK32
            k1 = (k1 + PHILOX_WEYL_1) & MASK32
        hi0, lo0 = _mul_hi_lo(c0, PHILOX_MULTIPLIER_0)
        hi1, lo1 = _mul_hi_lo(c2, PHILOX_MULTIPLIER_1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_bits(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """First Philox output word for every (row, vocabulary index): ``[R, V]`` int64.

    ``seed`` and ``position`` are ``[R]`` int64; the key is the seed's two 32-bit halves
    (two's complement) and the counter is ``(v, position low, position high, 0)``.
    """
    seed = seed.unsqueeze(1)
    position = position.unsqueeze(1)
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int64).unsqueeze(0)
    counter = (vocab, position & MASK32, (position >> 32) & MASK32, torch.zeros_like(position))
    key = (seed & MASK32, (seed >> 32) & MASK32)
    return philox4x32_10(counter, key)[0]


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log(u))``, ``u = ((bits >> 8) + 0.5) * 2**-24``, in fp32.

    ``u`` has 25 significant bits, so in fp32 it is exact only below 1/2, where
    ``(bits >> 8) < 2**23``; above, ``1 - u`` is exact instead. ``-log(u)`` is therefore
    computed as ``-log(u)`` below 1/2 and ``-log1p(-(1 - u))`` above, accurate to a few fp32
    ulps everywhere (rounding ``u`` itself would turn the largest ``u`` into 1 and
    ``g`` into ``+inf``).
    """
    top = bits >> 8
    lower_half = top < (1 << 23)
    u_lower = (top.float() + 0.5) * 2.0**-24
    one_minus_u_upper = ((1 << 24) - top).float().sub(0.5).mul(2.0**-24)
    neg_log_u = torch.where(lower_half, -torch.log(u_lower), -torch.log1p(-one_minus_u_upper))
    return -torch.log(neg_log_u)


def philox_gumbel(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise of every (row, vocabulary index): ``[R, V]`` fp32."""
    return gumbel_from_bits(philox_bits(seed, position, vocab_size))


# ----------------------------------------------------------------------------------------
# The vectorised PyTorch implementation.
# ----------------------------------------------------------------------------------------


def _row_entropy(x: torch.Tensor) -> torch.Tensor:
    """Entropy per row of fp32 ``x`` ``[R, V]``; NaN where the row has NaN, +inf or no
    finite maximum.

    With ``m = max(x)``, ``z = sum(exp(x - m))`` and ``p = exp(x - m) / z``:
    ``H = logsumexp(x) - sum(p * x) = log(z) + sum(p * (m - x))``. Both terms are sums of
    non-negative numbers (no cancellation); ``-inf`` entries have ``p = 0`` and contribute 0.
    """
    undefined = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1)
    row_max = torch.where(undefined, 0.0, x.amax(-1))
    undefined = undefined | torch.isneginf(row_max)
    row_max = torch.where(undefined, 0.0, row_max).unsqueeze(-1)
    gap = torch.where(torch.isneginf(x), 0.0, row_max - x)  # m - x >= 0, 0 for -inf entries
    weight = torch.where(torch.isneginf(x), 0.0, torch.exp(-gap))
    total = weight.sum(-1)
    entropy = torch.log(total) + (weight * gap).sum(-1) / total
    return torch.where(undefined, float("nan"), entropy)


def _sample(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    gumbel: torch.Tensor,
) -> torch.Tensor:
    """Top-k, top-p and Gumbel-max sample per row of ``x`` ``[R, V]`` (fp32, no NaN)."""
    vocab_size = x.shape[-1]
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    sorted_x = torch.sort(x, dim=-1, descending=True).values

    # top-k: keep x >= the k-th largest value (ties kept); k <= 0 or k >= V keeps all.
    k_index = (top_k.long() - 1).clamp(0, vocab_size - 1).unsqueeze(-1)
    kth_value = sorted_x.gather(-1, k_index)
    top_k_on = ((top_k > 0) & (top_k < vocab_size)).unsqueeze(-1)
    kept = ~top_k_on | (x >= kth_value)

    # top-p on the untempered softmax over the top-k survivors. For each kept v, the mass
    # of strictly larger kept values is the exclusive cumulative sum (over the descending
    # sort) at the first entry equal to x_v; ties share the mass of their group's start.
    row_max = sorted_x[:, :1]
    sorted_kept = torch.where(~top_k_on | (sorted_x >= kth_value), sorted_x, neg_inf)
    safe_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    sorted_weight = torch.exp(sorted_kept - safe_max)
    sorted_prob = sorted_weight / sorted_weight.sum(-1, keepdim=True)
    mass_before = torch.nn.functional.pad(torch.cumsum(sorted_prob[:, :-1], -1), (1, 0))
    group_start = torch.searchsorted(-sorted_x, -x, right=False).clamp(max=vocab_size - 1)
    mass_above = mass_before.gather(-1, group_start)
    top_p_row = top_p.unsqueeze(-1)
    top_p_off = (top_p_row >= 1) | ~torch.isfinite(row_max)
    kept = kept & (top_p_off | (mass_above < top_p_row) | (x == row_max))

    # Gumbel-max: argmax of x / T + g over the kept entries is a sample of softmax(x / T).
    scores = x / temperature.unsqueeze(-1) + gumbel
    scores = torch.where(kept & ~torch.isnan(scores), scores, neg_inf)
    return torch.argmax(scores, dim=-1)


def _per_sequence_min(
    values: torch.Tensor, sequence: torch.Tensor, num_sequences: int, fill: float | int
) -> torch.Tensor:
    """``out[b] = min(values[r] for r with sequence[r] == b)`` (``fill`` where there is
    none); ``sequence == num_sequences`` is a discard bucket."""
    out = torch.full((num_sequences + 1,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, sequence, values, reduce="amin", include_self=True)


def select_tokens_torch(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows, vocab_size = logits.shape
    num_seqs = cu_rows.shape[0] - 1
    device = logits.device
    rows = torch.arange(num_rows, device=device)

    # Row -> sequence: the last b with cu_rows[b] <= r; rows outside [cu_rows[0], cu_rows[B])
    # are padding. Padding rows and rows with row_pos < 0 use the bucket `num_seqs`.
    sequence = torch.searchsorted(cu_rows.long(), rows, right=True) - 1
    valid = (sequence >= 0) & (sequence < num_seqs) & (row_pos >= 0)
    sequence = torch.where(valid, sequence, num_seqs)

    def per_row(values: torch.Tensor, padding_value: float | int) -> torch.Tensor:
        padded = torch.cat([values, values.new_full((1,), padding_value)])
        return padded[sequence]

    row_temperature = per_row(temperature, 1.0)
    row_top_k = per_row(top_k, 0)
    row_top_p = per_row(top_p, 1.0)
    row_threshold = per_row(threshold, float("-inf"))
    row_penalty = per_row(penalty, 0.0)
    row_seed = per_row(seed, 0)

    x = logits.float()
    entropy = _row_entropy(x)

    # Token: NaN logits count as -inf; greedy is the first index of the maximum.
    x = torch.where(torch.isnan(x), float("-inf"), x)
    greedy_token = torch.argmax(x, dim=-1)
    gumbel = philox_gumbel(row_seed, row_pos, vocab_size)
    sampling_temperature = torch.where(row_temperature <= 0, 1.0, row_temperature)
    sampled_token = _sample(x, sampling_temperature, row_top_k, row_top_p, gumbel)
    token = torch.where(row_temperature <= 0, greedy_token, sampled_token)

    # Adjusted entropy: penalty * distance from the smallest valid row_pos of the sequence.
    min_pos = _per_sequence_min(row_pos, sequence, num_seqs, torch.iinfo(torch.int64).max)
    distance = torch.where(valid, row_pos - min_pos[sequence], 0).float()
    adjusted = entropy + row_penalty * distance
    passes = valid & (adjusted < row_threshold)  # NaN never passes

    # Fallback for sequences where no row passes: the first row with the smallest non-NaN
    # adjusted entropy, or the first valid row when every valid row is NaN.
    any_pass = _per_sequence_min((~passes).to(torch.int32), sequence, num_seqs, 1) == 0
    candidate = valid & ~torch.isnan(adjusted)
    has_candidate = _per_sequence_min((~candidate).to(torch.int32), sequence, num_seqs, 1) == 0
    min_adjusted = _per_sequence_min(
        torch.where(candidate, adjusted, float("inf")), sequence, num_seqs, float("inf")
    )
    at_min = candidate & (adjusted == min_adjusted[sequence])
    pool = torch.where(has_candidate[sequence], at_min, valid)
    first_row = _per_sequence_min(torch.where(pool, rows, num_rows), sequence, num_seqs, num_rows)
    fallback = valid & ~any_pass[sequence] & (rows == first_row[sequence])
    selected = passes | fallback

    token = torch.where(valid, token, 0)
    entropy = torch.where(valid, entropy, 0.0)
    return token, selected, entropy


def select_tokens_fake(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows = logits.shape[0]
    return (
        logits.new_empty((num_rows,), dtype=torch.int64),
        logits.new_empty((num_rows,), dtype=torch.bool),
        logits.new_empty((num_rows,), dtype=torch.float32),
    )
