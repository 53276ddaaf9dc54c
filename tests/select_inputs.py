"""Building select_tokens arguments from plain Python values (shared by the op and kernel tests)."""

import math

import pytest
import torch
from hypothesis import strategies as st

from reference import select as ref
from tests.numerics import DECISION_MARGIN

INF = float("inf")
NAN = float("nan")


# The warnings the one-launch kernel raises under Triton's interpreter on purpose, for the
# test modules that run it (pytestmark): the interpreter converts 1-element arrays to ints
# (loop bounds that are tensors), and numpy warns where the kernel's arithmetic meets -inf
# and NaN (the padding of a tile).
ONE_LAUNCH_INTERPRETER_WARNINGS = [
    pytest.mark.filterwarnings(
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def batch(logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed):
    """Argument tuple in the op's order (CPU tensors) from plain Python values."""
    if not isinstance(logits, torch.Tensor):
        logits = torch.tensor(logits, dtype=torch.float32)
    return (
        logits, i32(*cu_rows), i64(*row_pos), f32(*temperature), i32(*top_k), f32(*top_p),
        f32(*threshold), f32(*penalty), i64(*seed),
    )


def one_sequence(logits, row_pos, temperature=0.0, top_k=0, top_p=1.0, threshold=-INF,
                 penalty=0.0, seed=0):
    logits = torch.tensor(logits, dtype=torch.float32)
    return batch(logits, [0, logits.shape[0]], row_pos, [temperature], [top_k], [top_p],
                 [threshold], [penalty], [seed])


def random_logits(data, g, rows, vocab):
    """Random [rows, vocab] fp32 logits of one of four kinds drawn by hypothesis: normal,
    ties (few distinct values), peaked, or with -inf entries plus one row holding a NaN,
    +inf or -inf entry (or made entirely of it)."""
    kind = data.draw(st.sampled_from(["normal", "ties", "peaked", "special"]), label="kind")
    if kind == "ties":  # few distinct values: pins first-index and tie-keeping rules
        return torch.randint(-3, 3, (rows, vocab), generator=g).float()
    scale = data.draw(st.floats(0.3, 8.0), label="scale")
    logits = torch.randn(rows, vocab, generator=g) * scale
    if kind == "peaked" and rows:
        peak = torch.randint(0, vocab, (rows,), generator=g)
        logits[torch.arange(rows), peak] += 15.0
    if kind == "special" and rows:
        logits[torch.rand(rows, vocab, generator=g) < 0.3] = -INF
        # one row with a NaN, +inf or -inf entry, or made entirely of it
        special_row = int(torch.randint(0, rows, (1,), generator=g))
        value = data.draw(st.sampled_from([NAN, INF, -INF]), label="special value")
        if data.draw(st.booleans(), label="whole row"):
            logits[special_row] = value
        else:
            logits[special_row, int(torch.randint(0, vocab, (1,), generator=g))] = value
    return logits


def choose_thresholds(data, logits, cu_rows, row_pos, penalty):
    """Per sequence: -inf, below all adjusted entropies (fallback), between two of them
    (away from both) or above all, computed from the reference entropies."""
    thresholds = []
    for b in range(len(cu_rows) - 1):
        rows = [r for r in range(cu_rows[b], cu_rows[b + 1]) if row_pos[r] >= 0]
        if rows:
            nearest = min(row_pos[r] for r in rows)
            adjusted = [ref.row_entropy(logits[r]) + penalty[b] * (row_pos[r] - nearest)
                        for r in rows]
        else:
            adjusted = []
        values = sorted(a for a in adjusted if not math.isnan(a))
        choices = [-INF]
        if values:
            choices += [values[0] - 0.5, values[-1] + 0.5]
            choices += [(lo + hi) / 2 for lo, hi in zip(values, values[1:])
                        if hi - lo > 4 * DECISION_MARGIN * (1 + abs(hi))]
        thresholds.append(data.draw(st.sampled_from(choices), label=f"threshold {b}"))
    return thresholds


# ----------------------------------------------------------------------------------------
# Exact edge cases shared by the op and kernel tests. Each is built so that the decision it
# pins is exact in fp32 (no rounding can move it), so a `<` that becomes `<=`, or a tie won
# by the wrong entry, changes the answer.
# ----------------------------------------------------------------------------------------


def one_hot_row(vocab: int, hot: int, rest: float) -> list[float]:
    """A row whose softmax is a point mass at ``hot`` in fp32 (entropy exactly 0): the other
    entries are ``rest`` (-inf, or a value whose exp underflows to 0)."""
    row = [rest] * vocab
    row[hot] = 5.0
    return row


def exact_threshold_batch():
    """Four sequences of three point-mass rows (entropy exactly 0), where adjusted entropies
    ``penalty * distance`` are dyadic, so some rows sit exactly on their threshold. Returns
    ``(args, expected_selected, expected_token)``: a row exactly at the threshold is not
    selected (the comparison is strict), and several rows per sequence make the fallback
    irrelevant except in the last sequence, where no row passes.

    - sequence 0: distances 0, 1, 2, penalty 1/4, threshold 1/4 -> adjusted 0, 1/4, 1/2
    - sequence 1: distances 1, 0, 2 (rows out of position order), penalty 1/2, threshold 1/2
    - sequence 2: distances 0, 1, 2, penalty 1/4, threshold 1/2 -> two rows pass
    - sequence 3: penalty 0, threshold 0: every row sits on the threshold, none passes, and
      the fallback takes the first row
    """
    vocab = 37
    hot = [3, 36, 0, 17, 5, 9, 21, 30, 1, 2, 33, 4]
    logits = [one_hot_row(vocab, h, -INF if r % 2 else -1e4) for r, h in enumerate(hot)]
    row_pos = [10, 11, 12, 21, 20, 22, 40, 41, 42, 7, 8, 9]
    args = batch(logits, [0, 3, 6, 9, 12], row_pos, [0.0] * 4, [0] * 4, [1.0] * 4,
                 [0.25, 0.5, 0.5, 0.0], [0.25, 0.5, 0.25, 0.0], [1, 2, 3, 4])
    expected_selected = [True, False, False, False, True, False, True, True, False,
                         True, False, False]
    return args, expected_selected, hot


LN2_F32 = float(torch.tensor(math.log(2.0), dtype=torch.float32))


def dyadic_top_p_cases():
    """Rows whose untempered fp32 probabilities are exact dyadic fractions (logit
    differences of fp32 ln 2 round to exact powers of two under exp), with ``top_p`` exactly
    at the mass above a token and one fp32 step above it. Returns ``[(row, top_p, kept)]``:
    top-p keeps ``v`` iff the mass strictly above ``v`` is ``< top_p``, so at equality ``v`` is
    dropped, and one step above it is kept. Entries at -1e4 have probability 0.

    - ``[0, -ln2, -ln2]``: p = 1/2, 1/4, 1/4; the mass above tokens 1 and 2 is 1/2.
    - ``[-2 ln2, 0, -ln2, -2 ln2]``: p = 1/8, 1/2, 1/4, 1/8; the mass above token 2 is 1/2,
      above tokens 0 and 3 it is 3/4.
    """
    half, quarter = -LN2_F32, -2 * LN2_F32
    first = [0.0, half, half, -1e4, -1e4]
    second = [quarter, 0.0, half, quarter, -1e4, -1e4, -1e4]

    def step_up(value):
        return float(torch.nextafter(torch.tensor(value), torch.tensor(2.0)))

    cases = [
        (first, 0.5, {0}),
        (first, step_up(0.5), {0, 1, 2}),
        (second, 0.5, {1}),
        (second, step_up(0.5), {1, 2}),
        (second, 0.75, {1, 2}),
        (second, step_up(0.75), {0, 1, 2, 3}),
    ]
    for row, top_p, kept in cases:  # the premises, checked where the tests run
        assert dyadic_probabilities_are_exact(row), row
        reference_kept = ref.kept_tokens(torch.tensor(row), 0, top_p)  # float64, no rounding
        assert {v for v, k in enumerate(reference_kept) if k} == kept, (row, top_p)
    return cases


def dyadic_probabilities_are_exact(row) -> bool:
    """Whether torch's fp32 ``exp(x - max)`` of ``row`` gives exact powers of two (or 0) on
    this machine, as :func:`dyadic_top_p_cases` needs. The kernel's ``exp`` is not checked
    here; the kernel test checks its kept set (the sampling floor) directly."""
    x = torch.tensor(row, dtype=torch.float32)
    weight = torch.exp(x - x.max())
    exponent = torch.round(torch.log2(weight.double().clamp(min=1e-300)))
    return bool(((weight == 0) | (weight.double() == torch.exp2(exponent))).all())


def top_p_sampling_batch(row, top_p, count=64, seed=5):
    """``count`` rows of ``row`` in one sequence at distinct positions, sampled at a huge
    temperature (every kept token about equally likely), so the set of sampled tokens is the
    kept set: with at most 4 kept tokens, one is missed with probability below
    4 (3/4)^count (1e-7 at 64 rows, 4e-4 at 32; the seed is fixed, so a run is repeatable)."""
    logits = torch.tensor([row] * count, dtype=torch.float32)
    return batch(logits, [0, count], list(range(1000, 1000 + count)), [1e3], [0], [top_p],
                 [INF], [0.0], [seed])


# vocabulary 3 * 4096 + 5 (the kernel's scan tiles hold 2048 entries: seven tiles, the last
# partial) and groups of tied maxima in different tiles, on tile boundaries, in one tile
GREEDY_TIE_VOCAB = 12293
GREEDY_TIE_GROUPS = [(100, 4196), (4095, 4096), (5000, 12290), (7, 8200, 12292), (9, 10)]


def greedy_tile_tie_batch(vocab: int = GREEDY_TIE_VOCAB, index_groups=GREEDY_TIE_GROUPS):
    """One greedy row per group of indices: random logits below 10 with the maximum 50 at
    every index of the group. The first index of the maximum must win, wherever the tied
    entries fall (different tiles of one program, or different programs)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(index_groups), vocab, generator=g).clamp(-9.0, 9.0)
    for r, indices in enumerate(index_groups):
        logits[r, list(indices)] = 50.0
    args = batch(logits, [0, len(index_groups)], [100 + r for r in range(len(index_groups))],
                 [0.0], [0], [1.0], [INF], [0.0], [0])
    return args, [min(indices) for indices in index_groups]


def _fp32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def logit_for_equal_score(target: float, noise: float) -> float | None:
    """An fp32 ``x`` with ``fp32(x + noise) == target`` exactly, or None."""
    x = _fp32(float(torch.tensor(target, dtype=torch.float64) - noise))
    for _ in range(8):
        total = x + _fp32(noise)
        if total == _fp32(target):
            return float(x)
        x = torch.nextafter(x, _fp32(math.inf if total < target else -math.inf))
    return None


def sampled_tie_batch(vocab: int, indices, gumbel_of, top_k: int = 0):
    """Sampling rows (temperature 1, one sequence, distinct positions) in which the entries
    at ``indices`` have exactly equal Gumbel-max scores ``x + g`` and every other entry
    scores far below (logit -100). ``gumbel_of(seed, position, vocab_indices)`` returns the
    fp32 noise of the implementation under test. The first of ``indices`` must be sampled.
    Returns ``(args, expected_token)``."""
    assert list(indices) == sorted(set(indices)), "distinct indices in increasing order"
    seed, rows, row_pos = 77, [], []
    for position in range(501, 601):  # a position is skipped when no exact tie exists
        if len(rows) == 3:
            break
        noise = [float(n) for n in gumbel_of(seed, position, list(indices))]
        logits = [-100.0] * vocab
        logits[indices[0]] = 0.0  # score g_first exactly
        tied = [logit_for_equal_score(noise[0], n) for n in noise[1:]]
        if any(x is None for x in tied):
            continue
        for index, x in zip(indices[1:], tied):
            logits[index] = x
        rows.append(logits)
        row_pos.append(position)
    assert len(rows) == 3, "no exact tie found at 100 positions"
    args = batch(torch.tensor(rows), [0, len(rows)], row_pos, [1.0], [top_k], [1.0], [INF],
                 [0.0], [seed])
    return args, [indices[0]] * len(rows)
