"""select_tokens in one launch, for batches whose rows need no top-k or top-p.

The caller says so with ``select_tokens(..., sampling="greedy")`` (every row greedy) or
``sampling="temperature"`` (greedy and plain temperature rows); with ``"any"`` the
three-launch kernels of :mod:`wedlm_kernels.ops.select` run (top-k and top-p need their
filter pass). Same contract, same tokens bit for bit (the random stream and the score of an
entry are those of ``ops/select.py``); ``docs/contracts.md`` ("select_tokens", "Sampling
modes") states it and the bound below.

One launch, grid (row, vocabulary split):

1. Each program reads its slice of the row once, in tiles of ``BLOCK`` logits through a
   ``STAGES``-deep asynchronous copy pipeline (``STAGES - 1`` tiles in flight while one is
   reduced). Per tile one reduction gives the tile's maximum and the softmax sums
   ``s = sum exp(x - m)`` and ``t = sum exp(x - m)(x - m)`` relative to the running maximum m;
   a tile that raises it to m' (rare after the first) sums again relative to m', and the
   running sums are rescaled: ``s <- s e^(m-m')``, ``t <- e^(m-m')(t + (m - m') s)``. The
   greedy index is searched only in a tile that raises the running maximum (the first index
   of the maximum).
2. ``SAMPLING`` (compiled only into the ``temperature`` variant): a temperature row's token is
   ``argmax_v fl(x_v / T + g_v)`` with ``g_v`` the Gumbel noise of Philox word ``v`` (the
   exact score of ``ops/select.py``: an IEEE division and the log1p-exact transform). Each
   sub-tile of ``SUB_GRANULES`` x 64 entries first gets a cheap upper bound of every score
   (:func:`score_upper_bound`: a multiplication and a few exact operations on the word's bits);
   only a sub-tile whose bound reaches the best exact score so far is scored exactly. As the
   bound is never below the exact score, a skipped entry scores below the best, so the argmax
   (first index on ties) is the exact one. A tile whose largest logit cannot reach the best
   score even with the largest noise skips its Philox words altogether.
3. The program writes its partials (m, s, t, best value and its index), then takes a ticket
   of its sequence (an atomic count, zeroed before the launch); the last of the sequence's
   programs to arrive merges the splits of its rows and selects them
   (``ops/select.finish_sequence``, the three-launch kernel's last step).
"""

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton import POINTER_TYPES, CachedLaunch, KernelVariant
from .philox import gumbel_from_word
from .select import _GRANULE, finish_sequence, sequence_of_row
from .select import _first_best as first_best
from .select import _granule_tile as granule_tile
from .select import _gumbel_words as gumbel_words

_NEG_INF = tl.constexpr(float("-inf"))
_INDEX_NONE = tl.constexpr(2**31 - 1)
# No Gumbel noise exceeds 17.33 (the largest word's); test_select_one_launch checks every word.
_GUMBEL_MAX = tl.constexpr(17.5)
# The bound's margins (docs/contracts.md, "The score bound"): relative on x / T, absolute on g.
_SCALED_MARGIN = tl.constexpr(2.0**-21)
_GUMBEL_MARGIN = tl.constexpr(2.0**-16)
_MINUS_LN2_UP = tl.constexpr(-0.6931472)  # fp32 rounds ln 2 = 0.69314718... up
_THIRD_DOWN = tl.constexpr(0.3333333)  # below 1/3 in fp32


@triton.jit
def gumbel_upper_bound(word):
    """An upper bound of ``gumbel_from_word(word)`` from a few exact operations.

    With u = ((word >> 8) + 0.5) 2^-24 and w = 1 - u: g = -ln E, E = -ln u = -ln(1 - w) =
    w + w^2/2 + w^3/3 + ... >= w (1 + w (1/2 + w/3)) =: e (shrunk by 2^-20 for its roundings),
    so g <= -ln e = -ln 2 log2 e, and with e = 2^k (1 + f), log2(1 + f) >= f + c f (1 - f)
    on [0, 1) for c <= 0.27865 (the least of (log2(1 + f) - f) / (f (1 - f)), reached as f
    tends to 1): g <= -ln 2 (k + f + 0.278 f (1 - f)), plus 2^-16 for the roundings of both
    sides. The bound exceeds g by at most 0.02 where g >= 0 (where winners are) and by up
    to 2.3 for the smallest words; test_select_one_launch checks it on all 2^24 words."""
    top = (word >> 8).to(tl.int32)
    w = ((16777216 - top).to(tl.float32) - 0.5) * 5.9604644775390625e-08  # >= 2^-25
    e = w * (1.0 + w * (0.5 + w * _THIRD_DOWN)) * 0.99999905  # 1 - 2^-20, rounded down
    bits = e.to(tl.int32, bitcast=True)  # e > 0, normal
    exponent = ((bits >> 23) & 0xFF) - 127
    fraction = (bits & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07  # 2^-23
    log2_low = exponent.to(tl.float32) + fraction * (1.0 + 0.278 * (1.0 - fraction))
    return log2_low * _MINUS_LN2_UP + _GUMBEL_MARGIN


@triton.jit
def score_upper_bound(x, inverse_temperature, word):
    """An upper bound of the exact score ``fl(div_rn(x, T) + g)`` (NaN where x is -inf or
    the temperature NaN: such an entry never wins). ``x * fl(1 / T)`` is within 3 roundings
    of ``x / T`` (relative 2^-22); the margin doubles that."""
    scaled = x * inverse_temperature
    scaled = scaled + tl.abs(scaled) * _SCALED_MARGIN
    return scaled + gumbel_upper_bound(word)


@triton.jit
def _max_sum_sum(max_a, sum_a, gap_a, max_b, sum_b, gap_b):
    return tl.maximum(max_a, max_b), sum_a + sum_b, gap_a + gap_b


@triton.jit
def _sum_sum(sum_a, gap_a, sum_b, gap_b):
    return sum_a + sum_b, gap_a + gap_b


@triton.jit
def _greedy_update(x, index, tile_max, best, best_index):
    """The running maximum and the first index holding it, after a tile with maximum
    ``tile_max`` (an index reduction only where the tile raises the maximum)."""
    if tile_max > best:
        best_index = tl.min(tl.where(x == tile_max, index, _INDEX_NONE), axis=0)
        best = tile_max
    return best, best_index


@triton.jit
def _gumbel_max_update(row_ptr, end, tile_start, tile_max, position, seed, temperature,
                       inverse_temperature, best, best_index, rescored, BLOCK: tl.constexpr,
                       SUB_GRANULES: tl.constexpr):
    """The best exact score so far and its first index, after the tile at ``tile_start``
    (entries below ``end``), and the count of sub-tiles scored exactly."""
    reachable = tile_max * inverse_temperature
    reachable = reachable + tl.abs(reachable) * _SCALED_MARGIN + _GUMBEL_MAX
    if ~(reachable < best):  # else no entry of the tile can reach the best score
        for sub in range(0, BLOCK // (SUB_GRANULES * _GRANULE)):
            granule = tile_start // _GRANULE + sub * SUB_GRANULES + tl.arange(0, SUB_GRANULES)
            x, index, _ = granule_tile(row_ptr, end, granule)  # (re-read: in cache)
            words = gumbel_words(granule, position, seed)
            bound = score_upper_bound(x, inverse_temperature, words)
            # (a temperature whose inverse overflows has no bound: every sub-tile is scored)
            if (tl.max(bound) >= best) | ~(inverse_temperature < float("inf")):
                score = tl.math.div_rn(x, temperature) + gumbel_from_word(words)
                score = tl.where(score == score, score, _NEG_INF)
                sub_best, sub_best_index = first_best(score, index)
                rescored += 1
                if sub_best > best:  # strictly: an earlier entry wins a tie
                    best = sub_best
                    best_index = sub_best_index
    return best, best_index, rescored


@triton.jit
def _select_one_launch_kernel(
    logits_ptr,  # [R, V], unit last stride
    cu_rows_ptr,  # [B + 1] int32
    row_pos_ptr,  # [R] int64
    temperature_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    threshold_ptr,  # [B] fp32
    penalty_ptr,  # [B] fp32
    tickets_ptr,  # [B] int32, zero at launch: programs of the sequence done so far
    row_sequence_ptr,  # [R] int32 out: the row's sequence, -1 for padding rows
    partial_float_ptr,  # [R, num_splits, 4] fp32 out: m, s, t, best value
    partial_index_ptr,  # [R, num_splits] int32 out: first index of the best value
    rescored_ptr,  # [R, num_splits] int32 out: sub-tiles scored exactly (temperature rows)
    token_ptr,  # [R] int64 out
    selected_ptr,  # [R] bool out
    entropy_ptr,  # [R] fp32 out
    logits_row_stride,
    vocab_size,
    num_rows,
    num_sequences,
    search_steps,  # bit length of B + 1
    split_size,  # a multiple of BLOCK
    num_splits,
    BLOCK: tl.constexpr,  # logits per tile, a multiple of SUB_GRANULES * GRANULE
    STAGES: tl.constexpr,  # tiles in the load pipeline (STAGES - 1 in flight ahead)
    ONE_REDUCTION: tl.constexpr,  # max and sums in one tl.reduce (off: three; interpreter)
    SAMPLING: tl.constexpr,  # compile the temperature rows' Gumbel-max (else every row greedy)
    SUB_GRANULES: tl.constexpr,  # granules of 64 entries per exactly scored sub-tile
    BLOCK_ROWS: tl.constexpr,  # the merge's rows per step
    SPLIT_BLOCK: tl.constexpr,  # >= num_splits
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    position = tl.load(row_pos_ptr + row)
    sequence, member, first_row, end_row = sequence_of_row(row, cu_rows_ptr, num_sequences,
                                                           search_steps)
    valid = member & (position >= 0)
    if split == 0:
        tl.store(row_sequence_ptr + row, tl.where(valid, sequence, -1))
        if not valid:
            tl.store(token_ptr + row, tl.full([], 0, tl.int64))
            tl.store(selected_ptr + row, tl.full([], 0, tl.int1))
            tl.store(entropy_ptr + row, tl.full([], 0.0, tl.float32))

    if valid:
        row_ptr = logits_ptr + row * logits_row_stride
        start = split * split_size
        end = tl.minimum(start + split_size, vocab_size)
        sampling = tl.zeros([], tl.int1)
        temperature = tl.full([], 1.0, tl.float32)
        inverse_temperature = tl.full([], 1.0, tl.float32)
        seed = tl.full([], 0, tl.int64)
        if SAMPLING:
            temperature = tl.load(temperature_ptr + sequence)
            seed = tl.load(seed_ptr + sequence)
            sampling = ~(temperature <= 0.0)  # a NaN temperature samples (token 0)
            inverse_temperature = tl.math.div_rn(1.0, temperature)

        # m starts at the lowest finite fp32, so x - m is never -inf - -inf (see ops/select.py)
        run_max = tl.full([], -3.4028234663852886e38, tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)  # sum exp(x - m)
        run_gap = tl.full([], 0.0, tl.float32)  # sum exp(x - m) (x - m), <= 0
        best = tl.full([], float("-inf"), tl.float32)  # greedy: the maximum; else best score
        best_index = tl.full([], _INDEX_NONE, tl.int32)
        rescored = tl.full([], 0, tl.int32)
        offsets = tl.arange(0, BLOCK)
        for tile_start in tl.range(start, end, BLOCK, num_stages=STAGES):
            index = tile_start + offsets
            x = tl.load(row_ptr + index, mask=index < end, other=float("-inf")).to(tl.float32)
            # one reduction: the tile's maximum and its sums relative to the running maximum
            # (a tile that raises it, rare after the first, sums again relative to its own)
            gap = x - run_max  # NaN for NaN entries; -inf for -inf ones
            weight = tl.exp(gap)
            if ONE_REDUCTION:
                tile_max, tile_sum, tile_gap = tl.reduce(
                    (tl.where(x == x, x, _NEG_INF), weight, weight * tl.maximum(gap, -1e30)), 0,
                    _max_sum_sum)
            else:  # the same in three numpy reductions (the interpreter runs tl.reduce's
                # combine function in Python, element by element)
                tile_max = tl.max(tl.where(x == x, x, _NEG_INF), axis=0)
                tile_sum = tl.sum(weight, axis=0)
                tile_gap = tl.sum(weight * tl.maximum(gap, -1e30), axis=0)
            if tile_max > run_max:
                shift = run_max - tile_max
                scale = tl.exp(shift)
                run_gap = scale * (run_gap + tl.maximum(shift, -1e30) * run_sum)
                run_sum = scale * run_sum
                run_max = tile_max
                gap = x - run_max
                weight = tl.exp(gap)
                if ONE_REDUCTION:
                    tile_sum, tile_gap = tl.reduce((weight, weight * tl.maximum(gap, -1e30)), 0,
                                                   _sum_sum)
                else:
                    tile_sum = tl.sum(weight, axis=0)
                    tile_gap = tl.sum(weight * tl.maximum(gap, -1e30), axis=0)
            run_sum += tile_sum
            run_gap += tile_gap

            if SAMPLING:
                if sampling:
                    best, best_index, rescored = _gumbel_max_update(
                        row_ptr, end, tile_start, tile_max, position, seed, temperature,
                        inverse_temperature, best, best_index, rescored, BLOCK, SUB_GRANULES)
                else:
                    best, best_index = _greedy_update(x, index, tile_max, best, best_index)
            else:
                best, best_index = _greedy_update(x, index, tile_max, best, best_index)

        out = row * num_splits + split
        tl.store(partial_float_ptr + out * 4, run_max)
        tl.store(partial_float_ptr + out * 4 + 1, run_sum)
        tl.store(partial_float_ptr + out * 4 + 2, run_gap)
        tl.store(partial_float_ptr + out * 4 + 3, best)
        tl.store(partial_index_ptr + out, best_index)
        tl.store(rescored_ptr + out, rescored)

    if member:
        # the last of the sequence's programs to arrive merges and selects its rows
        tl.debug_barrier()  # every thread's stores land before the arrival
        arrived = tl.atomic_add(tickets_ptr + sequence, 1)
        if arrived == (end_row - first_row) * num_splits - 1:
            finish_sequence(sequence, cu_rows_ptr, row_pos_ptr, threshold_ptr, penalty_ptr,
                            row_sequence_ptr, partial_float_ptr, partial_index_ptr, token_ptr,
                            selected_ptr, entropy_ptr, num_rows, num_splits, BLOCK_ROWS,
                            SPLIT_BLOCK, ".cg")


@triton.jit
def _score_bound_debug_kernel(
    word_ptr,  # [N] int64: 32-bit words
    bound_ptr,  # [N] fp32 out: gumbel_upper_bound(word)
    gumbel_ptr,  # [N] fp32 out: gumbel_from_word(word)
    count,
    BLOCK: tl.constexpr,
):
    """The bound and the exact noise of explicit words, for tests."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < count
    word = tl.load(word_ptr + index, mask=mask, other=0).to(tl.uint32)
    tl.store(bound_ptr + index, gumbel_upper_bound(word), mask=mask)
    tl.store(gumbel_ptr + index, gumbel_from_word(word), mask=mask)


def gumbel_bound_triton(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, gumbel)`` of ``[N]`` int64 32-bit words, as the kernel computes them. For
    tests."""
    count = words.shape[0]
    bound = torch.empty(count, dtype=torch.float32, device=words.device)
    gumbel = torch.empty_like(bound)
    block = _DEBUG_BLOCK if words.is_cuda else 1 << 16  # (interpreter: fewer, wider programs)
    if count:
        _score_bound_debug_kernel[(triton.cdiv(count, block),)](
            words.contiguous(), bound, gumbel, count, BLOCK=block)
    return bound, gumbel


# ----------------------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------------------

# Tiles of 4096 logits with 8 warps (16 per thread) through a load pipeline of 4 stages for
# 2-byte logits (3 tiles, 24 KB, in flight per program) and 3 for fp32 (2 tiles, 32 KB: at 4
# the temperature kernel spills with Triton 3.6); sub-tiles of 512 entries for the exact
# scores (at 1024 the temperature kernel spills with Triton 3.6). The compile facts
# (bench/compile_facts.py, bench/results/sm90_compile/) give the registers, programs per SM
# and bytes in flight.
BLOCK = 4096
STAGES = {torch.float32: 3, torch.float16: 4, torch.bfloat16: 4}
SUB_GRANULES = 8
WARPS = 8
# Vocabulary splits: enough programs for PROGRAMS_PER_SM per multiprocessor when rows are
# few, each split at least one tile; the interpreter gets a fixed target.
MAX_SPLITS = 128
_PROGRAMS_PER_SM = 4
_INTERPRETER_TARGET_PROGRAMS = 4
_DEBUG_BLOCK = 1024
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The merge rounds the adjusted entropy twice, as the PyTorch path does: no fused
# multiply-add anywhere in the kernel (the scan loses one instruction per entry to it).
_FP_FUSION = False


# The merge's tile, whatever the split count: MAX_SPLITS partials of each of 2 rows (one per
# thread). One compiled kernel per mode and dtype; a tile sized by the split count changed
# the whole kernel's registers (64 to 100), and the merge runs once per sequence.
MERGE_CONSTEXPRS = {"BLOCK_ROWS": 2, "SPLIT_BLOCK": MAX_SPLITS}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv is a @jit function: microseconds a call)


@functools.lru_cache(maxsize=1024)
def split_plan(num_rows: int, vocab_size: int, device: torch.device,
               num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, split_size)`` of a launch: ``split_size`` a multiple of the tile."""
    if num_splits is None:
        if device.type == "cuda":
            from .select import _multiprocessor_count

            index = device.index if device.index is not None else torch.cuda.current_device()
            target = _PROGRAMS_PER_SM * _multiprocessor_count(index)
        else:
            target = _INTERPRETER_TARGET_PROGRAMS
        most = min(MAX_SPLITS, _cdiv(vocab_size, BLOCK))
        num_splits = max(1, min(most, _cdiv(target, max(num_rows, 1))))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    split_size = _cdiv(_cdiv(vocab_size, num_splits), BLOCK) * BLOCK
    return _cdiv(vocab_size, split_size), split_size


@dataclass
class Workspace:
    """The launch's intermediate tensors: int32 and fp32 views of one int32 buffer."""

    tickets: torch.Tensor  # [B] int32, zeroed before every launch
    row_sequence: torch.Tensor  # [R] int32
    partial_float: torch.Tensor  # [R, num_splits, 4] fp32
    partial_index: torch.Tensor  # [R, num_splits] int32
    rescored: torch.Tensor  # [R, num_splits] int32

    @staticmethod
    def shapes(num_rows: int, num_sequences: int, num_splits: int) -> dict[str, tuple]:
        return {"tickets": (num_sequences,), "row_sequence": (num_rows,),
                "partial_float": (num_rows, num_splits, 4),
                "partial_index": (num_rows, num_splits), "rescored": (num_rows, num_splits)}

    @classmethod
    def view(cls, buffer: torch.Tensor, num_rows: int, num_sequences: int,
             num_splits: int) -> "Workspace":
        parts, offset = {}, 0
        for name, shape in cls.shapes(num_rows, num_sequences, num_splits).items():
            size = 1
            for extent in shape:
                size *= extent
            part = buffer[offset:offset + size]
            parts[name] = (part.view(torch.float32) if name == "partial_float" else part).view(shape)
            offset += size
        return cls(**parts)

    @classmethod
    def size(cls, num_rows: int, num_sequences: int, num_splits: int) -> int:
        return num_sequences + num_rows * (1 + 6 * num_splits)


_LAUNCH = CachedLaunch(_select_one_launch_kernel)

# One buffer per (device, stream), grown as needed, and its workspace views per launch shape:
# a call allocates only its outputs. Calls on one stream run in order, so they can share it;
# under CUDA graph capture every call gets its own (the graph keeps it).
_BUFFERS: dict[tuple, tuple[torch.Tensor, dict]] = {}


def _workspace(num_rows: int, num_sequences: int, num_splits: int,
               device: torch.device) -> Workspace:
    size = Workspace.size(num_rows, num_sequences, num_splits)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            buffer = torch.empty(size, dtype=torch.int32, device=device)
            return Workspace.view(buffer, num_rows, num_sequences, num_splits)
        key = (device, torch.cuda.current_stream(device).cuda_stream)
    else:
        key = (device, None)
    buffer, views = _BUFFERS.get(key, (None, None))
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(max(size, 1 << 16), dtype=torch.int32, device=device)
        buffer, views = _BUFFERS[key] = (buffer, {})
    shape = (num_rows, num_sequences, num_splits)
    workspace = views.get(shape)
    if workspace is None:
        workspace = views[shape] = Workspace.view(buffer, *shape)
    return workspace


def select_tokens_one_launch(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
    *,
    sampling: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    workspace: Workspace | None = None,
    one_reduction: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-launch kernel (arguments validated by the caller): ``select_tokens`` with
    top-k and top-p off, and every row greedy unless ``sampling``. ``out``, ``num_splits``
    and ``workspace`` (shaped by :meth:`Workspace.shapes` for :func:`split_plan`'s split
    count) are for tests and benchmarks; results depend on none of them, nor on
    ``one_reduction`` (default: on, except under Triton's interpreter, where it is slow)."""
    num_rows, vocab_size = logits.shape
    num_sequences = cu_rows.shape[0] - 1
    device = logits.device
    if out is None:
        out = (torch.empty(num_rows, dtype=torch.int64, device=device),
               torch.empty(num_rows, dtype=torch.bool, device=device),
               torch.empty(num_rows, dtype=torch.float32, device=device))
    token, selected, entropy = out
    if num_rows == 0:
        return out
    num_splits, split_size = split_plan(num_rows, vocab_size, device, num_splits)
    if workspace is None:
        workspace = _workspace(num_rows, num_sequences, num_splits, device)
    else:  # shapes only: no device value is read
        for name, shape in Workspace.shapes(num_rows, num_sequences, num_splits).items():
            part = getattr(workspace, name)
            if tuple(part.shape) != shape:
                raise ValueError(f"`workspace.{name}` has shape {list(part.shape)}, the launch "
                                 f"needs {list(shape)} ({num_splits} splits)")
    workspace.tickets.zero_()
    if one_reduction is None:
        one_reduction = not _INTERPRETED
    w = workspace
    _LAUNCH(
        (num_rows, num_splits), logits, cu_rows, row_pos, temperature, seed, threshold, penalty, w.tickets,
        w.row_sequence, w.partial_float, w.partial_index, w.rescored, token, selected, entropy,
        logits.stride(0), vocab_size, num_rows, num_sequences,
        (num_sequences + 1).bit_length(), split_size, num_splits,
        BLOCK=BLOCK, STAGES=STAGES[logits.dtype], ONE_REDUCTION=one_reduction,
        SAMPLING=sampling,
        SUB_GRANULES=SUB_GRANULES,
        **MERGE_CONSTEXPRS,
        num_warps=WARPS, enable_fp_fusion=_FP_FUSION,
    )
    return out


# ----------------------------------------------------------------------------------------
# Kernel variants (compiled for sm_90 by the test suite).
# ----------------------------------------------------------------------------------------

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_POINTERS = {
    "cu_rows_ptr": "*i32", "row_pos_ptr": "*i64", "temperature_ptr": "*fp32",
    "seed_ptr": "*i64", "threshold_ptr": "*fp32", "penalty_ptr": "*fp32",
    "tickets_ptr": "*i32", "row_sequence_ptr": "*i32", "partial_float_ptr": "*fp32",
    "partial_index_ptr": "*i32", "rescored_ptr": "*i32", "token_ptr": "*i64",
    "selected_ptr": "*i1", "entropy_ptr": "*fp32",
}
_ALIGNED = ("logits_row_stride", "vocab_size", "split_size")


def kernel_variants() -> list[KernelVariant]:
    """The greedy and the temperature kernel per logits dtype, with the vocabulary size
    and row stride multiples of 16 (most models) and not (the merge tile is the same at every
    split count), and the bound's test kernel."""
    import inspect

    variants = []
    parameters = list(inspect.signature(_select_one_launch_kernel.fn).parameters)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for sampling in (False, True):
            for suffix, aligned in (("", ("split_size",)), ("_aligned16", _ALIGNED)):
                constexprs = dict(BLOCK=BLOCK, STAGES=STAGES[dtype], ONE_REDUCTION=True,
                                  SAMPLING=sampling, SUB_GRANULES=SUB_GRANULES,
                                  **MERGE_CONSTEXPRS)
                pointers = dict(_POINTERS, logits_ptr=POINTER_TYPES[dtype])
                signature = {name: "constexpr" if name in constexprs
                             else pointers.get(name, "i32") for name in parameters}
                mode = "temperature" if sampling else "greedy"
                variants.append(KernelVariant(
                    name=f"one_launch_{mode}_{_SHORT[dtype]}{suffix}",
                    kernel=_select_one_launch_kernel, signature=signature,
                    constexprs=constexprs, num_warps=WARPS, divisible_by_16=aligned,
                    enable_fp_fusion=_FP_FUSION))
    variants.append(KernelVariant(
        name="score_bound_debug", kernel=_score_bound_debug_kernel,
        signature={"word_ptr": "*i64", "bound_ptr": "*fp32", "gumbel_ptr": "*fp32",
                   "count": "i32", "BLOCK": "constexpr"},
        constexprs={"BLOCK": _DEBUG_BLOCK}))
    return variants
