"""Log-probabilities of committed tokens (vLLM's ``logprobs``) on a WeDLM window
(docs/contracts.md, "Logprobs").

An AR decoder samples a token and emits it at once; a WeDLM step fills mask slots anywhere
in its window and commits, at a later step (or the same one, at a finish), the leading run
of filled slots. A committed token's log-probability is that of the distribution its slot
was filled from, at the step that filled it, so the step that fills a slot takes its
*record* and keeps it with the slot until the slot commits::

    step t:   select_tokens fills slot s       -> row_records(...) of the step's rows,
                                                  keep_filled(...) at s's place
    step t':  commit_window commits s (t' >= t) -> take(...) of the committed places

A record is vLLM's row of ``LogprobsTensors``: column 0 the token, columns ``1 .. K`` the
``K`` most likely tokens of the slot's distribution (ties in an order ``torch.topk``
chooses), their values, and the token's rank (``1 +`` the tokens strictly more likely, as
vLLM counts ties: the number of tokens whose logit is at least the token's). Each place of
a sequence holds the record of the last fill of that place, so a slot filled again (a
grammar's rejected slot, masked again) keeps its new record. The places are the caller's:
model_min keeps one per output index; the vLLM plugin one per window slot modulo the
window's capacity (the live slots of a window are consecutive logical positions, so they
never share a place).

The distribution (vLLM's ``logprobs_mode``, one per engine):

- ``raw_logprobs`` (vLLM's default), ``raw_logits``: the slot's logits as the model gave
  them (a grammar's mask applied, as vLLM applies it before any sampling rule), before the
  request's logit rules and its temperature; log-softmax of them, or the logits themselves;
- ``processed_logprobs``, ``processed_logits``: after the logit rules
  (:func:`wedlm_kernels.process_logits`), divided by the temperature of a sampled request,
  the tokens top-k and top-p drop set to ``-inf``: the distribution ``select_tokens`` draws
  the token from.

Everything here is batched torch on the device and reads nothing back to the host; the one
host value is the width ``K`` (the most alternatives a request of the step asks for).
"""

from typing import NamedTuple

import torch

from .ops.select import kept_tokens
from .request_params import MAX_LOGPROBS  # noqa: F401  (the most alternatives a request gets)

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Logprob(NamedTuple):
    """One token's entry of a position's logprobs (vLLM's ``Logprob`` without its text)."""

    logprob: float
    rank: int


class Records(NamedTuple):
    """Logprob records: ``token_ids`` and ``logprobs`` ``[..., 1 + K]`` (int64, fp32; column
    0 the chosen token), ``ranks`` ``[...]`` int64 (the chosen token's rank)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def check_mode(mode: str, name: str = "logprobs_mode") -> str:
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _row_of_sequence(values: torch.Tensor, sequence: torch.Tensor, fill: float | int
                     ) -> torch.Tensor:
    return torch.cat([values, values.new_full((1,), fill)])[sequence]


def row_records(logits: torch.Tensor, token: torch.Tensor, num_logprobs: int, mode: str,
                cu_rows: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None
                ) -> Records:
    """The record of every row's ``token`` under ``mode``'s distribution.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]`` float32, float16 or bfloat16: the rows' logits at ``mode``'s stage (raw:
        as the model gave them; processed: after the logit rules); not modified.
    token : torch.Tensor
        ``[R]`` int64, the rows' tokens (``select_tokens``' output).
    num_logprobs : int
        ``K``, the alternatives per row, ``0 <= K <= V``.
    mode : str
        One of :data:`MODES`.
    cu_rows, temperature, top_k, top_p : torch.Tensor or None
        ``select_tokens``' arguments (``[B+1]`` int32, ``[B]`` float32, ``[B]`` int32,
        ``[B]`` float32), needed by the processed modes only. A row outside every
        sequence gets temperature 0 (no scaling, no filter).

    Returns
    -------
    Records
        ``token_ids`` and ``logprobs`` ``[R, 1 + K]``, ``ranks`` ``[R]``.

    Examples
    --------
    ::

        token, selected, _ = wk.select_tokens(logits, cu_rows, row_pos, ...)
        records = row_records(logits, token, 5, "raw_logprobs")
    """
    check_mode(mode, "mode")
    num_rows, vocab_size = logits.shape
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be in [0, {vocab_size}] (the vocabulary), "
                         f"got {num_logprobs}")
    x = logits.float()
    if mode.startswith("processed"):
        if cu_rows is None or temperature is None or top_k is None or top_p is None:
            raise ValueError("the processed modes need cu_rows, temperature, top_k and top_p")
        rows = torch.arange(num_rows, device=x.device)
        sequence = torch.searchsorted(cu_rows.long(), rows, right=True) - 1
        num_sequences = cu_rows.shape[0] - 1
        sequence = torch.where((sequence >= 0) & (sequence < num_sequences), sequence,
                               num_sequences)
        row_temperature = _row_of_sequence(temperature.float(), sequence, 0.0)[:, None]
        sampled = row_temperature > 0
        kept = kept_tokens(torch.where(torch.isnan(x), float("-inf"), x),
                           _row_of_sequence(top_k, sequence, 0),
                           _row_of_sequence(top_p.float(), sequence, 1.0))
        scaled = torch.where(sampled, x / torch.where(sampled, row_temperature, 1.0), x)
        x = torch.where(kept | ~sampled, scaled, float("-inf"))
    token_ids = token.long()[:, None]
    if num_logprobs > 0:
        token_ids = torch.cat([token_ids, torch.topk(x, num_logprobs, dim=-1).indices], dim=1)
    values = x.gather(1, token_ids)
    if mode.endswith("logprobs"):
        values = values - torch.logsumexp(x, dim=-1, keepdim=True)
    ranks = (x >= x.gather(1, token_ids[:, :1])).sum(-1)
    return Records(token_ids, values, ranks)


def empty_store(sequences: int, places: int, num_logprobs: int, device: torch.device
                ) -> Records:
    """A store of records ``[sequences, places + 1, 1 + num_logprobs]`` (place ``places``
    takes the rows :func:`keep_filled` does not keep), every record token 0, ``-inf``."""
    shape = (sequences, places + 1, 1 + num_logprobs)
    return Records(torch.zeros(shape, dtype=torch.int64, device=device),
                   torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
                   torch.zeros(shape[:2], dtype=torch.int64, device=device))


def keep_filled(store: Records, records: Records, sequence: torch.Tensor,
                place: torch.Tensor, filled: torch.Tensor) -> None:
    """Write the records of the rows that fill a slot into ``store``, in place.

    Parameters
    ----------
    store : Records
        From :func:`empty_store`, ``[N, P + 1, 1 + Ks]``.
    records : Records
        :func:`row_records`' ``[R, 1 + K]`` with ``K <= Ks`` (columns past ``K`` are
        written as token 0, ``-inf``).
    sequence : torch.Tensor
        ``[R]`` int64, the store row of each row's sequence (in ``[0, N)`` where
        ``filled``).
    place : torch.Tensor
        ``[R]`` int64, the place of the slot each row fills (in ``[0, P)`` where
        ``filled``).
    filled : torch.Tensor
        ``[R]`` bool, the rows that fill a slot (``selected & row_pos >= 0``). Two filled
        rows never share a (sequence, place).
    """
    places = store.ranks.shape[1] - 1
    width = store.token_ids.shape[2]
    columns = records.token_ids.shape[1]
    if columns > width:
        raise ValueError(f"the records have {columns - 1} alternatives, the store "
                         f"{width - 1}")
    token_ids, logprobs = records.token_ids, records.logprobs
    if columns < width:
        token_ids = torch.nn.functional.pad(token_ids, (0, width - columns), value=0)
        logprobs = torch.nn.functional.pad(logprobs, (0, width - columns),
                                           value=float("-inf"))
    sequence = torch.where(filled, sequence, 0)
    place = torch.where(filled, place, places)  # the rows not kept go to the spare place
    store.token_ids.index_put_((sequence, place), token_ids)
    store.logprobs.index_put_((sequence, place), logprobs)
    store.ranks.index_put_((sequence, place), records.ranks)


def take(store: Records, sequence: torch.Tensor, places: torch.Tensor,
         num_logprobs: int | None = None) -> Records:
    """The records at ``places`` ``[B, n]`` int64 of store rows ``sequence`` ``[B]``:
    ``[B, n, 1 + K]``, ``[B, n]`` (``K``: ``num_logprobs``, at most the store's)."""
    width = store.token_ids.shape[2] if num_logprobs is None else 1 + num_logprobs
    rows = sequence.long()[:, None].expand_as(places)
    return Records(store.token_ids[rows, places, :width], store.logprobs[rows, places, :width],
                   store.ranks[rows, places])


def position_logprobs(token_ids: list[int], logprobs: list[float], rank: int,
                      num_logprobs: int) -> dict[int, Logprob]:
    """One position's logprobs as vLLM returns them: the chosen token with its rank, then
    the ``num_logprobs`` most likely with ranks ``1 ..`` (a token among both keeps the
    latter entry, as in vLLM's ``append_logprobs_for_next_position``)."""
    ranks = [rank, *range(1, num_logprobs + 1)]
    return {token: Logprob(value, token_rank) for token, value, token_rank
            in zip(token_ids[: 1 + num_logprobs], logprobs, ranks)}
