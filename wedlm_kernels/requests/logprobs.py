"""Log-probabilities of committed tokens (vLLM's ``logprobs``) on a WeDLM window
(docs/requests.md, "Logprobs").

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
vLLM counts ties: the number of tokens whose logit is at least the token's). A sequence
that names its tokens (vLLM's ``logprob_token_ids``, ``chosen_ids`` here) gets, in columns
``1 .. C``, those tokens in its order, repeats kept, with their values under the same
distribution, in place of the top ``K``; a record of a step is ``1 + max(K, C)`` wide and
a row's columns past its own count hold token 0, ``-inf``. Each place of
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

Everything here is batched torch on the device and reads nothing back to the host; the
host values are the widths ``K`` (the most top alternatives a request of the step asks for)
and ``C`` (the most named tokens).
"""

from typing import NamedTuple

import torch

from ..ops._validate import Dims, check_tensor
from ..ops.select import kept_tokens
from .params import (
    MAX_LOGPROB_TOKEN_IDS,  # noqa: F401  (the most named tokens)
    MAX_LOGPROBS,  # noqa: F401  (the most alternatives a request gets)
)

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Logprob(NamedTuple):
    """One token's entry of a position's logprobs (vLLM's ``Logprob`` without its text)."""

    logprob: float
    rank: int


class Records(NamedTuple):
    """Logprob records: ``token_ids`` and ``logprobs`` ``[..., 1 + K]`` (int64, fp32; column
    0 the chosen token, then the top ``K`` or the named tokens, ``K`` the wider of the two
    counts), ``ranks`` ``[...]`` int64 (the chosen token's rank)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def check_mode(mode: str, name: str = "logprobs_mode") -> str:
    """``mode`` if it is one of :data:`MODES`, else a ``ValueError`` naming ``name``."""
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _row_of_sequence(values: torch.Tensor, sequence: torch.Tensor, fill: float | int
                     ) -> torch.Tensor:
    """``values`` ``[B]`` of each row's ``sequence`` ``[R]`` (``B``: ``fill``)."""
    return torch.cat([values, values.new_full((1,), fill)])[sequence]


def _sequence_of_rows(cu_rows: torch.Tensor, num_rows: int, device: torch.device
                      ) -> torch.Tensor:
    """``[R]`` int64: each row's sequence, ``B`` for a row outside every sequence."""
    rows = torch.arange(num_rows, device=device)
    sequence = torch.searchsorted(cu_rows.long(), rows, right=True) - 1
    num_sequences = cu_rows.shape[0] - 1
    return torch.where((sequence >= 0) & (sequence < num_sequences), sequence, num_sequences)


def _pad_columns(token_ids: torch.Tensor, values: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, n]`` columns padded on the right to ``width`` with token 0, ``-inf``."""
    extra = width - token_ids.shape[1]
    if extra <= 0:
        return token_ids, values
    return (torch.nn.functional.pad(token_ids, (0, extra), value=0),
            torch.nn.functional.pad(values, (0, extra), value=float("-inf")))


def row_records(logits: torch.Tensor, token: torch.Tensor, num_logprobs: int, mode: str,
                cu_rows: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                chosen_ids: torch.Tensor | None = None) -> Records:
    """The record of every row's ``token`` under ``mode``'s distribution: the token's value
    and rank, then the ``K`` most likely tokens, or the tokens its sequence names.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]`` float32, float16 or bfloat16: the rows' logits at ``mode``'s stage (raw:
        as the model gave them; processed: after the logit rules); not modified.
    token : torch.Tensor
        ``[R]`` int64, the rows' tokens (``select_tokens``' output).
    num_logprobs : int
        ``K``, the top alternatives per row, ``0 <= K <= V``.
    mode : str
        One of :data:`MODES`.
    cu_rows : torch.Tensor or None
        ``[B+1]`` int32, ``select_tokens``' row offsets: the rows of sequence ``b`` are
        ``cu_rows[b] .. cu_rows[b+1] - 1``. Needed by the processed modes and by
        ``chosen_ids``.
    temperature, top_k, top_p : torch.Tensor or None
        ``select_tokens``' ``[B]`` float32, ``[B]`` int32 and ``[B]`` float32, needed by
        the processed modes only. A row outside every sequence gets temperature 0 (no
        scaling, no filter).
    chosen_ids : torch.Tensor or None
        ``[B, C]`` int64, the tokens each sequence names (vLLM's ``logprob_token_ids``),
        entries ``< 0`` padding. A row of a sequence with at least one entry ``>= 0`` gets
        columns ``1 .. C`` = its sequence's entries in order (a padding entry: token 0,
        ``-inf``), each with its value under ``mode``'s distribution, instead of the top
        ``K``; the other rows (a row outside every sequence too) keep the top ``K``. None:
        every row the top ``K``.

    Returns
    -------
    Records
        ``token_ids`` ``[R, 1 + max(K, C)]`` int64 (column 0 ``token``), ``logprobs``
        ``[R, 1 + max(K, C)]`` float32 and ``ranks`` ``[R]`` int64 (the number of tokens
        whose value is at least the token's). Columns past a row's own count (``K``, or
        ``C`` for a row that names its tokens) hold token 0, ``-inf``.

    Raises
    ------
    ValueError
        A mode not in :data:`MODES`, ``K`` outside ``[0, V]``, a processed mode or
        ``chosen_ids`` without ``cu_rows`` (and the sampling tensors), or ``chosen_ids``
        of the wrong shape.
    TypeError
        ``chosen_ids`` or ``cu_rows`` not a tensor of its dtype.

    Examples
    --------
    ::

        token, selected, _ = wk.select_tokens(logits, cu_rows, row_pos, ...)
        records = row_records(logits, token, 5, "raw_logprobs")
        # sequence 0 names tokens 17 and 3, sequence 1 lists its 5 most likely
        chosen = torch.tensor([[17, 3], [-1, -1]])
        records = row_records(logits, token, 5, "raw_logprobs", cu_rows, chosen_ids=chosen)
        # records.token_ids: [R, 6]; sequence 0's rows [token, 17, 3, 0, 0, 0]
    """
    check_mode(mode, "mode")
    num_rows, vocab_size = logits.shape
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be in [0, {vocab_size}] (the vocabulary), "
                         f"got {num_logprobs}")
    processed = mode.startswith("processed")
    if processed and (cu_rows is None or temperature is None or top_k is None
                      or top_p is None):
        raise ValueError("the processed modes need cu_rows, temperature, top_k and top_p")
    if chosen_ids is not None:
        if cu_rows is None:
            raise ValueError("chosen_ids needs cu_rows (the rows of each sequence)")
        dims = Dims()
        check_tensor("cu_rows", cu_rows, torch.int32, ("B+1",), dims)
        check_tensor("chosen_ids", chosen_ids, torch.int64, ("B", None), dims)
    x = logits.float()
    sequence = None
    if processed or chosen_ids is not None:
        sequence = _sequence_of_rows(cu_rows, num_rows, x.device)
    if processed:
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
    if chosen_ids is not None and chosen_ids.shape[1] > 0:
        # each row's sequence's named tokens ([R, C]; a row outside every sequence: none)
        padding = chosen_ids.new_full((1, chosen_ids.shape[1]), -1)
        named = torch.cat([chosen_ids, padding])[sequence]
        names = (named >= 0).any(dim=1, keepdim=True)  # [R, 1]: the row lists its named tokens
        # (an id past the vocabulary, which the front ends refuse, reads as padding)
        listed = (named >= 0) & (named < vocab_size)
        named_ids = torch.where(listed, named, 0)
        named_values = torch.where(listed, x.gather(1, named_ids), float("-inf"))
        width = 1 + max(num_logprobs, chosen_ids.shape[1])
        token_ids, values = _pad_columns(token_ids, values, width)
        named_ids, named_values = _pad_columns(named_ids, named_values, width - 1)
        token_ids = torch.cat([token_ids[:, :1],
                               torch.where(names, named_ids, token_ids[:, 1:])], dim=1)
        values = torch.cat([values[:, :1], torch.where(names, named_values, values[:, 1:])],
                           dim=1)
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


def widen_store(store: Records, num_logprobs: int) -> Records:
    """``store`` with room for ``num_logprobs`` alternatives a record: its records kept, the
    new columns token 0, ``-inf``; a store at least that wide is returned as it is."""
    extra = 1 + num_logprobs - store.token_ids.shape[2]
    if extra <= 0:
        return store
    return Records(torch.nn.functional.pad(store.token_ids, (0, extra), value=0),
                   torch.nn.functional.pad(store.logprobs, (0, extra), value=float("-inf")),
                   store.ranks)


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
