"""Reference ``select_tokens``: entropy, sampling and selection, literally (float64).

docs/contracts.md "select_tokens" written out row by row and sequence by sequence:

- :func:`row_entropy`: entropy of one row's untempered softmax (NaN when undefined);
- :func:`kept_tokens`: the top-k / top-p filter of one row;
- :func:`sample_row`: the token of one row (greedy, or Gumbel-max over the kept tokens
  with the Philox stream of :mod:`reference.philox`);
- :func:`select_rows`: the threshold / fallback rule on one sequence's adjusted entropies;
- :func:`select_tokens`: all of it over a batch, with the op's signature.
"""

import math
from collections import Counter

import torch

from . import philox

NEG_INF = float("-inf")


def _row_values(logits_row: torch.Tensor) -> list[float]:
    return [float(v) for v in logits_row.double().tolist()]


def row_entropy(logits_row: torch.Tensor) -> float:
    """``H = logsumexp(x) - sum(softmax(x) * x)`` in nats; ``-inf`` entries contribute 0.

    NaN for a row containing NaN or ``+inf`` or whose entries are all ``-inf``.
    """
    x = _row_values(logits_row)
    if any(math.isnan(v) or v == math.inf for v in x) or all(v == NEG_INF for v in x):
        return math.nan
    finite = [v for v in x if v != NEG_INF]
    top = max(finite)
    total = math.fsum(math.exp(v - top) for v in finite)
    logsumexp = top + math.log(total)
    expected_logit = math.fsum(math.exp(v - top) / total * v for v in finite)
    return logsumexp - expected_logit


def kept_tokens(logits_row: torch.Tensor, top_k: int, top_p: float) -> list[bool]:
    """Which tokens survive top-k then top-p (NaN logits count as ``-inf``).

    top-k: if ``0 < top_k < V``, keep ``v`` iff ``x_v >=`` the ``top_k``-th largest value.
    top-p: with ``p`` the softmax of the untempered logits over the top-k survivors, keep
    ``v`` iff the total ``p`` of survivors ``u`` with ``x_u > x_v`` is ``< top_p``, or
    ``x_v`` is the maximum. Skipped when ``top_p >= 1`` or the maximum is not finite.
    """
    x = [NEG_INF if math.isnan(v) else v for v in _row_values(logits_row)]
    vocab_size = len(x)
    kept = [True] * vocab_size
    if 0 < top_k < vocab_size:
        kth_largest = sorted(x, reverse=True)[top_k - 1]
        kept = [v >= kth_largest for v in x]

    top = max(x)
    if top_p >= 1 or not math.isfinite(top):
        return kept
    survivors = [v for v, keep in zip(x, kept) if keep]
    total = math.fsum(math.exp(v - top) for v in survivors)
    # Mass of the strictly larger survivors, for each distinct value: walk the survivors in
    # descending order, one group of equal values at a time.
    group_size = Counter(survivors)
    mass_above: dict[float, float] = {}
    mass = 0.0
    for value in sorted(group_size, reverse=True):
        mass_above[value] = mass
        mass += math.exp(value - top) / total * group_size[value]
    return [
        keep and (mass_above[v] < top_p or v == top) for v, keep in zip(x, kept)
    ]


def sample_row(
    logits_row: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    position: int,
) -> int:
    """The token of one row (contracts.md "Token"); NaN logits count as ``-inf``.

    ``temperature <= 0``: first index of the maximum (0 if nothing is above ``-inf``).
    Otherwise: first index of the maximum of ``x_v / temperature + g_v`` over the kept
    tokens, ``g`` the Philox Gumbel noise of (seed, position, v); 0 if no kept score is
    above ``-inf``.
    """
    x = [NEG_INF if math.isnan(v) else v for v in _row_values(logits_row)]
    if temperature <= 0:
        return _first_argmax(x)
    kept = kept_tokens(logits_row, top_k, top_p)
    noise = philox.gumbel(seed, position, len(x))
    scores = []
    for v, keep in enumerate(kept):
        score = x[v] / temperature + float(noise[v]) if keep else NEG_INF
        scores.append(NEG_INF if math.isnan(score) else score)
    return _first_argmax(scores)


def _first_argmax(values: list[float]) -> int:
    best = 0
    for index, value in enumerate(values):
        if value > values[best]:
            best = index
    return best


def select_rows(adjusted: list[float], threshold: float) -> list[bool]:
    """The selection rule on one sequence's valid rows, in row order.

    Rows with ``adjusted < threshold`` (NaN never passes). If none passes: only the first
    row with the smallest non-NaN value, or the first row if all are NaN. No rows: nothing.
    """
    selected = [a < threshold for a in adjusted]
    if any(selected) or not adjusted:
        return selected
    candidates = [i for i, a in enumerate(adjusted) if not math.isnan(a)]
    if candidates:
        smallest = min(adjusted[i] for i in candidates)
        choice = next(i for i in candidates if adjusted[i] == smallest)
    else:
        choice = 0
    selected[choice] = True
    return selected


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
    """``(token int64 [R], selected bool [R], entropy float64 [R])``; padding rows give 0,
    False, 0."""
    num_rows = logits.shape[0]
    offsets = [int(c) for c in cu_rows.tolist()]
    positions = [int(p) for p in row_pos.tolist()]
    token = [0] * num_rows
    selected = [False] * num_rows
    entropy = [0.0] * num_rows

    for b in range(len(offsets) - 1):
        rows = [
            r for r in range(offsets[b], offsets[b + 1]) if 0 <= r < num_rows and positions[r] >= 0
        ]
        if not rows:
            continue
        for r in rows:
            entropy[r] = row_entropy(logits[r])
            token[r] = sample_row(
                logits[r], float(temperature[b]), int(top_k[b]), float(top_p[b]),
                int(seed[b]), positions[r],
            )
        nearest = min(positions[r] for r in rows)
        adjusted = [entropy[r] + float(penalty[b]) * (positions[r] - nearest) for r in rows]
        for r, chosen in zip(rows, select_rows(adjusted, float(threshold[b]))):
            selected[r] = chosen

    return (
        torch.tensor(token, dtype=torch.int64),
        torch.tensor(selected, dtype=torch.bool),
        torch.tensor(entropy, dtype=torch.float64),
    )
