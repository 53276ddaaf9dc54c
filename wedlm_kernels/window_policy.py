"""An adaptive streaming window: per sequence and per step, as many mask slots as the text
lets it commit, down to one (AR's cost) where it commits one token per forward.

Plain PyTorch on the batch's device; nothing here reads a value on the host, so an engine
runs it inside its decode step (a CUDA graph included). ``docs/algorithm.md``, "The adaptive
window", states the rule and what it does to the outputs.

The rule, for each sequence ``b`` after a step that fed it ``fed[b]`` mask slots and decided
``decided[b]`` of them (filled them with a token: a streaming window commits what it fills,
a step or more later), with ``W = policy.max_window``, the mask slots of its next window:

- its commit rate, a running estimate of the tokens it commits per forward, moves towards
  the step's count: ``rate <- (1 - smoothing) rate + smoothing decided`` (a sequence fed
  nothing keeps its rate);
- a sequence whose rate is at least ``parallel_rate`` decodes in parallel: its next
  window holds ``W`` masks (its window does not shrink while the text allows parallel
  commits: a smaller window would decide fewer masks, the far ones included, and so
  measure a lower rate);
- below it, the sequence decodes about one token per forward, and its window holds
  ``min_window`` masks (the rows that cost about nothing on the device, one where rows
  cost), except that a window that decided every mask it was fed (``decided >= fed >= 2``)
  doubles (at most ``W``): the text may allow more;
- a one-mask window always decides its mask, which says nothing about the text, so after
  ``probe_every`` one-mask steps in a row the next window has two masks (a probe): a
  sequence whose text became predictable grows back within a few steps, and one that stays
  unpredictable pays one extra row every ``probe_every + 1`` steps.

A sequence fed nothing (a step that only prefills it, or leaves it out) keeps its whole
state: its rate and its count of one-mask steps.

:func:`resize_windows` then gives each window that many slots past its leading filled run
(the run the next step commits), as the fixed window keeps ``W`` there: with ``W`` slots
nothing changes.

Each sequence's window depends only on its own history, not on its batch, so a request
decodes the same tokens alone or in any batch, in any engine that applies the rule.
"""

import math
from dataclasses import dataclass

import torch

from .ops._validate import check_int, check_same_device, check_tensor


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Rows a decode step can feed at about the cost of one, per device kind: "cpu" measured on
# the shipped tiny model (bench/results/cpu/window_policy.md: a 30-row step took 1.24x a
# 2-row one, 52 rows 1.94x); "cuda" is model_min's MEMORY_BOUND_ROWS for an 8B model on an
# H200 (the rows at which the matmuls start to outlast reading the weights), not yet swept.
ROW_BUDGETS = {"cpu": 32, "cuda": 160}


@dataclass(frozen=True)
class AdaptiveWindow:
    """Settings of the adaptive window (module docstring for the rule).

    Parameters
    ----------
    max_window : int
        ``W``, the most mask slots a window holds (the fixed window it replaces), >= 1.
    min_window : int
        The fewest, 1 .. ``W``: the masks a sequence keeps however little it commits, as
        rows that cost about nothing (:meth:`for_batch` derives it from a device's row
        budget).
    smoothing : float
        Weight of the newest step in the commit-rate estimate, in ``(0, 1]``.
    parallel_rate : float
        The commit rate (tokens per forward) from which a sequence gets the whole window,
        >= 1.
    probe_every : int
        One-mask steps in a row before a two-mask probe, >= 1.

    Examples
    --------
    >>> AdaptiveWindow(max_window=16)
    AdaptiveWindow(max_window=16, min_window=1, smoothing=0.25, parallel_rate=1.5, probe_every=8)
    """

    max_window: int = 16
    min_window: int = 1
    smoothing: float = 0.25
    parallel_rate: float = 1.5
    probe_every: int = 8

    def __post_init__(self) -> None:
        check_int("max_window", self.max_window, minimum=1)
        check_int("min_window", self.min_window, minimum=1)
        if self.min_window > self.max_window:
            raise ValueError(f"`min_window` must be at most `max_window` ({self.max_window}), "
                             f"got {self.min_window}")
        check_int("probe_every", self.probe_every, minimum=1)
        if not _is_number(self.smoothing) or not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"`smoothing` must be a number in (0, 1], got {self.smoothing!r}")
        if not _is_number(self.parallel_rate) or not 1.0 <= self.parallel_rate < math.inf:
            raise ValueError("`parallel_rate` must be a number >= 1 and finite, got "
                             f"{self.parallel_rate!r}")

    @classmethod
    def for_batch(cls, max_window: int, max_batch: int, row_budget: int,
                  **settings) -> "AdaptiveWindow":
        """The policy of an engine that decodes at most ``max_batch`` sequences at once on a
        device where a step of up to ``row_budget`` rows costs about one row's
        (:data:`ROW_BUDGETS`): each sequence keeps at least ``row_budget // (2 max_batch)``
        masks (a window of ``m`` masks feeds up to ``2 m`` rows), 1 .. ``W``. The floor is
        the engine's, not the batch's, so a request's windows do not depend on its batch.

        Examples
        --------
        >>> AdaptiveWindow.for_batch(16, max_batch=64, row_budget=160).min_window
        1
        >>> AdaptiveWindow.for_batch(16, max_batch=4, row_budget=32).min_window
        4
        """
        check_int("max_batch", max_batch, minimum=1)
        check_int("row_budget", row_budget, minimum=1)
        floor = min(max(row_budget // (2 * max_batch), 1), max_window)
        return cls(max_window=max_window, min_window=floor, **settings)

    @classmethod
    def for_device(cls, max_window: int, max_batch: int, device: torch.device | str,
                   min_window: int | None = None, **settings) -> "AdaptiveWindow":
        """The policy of an engine on ``device``: its own floor ``min_window`` (at most
        ``max_window``), or where that is None, :meth:`for_batch` with the row budget of
        ``device``'s kind (:data:`ROW_BUDGETS`; a kind it does not list takes the
        ``"cuda"`` budget). model_min's ``Generator`` and the vLLM plugin both size their
        policy here.

        Examples
        --------
        >>> AdaptiveWindow.for_device(16, max_batch=16, device="cpu").min_window
        1
        >>> AdaptiveWindow.for_device(8, max_batch=16, device="cpu", min_window=12).min_window
        8
        """
        if min_window is not None:
            check_int("min_window", min_window, minimum=1)
            return cls(max_window=max_window, min_window=min(min_window, max_window),
                       **settings)
        kind = torch.device(device).type
        return cls.for_batch(max_window, max_batch,
                             ROW_BUDGETS.get(kind, ROW_BUDGETS["cuda"]), **settings)


@dataclass
class WindowPolicyState:
    """What the rule remembers per sequence (:func:`new_policy_state`).

    Parameters
    ----------
    commit_rate : torch.Tensor
        ``[B]`` fp32, tokens the sequence commits per forward, estimated from the masks
        each step decides.
    one_slot_steps : torch.Tensor
        ``[B]`` int32, one-mask steps in a row (the probe's count).
    """

    commit_rate: torch.Tensor
    one_slot_steps: torch.Tensor


def new_policy_state(batch: int, policy: AdaptiveWindow,
                     device: torch.device | str | None = None) -> WindowPolicyState:
    """The state of ``batch`` newly admitted sequences: a commit rate of
    ``parallel_rate + 1`` (a new sequence starts with the whole window, and shrinks within
    a few steps if its text commits one token per forward), no one-mask steps.

    Parameters
    ----------
    batch : int
        Sequences admitted, >= 0.
    policy : AdaptiveWindow
        The settings (the starting rate).
    device : torch.device or str, optional
        Where the state lives (the batch's device).

    Returns
    -------
    WindowPolicyState
        ``[batch]`` tensors, concatenated to the batch's state by the engine.

    Examples
    --------
    >>> new_policy_state(2, AdaptiveWindow(max_window=8)).commit_rate
    tensor([2.5000, 2.5000])
    """
    check_int("batch", batch, minimum=0)
    return WindowPolicyState(
        torch.full((batch,), policy.parallel_rate + 1.0, dtype=torch.float32, device=device),
        torch.zeros(batch, dtype=torch.int32, device=device))


def next_window_lengths(fed: torch.Tensor, decided: torch.Tensor, state: WindowPolicyState,
                        policy: AdaptiveWindow,
                        max_window: torch.Tensor | None = None) -> torch.Tensor:
    """The slots of each sequence's next window past its leading filled run (its "masks":
    the slots a step predicts), updating ``state`` in place.

    Parameters
    ----------
    fed : torch.Tensor
        ``[B]`` int32 or int64, mask slots the step fed each sequence (:func:`window_masks`
        of the window it fed; 0: not fed, its state is kept).
    decided : torch.Tensor
        ``[B]`` int32 or int64, masks the step filled for each sequence (its selected
        rows: ``select_tokens``' threshold picks them, and at least one per step).
    state : WindowPolicyState
        ``[B]`` tensors on ``fed``'s device (:func:`new_policy_state`).
    policy : AdaptiveWindow
    max_window : torch.Tensor, optional
        ``[B]`` int32 or int64, each sequence's own ``W``, 1 .. ``policy.max_window`` (an
        engine whose requests choose a smaller window than the engine's): the rule runs
        per sequence with that ``W`` and a floor of ``min(policy.min_window, W)``. None:
        ``policy.max_window`` for every sequence.

    Returns
    -------
    torch.Tensor
        ``[B]`` int32 in ``[min_window, W]``: the mask slots of each sequence's next window
        (before the ``max_new`` limit, which :func:`resize_windows` applies).

    Examples
    --------
    >>> policy = AdaptiveWindow(max_window=16)
    >>> state = new_policy_state(2, policy)
    >>> for step in range(4):  # the first sequence decides one mask a step, the other six
    ...     masks = next_window_lengths(torch.tensor([16, 16]), torch.tensor([1, 6]), state,
    ...                                 policy)
    >>> masks, state.commit_rate.round(decimals=2)
    (tensor([ 1, 16], dtype=torch.int32), tensor([1.4700, 4.8900]))
    """
    check_tensor("fed", fed, (torch.int32, torch.int64), (None,))
    batch = fed.shape[0]
    check_tensor("decided", decided, (torch.int32, torch.int64), (batch,))
    check_tensor("state.commit_rate", state.commit_rate, (torch.float32,), (batch,))
    check_tensor("state.one_slot_steps", state.one_slot_steps, (torch.int32,), (batch,))
    devices = dict(fed=fed, decided=decided, commit_rate=state.commit_rate,
                   one_slot_steps=state.one_slot_steps)
    if max_window is not None:
        check_tensor("max_window", max_window, (torch.int32, torch.int64), (batch,))
        devices["max_window"] = max_window
    check_same_device(**devices)
    fed_any = fed > 0
    count = decided.to(torch.float32)
    rate = torch.where(fed_any, state.commit_rate + policy.smoothing
                       * (count - state.commit_rate), state.commit_rate)
    # each sequence's bounds [low, high] (a bound outside 1 .. W is clamped into it: no
    # host read checks it)
    if max_window is None:
        high = torch.full_like(rate, policy.max_window)
    else:
        high = max_window.to(torch.float32).clamp(1, policy.max_window)
    low = high.clamp(max=policy.min_window)

    def bounded(value: torch.Tensor) -> torch.Tensor:
        return torch.minimum(torch.maximum(value.to(torch.float32), low), high)

    steady = torch.where(rate >= policy.parallel_rate, high, low)
    length = torch.where((fed >= 2) & (decided >= fed),
                         torch.maximum(bounded(2 * fed), steady), steady)
    one_slot = fed == 1  # (one mask)
    steps = torch.where(one_slot, state.one_slot_steps + 1,
                        torch.where(fed_any, 0, state.one_slot_steps))
    probe = one_slot & (steps >= policy.probe_every)
    length = torch.where(one_slot, torch.where(probe, bounded(low.clamp(min=2)), low), length)
    steps = torch.where(probe, 0, steps)
    length = torch.where(fed_any, length, bounded(torch.ceil(state.commit_rate)))
    state.commit_rate.copy_(rate)
    state.one_slot_steps.copy_(steps.to(torch.int32))
    return length.to(torch.int32)


def window_masks(win_mask: torch.Tensor, win_len: torch.Tensor) -> torch.Tensor:
    """The mask slots among each window's live slots: what a step feeds of it to be
    predicted, the ``fed`` of :func:`next_window_lengths`.

    Parameters
    ----------
    win_mask : torch.Tensor
        ``[B, S]`` bool, the window's masks.
    win_len : torch.Tensor
        ``[B]`` int32, the live slots.

    Returns
    -------
    torch.Tensor
        ``[B]`` int32.

    Examples
    --------
    >>> window_masks(torch.tensor([[False, True, True, True]]), torch.tensor([3]))
    tensor([2], dtype=torch.int32)
    """
    check_tensor("win_mask", win_mask, (torch.bool,), (None, None))
    check_tensor("win_len", win_len, (torch.int32, torch.int64), (win_mask.shape[0],))
    check_same_device(win_mask=win_mask, win_len=win_len)
    live = torch.arange(win_mask.shape[1], device=win_mask.device)[None, :] < win_len[:, None]
    return (win_mask & live).sum(dim=1, dtype=torch.int32)


def resize_windows(win_tokens: torch.Tensor, win_mask: torch.Tensor, win_len: torch.Tensor,
                   masks: torch.Tensor, out_len: torch.Tensor, max_new: torch.Tensor,
                   finished: torch.Tensor, mask_id: int, max_output: int,
                   enabled: torch.Tensor | None = None) -> None:
    """Give each active sequence's window ``masks[b]`` slots past its leading filled run, in
    place, after :func:`commit_window` (``docs/contracts.md``), whose refill leaves that run
    (the next step commits it) and ``W`` slots past it: ``masks[b] = W`` changes nothing.
    A window cut shorter drops its slots past the new length (they become masks past
    ``win_len``, so a filled slot there is dropped and its position predicted again when
    the window reaches it); a window grown longer gets mask slots at its end. Either way
    ``win_len`` stays within ``min(max(max_new, 0), max_output) - out_len`` and ``S``, like
    the refill, and the slots from ``win_len`` on are masks. Sequences that are finished,
    have an empty window, or are not ``enabled`` keep their window.

    Parameters
    ----------
    win_tokens : torch.Tensor
        ``[B, S]`` int64, the window tokens (``WindowState``), updated in place.
    win_mask : torch.Tensor
        ``[B, S]`` bool, the window's masks, updated in place.
    win_len : torch.Tensor
        ``[B]`` int32, the live slots, updated in place.
    masks : torch.Tensor
        ``[B]`` int32 or int64, >= 1: the slots past the leading run of each next window
        (:func:`next_window_lengths`).
    out_len : torch.Tensor
        ``[B]`` int32, tokens committed so far.
    max_new : torch.Tensor
        ``[B]`` int32, the output limit.
    finished : torch.Tensor
        ``[B]`` bool.
    mask_id : int
        The mask token id, >= 0.
    max_output : int
        ``T``, the output capacity (``out_tokens.shape[1]``).
    enabled : torch.Tensor, optional
        ``[B]`` bool, the sequences the policy applies to (None: every sequence).

    Returns
    -------
    None
        The three window tensors are updated in place.

    Examples
    --------
    >>> win_tokens = torch.tensor([[7, 9, 9, 5, 9, 9]])  # mask id 9; slots 0 and 3 filled
    >>> win_mask = torch.tensor([[False, True, True, False, True, True]])
    >>> win_len = torch.tensor([6], dtype=torch.int32)
    >>> resize_windows(win_tokens, win_mask, win_len, torch.tensor([2]),
    ...                out_len=torch.tensor([0], dtype=torch.int32),
    ...                max_new=torch.tensor([32], dtype=torch.int32),
    ...                finished=torch.tensor([False]), mask_id=9, max_output=32)
    >>> win_len, win_tokens, win_mask
    (tensor([3], dtype=torch.int32), tensor([[7, 9, 9, 9, 9, 9]]), tensor([[False,  True,  True,  True,  True,  True]]))
    """
    check_tensor("win_tokens", win_tokens, (torch.int64,), (None, None), contiguous=True)
    batch, slots = win_tokens.shape
    check_tensor("win_mask", win_mask, (torch.bool,), (batch, slots), contiguous=True)
    check_tensor("win_len", win_len, (torch.int32,), (batch,), contiguous=True)
    check_tensor("masks", masks, (torch.int32, torch.int64), (batch,))
    check_tensor("out_len", out_len, (torch.int32,), (batch,))
    check_tensor("max_new", max_new, (torch.int32,), (batch,))
    check_tensor("finished", finished, (torch.bool,), (batch,))
    if enabled is not None:
        check_tensor("enabled", enabled, (torch.bool,), (batch,))
    check_int("mask_id", mask_id, minimum=0)
    check_int("max_output", max_output, minimum=0)
    check_same_device(win_tokens=win_tokens, win_mask=win_mask, win_len=win_len,
                      masks=masks, out_len=out_len, max_new=max_new, finished=finished,
                      **({} if enabled is None else {"enabled": enabled}))
    slot = torch.arange(slots, device=win_len.device)[None, :]
    filled = ~win_mask & (slot < win_len[:, None])
    run = filled.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    room = (max_new.clamp(min=0, max=max_output) - out_len).clamp(min=0)
    length = torch.minimum(run + masks.to(torch.int32).clamp(min=1), room).clamp(max=slots)
    active = (win_len > 0) & ~finished
    if enabled is not None:
        active &= enabled
    new_len = torch.where(active, length, win_len)
    reset = active[:, None] & (slot >= new_len[:, None])
    win_tokens.masked_fill_(reset, mask_id)
    win_mask.masked_fill_(reset, True)
    win_len.copy_(new_len)
