"""Building select_tokens arguments from plain Python values (shared by the op and kernel tests)."""

import math

import torch
from hypothesis import strategies as st

from reference import select as ref

INF = float("inf")
NAN = float("nan")
# Decisions on adjusted entropies closer than this to a threshold (or to each other) are
# not decidable at fp32 precision; the random tests keep their thresholds away from them.
DECISION_MARGIN = 1e-4


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
