"""process_logits: a request's logit rules (bans, bias, penalties, min_p), in place.

The public op (the PyTorch implementation on CPU) is compared bit for bit with
``reference.logits`` on random batches (odd vocabularies, empty sequences, padding rows,
every optional group on or off, NaN / inf / -0.0 logits, edge parameters), and each rule of
docs/contracts.md "process_logits" is pinned by small cases whose expected values are worked
out here. The helpers that build inputs are shared with test_process_logits_kernel.py.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import logits as ref
from wedlm_kernels import _backend

INF = float("inf")
NAN = float("nan")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
OPTIONAL = ("min_p", "min_tokens", "stop_ids", "bias_ids", "bias_values", "output_counts",
            "prompt_mask", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "allowed_mask", "token_bitmask")
GROUPS = {
    "min_p": ("min_p",),
    "min_tokens": ("min_tokens", "stop_ids"),
    "bias": ("bias_ids", "bias_values"),
    "penalties": ("output_counts", "prompt_mask", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"),
    "allowed": ("allowed_mask",),
    "bitmask": ("token_bitmask",),
}


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def words(vocab: int) -> int:
    return -(-vocab // 32)


def mask_words(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """``[n, ceil(V/32)]`` int32 bitmask words with exactly the listed tokens allowed."""
    out = torch.zeros(len(allowed), words(vocab), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for v in tokens:
            out[row, v // 32] |= 1 << (v % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


# ----------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "logits"):
    """Equal bit for bit (so -0.0 differs from 0.0), except that any NaN equals any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    actual, expected = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    nan_actual, nan_expected = torch.isnan(actual), torch.isnan(expected)
    same = (actual.view(INT_VIEW[actual.dtype]) == expected.view(INT_VIEW[actual.dtype]))
    same |= nan_actual & nan_expected
    if not bool(same.all()):
        where = (~same).nonzero()[:8].tolist()
        detail = [(r, v, float(actual[r, v]), float(expected[r, v])) for r, v in where]
        raise AssertionError(f"{what}: {int((~same).sum())} entries differ "
                             f"(row, token, actual, expected): {detail}")


def assert_identical_bits(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Equal bit for bit, NaN payloads included (an element nobody may touch)."""
    view = INT_VIEW[actual.dtype]
    assert torch.equal(actual.contiguous().view(view), expected.contiguous().view(view)), what


def valid_rows(cu_rows, row_pos, num_rows) -> list[bool]:
    """Which rows a sequence holds with ``row_pos >= 0`` (the contract's valid rows)."""
    valid = [False] * num_rows
    for b in range(len(cu_rows) - 1):
        for r in range(cu_rows[b], cu_rows[b + 1]):
            valid[r] = row_pos[r] >= 0
    return valid


# ----------------------------------------------------------------------------------------
# Random inputs (shared with the kernel tests)
# ----------------------------------------------------------------------------------------

VOCABS = st.one_of(st.integers(1, 40), st.sampled_from([31, 32, 33, 63, 65, 257, 300]))


def random_logits(data, g, rows, vocab, dtype):
    """``[rows, vocab]`` logits of a kind drawn by hypothesis: normal, ties (small integers
    and signed zeros), special (NaN, +-inf, -0.0 entries, or a whole row of one), or raw
    bit patterns (every float of the dtype: NaN payloads, subnormals, huge values)."""
    kind = data.draw(st.sampled_from(["normal", "ties", "special", "bits"]), label="kind")
    if kind == "bits":
        view = INT_VIEW[dtype]
        info = torch.iinfo(view)
        bits = torch.randint(info.min, info.max, (rows, vocab), generator=g, dtype=view)
        return bits.view(dtype).clone()
    if kind == "ties":
        logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()
        negative_zero = (logits == 0) & (torch.rand(rows, vocab, generator=g) < 0.5)
        return torch.where(negative_zero, -0.0, logits).to(dtype)
    scale = data.draw(st.sampled_from([0.3, 3.0, 20.0]), label="scale")
    logits = torch.randn(rows, vocab, generator=g) * scale
    if kind == "special" and rows:
        pick = torch.rand(rows, vocab, generator=g)
        logits = torch.where(pick < 0.1, -INF, logits)
        logits = torch.where((pick >= 0.1) & (pick < 0.15), -0.0, logits)
        logits = torch.where((pick >= 0.15) & (pick < 0.17), INF, logits)
        logits = torch.where((pick >= 0.17) & (pick < 0.19), NAN, logits)
        if data.draw(st.booleans(), label="special row"):
            value = data.draw(st.sampled_from([NAN, INF, -INF, -0.0]), label="row value")
            logits[int(torch.randint(0, rows, (1,), generator=g))] = value
    return logits.to(dtype)


def random_words(data, g, rows, vocab, label):
    """``[rows, ceil(V/32)]`` int32 bitmask words: every bit set, random bits, a few bits,
    or none (a whole row banned), drawn per row; bits past V are random too."""
    out = torch.empty(rows, words(vocab), dtype=torch.int32)
    for row in range(rows):
        kind = data.draw(st.sampled_from(["all", "random", "sparse", "none"]), label=label)
        bits = torch.randint(-(2**31), 2**31 - 1, (words(vocab),), generator=g,
                             dtype=torch.int32)
        if kind == "all":
            bits = torch.full_like(bits, -1)
        elif kind == "sparse":
            bits = bits & torch.randint(-(2**31), 2**31 - 1, bits.shape, generator=g,
                                        dtype=torch.int32) & torch.randint(
                -(2**31), 2**31 - 1, bits.shape, generator=g, dtype=torch.int32)
        elif kind == "none":
            bits = torch.zeros_like(bits)
        out[row] = bits
    return out


def draw_inputs(data, g, vocab, dtype, max_seqs=5, max_rows_per_sequence=2, groups=None):
    """A random batch: ``(args, options)`` with ``args`` the five positional arguments and
    ``options`` the optional ones: each group (a key of ``GROUPS``) given or ``None``
    independently, or exactly those in ``groups`` when it is given.

    Rows: up to ``max_seqs`` sequences of 0 .. ``max_rows_per_sequence`` rows (empty ones
    too), padding rows before the first and after the last (``cu_rows[0] > 0``, rows past
    ``cu_rows[B]``) and ``row_pos = -1`` rows inside."""
    # sampled (not integers(0, n), which hypothesis draws near 0 most of the time): most
    # batches hold rows to process
    num_seqs = data.draw(st.sampled_from([0, 1, 2, 2, *range(2, max_seqs + 1)]), label="B")
    seq_lens = [data.draw(st.sampled_from([0, *[n for n in range(1, max_rows_per_sequence + 1)
                                                for _ in range(2)]]), label="rows")
                for _ in range(num_seqs)]
    leading, trailing = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    num_rows = leading + sum(seq_lens) + trailing
    logits = random_logits(data, g, num_rows, vocab, dtype)
    cu_rows = [leading]
    for length in seq_lens:
        cu_rows.append(cu_rows[-1] + length)
    row_pos = [7] * num_rows  # rows outside the sequences are padding whatever row_pos says
    output_start = []
    for b, length in enumerate(seq_lens):
        context = data.draw(st.sampled_from([0, 3, 17, 2**31 + 9, 2**40 + 5]), label="ctx")
        slots = torch.randperm(length + 2, generator=g)[:length].tolist()  # any row order
        for j, slot in enumerate(slots):
            row_pos[cu_rows[b] + j] = context + slot
        if length and data.draw(st.booleans(), label="padding row"):
            row_pos[cu_rows[b] + data.draw(st.integers(0, length - 1))] = -1
        # the output index row_pos - output_start: around min_tokens, negative, or huge
        start = data.draw(st.sampled_from([0, -1, 2, 5, 2**31 - 1, -(2**31)]), label="start")
        output_start.append(start if start in (0, -1, 2**31 - 1, -(2**31))
                            else max(min(context - start, 2**31 - 1), 0))
    temperature = [data.draw(st.sampled_from([0.0, -1.0, 1.0, 0.35, 1.7, 1e-30, 1e30]),
                             label="temperature") for _ in seq_lens]
    args = (logits, i32(*cu_rows), i64(*row_pos), i32(*output_start), f32(*temperature))

    options = dict.fromkeys(OPTIONAL)
    B = num_seqs

    def wanted(group):
        if groups is not None:
            return group in groups
        return data.draw(st.booleans(), label=group)

    if wanted("min_p"):
        options["min_p"] = f32(*[data.draw(st.sampled_from(
            [0.0, 1.0, 1e-45, 1e-8, 0.05, 0.3, 0.9])) for _ in range(B)])
    if wanted("min_tokens"):
        options["min_tokens"] = i32(*[data.draw(st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]))
                                      for _ in range(B)])
        num_stops = data.draw(st.integers(0, 4), label="K")
        stops = st.one_of(st.integers(0, vocab - 1),
                          st.sampled_from([-1, -7, vocab, vocab + 5, 2**40, -(2**40)]))
        options["stop_ids"] = torch.tensor(
            [[data.draw(stops) for _ in range(num_stops)] for _ in range(B)],
            dtype=torch.int64).view(B, num_stops)
    if wanted("bias"):
        num_bias = data.draw(st.integers(0, 5), label="Kb")
        ids, values = [], []
        for _ in range(B):
            fresh = torch.randperm(vocab, generator=g).tolist()  # in-range ids never repeat
            row_ids = []
            for _ in range(num_bias):
                kind = data.draw(st.sampled_from(["in", "in", "in", "padding", "outside"]))
                if kind == "in" and fresh:
                    row_ids.append(fresh.pop())
                elif kind == "outside":
                    row_ids.append(data.draw(st.sampled_from([vocab, vocab + 3, 2**40,
                                                              -(2**40)])))
                else:
                    row_ids.append(-1)
            ids.append(row_ids)
            values.append([data.draw(st.sampled_from([
                float(torch.randn((), generator=g) * 4), -0.0, 0.0, 0.125, -1e30, 3e38,
                -3e38])) for _ in range(num_bias)])
        options["bias_ids"] = torch.tensor(ids, dtype=torch.int64).view(B, num_bias)
        options["bias_values"] = torch.tensor(values, dtype=torch.float32).view(B, num_bias)
    if wanted("penalties"):
        pick = torch.rand(B, vocab, generator=g)
        counts = torch.where(pick < 0.6, 0, torch.randint(1, 4, (B, vocab), generator=g))
        counts = torch.where(pick > 0.97, 2**31 - 1, counts)
        counts = torch.where((pick > 0.94) & (pick <= 0.97), 2**24 + 1, counts)
        options["output_counts"] = counts.to(torch.int32)
        options["prompt_mask"] = torch.rand(B, vocab, generator=g) < 0.3
        options["presence_penalty"] = f32(*[data.draw(st.sampled_from(
            [0.0, -0.0, 0.5, -2.0, 2.0, 1e-8])) for _ in range(B)])
        options["frequency_penalty"] = f32(*[data.draw(st.sampled_from(
            [0.0, 0.25, -2.0, 2.0, -0.3, 1e-3])) for _ in range(B)])
        options["repetition_penalty"] = f32(*[data.draw(st.sampled_from(
            [1.0, 0.5, 1.3, 2.0, 1e-3, 1e3])) for _ in range(B)])
    if wanted("allowed"):
        options["allowed_mask"] = random_words(data, g, B, vocab, "allowed")
    if wanted("bitmask"):
        options["token_bitmask"] = random_words(data, g, num_rows, vocab, "bitmask")
    return args, options


def call_op(args, options):
    """The public op on a copy of the logits; returns the processed copy."""
    logits = args[0].clone()
    wk.process_logits(logits, *args[1:], **options)
    return logits


# ----------------------------------------------------------------------------------------
# Random batches against the reference
# ----------------------------------------------------------------------------------------


@given(data=st.data())
def test_matches_reference_bit_for_bit_on_random_batches(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(VOCABS, label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    args, options = draw_inputs(data, g, vocab, dtype)
    before = [a.clone() for a in args] + [o.clone() for o in options.values() if o is not None]

    out = call_op(args, options)
    expected = ref.process_logits(*args, **options)
    assert_same_bits(out, expected)

    logits = args[0]
    valid = valid_rows(args[1].tolist(), args[2].tolist(), logits.shape[0])
    for r, is_valid in enumerate(valid):
        if not is_valid:
            assert_identical_bits(out[r], logits[r], f"row {r} is not valid but changed")
    after = list(args) + [o for o in options.values() if o is not None]
    for a, b in zip(after, before):  # no argument but the logits is modified
        assert torch.equal(a, b) if not a.is_floating_point() else torch.equal(
            a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@given(data=st.data(), groups=st.sampled_from([(group,) for group in GROUPS] + [tuple(GROUPS)]))
def test_each_group_alone_and_all_together_match_reference(data, groups):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(VOCABS, label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    args, options = draw_inputs(data, g, vocab, dtype, groups=groups)
    assert all((options[name] is not None) == any(name in GROUPS[group] for group in groups)
               for name in OPTIONAL)
    assert_same_bits(call_op(args, options), ref.process_logits(*args, **options))


# ----------------------------------------------------------------------------------------
# Each rule by hand
# ----------------------------------------------------------------------------------------


def one_sequence(rows, row_pos, output_start=0, temperature=1.0, dtype=torch.float32):
    """Positional arguments for one sequence holding every row."""
    logits = torch.tensor(rows, dtype=torch.float32).to(dtype)
    return (logits, i32(0, logits.shape[0]), i64(*row_pos), i32(output_start),
            f32(temperature))


def processed(args, **options):
    """The public op's result on a copy, checked against the reference bit for bit."""
    out = call_op(args, options)
    assert_same_bits(out, ref.process_logits(*args, **options), "reference")
    return out


def expect(out, rows, dtype=torch.float32):
    assert_same_bits(out, torch.tensor(rows, dtype=torch.float32).to(dtype), "by hand")


def test_allowed_mask_bans_every_token_whose_bit_is_clear():
    vocab = 40  # two words; bit 31 of a word is its sign bit
    row = [float(v) for v in range(vocab)]
    # sequence 0 allows 0, 5, 31 (word 0: 1 + 32 + 2**31) and 32, 39 (word 1: 1 + 128);
    # sequence 1 allows everything; sequence 2 nothing (its row is all -inf)
    allowed = i32(1 + 32 - 2**31, 129, -1, -1, 0, 0).view(3, 2)
    args = (torch.tensor([row, row, row, row]), i32(0, 1, 3, 4), i64(5, 6, -1, 2),
            i32(0, 0, 0), f32(1.0, 1.0, 1.0))
    out = processed(args, allowed_mask=allowed)
    kept = [v if v in (0, 5, 31, 32, 39) else -INF for v in range(vocab)]
    expect(out, [kept, row, row, [-INF] * vocab])  # row 2 is padding: untouched


def test_token_bitmask_is_each_rows_own_and_combines_with_the_allowed_mask():
    vocab = 33
    row = [float(v) + 0.5 for v in range(vocab)]
    bitmask = i32(0b1011, 0, -1, 1, 2**30, 1).view(3, 2)  # per row: {0,1,3}, all, {30, 32}
    allowed = i32(-1 - 2, 0)  # every token of word 0 but 1; none of word 1 (token 32)
    args = one_sequence([row] * 3, [4, 5, 6])
    out = processed(args, token_bitmask=bitmask)
    keep = [[0, 1, 3], list(range(vocab)), [30, 32]]
    expect(out, [[row[v] if v in keep[r] else -INF for v in range(vocab)] for r in range(3)])
    out = processed(args, token_bitmask=bitmask, allowed_mask=allowed.view(1, 2))
    both = [[0, 3], [v for v in range(32) if v != 1], [30]]
    expect(out, [[row[v] if v in both[r] else -INF for v in range(vocab)] for r in range(3)])


def test_min_tokens_bans_stop_ids_while_the_output_index_is_below_it():
    vocab = 8
    row = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    # sequence 0: output_start 10, min_tokens 2: positions 9, 10, 11 (output index -1, 0, 1)
    # ban the stop ids 3 and 7; 12 and 13 (index 2, 3) do not. -1 pads, 8 and 2**40 match
    # nothing. Sequence 1: min_tokens 0 bans nothing. Sequence 2: its row is padding.
    stop_ids = i64(3, -1, 7, vocab, 2**40, 3, 0, 1, 2, 2, 5, 5, 5, 5, 5).view(3, 5)
    args = (torch.tensor([row] * 7), i32(0, 5, 6, 7), i64(12, 9, 13, 10, 11, 0, -1),
            i32(10, 0, 0), f32(0.0, 0.0, 0.0))
    out = processed(args, min_tokens=i32(2, 0, 9), stop_ids=stop_ids)
    banned = [v if v not in (3, 7) else -INF for v in row[:3]] + [4.0, 5.0, 6.0] + [-INF, 8.0]
    banned = [-INF if v in (4, 8) else float(v) for v in range(1, 9)]
    expect(out, [row, banned, row, banned, banned, row, row])


def test_min_tokens_reaches_past_int32_output_indices():
    # output index 2**40 - 5 - (2**31 - 1) is above any int32 min_tokens; index -2**31 + 3
    # (a position below output_start) is below every min_tokens
    args = (torch.zeros(2, 4), i32(0, 1, 2), i64(2**40 - 5, 3), i32(2**31 - 1, 2**31 - 1),
            f32(1.0, 1.0))
    out = processed(args, min_tokens=i32(2**31 - 1, 0), stop_ids=i64(1, 1).view(2, 1))
    expect(out, [[0.0] * 4, [0.0, -INF, 0.0, 0.0]])


def test_bias_adds_its_value_to_its_token_only():
    # ids -1 (padding), 6 (= V) and -2**40 match nothing; -0.0 + -0.0 stays -0.0, -0.0 + 0.0
    # is 0.0; -inf + 2 stays -inf; 3e38 + 3e38 overflows to inf
    row = [-0.0, 1.0, 2.0, -0.0, -INF, 3e38]
    ids = i64(0, 2, -1, 3, 4, 5, 6, -(2**40)).view(1, 8)
    values = f32(-0.0, 1.5, 100.0, 0.0, 2.0, 3e38, 7.0, 9.0).view(1, 8)
    out = processed(one_sequence([row], [3]), bias_ids=ids, bias_values=values)
    expect(out, [[-0.0, 1.0, 3.5, 0.0, -INF, INF]])


def test_bias_is_added_after_the_bans_and_before_the_rounding_to_the_dtype():
    third = float(np.float32(1 / 3))
    ids, values = i64(0, 1).view(1, 2), f32(third, 1e4).view(1, 2)
    args = one_sequence([[1.0, 6e4, 0.0]], [0])
    expect(processed(args, bias_ids=ids, bias_values=values),
           [[float(np.float32(1 + np.float32(third))), 7e4, 0.0]])
    # bf16 keeps 8 significant bits: 4/3 -> 171/128; fp16 11 bits: 4/3 -> 1365/1024, and
    # 70000 is past fp16's largest value (65504): inf
    for dtype, expected in ((torch.bfloat16, [171 / 128, 70144.0, 0.0]),
                            (torch.float16, [1365 / 1024, INF, 0.0])):
        args = one_sequence([[1.0, 6e4, 0.0]], [0], dtype=dtype)
        expect(processed(args, bias_ids=ids, bias_values=values), [expected], dtype)
    # a banned token stays -inf whatever its bias
    expect(processed(args, bias_ids=ids, bias_values=values, allowed_mask=i32(6).view(1, 1)),
           [[-INF, INF, 0.0]], torch.float16)


def penalties(counts, prompt, presence, frequency, repetition):
    return dict(output_counts=torch.tensor(counts, dtype=torch.int32),
                prompt_mask=torch.tensor(prompt), presence_penalty=f32(*presence),
                frequency_penalty=f32(*frequency), repetition_penalty=f32(*repetition))


def test_penalties_by_hand():
    # sequence 0 (rep 2, frequency 1/4, presence 1/2), rows of positions 7 and 8:
    #   token 0 unseen: 1 - 1/4 * 0 = 1; token 1 (count 2): 3 / 2 - 1/2 - 1/2 = 1/2;
    #   token 2 (prompt): 4 / 2 = 2; token 3 (count 1): -1 * 2 - 1/4 - 1/2 = -2.75;
    #   token 4 (prompt): -2 * 2 = -4; token 5 (count 3, -0.0 is not > 0): -0.0 * 2 - 3/4 - 1/2
    #   = -1.25; token 6 (count 5): -inf stays -inf
    # sequence 1 (rep 1/2 < 1, frequency -2, presence 2, no counts): prompt tokens 0, 1, 5:
    #   3 / (1/2) = 6; -3 * (1/2) = -1.5; inf / (1/2) = inf; token 2: -0.0 - (-2 * 0) =
    #   -0.0 - -0.0 = 0.0 (the frequency term applies to every token); 0.0 stays 0.0; NaN
    #   stays NaN; -inf stays -inf
    rows = [[1.0, 3.0, 4.0, -1.0, -2.0, -0.0, -INF],
            [1.0, 3.0, 4.0, -1.0, -2.0, -0.0, -INF],
            [3.0, -3.0, -0.0, 0.0, NAN, INF, -INF]]
    args = (torch.tensor(rows), i32(0, 2, 3), i64(7, 8, 2), i32(0, 0), f32(1.0, 1.0))
    options = penalties([[0, 2, 0, 1, 0, 3, 5], [0] * 7],
                        [[False, False, True, False, True, False, False],
                         [True, True, False, False, False, True, False]],
                        (0.5, 2.0), (0.25, -2.0), (2.0, 0.5))
    out = processed(args, **options)
    seq0 = [1.0, 0.5, 2.0, -2.75, -4.0, -1.25, -INF]
    expect(out, [seq0, seq0, [6.0, -1.5, 0.0, 0.0, NAN, INF, -INF]])


def test_frequency_penalty_rounds_the_count_and_the_product_before_the_difference():
    # count 2**24 + 1 is 2**24 in float32: 3 - 2**24 = -16777213 (not -16777214);
    # float32(0.2) * 5 rounds to exactly 1: 1 - 1 = 0 (a fused multiply-add gives -1.5e-8);
    # presence -0.0 leaves -0.0 - -0.0 ... on a seen token x - (-0.0) = x
    args = one_sequence([[3.0, 1.0, 1.0]], [0])
    options = penalties([[2**24 + 1, 0, 5]], [[False, False, False]], (-0.0,), (1.0,),
                        (1.0,))
    expect(processed(args, **options), [[-16777213.0, 1.0, -4.0]])
    options = penalties([[1, 0, 5]], [[False, False, False]], (0.0,), (0.2,), (1.0,))
    expect(processed(args, **options), [[float(np.float32(3.0) - np.float32(0.2)), 1.0, 0.0]])


def test_large_counts_and_a_tiny_repetition_penalty():
    args = one_sequence([[1.0, -1.0, 5.0]], [0])
    options = penalties([[2**31 - 1, 2**31 - 1, 0]], [[False, False, True]], (1.0,), (2.0,),
                        (1e-3,))
    # 1 / 1e-3 = 1000 (float32), minus 2 * 2**31, minus 1; -1 * 1e-3 likewise
    thousand = float(np.float32(1.0) / np.float32(1e-3))
    milli = float(np.float32(-1.0) * np.float32(1e-3))
    twice = float(np.float32(2.0) * np.float32(2**31 - 1))
    expect(processed(args, **options), [[
        float(np.float32(np.float32(thousand) - np.float32(twice)) - np.float32(1.0)),
        float(np.float32(np.float32(milli) - np.float32(twice)) - np.float32(1.0)),
        float(np.float32(5.0) / np.float32(1e-3))]])


def min_p_cut(maximum, temperature, min_p):
    """The contract's cut, computed here: m + T * float32(log(float64(min_p)))."""
    log_min_p = np.float32(math.log(float(np.float32(min_p))))
    return float(np.float32(np.float32(maximum)
                            + np.float32(np.float32(temperature) * log_min_p)))


def test_min_p_cuts_below_the_maximum_plus_temperature_times_log_min_p():
    row = [0.0, -1.0, -2.0, -3.0, -200.0]
    # log(1/4) = -1.386: T = 1 keeps 0 and -1, T = 2 (cut -2.77) keeps -2 as well; a tiny
    # min_p (1e-45, log -103.3) only cuts -200; min_p 1 keeps the maximum and its ties
    rows = [row, row, row, [2.0, 2.0, 1.0, -INF, 0.0], row, row, row]
    args = (torch.tensor(rows), i32(0, 1, 2, 3, 4, 5, 6, 7), i64(0, 1, 2, 3, 4, 5, 6),
            i32(*[0] * 7), f32(1.0, 2.0, 1.0, 0.5, 0.0, -1.0, 1.0))
    out = processed(args, min_p=f32(0.25, 0.25, 1e-45, 1.0, 0.5, 0.5, 0.0))
    expect(out, [[0.0, -1.0, -INF, -INF, -INF], [0.0, -1.0, -2.0, -INF, -INF],
                 [0.0, -1.0, -2.0, -3.0, -INF], [2.0, 2.0, -INF, -INF, -INF],
                 row, row, row])  # temperature 0 or -1, or min_p 0: no cut


def test_min_p_keeps_a_value_equal_to_the_cut_and_cuts_the_next_one_below():
    for maximum, temperature, min_p in ((0.0, 1.0, 0.3), (1.0, 0.7, 0.05), (-5.0, 1.7, 0.9)):
        cut = min_p_cut(maximum, temperature, min_p)
        below = float(np.nextafter(np.float32(cut), np.float32(-INF)))
        assert below < cut < maximum
        args = one_sequence([[cut, maximum, below]], [0], temperature=temperature)
        expect(processed(args, min_p=f32(min_p)), [[cut, maximum, -INF]])


def test_min_p_skips_rows_with_nan_or_without_a_finite_maximum():
    rows = [[NAN, 0.0, -50.0], [INF, 0.0, -50.0], [-INF, -INF, -INF], [0.0, -50.0, -INF]]
    args = one_sequence(rows, [0, 1, 2, 3])
    expect(processed(args, min_p=f32(0.5)), rows[:3] + [[0.0, -INF, -INF]])


def test_min_p_reads_the_values_stored_in_the_dtype_after_the_other_rules():
    # fp16: 1 + 2e-4 rounds back to 1 (the spacing is 2**-10), so min_p 1 keeps both 1s
    # (on the unrounded values token 1 would be cut); banned tokens do not count for the
    # maximum: token 2 (100) is banned, so the maximum is 1
    args = one_sequence([[1.0, 1.0, 100.0, 0.5]], [0], dtype=torch.float16)
    options = dict(min_p=f32(1.0), bias_ids=i64(0).view(1, 1), bias_values=f32(2e-4).view(1, 1),
                   allowed_mask=i32(0b1011).view(1, 1))
    expect(processed(args, **options), [[1.0, 1.0, -INF, -INF]], torch.float16)
    # fp32 keeps 1.0002: token 1 is cut
    args = one_sequence([[1.0, 1.0, 100.0, 0.5]], [0])
    expect(processed(args, **options),
           [[float(np.float32(1.0) + np.float32(2e-4)), -INF, -INF, -INF]])


def test_every_rule_in_order_on_one_row():
    # bans (allowed: tokens 0-4; stop id 4 at output index 0 < min_tokens 1), then the bias
    # (+1 on token 0, +5 on token 3), then penalties (token 0 count 1, token 3 in the
    # prompt; rep 2, frequency 1, presence 1/2), then min_p 1/2 at T 1 (cut 3.5 - 0.693)
    row = [2.0, 1.0, 0.5, 2.0, 9.0, 9.0]
    options = dict(allowed_mask=i32(0b11111).view(1, 1), min_tokens=i32(1),
                   stop_ids=i64(4).view(1, 1), bias_ids=i64(0, 3).view(1, 2),
                   bias_values=f32(1.0, 5.0).view(1, 2), min_p=f32(0.5),
                   **penalties([[1, 0, 0, 0, 0, 0]], [[False, False, False, True, False, False]],
                               (0.5,), (1.0,), (2.0,)))
    out = processed(one_sequence([row], [20], output_start=20), **options)
    # token 0: (2 + 1) / 2 - 1 - 1/2 = 0; token 3: (2 + 5) / 2 = 3.5; max 3.5, cut 2.807
    expect(out, [[-INF, -INF, -INF, 3.5, -INF, -INF]])


# ----------------------------------------------------------------------------------------
# Rows, layouts, shapes
# ----------------------------------------------------------------------------------------


def every_group(num_seqs, num_rows, vocab, allowed_word=0):
    """Every optional group, on values that change every token of a valid row."""
    return dict(
        min_p=f32(*[0.5] * num_seqs), min_tokens=i32(*[5] * num_seqs),
        stop_ids=i64(*[0] * num_seqs).view(num_seqs, 1),
        bias_ids=i64(*[1] * num_seqs).view(num_seqs, 1),
        bias_values=f32(*[1.0] * num_seqs).view(num_seqs, 1),
        output_counts=torch.ones(num_seqs, vocab, dtype=torch.int32),
        prompt_mask=torch.ones(num_seqs, vocab, dtype=torch.bool),
        presence_penalty=f32(*[0.5] * num_seqs), frequency_penalty=f32(*[0.25] * num_seqs),
        repetition_penalty=f32(*[2.0] * num_seqs),
        allowed_mask=torch.full((num_seqs, words(vocab)), allowed_word, dtype=torch.int32),
        token_bitmask=torch.full((num_rows, words(vocab)), -1, dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_are_not_valid_keep_their_bits(dtype):
    """Row 0 is before cu_rows[0], row 3 has row_pos -1, rows 5 and 6 are past cu_rows[B]
    (sequence 1 is empty); their bits (NaN payloads included) stay as they were, while every
    entry of a valid row becomes -inf (nothing is allowed)."""
    vocab = 37
    view = INT_VIEW[dtype]
    info = torch.iinfo(view)
    logits = torch.randint(info.min, info.max, (7, vocab), dtype=view).view(dtype)
    logits[:, :3] = torch.tensor([NAN, -0.0, INF]).to(dtype)
    # the smallest subnormal, a NaN of all ones and a signalling NaN of payload 1
    signalling = {torch.float32: 0x7F800001, torch.float16: 0x7C01, torch.bfloat16: 0x7F81}
    logits[0, 3:6] = torch.tensor([1, -1, signalling[dtype]], dtype=torch.int32).to(view).view(
        dtype)
    args = (logits, i32(1, 5, 5), i64(3, 4, 5, -1, 6, 7, 8), i32(0, 0), f32(1.0, 1.0))
    out = processed(args, **every_group(2, 7, vocab))
    for r in (0, 3, 5, 6):
        assert_identical_bits(out[r], logits[r], f"row {r}")
    assert torch.equal(out[[1, 2, 4]], torch.full((3, vocab), -INF, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_strided_logits_are_processed_in_place_and_the_other_columns_kept(dtype):
    g = torch.Generator().manual_seed(5)
    rows, vocab = 5, 45
    storage = (torch.randn(rows, vocab + 7, generator=g) * 3).to(dtype)
    storage[0, 0], storage[4, -1] = NAN, -0.0
    before = storage.clone()
    view = storage[:, 3:3 + vocab]
    assert view.stride(0) == vocab + 7 and not view.is_contiguous()
    args = (view, i32(0, 2, 4), i64(3, 4, -1, 9, 10), i32(0, 0), f32(1.0, 0.5))
    options = every_group(2, rows, vocab, allowed_word=-1)
    options["min_tokens"] = i32(4, 0)
    expected = ref.process_logits(view.contiguous(), *args[1:], **options)
    wk.process_logits(*args, **options)
    assert_same_bits(view, expected)
    assert_identical_bits(storage[:, :3], before[:, :3], "columns before the view")
    assert_identical_bits(storage[:, 3 + vocab:], before[:, 3 + vocab:], "columns after it")
    assert_identical_bits(storage[4], before[4], "row 4 is past cu_rows[B]")


@pytest.mark.parametrize("shape,cu_rows", [((0, 9), [0]), ((0, 9), [0, 0, 0]),
                                           ((3, 9), [0]), ((3, 0), [0, 2, 3])])
def test_no_rows_no_sequences_or_no_vocabulary_change_nothing(shape, cu_rows):
    num_seqs, (num_rows, vocab) = len(cu_rows) - 1, shape
    logits = torch.randn(shape)
    args = (logits, i32(*cu_rows), i64(*range(num_rows)), i32(*[0] * num_seqs),
            f32(*[1.0] * num_seqs))
    out = call_op(args, every_group(num_seqs, num_rows, vocab))
    assert_identical_bits(out, logits, "logits")


def test_no_optional_group_changes_nothing():
    logits = torch.randn(4, 50)
    logits[1, 3] = -0.0
    out = call_op((logits, i32(0, 4), i64(0, 1, 2, 3), i32(0), f32(1.0)), {})
    assert_identical_bits(out, logits, "logits")


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------

POSITIONAL = ("logits", "cu_rows", "row_pos", "output_start", "temperature")
VOCAB = 40  # two bitmask words


def valid_call():
    """``(args, options)`` of a valid call on 3 rows of 2 sequences, every group given."""
    args = (torch.randn(3, VOCAB), i32(0, 1, 3), i64(4, 5, 6), i32(0, 2), f32(1.0, 0.5))
    options = every_group(2, 3, VOCAB, allowed_word=-1)
    options["stop_ids"] = i64(1, 2, 3, 4).view(2, 2)
    options["bias_ids"] = i64(1, 2, 3, -1, 5, 6).view(2, 3)
    options["bias_values"] = f32(1, 2, 3, 4, 5, 6).view(2, 3)
    return args, options


def call_with(name, value):
    args, options = valid_call()
    if name in POSITIONAL:
        args = tuple(value if n == name else a for n, a in zip(POSITIONAL, args))
    else:
        options[name] = value
    wk.process_logits(*args, **options)


def argument(name):
    args, options = valid_call()
    return dict(zip(POSITIONAL, args), **options)[name]


WRONG_DTYPES = {
    "logits": torch.float64, "cu_rows": torch.int64, "row_pos": torch.int32,
    "output_start": torch.int64, "temperature": torch.float64, "min_p": torch.float16,
    "min_tokens": torch.int64, "stop_ids": torch.int32, "bias_ids": torch.int32,
    "bias_values": torch.float64, "output_counts": torch.int64, "prompt_mask": torch.uint8,
    "presence_penalty": torch.bfloat16, "frequency_penalty": torch.float64,
    "repetition_penalty": torch.int32, "allowed_mask": torch.int64,
    "token_bitmask": torch.uint8,
}


@pytest.mark.parametrize("name", POSITIONAL + OPTIONAL)
def test_wrong_dtype_is_a_type_error_naming_the_argument(name):
    with pytest.raises(TypeError, match=f"`{name}` must have dtype"):
        call_with(name, argument(name).to(WRONG_DTYPES[name]))


@pytest.mark.parametrize("name", POSITIONAL + OPTIONAL)
def test_non_tensor_argument_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=f"`{name}` must be a torch.Tensor"):
        call_with(name, argument(name).tolist())


@pytest.mark.parametrize("name", POSITIONAL + OPTIONAL)
def test_one_more_entry_in_the_first_dimension_is_a_value_error_naming_it(name):
    value = argument(name)
    with pytest.raises(ValueError, match=f"`{name}`"):
        call_with(name, torch.cat([value, value[:1]]))


@pytest.mark.parametrize("name", POSITIONAL + OPTIONAL)
def test_wrong_rank_is_a_value_error_naming_the_argument(name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        call_with(name, argument(name).unsqueeze(0))


@pytest.mark.parametrize("name,columns", [
    ("allowed_mask", 1), ("allowed_mask", 3), ("token_bitmask", 1), ("token_bitmask", 3),
    ("output_counts", VOCAB - 1), ("prompt_mask", VOCAB + 1), ("bias_values", 2),
    ("bias_ids", 4),
])
def test_a_wrong_second_dimension_is_a_value_error_naming_the_argument(name, columns):
    value = argument(name)
    wrong = torch.zeros(value.shape[0], columns, dtype=value.dtype)
    with pytest.raises(ValueError, match=f"`{name}`"):
        call_with(name, wrong)


def test_bitmask_words_follow_the_vocabulary():
    for vocab, count in ((1, 1), (31, 1), (32, 1), (33, 2), (64, 2), (65, 3)):
        args = (torch.zeros(1, vocab), i32(0, 1), i64(0), i32(0), f32(1.0))
        wk.process_logits(*args, allowed_mask=torch.full((1, count), -1, dtype=torch.int32))
        with pytest.raises(ValueError, match="`allowed_mask`"):
            wk.process_logits(*args, allowed_mask=torch.full((1, count + 1), -1,
                                                             dtype=torch.int32))


@pytest.mark.parametrize("group,missing", [
    (group, name) for group, names in GROUPS.items() if len(names) > 1 for name in names])
def test_a_group_given_in_part_is_a_value_error_naming_the_missing_argument(group, missing):
    args, options = valid_call()
    options = {name: options[name] if name in GROUPS[group] else None for name in OPTIONAL}
    options[missing] = None
    with pytest.raises(ValueError, match=f"`{missing}` must be given with"):
        wk.process_logits(*args, **options)


@pytest.mark.parametrize("name", POSITIONAL[1:] + OPTIONAL)
def test_a_tensor_on_another_device_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match=f"`{name}` is on meta"):
        call_with(name, argument(name).to("meta"))


def test_logits_without_unit_last_stride_are_rejected():
    with pytest.raises(ValueError, match="`logits` must have stride 1"):
        call_with("logits", torch.randn(3, 2 * VOCAB)[:, ::2])


def test_empty_cu_rows_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="`cu_rows`"):
        call_with("cu_rows", torch.empty(0, dtype=torch.int32))


@pytest.mark.parametrize("name,value,message", [
    ("cu_rows", i32(0, 3, 2), "non-decreasing"), ("cu_rows", i32(-1, 1, 3), "cu_rows\\[0\\]"),
    ("cu_rows", i32(0, 1, 4), "cu_rows\\[-1\\]"), ("min_p", f32(0.5, 1.5), "min_p"),
    ("min_p", f32(-0.1, 0.5), "min_p"), ("repetition_penalty", f32(1.0, 0.0), "repetition"),
])
def test_debug_mode_checks_values(monkeypatch, name, value, message):
    monkeypatch.setattr(_backend, "DEBUG", True)
    with pytest.raises(ValueError, match=message):
        call_with(name, value)
    args, options = valid_call()
    wk.process_logits(*args, **options)  # valid values pass


@pytest.mark.cuda
def test_tensors_on_different_devices_are_rejected_on_gpu():
    args, options = valid_call()
    with pytest.raises(ValueError, match="device|cuda"):
        wk.process_logits(args[0].cuda(), *args[1:], **options)
