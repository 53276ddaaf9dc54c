"""Structured outputs on a WeDLM window: which slots a grammar decides, under which token
masks, and what a decode step does with them (docs/contracts.md, "Structured outputs").

A grammar accepts tokens left to right; a WeDLM step fills mask slots anywhere in its
window and commits, one step later, the leading run of filled slots. The rule that makes
the two meet and keeps every committed prefix inside the grammar:

1. Before a step, the host walks the window the step is fed, slot by slot in logical
   order, from the grammar's state after the committed tokens (:func:`plan_window`):

   - a filled slot the grammar accepts advances the grammar, and the walk goes on;
   - a mask slot gets the grammar's token mask at that state, less the ids no request
     outputs (:mod:`wedlm_kernels.output_ids`); if the mask allows exactly one token (a
     *forced* token) the walk advances with it and goes on; if it allows none (or the
     grammar refuses the token it forces) the walk stops *before* this slot, a *dead end*
     (no token can fill it; at the first slot, the request can never go on and its front
     end ends it with an error); otherwise the walk stops after this slot;
   - a filled slot the grammar rejects stops the walk; the step turns it back into a mask;
   - once the grammar has terminated (its end accepted), the remaining slots are not
     constrained (vLLM ignores tokens after termination too).

   The slots walked are the *decided* slots; the walk is undone afterwards (the grammar
   stays at the committed tokens).
2. The step samples every decided mask slot under its mask and fills them all, whatever
   the entropy rule would select; an undecided mask is not sampled. So every filled slot
   holds a token the grammar accepted at its place, and the leading run that
   ``commit_window`` commits is always a prefix the grammar accepts. Each step commits what
   the previous one decided: one token, plus the forced tokens after it.

The grammar is any object with vLLM's ``StructuredOutputGrammar`` methods
(:class:`Grammar`); masks use xgrammar's layout (bit ``v % 32`` of int32 word ``v // 32``
set iff token ``v`` is allowed), the layout :func:`wedlm_kernels.process_logits` reads.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .ops.logits import process_logits

ALL_ALLOWED = -1  # an int32 word with every bit set


class Grammar(Protocol):
    """What :func:`plan_window` needs of a grammar (vLLM's ``StructuredOutputGrammar``)."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...

    def is_terminated(self) -> bool: ...


def token_allowed(row: np.ndarray, token: int) -> bool:
    """Whether the mask ``row`` (int32 words) allows ``token``."""
    word = token >> 5
    return 0 <= token and word < row.shape[0] and bool((int(row[word]) >> (token & 31)) & 1)


def only_token(row: np.ndarray) -> int | None:
    """The token the mask ``row`` allows, if it allows exactly one; else None."""
    words = row.view(np.uint32)
    counts = np.bitwise_count(words)
    if int(counts.sum()) != 1:
        return None
    word = int(np.flatnonzero(counts)[0])
    return word * 32 + int(words[word]).bit_length() - 1


class WindowPlan(NamedTuple):
    """What :func:`plan_window` concluded: slots ``0 .. decided - 1`` are decided;
    ``rejected`` is the filled slot the grammar rejects (masked again by the step), or -1;
    ``dead_end``: slot ``decided`` is a mask no token can fill (the grammar allows none
    there, or refuses the one it forces). ``decided == 0`` with a dead end: the grammar,
    after the committed tokens, allows nothing and has not ended (:meth:`stuck`)."""

    decided: int
    rejected: int
    dead_end: bool = False

    @property
    def stuck(self) -> bool:
        """The request can never commit another token: its grammar allows no token after
        its committed ones (a grammar that allows nothing at all: at its first walk)."""
        return self.dead_end and self.decided == 0


def plan_window(grammar: Grammar, window: Sequence[int], bitmask: torch.Tensor,
                first_row: int, request_id: str = "",
                output_mask: np.ndarray | None = None) -> WindowPlan:
    """Walk one window (rule 1 of the module docstring) and return its decided slots.

    Parameters
    ----------
    grammar : Grammar
        At the state after the request's committed tokens; left there on return.
    window : Sequence[int]
        The slots the step is fed, in logical order: a filled slot's token, ``-1`` for a
        mask.
    bitmask : torch.Tensor
        ``[N, words]`` int32 on the CPU. Row ``first_row + s`` receives slot ``s``'s mask:
        the grammar's for a decided slot, all ones for the others.
    first_row : int
        The row of slot 0.
    request_id : str
        Passed to the grammar's ``accept_tokens``.
    output_mask : np.ndarray or None
        ``[words]`` int32, the ids a request may output
        (:func:`wedlm_kernels.output_ids.output_bitmask`); each mask slot's row is narrowed
        to them before it is read (a filled slot's token outside them is rejected). None:
        the grammar's masks as they are.

    Returns
    -------
    WindowPlan
        ``(decided, rejected, dead_end)``. A mask slot that allows no token, or whose forced
        token the grammar then refuses (its mask and its ``accept_tokens`` disagree: a
        broken grammar), is not decided, so it is not sampled: it is a dead end.

    Example: with a grammar for the string ``"ab"`` over byte tokens, an empty window of
    three masks decides all three (``a``, ``b`` and the end are forced)::

        plan_window(grammar, [-1, -1, -1], bitmask, 0)
        # WindowPlan(decided=3, rejected=-1, dead_end=False)
    """
    rows = bitmask.numpy()
    decided = unconstrained_from = len(window)
    rejected = -1
    dead_end = False
    advanced = 0
    try:
        for slot, token in enumerate(window):
            row = first_row + slot
            if grammar.is_terminated():  # the rest is decided and not constrained
                unconstrained_from = slot
                break
            grammar.fill_bitmask(bitmask, row)
            if output_mask is not None:
                words = min(rows.shape[1], output_mask.shape[0])
                rows[row, :words] &= output_mask[:words]
                rows[row, words:] = 0
            if token >= 0:  # a filled slot
                if token_allowed(rows[row], token) and grammar.accept_tokens(
                        request_id, [token]):
                    advanced += 1
                    continue
                decided = unconstrained_from = slot + 1  # rejected: masked again
                rejected = slot
                break
            allowed = np.bitwise_count(rows[row].view(np.uint32)).sum()
            if allowed == 0:  # no token can fill this slot
                decided = unconstrained_from = slot
                dead_end = True
                break
            if allowed > 1:
                decided = unconstrained_from = slot + 1
                break
            if not grammar.accept_tokens(request_id, [only_token(rows[row])]):
                decided = unconstrained_from = slot  # its one token is refused
                dead_end = True
                break
            advanced += 1
        rows[first_row + unconstrained_from: first_row + len(window)] = ALL_ALLOWED
    finally:
        if advanced:
            grammar.rollback(advanced)
    return WindowPlan(decided, rejected, dead_end)


@dataclass
class GrammarStep:
    """What a decode step does for its grammar-constrained sequences (rule 2), as device
    index tensors built on the host by :meth:`build`.

    ``sampled_rows`` [n] int64: logit rows of decided mask slots; ``masks`` [n, words]
    int32: their token masks; ``idle_rows`` [m] int64: logit rows of undecided mask slots of
    constrained sequences (and of held ones); ``remask_sequence``, ``remask_slot`` [k]
    int64: filled slots the grammar rejects.
    """

    sampled_rows: torch.Tensor
    masks: torch.Tensor
    idle_rows: torch.Tensor
    remask_sequence: torch.Tensor
    remask_slot: torch.Tensor
    sampled_bounds: torch.Tensor  # [2] int32: [0, n], the sampled rows as one sequence
    _saved: torch.Tensor | None = None

    @staticmethod
    def build(windows: Sequence[Sequence[int] | None], plans: Sequence[WindowPlan | None],
              first_rows: Sequence[int], mask_row_base: Sequence[int], bitmask: np.ndarray,
              device: torch.device | str, held_rows: Sequence[int] = ()) -> "GrammarStep":
        """The step of a batch: ``windows[b]`` is the window sequence ``b`` is fed (as for
        :func:`plan_window`; None: not constrained), ``plans[b]`` and ``first_rows[b]`` its
        walk, ``mask_row_base[b]`` the logit row of its first mask slot (its mask slots'
        rows follow in logical order), ``bitmask`` the rows the walks filled; ``held_rows``:
        more logit rows not to sample (a constrained sequence without a walk this step).
        Every index reaches the device in one pinned, asynchronous copy."""
        sampled, grammar_rows, idle, remask = [], [], list(held_rows), []
        for b, window in enumerate(windows):
            if window is None:
                continue
            decided, rejected = plans[b].decided, plans[b].rejected
            masks_seen = 0
            for slot, token in enumerate(window):
                if token < 0:
                    row = mask_row_base[b] + masks_seen
                    masks_seen += 1
                    if slot < decided:
                        sampled.append(row)
                        grammar_rows.append(first_rows[b] + slot)
                    else:
                        idle.append(row)
            if rejected >= 0:
                remask.append((b, rejected))
        pinned = torch.device(device).type == "cuda"

        def tensor(values, dtype=torch.int64) -> torch.Tensor:
            host = torch.as_tensor(np.asarray(values, dtype=np.int64)).to(dtype)
            return (host.pin_memory() if pinned else host).to(device, non_blocking=True)

        masks = tensor(bitmask[grammar_rows] if grammar_rows else
                       np.zeros((0, bitmask.shape[1]), dtype=np.int32), torch.int32)
        pairs = np.asarray(remask, dtype=np.int64).reshape(-1, 2)
        return GrammarStep(tensor(sampled), masks, tensor(idle), tensor(pairs[:, 0]),
                           tensor(pairs[:, 1]), tensor([0, len(sampled)], torch.int32))

    def mask_logits(self, logits: torch.Tensor, row_pos: torch.Tensor) -> torch.Tensor:
        """Before the request rules: ban what each decided slot's mask does not allow (in
        place), and return ``row_pos`` with the undecided mask rows made padding (-1), so
        the selection neither samples nor fills them."""
        rows = self.sampled_rows
        if rows.numel():
            decided = logits.index_select(0, rows)
            words = -(-logits.shape[1] // 32)
            masks = self.masks[:, :words]
            if masks.shape[1] < words:  # tokens past the grammar's vocabulary: banned
                masks = torch.nn.functional.pad(masks, (0, words - masks.shape[1]))
            # the masks alone: one sequence of the sampled rows, every row valid
            process_logits(
                decided, self.sampled_bounds, rows.new_zeros(rows.shape),
                self.sampled_bounds.new_zeros(1),
                self.sampled_bounds.new_ones(1, dtype=torch.float32),
                token_bitmask=masks.contiguous())
            logits.index_copy_(0, rows, decided)
            self._saved = decided
        if self.idle_rows.numel():
            row_pos = row_pos.index_fill(0, self.idle_rows, -1)
        return row_pos

    def restore_dead_rows(self, logits: torch.Tensor) -> None:
        """After the request rules: a decided slot the rules left no token (all ``-inf``:
        min_tokens banning the end the grammar forces, say) takes back the grammar's
        tokens with their unprocessed logits, so the grammar, not the rules, decides it."""
        if self._saved is None:
            return
        rows = self.sampled_rows
        processed = logits.index_select(0, rows)
        dead = (processed == float("-inf")).all(dim=1, keepdim=True)
        logits.index_copy_(0, rows, torch.where(dead, self._saved, processed))

    def force_selected(self, selected: torch.Tensor) -> None:
        """After the selection: every decided mask slot is filled (in place)."""
        if self.sampled_rows.numel():
            selected.index_fill_(0, self.sampled_rows, True)

    def remask(self, win_tokens: torch.Tensor, win_mask: torch.Tensor, mask_id: int) -> None:
        """Before the commit: the filled slots the grammar rejects become masks again."""
        if self.remask_slot.numel():
            index = (self.remask_sequence, self.remask_slot)
            win_tokens.index_put_(index, win_tokens.new_full((), mask_id))
            win_mask.index_put_(index, win_mask.new_ones(()))
