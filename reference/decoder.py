"""Reference WeDLM decoder without a KV cache (docs/algorithm.md section 4, docs/decoder.md
"Decoding loop around the ops").

One sequence at a time, on Python lists. Every forward recomputes the whole sequence: the
committed tokens at positions ``0..L-1`` followed by the window rows in reordered (physical)
order, row ``j`` carrying slot ``order[j]`` at RoPE position ``L + order[j]``, under a plain
causal mask. By the prefix-cacheability invariant (docs/algorithm.md section 3) its window logits
equal those of the cached decoder, so this is the oracle for it.

Numbered comments are the steps of docs/algorithm.md section 4; the early finish is rule 6 of
docs/contracts.md "commit_window".

The model is any callable ``forward(input_ids [N] int64, position_ids [N] int64) -> logits
[N, V]``, e.g. ``functools.partial(reference.model.forward, weights, config)``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reference import logits as logit_rules
from reference.select import row_entropy, sample_row, select_rows

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MODES = ("streaming", "blockwise", "ar")


@dataclass
class Params:
    """Per-request decoding parameters (docs/algorithm.md section 4)."""

    max_new_tokens: int
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    threshold: float | None = 0.4  # None: one token per step
    penalty: float = 0.02
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # the logit rules (docs/contracts.md "process_logits"), on every row before the entropy
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None


@dataclass
class ForwardRecord:
    """What one decode forward was fed and what it returned."""

    ctx_len: int  # committed tokens L before the forward
    win_tokens: list[int]  # the window in logical slot order, mask_id at masks
    win_mask: list[bool]  # True: the slot is a mask
    order: list[int]  # physical row j carries slot order[j]
    input_ids: torch.Tensor  # [L + n]: committed ++ reordered window
    position_ids: torch.Tensor  # [L + n]: 0..L-1 ++ L + order
    logits: torch.Tensor  # [n, V] float64: the window rows, physical order (AR: [1, V])
    committed: int  # tokens this forward committed (its leading filled run, stop/length cut)


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    forwards: int  # decode forwards (prefill excluded; AR: every token-producing forward)
    rows: int  # window rows fed over all forwards (AR: = forwards)
    tokens_per_forward: float  # generated tokens / forwards (0 without a forward)
    p_cache: float  # generated tokens / rows (0 without a forward)
    trace: list[ForwardRecord] = field(default_factory=list)


def decode(
    forward: ForwardFn,
    prompt_ids: list[int],
    params: Params,
    mode: str = "streaming",
    window: int = 16,
    mask_id: int | None = None,
    never_output: tuple[int, ...] = (),
) -> DecodeResult:
    """Decode one sequence: ``mode`` "streaming" (WeDLM streaming parallel decoding),
    "blockwise" (the stop-and-wait block baseline) or "ar" (one token per forward).
    ``never_output``: the ids no request outputs (wedlm_kernels.requests.output_ids), ``-inf`` in
    every row before the logit rules."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    prompt = [int(t) for t in prompt_ids]
    if never_output:
        forward = _banning(forward, list(never_output))
    if mode == "ar":
        return _decode_ar(forward, prompt, params)
    if mask_id is None or mask_id < 0:
        raise ValueError(f"mask_id must be a vocabulary id for mode {mode!r}, got {mask_id}")
    return _decode_window(forward, prompt, params, window, mask_id, mode == "blockwise")


def _banning(forward: ForwardFn, never: list[int]) -> ForwardFn:
    """``forward`` with the ids ``never`` at ``-inf`` in every row it returns."""
    def banned(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        logits = forward(input_ids, position_ids).clone()
        logits[:, never] = -math.inf
        return logits
    return banned


def _result(out, reason, trace, rows) -> DecodeResult:
    forwards = len(trace)
    return DecodeResult(
        token_ids=out,
        finish_reason=reason,
        forwards=forwards,
        rows=rows,
        tokens_per_forward=len(out) / forwards if forwards else 0.0,
        p_cache=len(out) / rows if rows else 0.0,
        trace=trace,
    )


def _sample(logits_row: torch.Tensor, params: Params, position: int) -> int:
    return sample_row(
        logits_row, params.temperature, params.top_k, params.top_p, params.seed, position
    )


def _apply_rules(row: torch.Tensor, params: Params, prompt: list[int], committed: list[int],
                 position: int) -> torch.Tensor:
    """The logit rules on one row predicting ``position``, with the tokens ``committed``
    before the forward (reference/logits.py, float32 as the op); the row comes back as
    float64. Without any rule the row is returned as it is."""
    if (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p, params.min_tokens, params.logit_bias, params.allowed_token_ids
        ) == (0.0, 0.0, 1.0, 0.0, 0, None, None):
        return row
    vocab_size = row.shape[0]
    allowed = params.allowed_token_ids
    early = position - len(prompt) < params.min_tokens
    banned = [(allowed is not None and v not in allowed)
              or (early and v in params.stop_token_ids) for v in range(vocab_size)]
    bias = sorted((params.logit_bias or {}).items())
    counts = [0] * vocab_size
    for token in committed:
        counts[token] += 1
    in_prompt = [False] * vocab_size
    for token in prompt:
        in_prompt[token] = True
    penalties = (params.presence_penalty, params.frequency_penalty,
                 params.repetition_penalty) != (0.0, 0.0, 1.0)
    x = logit_rules.row_rules(row.float().numpy(), banned, bias,
                              counts if penalties else None, in_prompt,
                              params.presence_penalty, params.frequency_penalty,
                              params.repetition_penalty)
    x = logit_rules.min_p_cut(x, params.temperature, params.min_p)
    return torch.from_numpy(x).double()


def _decode_ar(forward: ForwardFn, prompt: list[int], params: Params) -> DecodeResult:
    """Plain next-token decoding: the last row's logits predict position ``L``."""
    limit = max(params.max_new_tokens, 0)
    if limit > 0 and not prompt:
        raise ValueError("AR decoding needs a non-empty prompt")
    stops = set(params.stop_token_ids)
    tokens, out, trace = list(prompt), [], []
    while len(out) < limit:
        ctx_len = len(tokens)
        input_ids = torch.tensor(tokens, dtype=torch.int64)
        position_ids = torch.arange(ctx_len, dtype=torch.int64)
        last_row = forward(input_ids, position_ids)[-1:].to(torch.float64)
        last_row = _apply_rules(last_row[0], params, prompt, out, ctx_len)[None]
        token = _sample(last_row[0], params, ctx_len)
        trace.append(
            ForwardRecord(ctx_len, [], [], [], input_ids, position_ids, last_row, committed=1)
        )
        out.append(token)
        tokens.append(token)
        if token in stops:
            return _result(out, "stop", trace, rows=len(trace))
    return _result(out, "length", trace, rows=len(trace))


def _leading_run(slots: list[int | None], window: int, blockwise: bool) -> int:
    """The effective leading run of filled slots (block-wise: only a whole block counts)."""
    run = 0
    while run < len(slots) and slots[run] is not None:
        run += 1
    if not blockwise:
        return run
    block = min(window, len(slots))
    return block if run >= block else 0


def _commit(tokens: list[int], out: list[int], limit: int, stops: set) -> tuple[int, str]:
    """Append ``tokens`` in order under the stop and length rules.

    Returns ``(number committed, finish reason or "")``: a stop token is appended and ends
    the run; a token that would exceed ``limit`` is not appended.
    """
    committed = 0
    for token in tokens:
        if len(out) >= limit:
            break
        out.append(token)
        committed += 1
        if token in stops:
            return committed, "stop"
    return committed, "length" if len(out) >= limit else ""


def _decode_window(
    forward: ForwardFn,
    prompt: list[int],
    params: Params,
    window: int,
    mask_id: int,
    blockwise: bool,
) -> DecodeResult:
    limit = max(params.max_new_tokens, 0)
    stops = set(params.stop_token_ids)
    threshold = -math.inf if params.threshold is None else params.threshold
    out: list[int] = []
    slots: list[int | None] = [None] * min(window, limit)  # None: a mask
    trace: list[ForwardRecord] = []
    rows = 0
    reason = "" if limit > 0 else "length"

    while not reason:
        # 1. forward: committed ++ the window in reordered order (filled slots first)
        ctx_len = len(prompt) + len(out)
        n = len(slots)
        order = [s for s in range(n) if slots[s] is not None]
        order += [s for s in range(n) if slots[s] is None]
        n_filled = n - slots.count(None)
        fed = [mask_id if slots[s] is None else slots[s] for s in order]
        input_ids = torch.tensor(prompt + out + fed, dtype=torch.int64)
        position_ids = torch.tensor(
            list(range(ctx_len)) + [ctx_len + s for s in order], dtype=torch.int64
        )
        logits = forward(input_ids, position_ids)[ctx_len:].to(torch.float64)
        rows += n
        # the logit rules on the mask rows, with the tokens committed before this forward
        committed_before = list(out)
        for j in range(n_filled, n):
            logits[j] = _apply_rules(logits[j], params, prompt, committed_before,
                                     ctx_len + order[j])

        # 2. commit the leading filled run as it was fed
        run = _leading_run(slots, window, blockwise)
        committed, reason = _commit(slots[:run], out, limit, stops)
        trace.append(
            ForwardRecord(
                ctx_len=ctx_len,
                win_tokens=_slot_tokens(slots, mask_id),
                win_mask=[s is None for s in slots],
                order=order,
                input_ids=input_ids,
                position_ids=position_ids,
                logits=logits,
                committed=committed,
            )
        )
        if reason:
            break
        slots = slots[committed:]

        # 3-5. entropy, distance-adjusted entropy and selection over the mask rows
        mask_rows = range(n_filled, n)
        row_positions = [ctx_len + order[j] for j in mask_rows]
        if row_positions:
            leftmost = min(row_positions)
            adjusted = [
                row_entropy(logits[j]) + params.penalty * (position - leftmost)
                for j, position in zip(mask_rows, row_positions)
            ]
            selected = select_rows(adjusted, threshold)
            # 6. sample the selected masks into their slots (slot = position - new L)
            new_ctx_len = ctx_len + committed
            for j, position, chosen in zip(mask_rows, row_positions, selected):
                slot = position - new_ctx_len
                if chosen and 0 <= slot < len(slots) and slots[slot] is None:
                    slots[slot] = _sample(logits[j], params, position)

        # early finish: a new leading run that would finish the sequence is committed now
        run = _leading_run(slots, window, blockwise)
        if any(t in stops for t in slots[:run]) or len(out) + run >= limit:
            _, reason = _commit(slots[:run], out, limit, stops)
            break

        # 7. refill by the leading run, never past position len(prompt) + max_new
        new_len = min(len(slots) + run, limit - len(out), 2 * window)
        slots += [None] * (new_len - len(slots))
        if not slots:
            raise RuntimeError("unfinished sequence with an empty window")

    return _result(out, reason, trace, rows)


def _slot_tokens(slots: list[int | None], mask_id: int) -> list[int]:
    """The window's tokens in logical slot order, ``mask_id`` at the masks."""
    return [mask_id if token is None else token for token in slots]
