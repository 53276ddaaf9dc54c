"""Reference logprob records (docs/contracts.md, "Logprobs"), one row at a time in float64.

:func:`row_record`: the chosen token's value and rank, and the values of the ``K`` most
likely tokens (in descending order; which of several tied tokens is listed is left to the
op, so the reference gives values, not ids), under one of vLLM's ``logprobs_mode``s.
"""

import math

import torch

from .select import kept_tokens

NEG_INF = float("-inf")


def distribution(logits_row: torch.Tensor, mode: str, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The row's values under ``mode`` before the log-softmax: raw, the logits; processed,
    the logits divided by a positive temperature with the tokens top-k and top-p drop at
    ``-inf`` (a greedy row, temperature <= 0, is neither scaled nor filtered)."""
    x = [float(v) for v in logits_row.double().tolist()]
    if mode.startswith("processed") and temperature > 0:
        kept = kept_tokens(logits_row, top_k, top_p)
        x = [v / float(torch.tensor(temperature, dtype=torch.float32)) if keep else NEG_INF
             for v, keep in zip(x, kept)]
    return x


def row_record(logits_row: torch.Tensor, token: int, num_logprobs: int, mode: str,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
               ) -> tuple[float, int, list[float]]:
    """``(value of token, rank of token, values of the num_logprobs most likely)``."""
    x = distribution(logits_row, mode, temperature, top_k, top_p)
    if mode.endswith("logprobs"):
        finite = [v for v in x if v != NEG_INF]
        top = max(finite)
        logsumexp = top + math.log(math.fsum(math.exp(v - top) for v in finite))
        values = [v - logsumexp for v in x]
    else:
        values = x
    rank = sum(1 for v in x if v >= x[token])
    return values[token], rank, sorted(values, reverse=True)[:num_logprobs]
