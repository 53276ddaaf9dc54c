"""Structured outputs on a WeDLM window: which slots a grammar decides, which slots are
drafts, under which token masks, and what a decode step does with them (docs/requests.md,
"Structured outputs").

A grammar accepts tokens left to right; a WeDLM step fills mask slots anywhere in its
window and commits, one step later, the leading run of filled slots. The rule that makes
the two meet, keeps every committed prefix inside the grammar and still fills several
slots per step:

1. Before a step, the host walks the window the step is fed, slot by slot in logical
   order, from the grammar's state after the committed tokens (:func:`plan_window`):

   - a filled slot the grammar accepts advances the grammar (it is *validated*), and the
     walk goes on;
   - a mask slot gets the grammar's token mask at that state, less the ids no request
     outputs (:mod:`wedlm_kernels.requests.output_ids`); if the mask allows exactly one token (a
     *forced* token) the walk advances with it and goes on; if it allows none (or the
     grammar refuses the token it forces) the walk stops *before* this slot, a *dead end*
     (no token can fill it; at the first slot, the request can never go on and its front
     end ends it with an error); otherwise the walk stops after this slot (the *grammar
     slot*: its left neighbours are all decided, so its mask is exact);
   - a filled slot the grammar rejects stops the walk; the step turns it, and every filled
     slot to its right, back into masks;
   - once the grammar has terminated (its end accepted), the remaining slots are not
     constrained (vLLM ignores tokens after termination too).

   The slots walked are the *decided* slots; the walk is undone afterwards (the grammar
   stays at the committed tokens).
2. The step samples every decided mask slot under its mask and fills them all, whatever
   the entropy rule would select. The mask slots past the grammar slot are *drafts*:
   sampled and selected as in free decoding, without a grammar mask (their left
   neighbours are not decided yet), and checked by the next step's walk. The step keeps
   them only if the grammar slot's mask allows the model's first choice there (its
   largest logit): where the grammar overrules the model, drafts made past it would likely
   be rejected, and a rejected draft costs a forward. Not drafted: the slots from a dead
   end on, and the slots right of a rejected one (their forward saw the rejected token).
3. ``commit_window`` commits at most the decided slots of the window it was fed
   (``commit_limit``, its early finish included): every committed slot was validated by
   a walk or sampled under the exact mask of its place, so the committed tokens are always
   a prefix the grammar accepts. A grammar that accepts what free decoding writes
   validates every draft: the steps fill and commit what free decoding's would (where
   free decoding fills each step's first mask, as it does on predictable text), and the
   last drafts wait one more forward for their walk (free decoding commits them at once,
   by the early finish).

The grammar is any object with vLLM's ``StructuredOutputGrammar`` methods
(:class:`Grammar`); masks use xgrammar's layout (bit ``v % 32`` of int32 word ``v // 32``
set iff token ``v`` is allowed), the layout :func:`wedlm_kernels.process_logits` reads.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ..ops.logits import process_logits

ALL_ALLOWED = -1  # an int32 word with every bit set
INT32_MAX = 2**31 - 1  # a commit limit that limits nothing


class Grammar(Protocol):
    """What :func:`plan_window` needs of a grammar (vLLM's ``StructuredOutputGrammar``; its
    ``validate_tokens``, when a grammar has it, checks a draft before it is accepted)."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...

    def is_terminated(self) -> bool: ...


def _accepts(grammar: Grammar, request_id: str, token: int) -> bool:
    """Advance ``grammar`` by a filled slot's token if it accepts it. A grammar with vLLM's
    ``validate_tokens`` checks it first, without advancing: vLLM's ``accept_tokens`` logs a
    refusal as an error ("Please file an issue"), while a rejected draft is expected."""
    validate = getattr(grammar, "validate_tokens", None)
    if validate is not None and not validate([token]):
        return False
    return grammar.accept_tokens(request_id, [token])


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
    ``rejected`` is the filled slot the grammar rejects (it and every filled slot to its
    right are masked again by the step), or -1; ``dead_end``: slot ``decided`` is a mask no
    token can fill (the grammar allows none there, or refuses the one it forces).
    ``decided == 0`` with a dead end: the grammar, after the committed tokens, allows
    nothing and has not ended (:meth:`stuck`)."""

    decided: int
    rejected: int
    dead_end: bool = False
    grammar_slot: bool = False

    @property
    def commit_limit(self) -> int:
        """The leading slots of the walked window the step may commit: the validated and
        decided ones, up to a rejected slot (rule 3 of the module docstring)."""
        return self.rejected if self.rejected >= 0 else self.decided

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
        the grammar's for a decided mask slot, all ones for the others (a filled slot is
        checked by the grammar's ``validate_tokens``, when it has one, and
        ``accept_tokens``: no mask is computed for it).
    first_row : int
        The row of slot 0.
    request_id : str
        Passed to the grammar's ``accept_tokens``.
    output_mask : np.ndarray or None
        ``[words]`` int32, the ids a request may output
        (:func:`wedlm_kernels.requests.output_ids.output_bitmask`); each mask slot's row is narrowed
        to them before it is read (a filled slot's token outside them is rejected). None:
        the grammar's masks as they are.

    Returns
    -------
    WindowPlan
        ``(decided, rejected, dead_end, grammar_slot)``. A mask slot that allows no token, or whose forced
        token the grammar then refuses (its mask and its ``accept_tokens`` disagree: a
        broken grammar), is not decided, so it is not sampled: it is a dead end.

    Example: with a grammar for the string ``"ab"`` over byte tokens, an empty window of
    three masks decides all three (``a``, ``b`` and the end are forced)::

        plan_window(grammar, [-1, -1, -1], bitmask, 0)
        # WindowPlan(decided=3, rejected=-1, dead_end=False, grammar_slot=False)
    """
    rows = bitmask.numpy()
    decided = unconstrained_from = len(window)
    rejected = -1
    dead_end = grammar_slot = False
    advanced = 0
    try:
        for slot, token in enumerate(window):
            row = first_row + slot
            if grammar.is_terminated():  # the rest is decided and not constrained
                unconstrained_from = slot
                break
            if token >= 0:  # a filled slot: the grammar's acceptance decides (its row is
                rows[row] = ALL_ALLOWED  # not sampled, so the walk computes no mask for it)
                if (output_mask is None or token_allowed(output_mask, token)) and (
                        _accepts(grammar, request_id, token)):
                    advanced += 1
                    continue
                decided = unconstrained_from = slot + 1  # rejected: masked again
                rejected = slot
                break
            grammar.fill_bitmask(bitmask, row)
            if output_mask is not None:
                words = min(rows.shape[1], output_mask.shape[0])
                rows[row, :words] &= output_mask[:words]
                rows[row, words:] = 0
            allowed = np.bitwise_count(rows[row].view(np.uint32)).sum()
            if allowed == 0:  # no token can fill this slot
                decided = unconstrained_from = slot
                dead_end = True
                break
            if allowed > 1:
                decided = unconstrained_from = slot + 1
                grammar_slot = True
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
    return WindowPlan(decided, rejected, dead_end, grammar_slot)


@dataclass
class GrammarStep:
    """What a decode step does for its grammar-constrained sequences (rules 2 and 3), as
    device index tensors built on the host by :meth:`build`.

    ``sampled_rows`` [n] int64: logit rows of decided mask slots; ``masks`` [n, words]
    int32: their token masks; ``idle_rows`` [m] int64: logit rows not sampled (mask slots
    from a dead end on or right of a rejected slot, every row of a held sequence, and every
    undecided mask without drafts); ``gate_rows`` [g]: the grammar slot's row of each drafting sequence, ``gate_index`` [g]
    its index in ``sampled_rows``; ``draft_rows`` [d]: the drafts' rows, ``draft_gate`` [d]
    the index of their sequence's grammar slot in ``gate_rows``; ``remask_sequence``,
    ``remask_slot`` [k] int64: filled slots masked again (a rejected slot and the filled
    slots to its right); ``commit_limit`` [B] int32: the slots each sequence may commit
    this step (a sequence without a walk: no limit); ``window_cut`` [B] int32: the live
    slots a window drops before the commit (:meth:`cut_windows`).
    """

    sampled_rows: torch.Tensor
    masks: torch.Tensor
    idle_rows: torch.Tensor
    gate_rows: torch.Tensor
    gate_index: torch.Tensor
    draft_rows: torch.Tensor
    draft_gate: torch.Tensor
    remask_sequence: torch.Tensor
    remask_slot: torch.Tensor
    sampled_bounds: torch.Tensor  # [2] int32: [0, n], the sampled rows as one sequence
    commit_limit: torch.Tensor
    rejected: torch.Tensor
    _saved: torch.Tensor | None = None
    _agrees: torch.Tensor | None = None

    @staticmethod
    def build(windows: Sequence[Sequence[int] | None], plans: Sequence[WindowPlan | None],
              first_rows: Sequence[int], mask_row_base: Sequence[int], bitmask: np.ndarray,
              device: torch.device | str, held_rows: Sequence[int] = (),
              drafts: bool = True) -> "GrammarStep":
        """The step of a batch: ``windows[b]`` is the window sequence ``b`` is fed (as for
        :func:`plan_window`; None: not constrained), ``plans[b]`` and ``first_rows[b]`` its
        walk, ``mask_row_base[b]`` the logit row of its first mask slot (its mask slots'
        rows follow in logical order), ``bitmask`` the rows the walks filled; ``held_rows``:
        more logit rows not to sample (a constrained sequence without a walk this step);
        ``drafts``: False leaves every undecided mask unsampled (no drafts: one sampled
        token per step, the rule before drafts). Every index reaches the device in one
        pinned, asynchronous copy."""
        sampled, grammar_rows, idle = [], [], list(held_rows)
        gates, gate_index, draft_rows, draft_gate, remask = [], [], [], [], []
        limits, rejected_slots = [INT32_MAX] * len(windows), [-1] * len(windows)
        for b, window in enumerate(windows):
            if window is None:
                continue
            plan = plans[b]
            decided, rejected = plan.decided, plan.rejected
            # rule 2: drafts past a grammar slot only (not from a dead end on, nor right
            # of a rejected slot, nor past a window the walk decided to its end)
            drafting = drafts and plan.grammar_slot and not plan.dead_end and rejected < 0
            masks_seen = 0
            for slot, token in enumerate(window):
                if token < 0:
                    row = mask_row_base[b] + masks_seen
                    masks_seen += 1
                    if slot < decided:
                        if drafting and slot == decided - 1:  # the grammar slot
                            gates.append(row)
                            gate_index.append(len(sampled))
                        sampled.append(row)
                        grammar_rows.append(first_rows[b] + slot)
                    elif drafting:
                        draft_rows.append(row)
                        draft_gate.append(len(gates) - 1)
                    else:
                        idle.append(row)
                elif 0 <= rejected <= slot:
                    remask.append((b, slot))
            limits[b], rejected_slots[b] = plan.commit_limit, rejected
        pinned = torch.device(device).type == "cuda"

        def tensor(values, dtype=torch.int64) -> torch.Tensor:
            host = torch.as_tensor(np.asarray(values, dtype=np.int64)).to(dtype)
            return (host.pin_memory() if pinned else host).to(device, non_blocking=True)

        masks = tensor(bitmask[grammar_rows] if grammar_rows else
                       np.zeros((0, bitmask.shape[1]), dtype=np.int32), torch.int32)
        pairs = np.asarray(remask, dtype=np.int64).reshape(-1, 2)
        return GrammarStep(
            tensor(sampled), masks, tensor(idle), tensor(gates),
            tensor(gate_index), tensor(draft_rows), tensor(draft_gate), tensor(pairs[:, 0]),
            tensor(pairs[:, 1]), tensor([0, len(sampled)], torch.int32),
            tensor(limits, torch.int32), tensor(rejected_slots, torch.int32))

    def mask_logits(self, logits: torch.Tensor, row_pos: torch.Tensor) -> torch.Tensor:
        """Before the request rules: ban what each decided slot's mask does not allow (in
        place), and return ``row_pos`` with the idle rows made padding (-1), so the selection
        neither samples nor fills them (the drafts stay valid rows). First, whether each
        grammar slot's mask allows the model's own first choice there (the largest of its
        logits as given: the gate of :meth:`settle`)."""
        rows = self.sampled_rows
        if self.gate_rows.numel():
            top = logits.index_select(0, self.gate_rows).argmax(dim=1)  # [g]
            gate_masks = self.masks.index_select(0, self.gate_index)
            word = torch.div(top, 32, rounding_mode="floor")
            bits = gate_masks.gather(1, word.clamp(max=gate_masks.shape[1] - 1)[:, None])[:, 0]
            self._agrees = (word < gate_masks.shape[1]) & (
                torch.bitwise_right_shift(bits, top % 32) & 1 == 1)
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

    def settle(self, selected: torch.Tensor) -> None:
        """After the selection, in place: every decided mask slot is filled, whatever the
        entropy rule selected (forced tokens and the grammar slot: each step commits at
        least what a step without drafts does); a drafting sequence keeps the drafts the
        selection chose, as free decoding does, if its grammar slot allows the model's first
        choice there, and drops them if not (the grammar overrules the model there, so
        drafts made past it would likely be rejected, each rejection costing a forward)."""
        if self.sampled_rows.numel():
            selected.index_fill_(0, self.sampled_rows, True)
        if self._agrees is not None and self.draft_rows.numel():
            selected.index_copy_(0, self.draft_rows, selected.index_select(0, self.draft_rows)
                                 & self._agrees.index_select(0, self.draft_gate))

    def cut_windows(self, win_len: torch.Tensor, window: int | torch.Tensor) -> torch.Tensor:
        """Before the commit: ``win_len`` less the slots each window drops. A window is fed
        its leading filled run (which the step commits) and up to ``window`` (``W``) more
        slots, and keeps those ``W`` after the commit; a rejected slot inside that run
        makes the rest of the run masks again, which the commit (up to the rejected slot)
        keeps as live slots past the ``W``, and the refill would grow the window further.
        So the window drops its last slots (masks: nothing right of a rejected slot is
        filled or drafted) to keep at most ``W`` after the rejected slot, as free decoding
        keeps ``W`` after its commit."""
        rejected = self.rejected
        excess = (win_len - rejected - window).clamp(min=0)
        return (win_len - torch.where(rejected >= 0, excess, 0)).to(win_len.dtype)

    def remask(self, win_tokens: torch.Tensor, win_mask: torch.Tensor, mask_id: int) -> None:
        """Before the commit: a filled slot the grammar rejects, and the filled slots to its
        right, become masks again."""
        if self.remask_slot.numel():
            index = (self.remask_sequence, self.remask_slot)
            win_tokens.index_put_(index, win_tokens.new_full((), mask_id))
            win_mask.index_put_(index, win_mask.new_ones(()))
