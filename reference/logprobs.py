"""Reference logprob records (docs/requests.md, "Logprobs"), one row at a time in float64.

:func:`row_record`: the chosen token's value and rank, and the values of the ``K`` most
likely tokens (in descending order; which of several tied tokens is listed is left to the
op, so the reference gives values, not ids), under one of vLLM's ``logprobs_mode``s.
:func:`named_columns`: the columns of a row whose sequence names its tokens (vLLM's
``logprob_token_ids``), ids and values. :func:`record_columns`: a whole record row as
``wedlm_kernels.requests.logprobs.row_records`` lays it out, either kind, padding included.
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


def values_of(logits_row: torch.Tensor, mode: str, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0) -> list[float]:
    """Every token's value under ``mode``: the log-softmax of :func:`distribution` for the
    ``*_logprobs`` modes, the distribution itself for the ``*_logits`` ones."""
    x = distribution(logits_row, mode, temperature, top_k, top_p)
    if not mode.endswith("logprobs"):
        return x
    finite = [v for v in x if v != NEG_INF]
    top = max(finite)
    logsumexp = top + math.log(math.fsum(math.exp(v - top) for v in finite))
    return [v - logsumexp for v in x]


def row_record(logits_row: torch.Tensor, token: int, num_logprobs: int, mode: str,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
               ) -> tuple[float, int, list[float]]:
    """``(value of token, rank of token, values of the num_logprobs most likely)``."""
    x = distribution(logits_row, mode, temperature, top_k, top_p)
    values = values_of(logits_row, mode, temperature, top_k, top_p)
    rank = sum(1 for v in x if v >= x[token])
    return values[token], rank, sorted(values, reverse=True)[:num_logprobs]


def named_columns(logits_row: torch.Tensor, named: list[int], mode: str,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
                  ) -> list[tuple[int, float]]:
    """The columns ``1 ..`` of a row whose sequence names the tokens ``named`` (entries < 0
    padding): per entry, in order and repeats kept, ``(id, its value)``, a padding entry
    ``(0, -inf)``."""
    values = values_of(logits_row, mode, temperature, top_k, top_p)
    columns = []
    for token in named:
        if token < 0:
            columns.append((0, NEG_INF))
        else:
            columns.append((token, values[token]))
    return columns


def record_columns(logits_row: torch.Tensor, token: int, num_logprobs: int,
                   named: list[int], mode: str, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0) -> tuple[float, int, list[tuple[int | None, float]]]:
    """``(value of token, rank of token, columns 1 .. max(K, C))`` of one record row, ``C =
    len(named)``: with an entry of ``named`` >= 0, :func:`named_columns`; else the ``K``
    most likely values with id None (any of several tied tokens may be listed); either
    padded with ``(0, -inf)`` to ``max(K, C)`` columns."""
    value, rank, top = row_record(logits_row, token, num_logprobs, mode, temperature, top_k,
                                  top_p)
    if any(t >= 0 for t in named):
        columns = named_columns(logits_row, named, mode, temperature, top_k, top_p)
    else:
        columns = [(None, v) for v in top]
    while len(columns) < max(num_logprobs, len(named)):
        columns.append((0, NEG_INF))
    return value, rank, columns
