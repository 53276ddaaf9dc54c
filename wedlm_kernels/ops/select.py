"""select_tokens: entropy, distance penalty, threshold selection and sampling.

One call handles every mask row of a decode step (docs/algorithm.md section 4, steps 3 to 6):
the entropy of each row's untempered softmax, the distance-adjusted entropy used to decide
which rows are committed this step, and a token for every row (greedy or top-k / top-p /
temperature sampling by the Gumbel-max trick on a stateless Philox4x32-10 stream).

The random stream (wedlm_kernels/ops/philox.py) depends only on (sequence seed, absolute
position, vocabulary index), so tokens do not depend on batch composition, row order, step
count or how a kernel splits the vocabulary, apart from decisions within fp32 rounding of a
top-p boundary (docs/contracts.md, "Precision of the token").
"""

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from . import _dispatch, philox
from ._triton import POINTER_TYPES, KernelVariant, next_power_of_2
from ._validate import (
    FLOAT_DTYPES,
    CheckedSignatures,
    Dims,
    check_same_device,
    check_tensor,
    debug_check,
)
from .philox import gumbel_from_word, philox4x32_words, philox_gumbel


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
    sampling: str = "any",
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
      ``seed[b]``: the word of index ``v`` is output ``v & 3`` of the call at counter
      ``(v >> 2, row_pos)`` (docs/contracts.md). NaN logits count as ``-inf``.
    - ``selected``: ``entropy + penalty[b] * (row_pos - min valid row_pos of b) <
      threshold[b]``; if no row of ``b`` passes, only the first row with the smallest such
      value (NaN rows only when all valid rows are NaN). ``threshold = -inf`` selects one
      row per sequence.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]`` fp32, fp16 or bf16, stride 1 in the last dimension, ``V >= 1``.
    cu_rows : torch.Tensor
        ``[B+1]`` int32, row offsets of the sequences (non-decreasing, ``cu_rows[0] >= 0``,
        ``cu_rows[B] <= R``; checked with ``WEDLM_KERNELS_DEBUG=1``).
    row_pos : torch.Tensor
        ``[R]`` int64, absolute position predicted by each row; -1 marks padding.
    temperature : torch.Tensor
        ``[B]`` fp32; ``<= 0`` means greedy.
    top_k : torch.Tensor
        ``[B]`` int32; ``<= 0`` or ``>= V`` means off.
    top_p : torch.Tensor
        ``[B]`` fp32; ``>= 1`` means off.
    threshold : torch.Tensor
        ``[B]`` fp32, selection threshold on the adjusted entropy (strict).
    penalty : torch.Tensor
        ``[B]`` fp32, adjusted-entropy increase per position of distance.
    seed : torch.Tensor
        ``[B]`` int64, per-sequence seed (all 64 bits are used).
    sampling : str
        What the call decodes, so that a kernel compiled for it alone can run (the
        ``one_launch`` kernel, ``WEDLM_KERNELS_SELECT_KERNEL``): ``"any"`` (default) the rule
        above; ``"temperature"`` the rule with top-k and top-p off (``top_k`` and ``top_p``
        are not read); ``"greedy"`` every row greedy (``temperature``, ``top_k``, ``top_p`` and
        ``seed`` are not read). Tokens equal the rule's whenever the parameters agree with
        the mode (docs/contracts.md, "Sampling modes").

    Returns
    -------
    token : torch.Tensor
        Fresh ``[R]`` tensor of dtype int64.
    selected : torch.Tensor
        Fresh ``[R]`` tensor of dtype bool.
    entropy : torch.Tensor
        Fresh ``[R]`` tensor of dtype fp32.

    No argument is modified.

    Examples
    --------
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
    _CHECKED.check(_check_arguments, (logits, cu_rows, row_pos, temperature, top_k, top_p,
                                      threshold, penalty, seed), sampling)
    if _backend.DEBUG:
        num_rows = logits.shape[0]
        debug_check(cu_rows[0] >= 0, "cu_rows[0] must be >= 0")
        debug_check(cu_rows[1:] >= cu_rows[:-1], "cu_rows must be non-decreasing")
        debug_check(cu_rows[-1] <= num_rows, f"cu_rows[-1] must be <= R = {num_rows}")
    return _dispatch.call(
        "select_tokens", logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty,
        seed, sampling,
    )


# The argument signatures (dtypes, shapes, strides, devices, mode) that passed the checks:
# a decode loop's calls are checked once per shape.
_CHECKED = CheckedSignatures()


def _check_arguments(logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty,
                     seed, sampling) -> None:
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
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"`sampling` must be one of {', '.join(map(repr, SAMPLING_MODES))}, "
                         f"got {sampling!r}")
    check_same_device(
        logits=logits, cu_rows=cu_rows, row_pos=row_pos, temperature=temperature,
        top_k=top_k, top_p=top_p, threshold=threshold, penalty=penalty, seed=seed,
    )


SAMPLING_MODES = ("any", "temperature", "greedy")


def _parameters_of_mode(sampling: str, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, top_k, top_p)`` as the rule reads them under ``sampling``: greedy
    temperatures, or top-k and top-p off (new tensors only where the mode changes them)."""
    if sampling == "greedy":
        temperature = torch.zeros_like(temperature)
    if sampling != "any":
        top_k, top_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    return temperature, top_k, top_p


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


def kept_tokens(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens top-k and top-p keep, per row of ``x`` ``[R, V]`` (fp32, no NaN;
    ``top_k`` [R] int, ``top_p`` [R] fp32): bool ``[R, V]``, the sampling rule's steps 1
    and 2 (``contracts.md``, select_tokens)."""
    vocab_size = x.shape[-1]
    neg_inf = torch.full((), float("-inf"), device=x.device)  # no host copy: graph-safe
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
    return kept & (top_p_off | (mass_above < top_p_row) | (x == row_max))


def _sample(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    gumbel: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """Top-k, top-p and Gumbel-max sample per row of ``x`` ``[R, V]`` (fp32, no NaN).
    ``filtered=False`` says no row has a top-k or top-p that drops an entry (kept_tokens
    would keep them all), and skips their sort."""
    neg_inf = torch.full((), float("-inf"), device=x.device)  # no host copy: graph-safe

    # Gumbel-max: argmax of x / T + g over the kept entries is a sample of softmax(x / T).
    scores = x / temperature.unsqueeze(-1) + gumbel
    keep = ~torch.isnan(scores)
    if filtered:
        keep = kept_tokens(x, top_k, top_p) & keep
    return torch.argmax(torch.where(keep, scores, neg_inf), dim=-1)


def _tokens_on_the_device(
    x: torch.Tensor,
    greedy_token: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """Each row's token (``greedy_token`` where ``temperature <= 0``, else its sample), with
    no host read and no shape that depends on the values: every row is sampled, and the
    greedy ones take their argmax instead (CUDA graphs, ``torch.compile``)."""
    gumbel = philox_gumbel(seed, position, x.shape[-1])
    sampling_temperature = torch.where(temperature <= 0, 1.0, temperature)
    sampled_token = _sample(x, sampling_temperature, top_k, top_p, gumbel)
    return torch.where(temperature <= 0, greedy_token, sampled_token)


def _tokens_on_the_host(
    x: torch.Tensor,
    greedy_token: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """:func:`_tokens_on_the_device` for CPU tensors, where reading a value costs no device
    wait: the Philox noise, the sort and the top-p scan run only for the rows that sample,
    and the sort only when one of them filters. Each row's token depends on that row alone,
    so the tokens are the same (``test_select_tokens.py`` compares the two). On a vocabulary
    of 151936 entries the work skipped is most of a decode step's time on a CPU."""
    sampling = (~(temperature <= 0)).nonzero().squeeze(-1)  # (a NaN temperature samples)
    if sampling.numel() == 0:
        return greedy_token
    token = greedy_token.clone()
    rows = x[sampling]
    gumbel = philox_gumbel(seed[sampling], position[sampling], x.shape[-1])
    rows_top_k, rows_top_p = top_k[sampling], top_p[sampling]
    top_k_on = (rows_top_k > 0) & (rows_top_k < x.shape[-1])
    filtered = bool(top_k_on.any()) or not bool((rows_top_p >= 1).all())
    token[sampling] = _sample(rows, temperature[sampling], rows_top_k, rows_top_p, gumbel,
                              filtered)
    return token


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
    sampling: str = "any",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p = _parameters_of_mode(sampling, temperature, top_k, top_p)
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
    # (torch.compile traces the path without host reads, whatever the device)
    on_the_host = device.type == "cpu" and not torch.compiler.is_compiling()
    tokens = _tokens_on_the_host if on_the_host else _tokens_on_the_device
    token = tokens(x, greedy_token, row_temperature, row_top_k, row_top_p, row_seed, row_pos)

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
    sampling: str = "any",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows = logits.shape[0]
    return (
        logits.new_empty((num_rows,), dtype=torch.int64),
        logits.new_empty((num_rows,), dtype=torch.bool),
        logits.new_empty((num_rows,), dtype=torch.float32),
    )


# ----------------------------------------------------------------------------------------
# Triton kernels: three launches, none of which waits for the host.
#
# 1. _select_scan_kernel, grid (row, vocabulary split), the one full pass over the logits,
#    one tile at a time with scalar accumulators:
#      - softmax statistics: running max m, s = sum exp(x - m), t = sum exp(x - m)(x - m)
#        <= 0; a tile raising the max from m to m' rescales s <- s e^(m-m') and
#        t <- e^(m-m') (t + (m - m') s). H = log(s) - t / s adds two non-negative terms;
#      - greedy rows: the first index of the maximum (a tile that ties an earlier tile's
#        maximum keeps the earlier index);
#      - sampling rows without top-k: the four best Gumbel-max scores x / T + g (score
#        descending, index ascending), the first of which is a temperature-only row's
#        token. As g lies in [-2.86, 17.33], an entry more than GUMBEL_SPREAD * T below
#        the (running) maximum cannot win, and a tile entirely below skips its noise;
#      - top-k / top-p rows: the maximum of every GRANULE logits (NaN as -inf).
# 2. _select_filter_kernel, grid (row, split), for top-k / top-p rows: the floor of the kept set
#    (top-k keeps x >= the k-th largest value, ties included; top-p keeps x >= the cutoff c,
#    the smallest value whose strictly larger survivors hold less than top_p of their
#    softmax mass) raised to max - GUMBEL_SPREAD * T, then the Gumbel argmax over x >= floor.
#    Both thresholds are the largest y with F(y) >= target, F(y) the sum over x >= y of a
#    weight (1, target k; exp(x - max) over the top-k survivors, target top_p * their mass).
#    F falls as y rises: a search over the order-preserving integer keys of fp32 values
#    evaluates NUM_PIVOTS pivots per pass, shrinking the interval NUM_PIVOTS-fold (at most 8
#    passes), or ends when one distinct value is left. Answers are data values, so ties are
#    kept exactly like a sort would. This is a radix select with 16-way digits: each pass
#    is a 16-bin cumulative histogram (count, or softmax mass for top-p) of the domain,
#    summed in registers, so the kept sets do not depend on an order of float atomics.
#    Its passes run over the candidate granules, not the row (next paragraph): the row is
#    read from memory once by the scan, and the candidates (at most MAX_CANDIDATES
#    granules, 32 KB of bf16) again, from the cache, by each pass (bench/vocabulary_passes.py
#    counts them: at most one pass over the row more than greedy on the benchmark's rows).
#    The passes read candidate granules, not the row. The k largest granule maxima are k
#    entries >= the k-th largest of them, tau: every top-k survivor is in a granule whose
#    maximum is >= tau. For top-p alone, tau is the largest granule maximum whose granule
#    maxima at or above it already reach the target (checked on the entries): nothing
#    below tau is kept. Split 0 does this work (for a top-k row, alone).
#    A top-p-alone row with more than MAX_CANDIDATES candidates (a flat row) is checked
#    instead: its token is the first of the scan's four best draws whose mass strictly
#    above is below the target. Why that is exact: the token t is the best-scoring kept
#    entry; the maximum is always kept and the scan scores it, and an entry the scan
#    skipped scores below the maximum, so t was scored. If t is among the four, the draws
#    ranked above it are not kept and it is the first kept one; if it is not, all four
#    outscore it, so none is kept. Each program sums the four masses over its split; the
#    last of the row's programs to arrive (an atomic count) adds them up and decides.
#    Rows whose four draws all fall outside top-p,
#    and the other rows with too many candidates (ties, large k, rows with a NaN), run the
#    searches over the whole row in one program: exact on every path.
# 3. _select_sequences_kernel, one program per sequence: merges each row's partials, writes
#    token and entropy, and applies the distance penalty, the strict threshold and the
#    selection fallback.
#
# The random word of vocabulary index v is output v & 3 of the Philox call at counter
# (v >> 2, position): one call per four entries.
# ----------------------------------------------------------------------------------------

_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))
_INDEX_NONE = tl.constexpr(2**31 - 1)  # "no index yet" in argmax merges
_GUMBEL_SPREAD = tl.constexpr(24.0)  # > max g - min g = 17.33 + 2.86, with margin
_GRANULE = tl.constexpr(64)  # logits per granule; a tile is [granules, 64]
_QUADS = tl.constexpr(16)  # Philox counters per granule (four words each)


@triton.jit
def _sortable_key(value):
    """Order-preserving int64 key of an fp32 value: its bits for x >= +0.0, its bits with
    the 31 value bits flipped below (-0.0 sits one key under +0.0)."""
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value of a key from :func:`_sortable_key`."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _gumbel_words(granule, position, seed):
    """The random words of the granules' entries, ``[G, 64]`` uint32 for ``[G]`` granules:
    one Philox call per four entries, its words interleaved back into vocabulary order."""
    quad = granule[:, None].to(tl.uint32) * _QUADS + tl.arange(0, _QUADS)[None, :].to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_words(quad, position, seed)
    return tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))


@triton.jit
def _tile_scores(x, granule, position, seed, temperature, floor):
    """The Gumbel-max scores x / T + g of a tile's entries (NaN-free x), -inf below floor."""
    score = tl.math.div_rn(x, temperature) + gumbel_from_word(_gumbel_words(granule, position,
                                                                            seed))
    return tl.where((x >= floor) & (score == score), score, _NEG_INF)


@triton.jit
def _first_best(score, index):
    """The best score of a tile and the first index holding it (INDEX_NONE if -inf)."""
    best = tl.max(score)
    best_index = tl.min(tl.where(score == best, index, _INDEX_NONE))
    return best, tl.where(best > float("-inf"), best_index, _INDEX_NONE)


@triton.jit
def _vector4(a, b, c, d):
    """The four scalars as a [4] tensor."""
    lane = tl.arange(0, 4)
    return tl.where(lane == 0, a, tl.where(lane == 1, b, tl.where(lane == 2, c, d)))


@triton.jit
def _insert_best4(s0, s1, s2, s3, i0, i1, i2, i3, score, index):
    """Insert (score, index) into the four best (score, index) pairs, ordered by score
    descending then index ascending; a -inf score with INDEX_NONE changes nothing."""
    ahead0 = (s0 > score) | ((s0 == score) & (i0 <= index))
    ahead1 = (s1 > score) | ((s1 == score) & (i1 <= index))
    ahead2 = (s2 > score) | ((s2 == score) & (i2 <= index))
    ahead3 = (s3 > score) | ((s3 == score) & (i3 <= index))
    n3 = tl.where(ahead3, s3, tl.where(ahead2, score, s2))
    j3 = tl.where(ahead3, i3, tl.where(ahead2, index, i2))
    n2 = tl.where(ahead2, s2, tl.where(ahead1, score, s1))
    j2 = tl.where(ahead2, i2, tl.where(ahead1, index, i1))
    n1 = tl.where(ahead1, s1, tl.where(ahead0, score, s0))
    j1 = tl.where(ahead1, i1, tl.where(ahead0, index, i0))
    return (tl.where(ahead0, s0, score), n1, n2, n3, tl.where(ahead0, i0, index), j1, j2, j3)


@triton.jit
def _merge_best4(s0, s1, s2, s3, i0, i1, i2, i3, score, index):
    """The four best (score, index) pairs of the held four and a tile's ``score`` at
    ``index`` (its own four best are inserted one by one)."""
    for _rank in tl.static_range(4):
        top, top_index = _first_best(score, index)
        s0, s1, s2, s3, i0, i1, i2, i3 = _insert_best4(s0, s1, s2, s3, i0, i1, i2, i3, top,
                                                       top_index)
        score = tl.where(index == top_index, _NEG_INF, score)
    return s0, s1, s2, s3, i0, i1, i2, i3


@triton.jit
def _granule_tile(values_ptr, length, granule):
    """Entries of ``[G]`` granules (-1: none) of the values ``values_ptr[0 .. length)``:
    ``(x [G, 64] fp32 with NaN as -inf, index [G, 64], valid [G, 64])``."""
    index = granule[:, None] * _GRANULE + tl.arange(0, _GRANULE)[None, :]
    valid = (granule >= 0)[:, None] & (index < length)
    x = tl.load(values_ptr + index, mask=valid, other=float("-inf")).to(tl.float32)
    return tl.where(x == x, x, _NEG_INF), index, valid


@triton.jit
def _domain_granules(list_ptr, use_list, slot, domain_size):
    """Granule ids of domain slots ``slot``: ``list_ptr[slot]`` when ``use_list``, else
    the slot itself (the whole row); -1 past the domain's ``domain_size`` granules."""
    in_domain = slot < domain_size
    listed = tl.load(list_ptr + slot, mask=in_domain & use_list, other=-1)
    return tl.where(in_domain, tl.where(use_list, listed, slot), -1)


@triton.jit
def _measure(pivot_values, low_value, high_value, values_ptr, length, list_ptr, use_list,
             domain_size, weight_floor, row_max, MASS: tl.constexpr, TILE: tl.constexpr):
    """One pass over a domain: F at each pivot and at ``low_value``, and the smallest and
    largest value in ``[low_value, high_value]``. ``F(y)`` sums over the entries ``x >= y``
    the weight 1 (count) or, with ``MASS``, ``exp(x - row_max)`` for ``x >= weight_floor``
    (0 below)."""
    if MASS:
        reaching = tl.zeros(pivot_values.shape, tl.float32)
        reaching_low = tl.zeros([TILE, _GRANULE], tl.float32)
    else:
        reaching = tl.zeros(pivot_values.shape, tl.int32)
        reaching_low = tl.zeros([TILE, _GRANULE], tl.int32)
    inside_min = tl.full([TILE, _GRANULE], float("inf"), tl.float32)
    inside_max = tl.full([TILE, _GRANULE], float("-inf"), tl.float32)
    for tile_start in range(0, domain_size, TILE):
        granule = _domain_granules(list_ptr, use_list, tile_start + tl.arange(0, TILE),
                                   domain_size)
        x, index, valid = _granule_tile(values_ptr, length, granule)
        if MASS:
            weight = tl.where(valid & (x >= weight_floor), tl.exp(x - row_max), 0.0)
        else:
            weight = valid.to(tl.int32)
        at_pivot = x[:, :, None] >= pivot_values[None, None, :]
        reaching += tl.sum(tl.sum(tl.where(at_pivot, weight[:, :, None], 0), axis=0), axis=0)
        at_least_low = valid & (x >= low_value)
        reaching_low += tl.where(at_least_low, weight, 0)
        inside = at_least_low & (x <= high_value)
        inside_min = tl.minimum(inside_min, tl.where(inside, x, _POS_INF))
        inside_max = tl.maximum(inside_max, tl.where(inside, x, _NEG_INF))
    return reaching, tl.sum(reaching_low), tl.min(inside_min), tl.max(inside_max)


@triton.jit
def _largest_key_reaching(target, low_key, high_key, values_ptr, length, list_ptr, use_list,
                          domain_size, weight_floor, row_max, MASS: tl.constexpr,
                          TILE: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The largest key y in [low_key, high_key] with F(y) >= target (see :func:`_measure`);
    low_key when there is none. The caller guarantees F(high_key + 1) < target."""
    pivot_rank = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    while low_key < high_key:
        width = high_key - low_key
        pivots = low_key + (width * pivot_rank + NUM_PIVOTS - 1) // NUM_PIVOTS  # in (low, high]
        reaching, reaching_low, value_min, value_max = _measure(
            _key_value(pivots), _key_value(low_key), _key_value(high_key), values_ptr, length,
            list_ptr, use_list, domain_size, weight_floor, row_max, MASS, TILE)
        if value_min >= value_max:
            # at most one distinct value v in [low, high]: F is F(low) up to v and
            # F(high + 1) < target above, so the answer is v if F(low) reaches, else none
            found = (value_min < float("inf")) & (reaching_low >= target)
            low_key = tl.where(found, _sortable_key(value_min), low_key)
            high_key = low_key
        else:
            # pivot j reaches iff j <= passing (F falls as the pivot rises): the answer lies
            # in [pivot(passing), pivot(passing + 1) - 1], pivot(j) = low + ceil(width j / P)
            passing = tl.sum((reaching >= target).to(tl.int64))
            new_low = low_key + (width * passing + NUM_PIVOTS - 1) // NUM_PIVOTS
            new_high = low_key + (width * (passing + 1) + NUM_PIVOTS - 1) // NUM_PIVOTS
            low_key = new_low
            high_key = tl.minimum(high_key, new_high - 1)
    return low_key


@triton.jit
def _row_mode(temperature, top_k, top_p, vocab_size):
    """(sampling, top_k_on, top_p_on): the row samples (temperature > 0 or NaN), through
    top-k, through top-p (a NaN top_p is on: it keeps only the maximum)."""
    sampling = ~(temperature <= 0.0)
    return sampling, sampling & (top_k > 0) & (top_k < vocab_size), sampling & ~(top_p >= 1.0)


@triton.jit
def _sequence_mode(temperature_ptr, top_k_ptr, top_p_ptr, sequence, vocab_size):
    """:func:`_row_mode` of sequence ``sequence``, from its parameters in memory."""
    return _row_mode(tl.load(temperature_ptr + sequence), tl.load(top_k_ptr + sequence),
                     tl.load(top_p_ptr + sequence), vocab_size)


@triton.jit
def sequence_of_row(row, cu_rows_ptr, num_sequences, search_steps):
    """``(sequence, member, first_row, end_row)``: the last ``b`` with ``cu_rows[b] <= row``
    (a binary search of ``search_steps``, the bit length of B + 1, steps over ``[0, B]``),
    whether ``row`` lies in that sequence's rows ``[first_row, end_row)``, and those bounds
    (0, 0 where it lies in none)."""
    low = tl.full([], 0, tl.int32)
    high = tl.full([], 0, tl.int32) + num_sequences + 1
    for _ in range(search_steps):
        active = low < high
        middle = (low + high) // 2
        offset = tl.load(cu_rows_ptr + tl.where(active, middle, 0))
        go_right = active & (offset <= row)
        low = tl.where(go_right, middle + 1, low)
        high = tl.where(active & ~go_right, middle, high)
    sequence = low - 1
    in_sequences = (sequence >= 0) & (sequence < num_sequences)
    safe_sequence = tl.where(in_sequences, sequence, 0)
    first_row = tl.load(cu_rows_ptr + safe_sequence)
    end_row = tl.load(cu_rows_ptr + safe_sequence + 1)
    member = in_sequences & (first_row <= row) & (row < end_row)
    return sequence, member, tl.where(member, first_row, 0), tl.where(member, end_row, 0)


@triton.jit
def _select_scan_kernel(
    logits_ptr,  # [R, V], unit last stride
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    temperature_ptr,  # [B] fp32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    row_sequence_ptr,  # [R] int32 out: the row's sequence, -1 for padding rows
    granule_max_ptr,  # [R, num_granules] fp32 out (top-k / top-p rows)
    partial_float_ptr,  # [R, num_splits, 4] fp32 out: m, s, t, best value
    partial_index_ptr,  # [R, num_splits] int32 out: first index of the best value
    top_score_ptr,  # [R, num_splits, 4] fp32 out: the four best Gumbel scores (no top-k)
    top_index_ptr,  # [R, num_splits, 4] int32 out: their indices
    arrivals_ptr,  # [R] int32 out: zeroed for the filter kernel's count of its programs
    token_ptr,  # [R] int64 out (padding rows only)
    selected_ptr,  # [R] bool out (padding rows only)
    entropy_ptr,  # [R] fp32 out (padding rows only)
    logits_row_stride,
    vocab_size,
    num_sequences,
    search_steps,  # bit length of B + 1
    split_size,  # a multiple of TILE_GRANULES * GRANULE
    num_splits,
    num_granules,  # cdiv(V, GRANULE)
    TILE_GRANULES: tl.constexpr,
    GUMBEL_GRANULES: tl.constexpr,  # sub-tile of the random numbers, divides TILE_GRANULES
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    position = tl.load(row_pos_ptr + row)

    sequence, member, _, _ = sequence_of_row(row, cu_rows_ptr, num_sequences, search_steps)
    valid = member & (position >= 0)
    if split == 0:
        tl.store(row_sequence_ptr + row, tl.where(valid, sequence, -1))
        tl.store(arrivals_ptr + row, 0)
        if not valid:
            tl.store(token_ptr + row, tl.full([], 0, tl.int64))
            tl.store(selected_ptr + row, tl.full([], 0, tl.int1))
            tl.store(entropy_ptr + row, tl.full([], 0.0, tl.float32))

    if valid:
        temperature = tl.load(temperature_ptr + sequence)
        seed = tl.load(seed_ptr + sequence)
        sampling, top_k_on, top_p_on = _sequence_mode(
            temperature_ptr, top_k_ptr, top_p_ptr, sequence, vocab_size)
        filtered = top_k_on | top_p_on
        draw = sampling & ~top_k_on  # the Gumbel scores here: temperature only, or top-p
        row_ptr = logits_ptr + row * logits_row_stride
        start = split * split_size
        end = tl.minimum(start + split_size, vocab_size)

        # m starts at the lowest finite fp32 rather than -inf, so that x - m is never
        # -inf - -inf: -inf entries get weight exp(-inf) = 0, and a row whose entries are
        # all -inf ends with s = 0. A NaN entry makes s NaN; a +inf one makes m +inf.
        run_max = tl.full([], -3.4028234663852886e38, tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)
        run_gap = tl.full([], 0.0, tl.float32)  # sum exp(x - m) * (x - m), <= 0
        best = tl.full([], float("-inf"), tl.float32)  # greedy: the maximum
        best_index = tl.full([], _INDEX_NONE, tl.int32)
        s0 = tl.full([], float("-inf"), tl.float32)  # sampling: the four best scores
        s1, s2, s3 = s0, s0, s0
        i0 = tl.full([], _INDEX_NONE, tl.int32)
        i1, i2, i3 = i0, i0, i0
        for tile_start in range(start, end, TILE_GRANULES * _GRANULE):
            index = tile_start + tl.arange(0, TILE_GRANULES * _GRANULE)
            x = tl.load(row_ptr + index, mask=index < end, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, axis=0)  # NaN entries are ignored by max
            if tile_max > run_max:  # rescale the sums to the new maximum (rare)
                shift = run_max - tile_max
                scale = tl.exp(shift)
                run_gap = scale * (run_gap + tl.maximum(shift, -1e30) * run_sum)
                run_sum = scale * run_sum
                run_max = tile_max
            gap = x - run_max  # <= 0; -inf for -inf entries
            weight = tl.exp(gap)
            run_sum += tl.sum(weight, axis=0)
            run_gap += tl.sum(weight * tl.maximum(gap, -1e30), axis=0)

            # the row's mode is reloaded per tile (three cached loads) rather than kept:
            # held across the tile, ptxas spilled the flags around the division's slow-path
            # calls when the launch specialises vocab_size, split_size and the row stride
            sampling, top_k_on, top_p_on = _sequence_mode(
                temperature_ptr, top_k_ptr, top_p_ptr, sequence, vocab_size)
            if top_k_on | top_p_on:
                granule = tile_start // _GRANULE + tl.arange(0, TILE_GRANULES)
                x_granules = tl.reshape(tl.where(x == x, x, _NEG_INF), [TILE_GRANULES, _GRANULE])
                tl.store(granule_max_ptr + row * num_granules + granule,
                         tl.max(x_granules, axis=1), mask=granule < num_granules)
            if sampling & ~top_k_on:
                floor = run_max - _GUMBEL_SPREAD * temperature
                floor = tl.where(floor == floor, floor, _NEG_INF)  # +inf max and +inf T
                if tile_max >= floor:
                    # in sub-tiles of GUMBEL_GRANULES, re-read from the cache: the random
                    # numbers of a whole tile would not fit in registers
                    for sub in range(0, TILE_GRANULES // GUMBEL_GRANULES):
                        sub_granule = (tile_start // _GRANULE + sub * GUMBEL_GRANULES
                                       + tl.arange(0, GUMBEL_GRANULES))
                        x_sub, sub_index, sub_valid = _granule_tile(row_ptr, end, sub_granule)
                        score = _tile_scores(x_sub, sub_granule, position, seed, temperature,
                                             floor)
                        if tl.max(score) > s3:  # strictly: an earlier entry wins a tie
                            s0, s1, s2, s3, i0, i1, i2, i3 = _merge_best4(
                                s0, s1, s2, s3, i0, i1, i2, i3, score, sub_index)
            elif not sampling:
                if tile_max > best:  # greedy: the first index of the maximum
                    best_index = tl.min(tl.where(x == tile_max, index, _INDEX_NONE), axis=0)
                    best = tile_max

        out = row * num_splits + split
        if draw:
            tl.store(top_score_ptr + out * 4 + tl.arange(0, 4), _vector4(s0, s1, s2, s3))
            tl.store(top_index_ptr + out * 4 + tl.arange(0, 4), _vector4(i0, i1, i2, i3))
            best = tl.where(filtered, float("-inf"), s0)  # the filter kernel draws top-p rows
            best_index = i0
        tl.store(partial_float_ptr + out * 4, run_max)
        tl.store(partial_float_ptr + out * 4 + 1, run_sum)
        tl.store(partial_float_ptr + out * 4 + 2, run_gap)
        tl.store(partial_float_ptr + out * 4 + 3, best)
        tl.store(partial_index_ptr + out, best_index)


@triton.jit
def _select_filter_kernel(
    logits_ptr,  # [R, V], unit last stride
    row_pos_ptr,  # [R] int64
    temperature_ptr,  # [B] fp32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    row_sequence_ptr,  # [R] int32 (from the scan)
    granule_max_ptr,  # [R, num_granules] fp32 (from the scan)
    top_score_ptr,  # [R, num_splits, 4] fp32 (from the scan)
    top_index_ptr,  # [R, num_splits, 4] int32 (from the scan)
    arrivals_ptr,  # [R] int32: programs of the row done so far (zeroed by the scan)
    mass_above_ptr,  # [R, num_splits, 4] fp32 scratch: mass above each drawn token, per split
    candidate_ptr,  # [R, MAX_CANDIDATES] int32 scratch: candidate granule ids
    floor_ptr,  # [R] fp32 out: the row drew from the entries x >= floor (paths 1 and 2)
    path_ptr,  # [R] int32 out: 1 candidates, 2 whole row, 3 drawn tokens checked
    partial_float_ptr,  # [R, num_splits, 4] fp32: m, s from the scan; best value out
    partial_index_ptr,  # [R, num_splits] int32: index of the best value out (split 0)
    logits_row_stride,
    vocab_size,
    num_granules,
    split_size,
    num_splits,
    TILE: tl.constexpr,  # granules per search tile
    LIST_BLOCK: tl.constexpr,  # granule maxima per step of the list scans
    SPLIT_BLOCK: tl.constexpr,  # >= num_splits
    NUM_PIVOTS: tl.constexpr,
    MAX_CANDIDATES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    sequence = tl.load(row_sequence_ptr + row)
    temperature = tl.load(temperature_ptr + sequence, mask=sequence >= 0, other=0.0)
    top_k = tl.load(top_k_ptr + sequence, mask=sequence >= 0, other=0)
    top_p = tl.load(top_p_ptr + sequence, mask=sequence >= 0, other=1.0)
    sampling, top_k_on, top_p_asked = _row_mode(temperature, top_k, top_p, vocab_size)
    # split 0 draws the row; the other splits only help check a top-p-alone row's four
    # draws (step 3), so a top-k row's searches run in one program, not in every split
    helps = (split == 0) | (top_p_asked & ~top_k_on)
    if (sequence >= 0) & (top_k_on | top_p_asked) & helps:
        seed = tl.load(seed_ptr + sequence)
        position = tl.load(row_pos_ptr + row)
        row_ptr = logits_ptr + row * logits_row_stride
        granule_row = granule_max_ptr + row * num_granules
        candidates = candidate_ptr + row * MAX_CANDIDATES
        list_offsets = tl.arange(0, LIST_BLOCK)

        row_max = tl.full([], float("-inf"), tl.float32)
        for list_start in range(0, num_granules, LIST_BLOCK):
            slot = list_start + list_offsets
            granule_max = tl.load(granule_row + slot, mask=slot < num_granules,
                                  other=float("-inf"))
            row_max = tl.maximum(row_max, tl.max(granule_max))
        floor = row_max - _GUMBEL_SPREAD * temperature
        floor = tl.where(floor == floor, floor, _NEG_INF)  # +inf max and +inf temperature
        top_p_on = top_p_asked & (row_max > float("-inf")) & (row_max < float("inf"))
        top_p = tl.where(top_p == top_p, top_p, 0.0)  # a NaN top_p keeps only the maximum
        max_key = _sortable_key(row_max)
        floor_key = _sortable_key(floor)
        no_list = tl.zeros([], tl.int1)
        granule_domain = tl.cdiv(num_granules, _GRANULE)

        # the row's softmax mass relative to row_max, from the scan (NaN if a NaN is in it)
        parts = row * num_splits + tl.arange(0, SPLIT_BLOCK)
        part_mask = tl.arange(0, SPLIT_BLOCK) < num_splits
        part_max = tl.load(partial_float_ptr + parts * 4, mask=part_mask, other=float("-inf"))
        part_sum = tl.load(partial_float_ptr + parts * 4 + 1, mask=part_mask, other=0.0)
        row_mass = tl.sum(tl.where(part_mask, part_sum * tl.exp(part_max - row_max), 0.0))

        # 1. a lower bound on the entries that matter, from the granule maxima
        bound_key = floor_key
        if top_k_on:
            tau_key = _largest_key_reaching(
                top_k, _sortable_key(tl.full([], float("-inf"), tl.float32)), max_key,
                granule_row, num_granules, candidates, no_list, granule_domain, _NEG_INF,
                row_max, False, TILE, NUM_PIVOTS)
            bound_key = tl.where(top_p_on, tau_key, tl.maximum(tau_key, floor_key))
        elif top_p_on:
            bound_key = _largest_key_reaching(
                top_p * row_mass, floor_key, max_key, granule_row, num_granules, candidates,
                no_list, granule_domain, _NEG_INF, row_max, True, TILE, NUM_PIVOTS)
        bound = _key_value(bound_key)

        # 2. the candidate granules (maximum >= bound), listed in ascending order
        count = tl.full([], 0, tl.int32)
        for list_start in range(0, num_granules, LIST_BLOCK):
            slot = list_start + list_offsets
            granule_max = tl.load(granule_row + slot, mask=slot < num_granules,
                                  other=float("-inf"))
            flag = (slot < num_granules) & (granule_max >= bound)
            place = count + tl.cumsum(flag.to(tl.int32), axis=0) - 1
            tl.store(candidates + place, slot, mask=flag & (place < MAX_CANDIDATES) & (split == 0))
            count += tl.sum(flag.to(tl.int32))
        tl.debug_barrier()  # the list is read back by other threads of this program
        use_list = count <= MAX_CANDIDATES

        # 3. top-p alone over too many candidates: the first of the scan's four best draws
        # that top-p keeps (mass strictly above < top_p * mass) is the token, or none of
        # them is kept (see the comment above the kernels). Every program sums the masses
        # above them over its split; the last one to arrive decides. (Every program of the
        # row takes the same decisions: they read the same values.)
        checked = (top_p_on & ~top_k_on) & ~use_list & (row_mass < float("inf"))
        finish = ~checked & (split == 0)
        if checked:
            s0 = tl.full([], float("-inf"), tl.float32)
            s1, s2, s3 = s0, s0, s0
            i0 = tl.full([], _INDEX_NONE, tl.int32)
            i1, i2, i3 = i0, i0, i0
            for other in range(0, num_splits):
                listed = (row * num_splits + other) * 4 + tl.arange(0, 4)
                score = tl.load(top_score_ptr + listed)
                index = tl.load(top_index_ptr + listed)
                s0, s1, s2, s3, i0, i1, i2, i3 = _merge_best4(
                    s0, s1, s2, s3, i0, i1, i2, i3, score, index)
            drawn_index = _vector4(i0, i1, i2, i3)
            drawn = _vector4(s0, s1, s2, s3) > float("-inf")
            value = tl.load(row_ptr + drawn_index, mask=drawn, other=float("inf")).to(tl.float32)
            start = split * split_size
            end = tl.minimum(start + split_size, vocab_size)
            above = tl.zeros([4], tl.float32)
            for tile_start in range(start, end, TILE * _GRANULE):
                index = tile_start + tl.arange(0, TILE * _GRANULE)
                x = tl.load(row_ptr + index, mask=index < end, other=float("-inf")).to(tl.float32)
                weight = tl.exp(x - row_max)
                above += tl.sum(tl.where(x[:, None] > value[None, :], weight[:, None], 0.0),
                                axis=0)
            tl.store(mass_above_ptr + (row * num_splits + split) * 4 + tl.arange(0, 4), above)
            tl.debug_barrier()  # every thread's store lands before the arrival
            if tl.atomic_add(arrivals_ptr + row, 1) == num_splits - 1:  # the last program
                above = tl.zeros([4], tl.float32)
                for other in range(0, num_splits):
                    above += tl.load(mass_above_ptr + (row * num_splits + other) * 4
                                     + tl.arange(0, 4), cache_modifier=".cg")
                kept = drawn & ((above < top_p * row_mass) | (value == row_max))
                first = tl.min(tl.where(kept, tl.arange(0, 4), 4))
                if first < 4:
                    tl.store(partial_float_ptr + row * num_splits * 4 + 3,
                             tl.sum(tl.where(tl.arange(0, 4) == first, _vector4(s0, s1, s2, s3),
                                             0.0)))
                    tl.store(partial_index_ptr + row * num_splits,
                             tl.sum(tl.where(tl.arange(0, 4) == first, drawn_index, 0)))
                    tl.store(path_ptr + row, 3)
                finish = first == 4  # none of the four is kept: search the whole row
        domain_size = tl.where(use_list, count, tl.cdiv(vocab_size, _GRANULE))

        if finish:
            if (top_p_on & ~top_k_on) & use_list:
                # top-p alone uses the scan's mass; the bound holds iff the candidates'
                # entries at or above it reach the target (it fails on rounding or NaN rows)
                pivots_at_bound, reached, lowest, highest = _measure(
                    tl.full([NUM_PIVOTS], 0.0, tl.float32) + bound, bound, bound, row_ptr,
                    vocab_size, candidates, use_list, count, _NEG_INF, row_max, True, TILE)
                bound_holds = (bound_key == floor_key) | (reached >= top_p * row_mass)
                use_list = bound_holds & (row_mass == row_mass)  # (this operand order: the
                # interpreter rejects `&` on a float comparison's result on the left)
                domain_size = tl.where(use_list, count, tl.cdiv(vocab_size, _GRANULE))

            # 4. the exact thresholds over the domain
            kth_value = tl.full([], float("-inf"), tl.float32)
            if top_k_on:
                kth_key = _largest_key_reaching(
                    top_k, bound_key, max_key, row_ptr, vocab_size, candidates, use_list,
                    domain_size, _NEG_INF, row_max, False, TILE, NUM_PIVOTS)
                kth_value = _key_value(kth_key)
                floor = tl.maximum(floor, kth_value)
            if top_p_on:
                total = row_mass
                if top_k_on | ~use_list:
                    pivots_at_floor, total, lowest, highest = _measure(
                        tl.full([NUM_PIVOTS], float("-inf"), tl.float32), _NEG_INF, _NEG_INF,
                        row_ptr, vocab_size, candidates, use_list, domain_size, kth_value,
                        row_max, True, TILE)
                low_key = _sortable_key(floor)
                low_key = tl.where(use_list, tl.maximum(low_key, bound_key), low_key)
                cutoff_key = _largest_key_reaching(
                    top_p * total, low_key, max_key, row_ptr, vocab_size, candidates, use_list,
                    domain_size, kth_value, row_max, True, TILE, NUM_PIVOTS)
                floor = tl.maximum(floor, _key_value(cutoff_key))

            # 5. the Gumbel-max argmax over the domain's entries x >= floor (in index order)
            best = tl.full([], float("-inf"), tl.float32)
            best_index = tl.full([], _INDEX_NONE, tl.int32)
            for tile_start in range(0, domain_size, TILE):
                granule = _domain_granules(candidates, use_list,
                                           tile_start + tl.arange(0, TILE), domain_size)
                x, index, in_row = _granule_tile(row_ptr, vocab_size, granule)
                if tl.max(x) >= floor:
                    tile_best, tile_index = _first_best(
                        _tile_scores(x, granule, position, seed, temperature, floor), index)
                    if tile_best > best:  # strictly: an earlier tile wins a tie
                        best = tile_best
                        best_index = tile_index
            tl.store(floor_ptr + row, floor)
            tl.store(path_ptr + row, tl.where(use_list, 1, 2))
            tl.store(partial_float_ptr + row * num_splits * 4 + 3, best)
            tl.store(partial_index_ptr + row * num_splits, best_index)


@triton.jit
def _select_sequences_kernel(
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    threshold_ptr,  # [B] fp32
    penalty_ptr,  # [B] fp32
    row_sequence_ptr,  # [R] int32
    partial_float_ptr,  # [R, num_splits, 4] fp32
    partial_index_ptr,  # [R, num_splits] int32
    token_ptr,  # [R] int64 out
    selected_ptr,  # [R] bool out
    entropy_ptr,  # [R] fp32 out
    num_rows,
    num_splits,
    BLOCK_ROWS: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,  # next_power_of_2(num_splits)
):
    finish_sequence(tl.program_id(0), cu_rows_ptr, row_pos_ptr, threshold_ptr, penalty_ptr,
                    row_sequence_ptr, partial_float_ptr, partial_index_ptr, token_ptr,
                    selected_ptr, entropy_ptr, num_rows, num_splits, BLOCK_ROWS, SPLIT_BLOCK, "")


@triton.jit
def finish_sequence(sequence, cu_rows_ptr, row_pos_ptr, threshold_ptr, penalty_ptr,
                    row_sequence_ptr, partial_float_ptr, partial_index_ptr, token_ptr,
                    selected_ptr, entropy_ptr, num_rows, num_splits, BLOCK_ROWS: tl.constexpr,
                    SPLIT_BLOCK: tl.constexpr, CACHE: tl.constexpr):
    """Merge the vocabulary splits of every row of ``sequence`` (the scan's partials) into
    token and entropy, and select its rows: the distance penalty, the strict threshold and
    the fallback. ``CACHE`` is the cache modifier of the loads of what the scan wrote
    (``".cg"`` where programs of the same launch wrote it: L1 is not coherent)."""
    first_row = tl.minimum(tl.maximum(tl.load(cu_rows_ptr + sequence), 0), num_rows)
    end_row = tl.minimum(tl.maximum(tl.load(cu_rows_ptr + sequence + 1), first_row), num_rows)
    threshold = tl.load(threshold_ptr + sequence)
    penalty = tl.load(penalty_ptr + sequence)
    row_offsets = tl.arange(0, BLOCK_ROWS)
    splits = tl.arange(0, SPLIT_BLOCK)

    # the smallest row_pos of the sequence's valid rows
    nearest = tl.full([], 2**63 - 1, tl.int64)
    for block_start in range(first_row, end_row, BLOCK_ROWS):
        rows = block_start + row_offsets
        in_range = rows < end_row
        row_sequence = tl.load(row_sequence_ptr + rows, mask=in_range, other=-1,
                               cache_modifier=CACHE)
        valid = in_range & (row_sequence == sequence)
        position = tl.load(row_pos_ptr + rows, mask=valid, other=2**63 - 1)
        nearest = tl.minimum(nearest, tl.min(position, axis=0))

    any_passes = tl.full([], 0, tl.int32)
    best_adjusted = tl.full([], float("inf"), tl.float32)
    best_row = num_rows  # first row with the smallest non-NaN adjusted entropy
    first_valid = num_rows
    for block_start in range(first_row, end_row, BLOCK_ROWS):
        rows = block_start + row_offsets
        in_range = rows < end_row
        row_sequence = tl.load(row_sequence_ptr + rows, mask=in_range, other=-1,
                               cache_modifier=CACHE)
        valid = in_range & (row_sequence == sequence)
        position = tl.load(row_pos_ptr + rows, mask=valid, other=0)

        # merge the vocabulary splits of each row: [BLOCK_ROWS, SPLIT_BLOCK]
        parts = rows.to(tl.int64)[:, None] * num_splits + splits[None, :]
        part_mask = valid[:, None] & (splits < num_splits)[None, :]
        part = partial_float_ptr + parts * 4
        part_max = tl.load(part, mask=part_mask, other=float("-inf"), cache_modifier=CACHE)
        part_sum = tl.load(part + 1, mask=part_mask, other=0.0, cache_modifier=CACHE)
        part_gap = tl.load(part + 2, mask=part_mask, other=0.0, cache_modifier=CACHE)
        part_best = tl.load(part + 3, mask=part_mask, other=float("-inf"), cache_modifier=CACHE)
        part_best_index = tl.load(partial_index_ptr + parts, mask=part_mask, other=_INDEX_NONE,
                                  cache_modifier=CACHE)

        # s and t of each split are relative to its own m: rescale to the row's maximum
        row_max = tl.max(part_max, axis=1)
        part_on = part_max > float("-inf")
        part_shift = tl.where(part_on, part_max - tl.where(part_on, row_max[:, None], 0.0), 0.0)
        part_scale = tl.where(part_on, tl.exp(part_shift), 0.0)
        total = tl.sum(part_sum * part_scale, axis=1)
        gap_total = tl.sum(part_scale * (part_gap + tl.maximum(part_shift, -1e30) * part_sum),
                           axis=1)
        # NaN entries made s NaN, +inf ones m +inf; all -inf leaves s = 0
        undefined = (total != total) | (total == 0.0) | (row_max == float("inf"))
        safe_total = tl.where(undefined, 1.0, total)
        entropy = tl.log(safe_total) - gap_total / safe_total
        entropy = tl.where(undefined, float("nan"), entropy)  # (a NaN global breaks the JIT cache check)
        # token: the first index of the best value over the splits (0 if none is above -inf)
        best = tl.max(part_best, axis=1)
        token = tl.min(tl.where(part_best == best[:, None], part_best_index, _INDEX_NONE), axis=1)
        token = tl.where(best > float("-inf"), token, 0)
        tl.store(token_ptr + rows, token.to(tl.int64), mask=valid)
        tl.store(entropy_ptr + rows, entropy, mask=valid)

        # two roundings, like the PyTorch path (the launch disables FMA contraction: fused,
        # a row within an ulp of its threshold could be selected differently)
        adjusted = entropy + penalty * (position - nearest).to(tl.float32)
        passes = valid & (adjusted < threshold)
        tl.store(selected_ptr + rows, passes, mask=valid)
        any_passes = tl.maximum(any_passes, tl.max(passes.to(tl.int32), axis=0))

        candidate = valid & (adjusted == adjusted)
        block_best = tl.min(tl.where(candidate, adjusted, _POS_INF), axis=0)
        block_best_row = tl.min(
            tl.where(candidate & (adjusted == block_best), rows, num_rows), axis=0
        )
        replace = (block_best_row < num_rows) & ((block_best < best_adjusted) | (best_row == num_rows))
        best_row = tl.where(replace, block_best_row, best_row)
        best_adjusted = tl.where(replace, block_best, best_adjusted)
        first_valid = tl.minimum(first_valid, tl.min(tl.where(valid, rows, num_rows), axis=0))

    # no row passed: select the first row with the smallest non-NaN adjusted entropy, or
    # the first valid row when every one is NaN
    tl.debug_barrier()  # the stores above land before the fallback store below
    choice = tl.where(best_row < num_rows, best_row, first_valid)
    fallback = (any_passes == 0) & (choice < num_rows)
    tl.store(selected_ptr + tl.where(fallback, choice, 0), fallback, mask=fallback)


# ----------------------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------------------

# The scan reads SCAN_TILE_GRANULES * GRANULE logits per loop step (8 warps); the filter's
# searches take FILTER_TILE granules times NUM_PIVOTS pivots per step and list the
# candidates LIST_BLOCK granule maxima at a time.
GRANULE = 64
MAX_CANDIDATES = 256  # candidate granules the filter reads instead of the whole row
_SCAN_TILE_GRANULES = 32
_GUMBEL_GRANULES = 16
_BLOCK_V = _SCAN_TILE_GRANULES * GRANULE
_FILTER_TILE = 8
_LIST_BLOCK = 1024
_NUM_PIVOTS = 16
_SCAN_WARPS = 8
_FILTER_WARPS = 8
_SEQUENCES_WARPS = 4
# The adjusted entropy rounds twice, as the PyTorch path does: no fused multiply-add.
_SEQUENCES_FP_FUSION = False
# Vocabulary split: enough programs to fill the GPU (PROGRAMS_PER_SM per multiprocessor)
# when rows are few, each split at least one tile. The interpreter gets a fixed target.
MAX_SPLITS = 128
_PROGRAMS_PER_SM = 8
_INTERPRETER_TARGET_PROGRAMS = 4


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_SCAN_CONSTEXPRS = {"TILE_GRANULES": _SCAN_TILE_GRANULES, "GUMBEL_GRANULES": _GUMBEL_GRANULES}
_FILTER_CONSTEXPRS = {"TILE": _FILTER_TILE, "LIST_BLOCK": _LIST_BLOCK, "SPLIT_BLOCK": MAX_SPLITS,
                      "NUM_PIVOTS": _NUM_PIVOTS}


def _sequences_constexprs(split_block: int) -> dict:
    """The per-sequence kernel's tile: ``split_block`` (next_power_of_2(num_splits))
    partials for each of at most 1024 // split_block rows (at most 64)."""
    return {"BLOCK_ROWS": max(1, min(64, 1024 // split_block)), "SPLIT_BLOCK": split_block}


def default_num_splits(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """How many programs share one row's vocabulary (from the shapes only, no sync)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = _PROGRAMS_PER_SM * _multiprocessor_count(index)
    else:
        target = _INTERPRETER_TARGET_PROGRAMS
    most = min(MAX_SPLITS, triton.cdiv(vocab_size, _BLOCK_V))
    return max(1, min(most, triton.cdiv(target, max(num_rows, 1))))


def split_plan(num_rows: int, vocab_size: int, device: torch.device,
               num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, split_size)``: the vocabulary of a row is cut into ``num_splits``
    slices of ``split_size`` entries (a multiple of the tile; the last may be shorter).
    ``num_splits`` defaults to :func:`default_num_splits` and is capped at ``MAX_SPLITS``."""
    if num_splits is None:
        num_splits = default_num_splits(num_rows, vocab_size, device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    split_size = triton.cdiv(triton.cdiv(vocab_size, num_splits), _BLOCK_V) * _BLOCK_V
    return triton.cdiv(vocab_size, split_size), split_size


@dataclass
class SelectWorkspace:
    """Intermediate tensors of one :func:`select_tokens_triton` call (contiguous int32 or
    fp32 views of one allocation, one allocator call per op call)."""

    row_sequence: torch.Tensor  # [R] int32: sequence of each row, -1 for padding rows
    floor: torch.Tensor  # [R] fp32: paths 1 and 2 drew from the entries x >= floor
    path: torch.Tensor  # [R] int32: how a top-k / top-p row was drawn (PATH_NAMES)
    arrivals: torch.Tensor  # [R] int32: the filter's programs done per row
    partial_float: torch.Tensor  # [R, num_splits, 4] fp32: m, s, t, best value per split
    partial_index: torch.Tensor  # [R, num_splits] int32: first index of the best value
    top_score: torch.Tensor  # [R, num_splits, 4] fp32: the scan's four best Gumbel scores
    top_index: torch.Tensor  # [R, num_splits, 4] int32: their indices
    mass_above: torch.Tensor  # [R, num_splits, 4] fp32: the mass above them, per split
    granule_max: torch.Tensor  # [R, cdiv(V, GRANULE)] fp32: top-k / top-p rows
    candidates: torch.Tensor  # [R, max_candidates] int32: candidate granules

    @staticmethod
    def shapes(num_rows: int, vocab_size: int, num_splits: int,
               max_candidates: int = MAX_CANDIDATES) -> dict[str, tuple[int, ...]]:
        return {
            "row_sequence": (num_rows,), "floor": (num_rows,), "path": (num_rows,),
            "arrivals": (num_rows,), "partial_float": (num_rows, num_splits, 4),
            "partial_index": (num_rows, num_splits), "top_score": (num_rows, num_splits, 4),
            "top_index": (num_rows, num_splits, 4), "mass_above": (num_rows, num_splits, 4),
            "granule_max": (num_rows, triton.cdiv(vocab_size, GRANULE)),
            "candidates": (num_rows, max_candidates),
        }

    @classmethod
    def empty(cls, num_rows: int, vocab_size: int, num_splits: int, device: torch.device,
              max_candidates: int = MAX_CANDIDATES) -> "SelectWorkspace":
        shapes = cls.shapes(num_rows, vocab_size, num_splits, max_candidates)
        floats = {"floor", "partial_float", "top_score", "mass_above", "granule_max"}
        sizes = [math.prod(shape) for shape in shapes.values()]
        parts = torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)
        return cls(**{
            name: (part.view(torch.float32) if name in floats else part).view(shape)
            for (name, shape), part in zip(shapes.items(), parts)
        })


# The ``path`` codes of a top-k / top-p row.
PATH_NAMES = {1: "candidates", 2: "whole row", 3: "checked draws"}


def select_tokens_triton(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
    sampling: str = "any",
    *,
    kernel: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    workspace: SelectWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`select_tokens` (arguments validated by the caller).

    A ``"greedy"`` or ``"temperature"`` call runs the ``one_launch`` kernel
    (ops/select_one_launch.py) where ``kernel`` (default: the ``WEDLM_KERNELS_SELECT_KERNEL``
    setting) says so, and the three launches below otherwise.

    Keyword arguments, for tests and benchmarks (results depend on none of them): ``out``,
    contiguous ``[R]`` (token, selected, entropy) tensors to write (every element) instead
    of fresh ones; ``num_splits``, the number of vocabulary splits per row; ``workspace``,
    the intermediate tensors (shaped for the split count of :func:`split_plan`; the width
    of its ``candidates`` is how many candidate granules a top-k / top-p row may read
    before it searches its whole row).
    """
    if sampling != "any" and (kernel or _backend.SELECT_KERNEL) == "one_launch":
        from .select_one_launch import select_tokens_one_launch

        return select_tokens_one_launch(
            logits, cu_rows, row_pos, temperature, threshold, penalty, seed,
            sampling=sampling == "temperature", out=out, num_splits=num_splits,
            workspace=workspace)
    temperature, top_k, top_p = _parameters_of_mode(sampling, temperature, top_k, top_p)
    num_rows, vocab_size = logits.shape
    num_sequences = cu_rows.shape[0] - 1
    device = logits.device
    if out is None:
        out = (torch.empty(num_rows, dtype=torch.int64, device=device),
               torch.empty(num_rows, dtype=torch.bool, device=device),
               torch.empty(num_rows, dtype=torch.float32, device=device))
    token, selected, entropy = out
    if num_rows == 0:
        return out
    num_splits, split_size = split_plan(num_rows, vocab_size, device, num_splits)
    if workspace is None:
        workspace = SelectWorkspace.empty(num_rows, vocab_size, num_splits, device)
    else:  # shapes only: no device value is read
        candidates = workspace.candidates.shape[-1]
        shapes = SelectWorkspace.shapes(num_rows, vocab_size, num_splits, candidates)
        for name, part in vars(workspace).items():
            if tuple(part.shape) != shapes[name]:
                raise ValueError(f"`workspace.{name}` has shape {list(part.shape)}, the launch "
                                 f"needs {list(shapes[name])} ({num_splits} splits)")
    num_granules = triton.cdiv(vocab_size, GRANULE)
    cu_rows, row_pos = cu_rows.contiguous(), row_pos.contiguous()
    temperature, top_k, top_p = temperature.contiguous(), top_k.contiguous(), top_p.contiguous()
    threshold, penalty, seed = threshold.contiguous(), penalty.contiguous(), seed.contiguous()

    w = workspace
    _select_scan_kernel[(num_rows, num_splits)](
        logits, cu_rows, row_pos, temperature, top_k, top_p, seed, w.row_sequence,
        w.granule_max, w.partial_float, w.partial_index, w.top_score, w.top_index, w.arrivals,
        token, selected, entropy, logits.stride(0), vocab_size, num_sequences,
        (num_sequences + 1).bit_length(), split_size, num_splits, num_granules,
        **_SCAN_CONSTEXPRS, num_warps=_SCAN_WARPS,
    )
    if sampling == "any":  # (other modes have no top-k or top-p row: nothing to filter)
        _select_filter_kernel[(num_rows, num_splits)](
            logits, row_pos, temperature, top_k, top_p, seed, w.row_sequence, w.granule_max,
            w.top_score, w.top_index, w.arrivals, w.mass_above, w.candidates, w.floor, w.path,
            w.partial_float, w.partial_index, logits.stride(0), vocab_size, num_granules,
            split_size, num_splits, **_FILTER_CONSTEXPRS,
            MAX_CANDIDATES=w.candidates.shape[1], num_warps=_FILTER_WARPS,
        )
    if num_sequences > 0:
        split_block = next_power_of_2(num_splits)
        _select_sequences_kernel[(num_sequences,)](
            cu_rows, row_pos, threshold, penalty, w.row_sequence, w.partial_float,
            w.partial_index, token, selected, entropy,
            num_rows, num_splits, **_sequences_constexprs(split_block),
            num_warps=_SEQUENCES_WARPS, enable_fp_fusion=_SEQUENCES_FP_FUSION,
        )
    return out


# ----------------------------------------------------------------------------------------
# Kernel variants (compiled for sm_90 by the test suite).
# ----------------------------------------------------------------------------------------

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Triton types of the kernels' pointer arguments (the logits' one is per dtype); every
# other argument is an i32 scalar or a constexpr.
_POINTER_ARGUMENTS = {
    "cu_rows_ptr": "*i32", "row_pos_ptr": "*i64", "temperature_ptr": "*fp32",
    "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "threshold_ptr": "*fp32",
    "penalty_ptr": "*fp32", "seed_ptr": "*i64", "row_sequence_ptr": "*i32",
    "granule_max_ptr": "*fp32", "candidate_ptr": "*i32", "floor_ptr": "*fp32",
    "path_ptr": "*i32", "partial_float_ptr": "*fp32", "partial_index_ptr": "*i32",
    "top_score_ptr": "*fp32", "top_index_ptr": "*i32", "arrivals_ptr": "*i32",
    "mass_above_ptr": "*fp32",
    "token_ptr": "*i64", "selected_ptr": "*i1", "entropy_ptr": "*fp32",
}


# The integer arguments a typical launch passes as multiples of 16, which Triton specialises
# on: the split size always, the vocabulary size and the row stride for most models.
_ALIGNED_ARGUMENTS = ("logits_row_stride", "vocab_size", "split_size")


def _variant(name: str, kernel, dtype: torch.dtype | None, constexprs: dict,
             num_warps: int, **options) -> KernelVariant:
    pointers = dict(_POINTER_ARGUMENTS, logits_ptr=POINTER_TYPES.get(dtype))
    signature = {
        argument: "constexpr" if argument in constexprs else pointers.get(argument, "i32")
        for argument in inspect.signature(kernel.fn).parameters
    }
    return KernelVariant(name=name, kernel=kernel, signature=signature, constexprs=constexprs,
                         num_warps=num_warps, **options)


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation :func:`select_tokens_triton` produces: the scan and the filter
    kernel per logits dtype, each with only the split size a multiple of 16 (it always is)
    and with the vocabulary size and row stride too (most models), the per-sequence kernel
    per power-of-two split count up to ``MAX_SPLITS``, and the two test kernels of the
    random stream."""
    variants = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        filter_constexprs = dict(_FILTER_CONSTEXPRS, MAX_CANDIDATES=MAX_CANDIDATES)
        for suffix, aligned in (("", ("split_size",)), ("_aligned16", _ALIGNED_ARGUMENTS)):
            variants.append(_variant(f"scan_{_SHORT[dtype]}{suffix}", _select_scan_kernel,
                                     dtype, _SCAN_CONSTEXPRS, _SCAN_WARPS,
                                     divisible_by_16=aligned))
            variants.append(_variant(f"filter_{_SHORT[dtype]}{suffix}", _select_filter_kernel,
                                     dtype, filter_constexprs, _FILTER_WARPS,
                                     divisible_by_16=aligned))
    split_block = 1
    while split_block <= MAX_SPLITS:
        variants.append(_variant(f"sequences_splits{split_block}", _select_sequences_kernel,
                                 None, _sequences_constexprs(split_block), _SEQUENCES_WARPS,
                                 enable_fp_fusion=_SEQUENCES_FP_FUSION))
        split_block *= 2
    variants += philox.kernel_variants()
    from . import select_one_launch

    return variants + select_one_launch.kernel_variants()
