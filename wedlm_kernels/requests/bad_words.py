"""vLLM's ``bad_words`` on a WeDLM window (docs/requests.md, "Bad words").

An AR decoder bans a word's last token when the tokens before it spell the rest of the
word. A WeDLM step fills several mask slots at once, anywhere in its window, so a word can
be completed at any of its places, and by two slots filled in the same step. The rule that
keeps every word out of the committed text:

1. **Ban** (before the selection, with the logit rules): a token is banned at a mask slot
   when writing it there would complete a word whose other places are all *known* when the
   step starts (committed tokens, or filled slots of the window). With one slot filled per
   step, left to right, this is vLLM's rule exactly.
2. **Unfill** (after the selection, before ``commit_window``): a slot the step selects is
   not filled when its token completes a word in which it is the rightmost place filled by
   this step (the word's other places known before the step or filled by it to the left).
   The step's leftmost fill is never refused (its word's other places were all known, so
   step 1 banned its token): every step still fills a slot.

A word matches output tokens only, never the prompt (as vLLM's); a word of one token is
banned everywhere. Places are logical positions. The caller describes them with
``known [B, C]``: the token at logical position ``first[b] + c``, or ``-1`` where it is not
known (a mask, the prompt, past the window); :func:`known_tokens` builds it from a window
state and the committed tail.

Every function is batched torch on the device and reads nothing back to the host; the cost
is ``rows x words x L x L`` comparisons a step (``L``: the longest word of the batch), run
only in steps where a request has bad words.
"""

from typing import NamedTuple

import torch


class BadWords(NamedTuple):
    """A batch's words: ``tokens [B, N, L]`` int64 (``-1`` past a word's end and in unused
    words), ``lengths [B, N]`` int64 (0: no word)."""

    tokens: torch.Tensor
    lengths: torch.Tensor


def pack(words: list[list[list[int]]], device: torch.device, num_words: int | None = None,
         word_len: int | None = None) -> BadWords:
    """Each sequence's words (token id lists) as a :class:`BadWords` of at least
    ``num_words`` words of ``word_len`` tokens."""
    num_words = max([num_words or 1] + [len(w) for w in words])
    word_len = max([word_len or 1] + [len(word) for w in words for word in w])
    tokens = torch.full((len(words), num_words, word_len), -1, dtype=torch.int64)
    lengths = torch.zeros((len(words), num_words), dtype=torch.int64)
    for b, sequence_words in enumerate(words):
        for j, word in enumerate(sequence_words):
            tokens[b, j, : len(word)] = torch.tensor(word, dtype=torch.int64)
            lengths[b, j] = len(word)
    return BadWords(tokens.to(device), lengths.to(device))


def known_tokens(win_tokens: torch.Tensor, win_mask: torch.Tensor, win_len: torch.Tensor,
                 ctx_len: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(known [B, T + S], first [B])``: the committed tail then the window.

    Parameters
    ----------
    win_tokens, win_mask : torch.Tensor
        ``[B, S]`` the window (int64; bool, True for a mask).
    win_len : torch.Tensor
        ``[B]`` int32, the live slots.
    ctx_len : torch.Tensor
        ``[B]`` int32, the committed tokens, prompt included (slot ``s`` is at logical
        position ``ctx_len + s``).
    tail : torch.Tensor
        ``[B, T]`` int64, the tokens at positions ``ctx_len - T .. ctx_len - 1`` (``-1``
        for a prompt position or before the sequence).
    """
    slots = torch.arange(win_tokens.shape[1], device=win_tokens.device)
    live = (slots < win_len[:, None]) & ~win_mask
    window = torch.where(live, win_tokens, -1)
    first = ctx_len.long() - tail.shape[1]
    return torch.cat([tail.long(), window], dim=1), first


def _neighbourhood(known: torch.Tensor, first: torch.Tensor, row_sequence: torch.Tensor,
                   row_pos: torch.Tensor, word_len: int) -> torch.Tensor:
    """``[R, 2L - 1]``: each row's known tokens at positions ``row_pos - L + 1 ..
    row_pos + L - 1`` (-1 outside ``known``)."""
    offsets = torch.arange(-(word_len - 1), word_len, device=known.device)
    index = (row_pos - first[row_sequence])[:, None] + offsets  # [R, 2L - 1]
    inside = (index >= 0) & (index < known.shape[1])
    values = known[row_sequence[:, None], index.clamp(0, known.shape[1] - 1)]
    return torch.where(inside, values, -1)


def _occurrences(neighbourhood: torch.Tensor, words: BadWords, row_sequence: torch.Tensor,
                 wildcard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every row, word ``j`` and the row's place ``i`` in it: whether the word's other
    places (and, without ``wildcard``, the row's own) hold its tokens. Returns ``(match
    [R, N, L], the places' positions' tokens [R, L, L] per (i, k), index [L, L])``."""
    word_len = words.tokens.shape[2]
    places = torch.arange(word_len, device=neighbourhood.device)
    # the token at the word's place k when the row is its place i: position row_pos - i + k
    index = (word_len - 1) - places[:, None] + places[None, :]  # [L(i), L(k)]
    at_place = neighbourhood[:, index]  # [R, L, L]
    tokens = words.tokens[row_sequence]  # [R, N, L(k)]
    lengths = words.lengths[row_sequence]  # [R, N]
    equal = at_place[:, None, :, :] == tokens[:, :, None, :]  # [R, N, L(i), L(k)]
    past_end = places[None, None, None, :] >= lengths[:, :, None, None]
    ok = equal | past_end
    if wildcard:
        ok = ok | (places[:, None] == places[None, :])[None, None]
    match = ok.all(-1) & (places[None, None, :] < lengths[:, :, None])  # [R, N, L(i)]
    return match, at_place, index


def ban_bad_words(logits: torch.Tensor, words: BadWords, row_sequence: torch.Tensor,
                  row_pos: torch.Tensor, known: torch.Tensor, first: torch.Tensor) -> None:
    """Rule 1, in place: ``logits[r, w_i] = -inf`` where writing ``w_i`` at row ``r``'s
    slot completes word ``w`` with the known tokens.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]``, any float dtype; modified.
    words : BadWords
        The batch's words ``[B, N, L]``.
    row_sequence : torch.Tensor
        ``[R]`` int64, each row's sequence (in ``[0, B)``).
    row_pos : torch.Tensor
        ``[R]`` int64, the logical position a row fills (``< 0``: not a mask row,
        untouched).
    known, first : torch.Tensor
        :func:`known_tokens`' (the state the step was fed).
    """
    word_len = words.tokens.shape[2]
    neighbourhood = _neighbourhood(known, first, row_sequence, row_pos.clamp(min=0), word_len)
    match, _, _ = _occurrences(neighbourhood, words, row_sequence, wildcard=True)
    match = match & (row_pos >= 0)[:, None, None]
    banned = words.tokens[row_sequence]  # [R, N, L]: the token each (j, i) would ban
    values = torch.where(match, float("-inf"), float("inf")).to(logits.dtype)
    logits.scatter_reduce_(1, banned.clamp(min=0).flatten(1), values.flatten(1), "amin")


def unfill_bad_words(selected: torch.Tensor, token: torch.Tensor, words: BadWords,
                     row_sequence: torch.Tensor, row_pos: torch.Tensor, known: torch.Tensor,
                     first: torch.Tensor) -> torch.Tensor:
    """Rule 2: ``selected`` without the rows whose token completes a word in which the row
    is the rightmost place this step fills. Arguments as :func:`ban_bad_words`, with the
    selection's ``selected [R]`` bool and ``token [R]`` int64; returns ``[R]`` bool."""
    word_len = words.tokens.shape[2]
    filling = selected & (row_pos >= 0)
    # the known tokens after the fill, and which positions this step fills
    index = torch.where(filling, row_pos - first[row_sequence], known.shape[1])
    index = index.clamp(max=known.shape[1])
    spare = torch.full((known.shape[0], 1), -1, dtype=known.dtype, device=known.device)
    after = torch.cat([known, spare], dim=1)
    after[row_sequence, index] = torch.where(filling, token, -1)
    filled_now = torch.zeros_like(after, dtype=torch.bool)
    filled_now[row_sequence, index] = filling
    after, filled_now = after[:, :-1], filled_now[:, :-1]
    position = row_pos.clamp(min=0)
    match, _, place_index = _occurrences(
        _neighbourhood(after, first, row_sequence, position, word_len), words, row_sequence,
        wildcard=False)
    # the row is the rightmost place filled now: no place k > i of the word is filled now
    now = _neighbourhood(filled_now.long(), first, row_sequence, position, word_len) > 0
    now_at_place = now[:, place_index]  # [R, L(i), L(k)]
    places = torch.arange(word_len, device=selected.device)
    right = places[None, :] > places[:, None]  # k > i
    lengths = words.lengths[row_sequence]
    inside = places[None, None, None, :] < lengths[:, :, None, None]
    later = (now_at_place[:, None] & right[None, None] & inside).any(-1)  # [R, N, L(i)]
    refused = (match & ~later).flatten(1).any(-1) & filling
    return selected & ~refused


def committed_tail(tail: torch.Tensor, out_tokens: torch.Tensor, committed: torch.Tensor
                   ) -> torch.Tensor:
    """The tail after a step committed ``out_tokens[b, :committed[b]]``: ``[B, T]`` the
    last ``T`` of ``tail ++ committed tokens``."""
    width = tail.shape[1]
    joined = torch.cat([tail, out_tokens.long()], dim=1)
    index = committed.long()[:, None] + torch.arange(width, device=tail.device)
    return joined.gather(1, index)
