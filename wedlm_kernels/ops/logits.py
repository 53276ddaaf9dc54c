"""process_logits: a request's logit rules, applied in place to a step's window rows.

vLLM's sampling parameters beyond temperature, top-k and top-p change the distribution a
token is drawn from: tokens banned (``allowed_token_ids``, a grammar's bitmask,
``min_tokens``' stop ids), biased (``logit_bias``), penalised for having appeared
(``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``) or cut below a share of
the most likely one (``min_p``). WeDLM decodes a window of slots per step, so the rules run
on every window row of the step, before :func:`wedlm_kernels.select_tokens`: its entropy, its
selection and its token then all read the processed distribution (docs/contracts.md,
"process_logits", has every rule and its order).

Two implementations: ``process_logits_torch`` (PyTorch, the CPU path) and
``process_logits_triton`` (a 2-D grid of rows x vocabulary tiles for the rules, then, when a
row has ``min_p``, one program per row for its cut).
"""

import torch
import triton
import triton.language as tl

from .. import _backend
from . import _dispatch
from ._triton import POINTER_TYPES, KernelVariant
from ._validate import FLOAT_DTYPES, Dims, check_same_device, check_tensor, debug_check

BITS = 32  # tokens per bitmask word (xgrammar's layout: bit v % 32 of word v // 32)


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row over a vocabulary of ``vocab_size`` tokens."""
    return -(-vocab_size // BITS)


def process_logits(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    output_start: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None = None,
    min_tokens: torch.Tensor | None = None,
    stop_ids: torch.Tensor | None = None,
    bias_ids: torch.Tensor | None = None,
    bias_values: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
    repetition_penalty: torch.Tensor | None = None,
    allowed_mask: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> None:
    """Apply each sequence's logit rules to its window rows, in place.

    Rows ``cu_rows[b] .. cu_rows[b+1]-1`` belong to sequence ``b`` and row ``r`` predicts
    the token at logical position ``row_pos[r]`` (``-1``: padding), as in
    :func:`select_tokens`; rows that are not valid are left as they are. Per element of a
    valid row, in float32: bans (``allowed_mask``, ``token_bitmask``, and the stop ids
    while the row's output index ``row_pos - output_start`` is below ``min_tokens``) set
    ``-inf``; the bias is added; the penalties apply to the tokens the sequence has
    committed (``output_counts``) or holds in its prompt (``prompt_mask``, repetition only);
    the result is stored in the logits' dtype; then ``min_p`` cuts every value below
    ``max + temperature * log(min_p)`` of its row to ``-inf``. Each optional group may be
    ``None``, which skips it. docs/contracts.md has the exact order and roundings.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]`` float32, float16 or bfloat16, stride 1 in the last dimension; modified.
    cu_rows : torch.Tensor
        ``[B+1]`` int32, row offsets of the sequences.
    row_pos : torch.Tensor
        ``[R]`` int64, logical position each row predicts; ``-1`` marks padding.
    output_start : torch.Tensor
        ``[B]`` int32, the logical position of the sequence's first generated token (its
        prompt length), for ``min_tokens``.
    temperature : torch.Tensor
        ``[B]`` float32, the sampling temperature (``min_p`` is skipped where ``<= 0``).
    min_p : torch.Tensor or None
        ``[B]`` float32 in ``[0, 1]``; ``0`` is off.
    min_tokens : torch.Tensor or None
        ``[B]`` int32: the stop ids are banned while the output index is below it.
    stop_ids : torch.Tensor or None
        ``[B, K]`` int64, the ids ``min_tokens`` bans (``< 0``: padding); given with it.
    bias_ids : torch.Tensor or None
        ``[B, Kb]`` int64 token ids whose logits get a bias (``logit_bias``; ``< 0``:
        padding).
    bias_values : torch.Tensor or None
        ``[B, Kb]`` float32, the bias added to the logit of ``bias_ids[b, j]``.
    output_counts : torch.Tensor or None
        ``[B, V]`` int32, how often each token is among the sequence's committed outputs.
    prompt_mask : torch.Tensor or None
        ``[B, V]`` bool, which tokens its prompt holds.
    presence_penalty : torch.Tensor or None
        ``[B]`` float32, subtracted from the logit of every token with a count (0: off).
        The penalties are given together with ``output_counts`` and ``prompt_mask``.
    frequency_penalty : torch.Tensor or None
        ``[B]`` float32, subtracted once per count (0: off).
    repetition_penalty : torch.Tensor or None
        ``[B]`` float32 ``> 0``, dividing the positive and multiplying the negative logits
        of the tokens with a count or in the prompt (1: off).
    allowed_mask : torch.Tensor or None
        ``[B, ceil(V / 32)]`` int32, per sequence: bit ``v % 32`` of word ``v // 32`` set
        iff token ``v`` may be generated (``allowed_token_ids``).
    token_bitmask : torch.Tensor or None
        ``[R, ceil(V / 32)]`` int32, per row, the same layout (a grammar's bitmask, as
        xgrammar fills it).

    Returns
    -------
    None. ``logits`` holds the processed values.

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)
    >>> wk.process_logits(
    ...     logits, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5]),
    ...     one(5, torch.int32), one(0.0), bias_ids=torch.tensor([[3]]),
    ...     bias_values=torch.tensor([[4.0]]), output_counts=torch.tensor([[2, 0, 0, 0]],
    ...     dtype=torch.int32), prompt_mask=torch.tensor([[False, True, False, False]]),
    ...     presence_penalty=one(0.5), frequency_penalty=one(0.25),
    ...     repetition_penalty=one(2.0))
    >>> logits.tolist()
    [[0.0, 0.5, 0.0, 3.0]]
    """
    dims = Dims()
    check_tensor("logits", logits, FLOAT_DTYPES, ("R", "V"), dims, unit_last_stride=True)
    check_tensor("cu_rows", cu_rows, torch.int32, (None,))
    if cu_rows.shape[0] < 1:
        raise ValueError("`cu_rows` must have B+1 >= 1 entries, got shape [0]")
    check_tensor("cu_rows", cu_rows, torch.int32, ("B+1",), dims)
    check_tensor("row_pos", row_pos, torch.int64, ("R",), dims)
    check_tensor("output_start", output_start, torch.int32, ("B",), dims)
    check_tensor("temperature", temperature, torch.float32, ("B",), dims)
    words = bitmask_words(dims["V"])
    optional = {
        "min_p": (torch.float32, ("B",)),
        "min_tokens": (torch.int32, ("B",)),
        "stop_ids": (torch.int64, ("B", None)),
        "bias_ids": (torch.int64, ("B", "Kb")),
        "bias_values": (torch.float32, ("B", "Kb")),
        "output_counts": (torch.int32, ("B", "V")),
        "prompt_mask": (torch.bool, ("B", "V")),
        "presence_penalty": (torch.float32, ("B",)),
        "frequency_penalty": (torch.float32, ("B",)),
        "repetition_penalty": (torch.float32, ("B",)),
        "allowed_mask": (torch.int32, ("B", words)),
        "token_bitmask": (torch.int32, ("R", words)),
    }
    given = {"min_p": min_p, "min_tokens": min_tokens, "stop_ids": stop_ids,
             "bias_ids": bias_ids, "bias_values": bias_values, "output_counts": output_counts,
             "prompt_mask": prompt_mask, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty, "repetition_penalty": repetition_penalty,
             "allowed_mask": allowed_mask, "token_bitmask": token_bitmask}
    for name, value in given.items():
        if value is not None:
            dtype, shape = optional[name]
            check_tensor(name, value, dtype, shape, dims)
    for group in (("min_tokens", "stop_ids"), ("bias_ids", "bias_values"),
                  ("output_counts", "prompt_mask", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")):
        present = [name for name in group if given[name] is not None]
        if present and len(present) != len(group):
            missing = [name for name in group if given[name] is None]
            raise ValueError(f"`{missing[0]}` must be given with `{present[0]}` (the group "
                             f"{', '.join(group)} is given whole or not at all)")
    check_same_device(logits=logits, cu_rows=cu_rows, row_pos=row_pos,
                      output_start=output_start, temperature=temperature, **given)
    if _backend.DEBUG:
        debug_check(cu_rows[0] >= 0, "cu_rows[0] must be >= 0")
        debug_check(cu_rows[1:] >= cu_rows[:-1], "cu_rows must be non-decreasing")
        debug_check(cu_rows[-1] <= dims["R"], f"cu_rows[-1] must be <= R = {dims['R']}")
        if min_p is not None:
            debug_check((min_p >= 0) & (min_p <= 1), "min_p must be in [0, 1]")
        if repetition_penalty is not None:
            debug_check(repetition_penalty > 0, "repetition_penalty must be > 0")
    _dispatch.call("process_logits", logits, cu_rows, row_pos, output_start, temperature,
                   min_p, min_tokens, stop_ids, bias_ids, bias_values, output_counts,
                   prompt_mask, presence_penalty, frequency_penalty, repetition_penalty,
                   allowed_mask, token_bitmask)


def log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """``float32(log(float64(min_p)))``: the one logarithm of the min_p cut, computed the
    same way for every implementation (``-inf`` for 0)."""
    return torch.log(min_p.double()).float()


def _bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, ceil(V/32)]`` int32 bitmask words -> ``[n, V]`` bool (bit set: allowed)."""
    tokens = torch.arange(vocab_size, device=words.device)
    word = words.index_select(1, tokens // BITS)
    return ((word >> (tokens % BITS).to(torch.int32)) & 1).bool()


def _matches(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, V]`` bool: which tokens appear among ``ids`` ``[R, K]`` (entries outside
    ``[0, V)`` match nothing)."""
    hits = torch.zeros((ids.shape[0], vocab_size), dtype=torch.int32, device=ids.device)
    inside = (ids >= 0) & (ids < vocab_size)
    hits.scatter_add_(1, ids.clamp(0, vocab_size - 1), inside.to(torch.int32))
    return hits > 0


def process_logits_torch(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    output_start: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    min_tokens: torch.Tensor | None,
    stop_ids: torch.Tensor | None,
    bias_ids: torch.Tensor | None,
    bias_values: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    allowed_mask: torch.Tensor | None,
    token_bitmask: torch.Tensor | None,
) -> None:
    num_rows, vocab_size = logits.shape
    num_seqs = cu_rows.shape[0] - 1
    if num_rows == 0 or num_seqs == 0 or vocab_size == 0:
        return
    device = logits.device
    rows = torch.arange(num_rows, device=device)
    # Row -> sequence: the last b with cu_rows[b] <= r (rows past cu_rows[B] are padding).
    sequence = torch.searchsorted(cu_rows.long(), rows, right=True) - 1
    valid = (sequence >= 0) & (sequence < num_seqs) & (row_pos >= 0)
    owner = sequence.clamp(0, num_seqs - 1)
    neg_inf = torch.tensor(float("-inf"), device=device)

    x = logits.float()
    banned = torch.zeros_like(x, dtype=torch.bool)
    if allowed_mask is not None:
        banned |= ~_bits(allowed_mask.index_select(0, owner), vocab_size)
    if token_bitmask is not None:
        banned |= ~_bits(token_bitmask, vocab_size)
    if min_tokens is not None:
        output_index = row_pos - output_start.long().index_select(0, owner)
        early = output_index < min_tokens.long().index_select(0, owner)
        banned |= early[:, None] & _matches(stop_ids.index_select(0, owner), vocab_size)
    x = torch.where(banned, neg_inf, x)
    if bias_ids is not None and bias_ids.shape[1] > 0:
        ids, values = bias_ids.index_select(0, owner), bias_values.index_select(0, owner)
        inside = (ids >= 0) & (ids < vocab_size)
        added = torch.full_like(x, -0.0)  # -0.0 + v = v for every v (0.0 + -0.0 is 0.0)
        added.scatter_add_(1, ids.clamp(0, vocab_size - 1), torch.where(inside, values, -0.0))
        x = torch.where(_matches(ids, vocab_size), x + added, x)
    if output_counts is not None:
        counts = output_counts.index_select(0, owner)
        appeared = counts > 0
        seen = appeared | prompt_mask.index_select(0, owner)
        repetition = repetition_penalty.index_select(0, owner)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        frequency = frequency_penalty.index_select(0, owner)[:, None]
        presence = presence_penalty.index_select(0, owner)[:, None]
        x = x - frequency * counts.float()
        x = torch.where(appeared, x - presence, x)
    stored = x.to(logits.dtype)
    if min_p is not None:
        values = stored.float()
        row_max = values.amax(dim=1)
        row_temperature = temperature.index_select(0, owner)
        row_min_p = min_p.index_select(0, owner)
        cut_on = ((row_temperature > 0) & (row_min_p > 0) & torch.isfinite(row_max)
                  & ~torch.isnan(values).any(dim=1))
        cut = row_max + row_temperature * log_min_p(row_min_p)
        stored = torch.where(cut_on[:, None] & (values < cut[:, None]),
                             neg_inf.to(logits.dtype), stored)
    logits.copy_(torch.where(valid[:, None], stored, logits))


def process_logits_fake(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    output_start: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    min_tokens: torch.Tensor | None,
    stop_ids: torch.Tensor | None,
    bias_ids: torch.Tensor | None,
    bias_values: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    allowed_mask: torch.Tensor | None,
    token_bitmask: torch.Tensor | None,
) -> None:
    return None


# ---------------------------------------------------------------------------- Triton kernels
#
# The rules kernel: program (row r, tile t) handles vocabulary entries t * BLOCK ..
# t * BLOCK + BLOCK - 1 of row r. Its sequence b is found by a binary search of cu_rows;
# every per-element rule reads only that element (its count, its prompt bit, its bitmask
# bits) and the short lists of b (stop ids, bias entries), so the tiles are independent:
#     x = float32(logits[r, v])
#     x = -inf                          if v is banned (allowed bit 0, row bitmask bit 0,
#                                          or a stop id while output index < min_tokens)
#     x = x + bias[j]                   for each bias entry j of b with id v
#     x = x / rep  (x > 0), x * rep     if v is in the prompt or was generated (count c > 0)
#     x = x - frequency * c, - presence if c > 0
#     logits[r, v] = x  (rounded to the logits' dtype)
# The min_p kernel: one program per row that has min_p (temperature > 0, min_p > 0), two
# passes over the row: its maximum m (and whether it holds a NaN), then every stored value
# below m + temperature * log(min_p) becomes -inf. Both are compiled without fused
# multiply-adds, so each operation rounds once, as the PyTorch path does; offsets are int64.


@triton.jit
def _row_sequence(cu_rows_ptr, row, num_sequences, search_steps):
    """``(sequence, in range)``: the last ``b`` with ``cu_rows[b] <= row`` (a binary search
    over ``b`` in ``[0, B]``; 0 where there is none), and whether it is a sequence."""
    low = tl.full([], 0, tl.int32)
    high = tl.full([], 0, tl.int32) + num_sequences + 1
    for _ in range(search_steps):
        active = low < high
        middle = (low + high) // 2
        offset = tl.load(cu_rows_ptr + tl.where(active, middle, 0))
        go_right = active & (offset <= row)
        low = tl.where(go_right, middle + 1, low)
        high = tl.where(active & ~go_right, middle, high)
    sequence = low - 1
    in_sequences = (sequence >= 0) & (sequence < num_sequences)
    return tl.where(in_sequences, sequence, 0), in_sequences


@triton.jit
def _bit_set(words_ptr, tokens, mask):
    word = tl.load(words_ptr + tokens // 32, mask=mask, other=-1)
    return ((word >> (tokens % 32)) & 1) != 0


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_sequences",
                               "num_stop_ids", "num_bias", "bitmask_words"])
def _process_logits_kernel(
    logits_ptr,  # [R, V], unit last stride
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    output_start_ptr,  # [B] int32
    min_tokens_ptr,  # [B] int32 (HAS_MIN_TOKENS)
    stop_ids_ptr,  # [B, K] int64 (HAS_MIN_TOKENS)
    bias_ids_ptr,  # [B, Kb] int64 (HAS_BIAS)
    bias_values_ptr,  # [B, Kb] fp32 (HAS_BIAS)
    output_counts_ptr,  # [B, V] int32 (HAS_PENALTIES)
    prompt_mask_ptr,  # [B, V] bool (HAS_PENALTIES)
    presence_ptr,  # [B] fp32 (HAS_PENALTIES)
    frequency_ptr,  # [B] fp32 (HAS_PENALTIES)
    repetition_ptr,  # [B] fp32 (HAS_PENALTIES)
    allowed_mask_ptr,  # [B, ceil(V/32)] int32 (HAS_ALLOWED)
    token_bitmask_ptr,  # [R, ceil(V/32)] int32 (HAS_BITMASK)
    logits_row_stride,
    vocab_size,
    num_sequences,
    search_steps,  # bit length of B + 1
    num_stop_ids,
    num_bias,
    bitmask_words,
    HAS_MIN_TOKENS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    HAS_BITMASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(row_pos_ptr + row)
    sequence, in_sequences = _row_sequence(cu_rows_ptr, row, num_sequences, search_steps)
    first_row = tl.load(cu_rows_ptr + sequence)
    end_row = tl.load(cu_rows_ptr + sequence + 1)
    valid = in_sequences & (first_row <= row) & (row < end_row) & (position >= 0)
    sequence = sequence.to(tl.int64)  # before the branch: a variable keeps its type in it
    if valid:
        tokens = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab_size
        row_ptr = logits_ptr + row * logits_row_stride + tokens
        x = tl.load(row_ptr, mask=inside, other=0.0).to(tl.float32)
        banned = tl.zeros([BLOCK], dtype=tl.int1)
        if HAS_ALLOWED:
            banned |= ~_bit_set(allowed_mask_ptr + sequence * bitmask_words, tokens, inside)
        if HAS_BITMASK:
            banned |= ~_bit_set(token_bitmask_ptr + row * bitmask_words, tokens, inside)
        if HAS_MIN_TOKENS:
            output_index = position - tl.load(output_start_ptr + sequence)
            if output_index < tl.load(min_tokens_ptr + sequence):
                stops_ptr = stop_ids_ptr + sequence * num_stop_ids
                for k in range(num_stop_ids):
                    banned |= tokens == tl.load(stops_ptr + k)
        x = tl.where(banned, float("-inf"), x)
        if HAS_BIAS:
            ids_ptr = bias_ids_ptr + sequence * num_bias
            values_ptr = bias_values_ptr + sequence * num_bias
            for j in range(num_bias):
                x = tl.where(tokens == tl.load(ids_ptr + j), x + tl.load(values_ptr + j), x)
        if HAS_PENALTIES:
            counts = tl.load(output_counts_ptr + sequence * vocab_size + tokens, mask=inside,
                             other=0)
            in_prompt = tl.load(prompt_mask_ptr + sequence * vocab_size + tokens,
                                mask=inside, other=0) != 0
            appeared = counts > 0
            repetition = tl.load(repetition_ptr + sequence)
            x = tl.where(appeared | in_prompt,
                         tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
            frequency = tl.load(frequency_ptr + sequence)
            presence = tl.load(presence_ptr + sequence)
            x = x - frequency * counts.to(tl.float32)
            x = tl.where(appeared, x - presence, x)
        tl.store(row_ptr, x.to(logits_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_sequences"])
def _min_p_kernel(
    logits_ptr,  # [R, V], unit last stride (the rules already applied)
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    temperature_ptr,  # [B] fp32
    min_p_ptr,  # [B] fp32
    log_min_p_ptr,  # [B] fp32: float32(log(float64(min_p)))
    logits_row_stride,
    vocab_size,
    num_sequences,
    search_steps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(row_pos_ptr + row)
    sequence, in_sequences = _row_sequence(cu_rows_ptr, row, num_sequences, search_steps)
    first_row = tl.load(cu_rows_ptr + sequence)
    end_row = tl.load(cu_rows_ptr + sequence + 1)
    valid = in_sequences & (first_row <= row) & (row < end_row) & (position >= 0)
    temperature = tl.load(temperature_ptr + sequence)
    min_p = tl.load(min_p_ptr + sequence)
    if valid & (temperature > 0) & (min_p > 0):
        row_ptr = logits_ptr + row * logits_row_stride
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        nan_count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK):
            tokens = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(row_ptr + tokens, mask=tokens < vocab_size,
                        other=float("-inf")).to(tl.float32)
            nan_count += (x != x).to(tl.int32)
            run_max = tl.maximum(run_max, tl.where(x != x, float("-inf"), x))
        row_max = tl.max(run_max, axis=0)
        has_nan = tl.sum(nan_count, axis=0) > 0
        finite = (row_max > float("-inf")) & (row_max < float("inf"))
        if finite & ~has_nan:
            cut = row_max + temperature * tl.load(log_min_p_ptr + sequence)
            for start in range(0, vocab_size, BLOCK):
                tokens = start + tl.arange(0, BLOCK).to(tl.int64)
                inside = tokens < vocab_size
                x = tl.load(row_ptr + tokens, mask=inside, other=0.0)
                below = x.to(tl.float32) < cut
                tl.store(row_ptr + tokens, tl.full([BLOCK], float("-inf"), tl.float32)
                         .to(logits_ptr.dtype.element_ty), mask=inside & below)


# 1024 entries per program with 4 warps (8 per thread): a step of 256 rows over a 152k
# vocabulary is 38k programs of one read and one write each.
_BLOCK = 1024
_NUM_WARPS = 4
_MIN_P_BLOCK = 2048
_MIN_P_WARPS = 8


def process_logits_triton(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    output_start: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    min_tokens: torch.Tensor | None,
    stop_ids: torch.Tensor | None,
    bias_ids: torch.Tensor | None,
    bias_values: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    allowed_mask: torch.Tensor | None,
    token_bitmask: torch.Tensor | None,
) -> None:
    """Triton launcher of :func:`process_logits` (arguments validated by the caller)."""
    num_rows, vocab_size = logits.shape
    num_sequences = cu_rows.shape[0] - 1
    if num_rows == 0 or num_sequences == 0 or vocab_size == 0:
        return
    search_steps = (num_sequences + 1).bit_length()
    cu_rows, row_pos = cu_rows.contiguous(), row_pos.contiguous()
    has = {"HAS_MIN_TOKENS": min_tokens is not None,
           "HAS_BIAS": bias_ids is not None and bias_ids.shape[1] > 0,
           "HAS_PENALTIES": output_counts is not None,
           "HAS_ALLOWED": allowed_mask is not None,
           "HAS_BITMASK": token_bitmask is not None}
    if any(has.values()):
        def pointer(tensor):  # an unused argument gets any pointer of the right dtype
            return row_pos if tensor is None else tensor.contiguous()
        _process_logits_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
            logits, cu_rows, row_pos, output_start.contiguous(),
            pointer(min_tokens), pointer(stop_ids), pointer(bias_ids), pointer(bias_values),
            pointer(output_counts), pointer(prompt_mask), pointer(presence_penalty),
            pointer(frequency_penalty), pointer(repetition_penalty), pointer(allowed_mask),
            pointer(token_bitmask), logits.stride(0), vocab_size, num_sequences, search_steps,
            0 if stop_ids is None else stop_ids.shape[1],
            0 if bias_ids is None else bias_ids.shape[1],
            bitmask_words(vocab_size), **has, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
            enable_fp_fusion=False,
        )
    if min_p is not None:
        _min_p_kernel[(num_rows,)](
            logits, cu_rows, row_pos, temperature.contiguous(), min_p.contiguous(),
            log_min_p(min_p).contiguous(), logits.stride(0), vocab_size, num_sequences,
            search_steps, BLOCK=_MIN_P_BLOCK, num_warps=_MIN_P_WARPS, enable_fp_fusion=False,
        )


_RULES_SIGNATURE = {
    "cu_rows_ptr": "*i32", "row_pos_ptr": "*i64", "output_start_ptr": "*i32",
    "min_tokens_ptr": "*i32", "stop_ids_ptr": "*i64", "bias_ids_ptr": "*i64",
    "bias_values_ptr": "*fp32", "output_counts_ptr": "*i32", "prompt_mask_ptr": "*i1",
    "presence_ptr": "*fp32", "frequency_ptr": "*fp32", "repetition_ptr": "*fp32",
    "allowed_mask_ptr": "*i32", "token_bitmask_ptr": "*i32", "logits_row_stride": "i32",
    "vocab_size": "i32", "num_sequences": "i32", "search_steps": "i32",
    "num_stop_ids": "i32", "num_bias": "i32", "bitmask_words": "i32",
}
_MIN_P_SIGNATURE = {
    "cu_rows_ptr": "*i32", "row_pos_ptr": "*i64", "temperature_ptr": "*fp32",
    "min_p_ptr": "*fp32", "log_min_p_ptr": "*fp32", "logits_row_stride": "i32",
    "vocab_size": "i32", "num_sequences": "i32", "search_steps": "i32",
}
# The rule sets a launch compiles: every rule (the widest kernel) and the common single ones.
_RULE_SETS = {
    "all": dict(HAS_MIN_TOKENS=True, HAS_BIAS=True, HAS_PENALTIES=True, HAS_ALLOWED=True,
                HAS_BITMASK=True),
    "penalties": dict(HAS_MIN_TOKENS=False, HAS_BIAS=False, HAS_PENALTIES=True,
                      HAS_ALLOWED=False, HAS_BITMASK=False),
    "bitmask": dict(HAS_MIN_TOKENS=False, HAS_BIAS=False, HAS_PENALTIES=False,
                    HAS_ALLOWED=False, HAS_BITMASK=True),
    "bias_min_tokens": dict(HAS_MIN_TOKENS=True, HAS_BIAS=True, HAS_PENALTIES=False,
                            HAS_ALLOWED=False, HAS_BITMASK=False),
}


def kernel_variants() -> list[KernelVariant]:
    """The rules kernel per logits dtype and rule set, and the min_p kernel per dtype."""
    variants = []
    for dtype, short in ((torch.float32, "fp32"), (torch.float16, "fp16"),
                         (torch.bfloat16, "bf16")):
        for rules, flags in _RULE_SETS.items():
            variants.append(KernelVariant(
                name=f"rules_{rules}_{short}", kernel=_process_logits_kernel,
                signature={"logits_ptr": POINTER_TYPES[dtype], **_RULES_SIGNATURE,
                           **{flag: "constexpr" for flag in flags}, "BLOCK": "constexpr"},
                constexprs={**flags, "BLOCK": _BLOCK}, num_warps=_NUM_WARPS,
                enable_fp_fusion=False))
        variants.append(KernelVariant(
            name=f"min_p_{short}", kernel=_min_p_kernel,
            signature={"logits_ptr": POINTER_TYPES[dtype], **_MIN_P_SIGNATURE,
                       "BLOCK": "constexpr"},
            constexprs={"BLOCK": _MIN_P_BLOCK}, num_warps=_MIN_P_WARPS,
            enable_fp_fusion=False))
    return variants

