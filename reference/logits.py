"""Reference ``process_logits``: a request's logit rules, literally (numpy float32).

docs/contracts.md "process_logits" written out sequence by sequence, row by row and element
by element, each arithmetic operation one numpy float32 operation (rounded once, never
fused):

- :func:`row_rules`: steps 1-3 (bans, bias, penalties) on one row, in float32;
- :func:`store`: step 4, the rounding to the logits' dtype (fp16 by numpy, bf16 by its bit
  pattern, round to nearest even);
- :func:`min_p_cut`: step 5 on one stored row;
- :func:`process_logits`: all of it over a batch, with the op's signature; it returns the
  processed logits as a new tensor and modifies nothing.
"""

import math

import numpy as np
import torch

NEG_INF = np.float32(-np.inf)


def _f32(value) -> np.float32:
    return np.float32(float(value))


def _bit(word: int, bit: int) -> bool:
    """Bit ``bit`` of a 32-bit word (given as a signed int32 value)."""
    return (int(word) >> bit) & 1 == 1


def row_rules(
    x: np.ndarray,
    banned: list[bool],
    bias: list[tuple[int, float]],
    counts: list[int] | None,
    in_prompt: list[bool] | None,
    presence: float,
    frequency: float,
    repetition: float,
) -> np.ndarray:
    """Steps 1-3 on one row ``x`` (float32 ``[V]``, a copy is returned): ``banned`` entries
    become ``-inf``; each ``(token, value)`` of ``bias`` in order adds ``value`` to its token;
    with ``counts`` (None: no penalties) the repetition, frequency and presence penalties."""
    x = x.astype(np.float32).copy()
    vocab_size = x.shape[0]
    for v in range(vocab_size):
        if banned[v]:
            x[v] = NEG_INF
    for token, value in bias:  # in increasing j
        if 0 <= token < vocab_size:
            x[token] = np.float32(x[token] + _f32(value))
    if counts is not None:
        rep, freq, pres = _f32(repetition), _f32(frequency), _f32(presence)
        for v in range(vocab_size):
            c = int(counts[v])
            if in_prompt[v] or c > 0:
                x[v] = np.float32(x[v] / rep) if x[v] > 0 else np.float32(x[v] * rep)
            product = np.float32(freq * np.float32(c))  # the product rounded ...
            x[v] = np.float32(x[v] - product)  # ... then the difference
            if c > 0:
                x[v] = np.float32(x[v] - pres)
    return x


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 value (ties to even), as float32; NaN stays NaN."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out).astype(np.float32)


def store(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Step 4: ``x`` (float32) rounded to ``dtype``, given back as the float32 values."""
    if dtype == torch.float32:
        return x.astype(np.float32)
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        return _bf16_round(x)
    raise TypeError(f"no reference rounding for {dtype}")


def min_p_cut(x: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    """Step 5 on one stored row ``x`` (float32): skipped unless ``temperature > 0``,
    ``min_p > 0``, the maximum is finite and no entry is NaN; else every entry below
    ``m + temperature * float32(log(float64(min_p)))`` becomes ``-inf``."""
    x = x.copy()
    if not (temperature > 0 and min_p > 0):
        return x
    if any(math.isnan(float(value)) for value in x):
        return x
    m = np.float32(max(float(value) for value in x))
    if not math.isfinite(float(m)):
        return x
    log_min_p = np.float32(math.log(float(min_p)))
    cut = np.float32(m + np.float32(_f32(temperature) * log_min_p))
    for v in range(x.shape[0]):
        if x[v] < cut:
            x[v] = NEG_INF
    return x


def process_logits(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    output_start: torch.Tensor,
    temperature: torch.Tensor,
    *,
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
) -> torch.Tensor:
    """The processed logits: a new contiguous tensor of ``logits``' dtype and shape on the
    CPU; rows that are not valid (outside every sequence, or ``row_pos < 0``) are copies."""
    dtype = logits.dtype
    num_rows, vocab_size = logits.shape
    source = logits.detach().cpu()
    out = source.clone().contiguous()
    offsets = [int(c) for c in cu_rows.tolist()]
    positions = [int(p) for p in row_pos.tolist()]
    allowed = None if allowed_mask is None else allowed_mask.tolist()
    row_masks = None if token_bitmask is None else token_bitmask.tolist()

    for b in range(len(offsets) - 1):
        for r in range(offsets[b], offsets[b + 1]):
            if not (0 <= r < num_rows) or positions[r] < 0:
                continue
            x = source[r].float().numpy().astype(np.float32)

            # 1. bans
            banned = [False] * vocab_size
            for v in range(vocab_size):
                if allowed is not None and not _bit(allowed[b][v // 32], v % 32):
                    banned[v] = True
                if row_masks is not None and not _bit(row_masks[r][v // 32], v % 32):
                    banned[v] = True
            if min_tokens is not None:
                output_index = positions[r] - int(output_start[b])
                if output_index < int(min_tokens[b]):
                    for stop in stop_ids[b].tolist():
                        if 0 <= stop < vocab_size:  # < 0: padding; >= V: matches nothing
                            banned[stop] = True

            # 2. bias (entries < 0 are padding, entries >= V match nothing)
            bias = []
            if bias_ids is not None:
                bias = [(int(t), float(w)) for t, w in zip(bias_ids[b].tolist(),
                                                           bias_values[b].tolist())]

            # 3. penalties over the sequence's committed tokens and prompt
            counts = in_prompt = None
            presence = frequency = 0.0
            repetition = 1.0
            if output_counts is not None:
                counts = output_counts[b].tolist()
                in_prompt = prompt_mask[b].tolist()
                presence = float(presence_penalty[b])
                frequency = float(frequency_penalty[b])
                repetition = float(repetition_penalty[b])

            with np.errstate(all="ignore"):
                x = row_rules(x, banned, bias, counts, in_prompt, presence, frequency,
                              repetition)
                # 4. stored in the logits' dtype
                x = store(x, dtype)
                # 5. min_p
                if min_p is not None:
                    x = min_p_cut(x, float(temperature[b]), float(min_p[b]))
            out[r] = torch.from_numpy(x).to(dtype)
    return out
