"""select_tokens: entropy, distance penalty, threshold selection and sampling.

The public op (the PyTorch implementation on CPU) is compared with ``reference.select`` on
random batches, and the rules of docs/contracts.md "select_tokens" are pinned by small
hand-computed cases and a statistical test of the sampler.
"""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import wedlm_kernels as wk
from reference import select as ref
from tests.numerics import (
    ENTROPY_TOLERANCE,
    TOP_P_MARGIN,
    assert_same_token,
    assert_selection,
)
from tests.select_inputs import (
    batch,
    choose_thresholds,
    dyadic_top_p_cases,
    exact_threshold_batch,
    greedy_tile_tie_batch,
    i32,
    one_sequence,
    random_logits,
    sampled_tie_batch,
    top_p_sampling_batch,
)
from wedlm_kernels import _backend
from wedlm_kernels.ops.philox import philox_gumbel

INF = float("inf")
NAN = float("nan")


def many_positions(row, count, temperature, top_k=0, top_p=1.0, seed=7):
    """One logits row repeated over ``count`` positions of one sequence."""
    logits = torch.tensor([row] * count, dtype=torch.float32)
    return batch(logits, [0, count], list(range(100, 100 + count)), [temperature], [top_k],
                 [top_p], [INF], [0.0], [seed])


def sampled_set(row, temperature, top_k=0, top_p=1.0, count=2000):
    token, _, _ = wk.select_tokens(*many_positions(row, count, temperature, top_k, top_p))
    return set(token.tolist())


def chi2_bound(df: int, false_failure: float) -> float:
    """x with P(chi2_df > x) <= false_failure. Exact for even df (closed-form survival
    function); odd df use df + 1, which is stochastically larger, so the bound is safe."""
    df += df % 2

    def survival(x):
        return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))

    low, high = 0.0, 1000.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if survival(mid) > false_failure else (low, mid)
    return high


# ----------------------------------------------------------------------------------------
# Random batches against the reference
# ----------------------------------------------------------------------------------------


@given(data=st.data())
def test_matches_reference_on_random_batches(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    num_seqs = data.draw(st.integers(0, 4), label="B")
    seq_lens = [data.draw(st.integers(0, 4)) for _ in range(num_seqs)]
    leading, trailing = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    num_rows = leading + sum(seq_lens) + trailing
    vocab = data.draw(st.one_of(st.integers(1, 40), st.sampled_from([7, 257, 1000, 3000])),
                      label="V")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))

    logits = random_logits(data, g, num_rows, vocab).to(dtype)
    cu_rows = [leading]
    for length in seq_lens:
        cu_rows.append(cu_rows[-1] + length)
    row_pos = [5] * num_rows  # rows outside the sequences are padding whatever row_pos says
    for b, length in enumerate(seq_lens):
        context = data.draw(st.sampled_from([0, 17, 2**32 - 2, 2**40 + 5]))
        slots = torch.randperm(length + 2, generator=g)[:length].tolist()  # any row order
        for j, slot in enumerate(slots):
            row_pos[cu_rows[b] + j] = context + slot
        if length and data.draw(st.booleans(), label="padding row"):
            row_pos[cu_rows[b] + data.draw(st.integers(0, length - 1))] = -1

    temperature = [data.draw(st.sampled_from([0.0, -1.0, 1.0, 0.35, 1.7])) for _ in seq_lens]
    top_k = [data.draw(st.sampled_from([0, -1, 1, 2, 5, vocab, vocab + 3,
                                        max(1, vocab // 3)])) for _ in seq_lens]
    top_p = [data.draw(st.sampled_from([1.0, 1.5, 0.0, 1e-3, 0.3, 0.9])) for _ in seq_lens]
    penalty = [data.draw(st.sampled_from([0.0, 0.02, 0.37])) for _ in seq_lens]
    seed = [data.draw(st.integers(-(2**63), 2**63 - 1)) for _ in seq_lens]
    threshold = choose_thresholds(data, logits, cu_rows, row_pos, penalty)

    args = batch(logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed)
    token, selected, entropy = wk.select_tokens(*args)
    ref_token, ref_selected, ref_entropy = ref.select_tokens(*args)

    assert token.dtype == torch.int64 and selected.dtype == torch.bool
    assert entropy.dtype == torch.float32
    assert token.shape == selected.shape == entropy.shape == (num_rows,)
    torch.testing.assert_close(entropy.double(), ref_entropy, **ENTROPY_TOLERANCE, equal_nan=True)

    for b in range(num_seqs):
        for r in range(cu_rows[b], cu_rows[b + 1]):
            assert_same_token(int(token[r]), int(ref_token[r]), logits[r], temperature[b],
                               top_k[b], top_p[b], seed[b], row_pos[r])

    assert_selection(selected, ref_entropy, ref_selected, cu_rows, row_pos, threshold, penalty)

    padding = [r for r in range(num_rows) if not any(
        cu_rows[b] <= r < cu_rows[b + 1] for b in range(num_seqs)) or row_pos[r] < 0]
    for r in padding:
        assert token[r] == 0 and not selected[r] and entropy[r] == 0, r


@pytest.mark.parametrize("case_seed", range(40))
def test_the_host_and_device_token_paths_give_the_same_tokens(case_seed):
    """On CPU tensors select_tokens samples only the rows that sample, and sorts only where
    one of them filters; the device path samples every row, with no host read. Same rows,
    same tokens: all-greedy batches, rows without filters, NaN and infinite temperatures,
    NaN top-p, -inf entries and ties included."""
    from wedlm_kernels.ops.select import _tokens_on_the_device, _tokens_on_the_host

    g = torch.Generator().manual_seed(case_seed)
    rows = int(torch.randint(0, 7, (), generator=g))
    vocab = [1, 7, 300, 2048][case_seed % 4]

    def pick(options):
        return torch.tensor([options[i] for i in torch.randint(0, len(options), (rows,),
                                                               generator=g).tolist()])

    greedy_only = case_seed % 5 == 0
    x = torch.randn(rows, vocab, generator=g).mul(3).round()  # rounded: ties
    x[torch.rand(rows, vocab, generator=g) < 0.1] = -INF
    temperature = pick([0.0, -1.0] if greedy_only else [0.0, -1.0, 0.5, 1.0, 2.5, INF, NAN])
    unfiltered = case_seed % 3 == 0
    top_k = pick([0] if unfiltered else [0, -1, 1, 3, vocab, vocab + 2]).long()
    top_p = pick([1.0, 1.5] if unfiltered else [1.0, 1.5, 0.5, 0.0, NAN]).float()
    seed = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    position = torch.randint(0, 2**40, (rows,), generator=g)
    greedy = torch.argmax(x, dim=-1) if vocab else torch.zeros(rows, dtype=torch.long)
    args = (x, greedy, temperature.float(), top_k, top_p, seed, position)
    assert torch.equal(_tokens_on_the_host(*args), _tokens_on_the_device(*args))


# the smallest vocabulary; top-k 1 on ties (several entries at the maximum); a top-k on a
# tie group with top-p about to cut it; top-p so small only the maximum's tie group stays
@given(
    case_seed=st.integers(0, 2**63 - 1),
    vocab=st.integers(2, 300),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01]),
    temperature=st.sampled_from([0.3, 1.0, 4.0]),
    ties=st.booleans(),
)
@example(case_seed=0, vocab=2, top_k=1, top_p=1.0, temperature=1.0, ties=False)
@example(case_seed=1, vocab=300, top_k=1, top_p=1.0, temperature=4.0, ties=True)
@example(case_seed=2, vocab=17, top_k=12, top_p=0.6, temperature=0.3, ties=True)
@example(case_seed=3, vocab=64, top_k=0, top_p=0.01, temperature=4.0, ties=True)
def test_sampled_tokens_stay_inside_the_kept_set(case_seed, vocab, top_k, top_p,
                                                 temperature, ties):
    """64 positions of one row: every token is kept by top-k (checked from its definition)
    and top-p, and equals the reference token."""
    g = torch.Generator().manual_seed(case_seed)
    row = (torch.randint(-4, 4, (vocab,), generator=g).float() if ties
           else torch.randn(vocab, generator=g) * 3)
    args = many_positions(row.tolist(), 64, temperature, top_k, top_p, seed=case_seed)
    token, _, _ = wk.select_tokens(*args)
    if 0 < top_k < vocab:
        kth_largest = sorted(row.tolist(), reverse=True)[top_k - 1]
        assert all(row[t] >= kth_largest for t in token.tolist())
    kept = ref.kept_tokens(row, top_k, min(top_p + TOP_P_MARGIN, 1.0))
    assert all(kept[t] for t in token.tolist())
    for r, position in enumerate(args[2].tolist()):
        expected = ref.sample_row(row, temperature, top_k, top_p, case_seed, position)
        assert_same_token(int(token[r]), expected, row, temperature, top_k, top_p,
                           case_seed, position)


# ----------------------------------------------------------------------------------------
# Entropy
# ----------------------------------------------------------------------------------------


def test_entropy_of_hand_computed_rows():
    logits = [
        [0.0, 0.0, 0.0, 0.0],                  # uniform over 4: log 4
        [0.0, -INF, 0.0, -INF],                # -inf entries contribute 0: log 2
        [math.log(3.0), 0.0, -INF, -INF],      # p = (3/4, 1/4): -(3/4 log 3/4 + 1/4 log 1/4)
        [5.0, 5.0, 5.0, 5.0],                  # shift invariance: log 4
        [0.0, -200.0, -INF, -INF],             # essentially one-hot: ~0
    ]
    _, _, entropy = wk.select_tokens(*one_sequence(logits, [0, 1, 2, 3, 4]))
    expected = [math.log(4), math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)),
                math.log(4), 0.0]
    torch.testing.assert_close(entropy.double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_rows_with_nan_or_plus_inf_or_only_minus_inf_have_nan_entropy():
    logits = [
        [0.0, NAN, 1.0],
        [0.0, INF, 1.0],
        [-INF, -INF, -INF],
        [NAN, NAN, NAN],
        [-INF, 2.0, -INF],   # a single finite entry is a point mass: 0
    ]
    token, selected, entropy = wk.select_tokens(*one_sequence(logits, [0, 1, 2, 3, 4]))
    assert torch.isnan(entropy[:4]).all()
    assert entropy[4] == 0.0
    assert selected.tolist() == [False, False, False, False, True]


def test_entropy_is_the_same_for_fp16_bf16_and_fp32_copies_of_exact_values():
    logits = torch.randint(-8, 8, (3, 300)).float()  # exact in every dtype
    args = one_sequence(logits.tolist(), [0, 1, 2], temperature=1.0, seed=4)
    expected = wk.select_tokens(*args)
    for dtype in (torch.float16, torch.bfloat16):
        actual = wk.select_tokens(logits.to(dtype), *args[1:])
        for a, e in zip(actual, expected):
            assert torch.equal(a, e), dtype


# ----------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------


def test_greedy_takes_the_first_index_of_the_maximum():
    logits = [
        [1.0, 3.0, 3.0, 2.0],
        [NAN, 1.0, 3.0, 3.0],     # NaN counts as -inf
        [-INF, -INF, -INF, -INF],  # nothing above -inf: 0
        [NAN, NAN, NAN, NAN],
        [0.0, INF, 5.0, INF],     # first +inf
        [-INF, -INF, -7.0, -7.0],
    ]
    token, _, _ = wk.select_tokens(*one_sequence(logits, [0, 1, 2, 3, 4, 5]))
    assert token.tolist() == [1, 2, 0, 0, 1, 2]


def test_negative_temperature_is_greedy_and_ignores_top_k_and_top_p():
    logits = [[0.0, 2.0, 1.0, 2.0, -1.0]] * 3
    for temperature in (0.0, -0.5):
        token, _, _ = wk.select_tokens(*one_sequence(
            logits, [3, 4, 5], temperature=temperature, top_k=1, top_p=0.01, seed=9))
        assert token.tolist() == [1, 1, 1]


def test_greedy_first_index_on_a_large_vocabulary_with_many_ties():
    logits = torch.zeros(4, 5000)
    logits[:, 4321] = 1.0
    logits[:, 4999] = 1.0
    logits[1, 17] = 1.0
    logits[2] = -INF
    logits[3, 2500:] = INF
    token, _, _ = wk.select_tokens(*one_sequence(logits.tolist(), [0, 1, 2, 3]))
    assert token.tolist() == [4321, 17, 0, 2500]


# ----------------------------------------------------------------------------------------
# Sampling: kept sets (every kept token shows up over 2000 positions, nothing else does)
# ----------------------------------------------------------------------------------------


def test_top_k_keeps_ties_of_the_kth_largest_value():
    row = [5.0, 4.0, 4.0, 4.0, 1.0, 0.0]
    assert sampled_set(row, temperature=3.0, top_k=2) == {0, 1, 2, 3}
    assert sampled_set(row, temperature=3.0, top_k=1) == {0}
    assert sampled_set(row, temperature=3.0, top_k=6) == {0, 1, 2, 3, 4, 5}  # >= V: off


def test_top_p_keeps_the_whole_tie_group_that_reaches_top_p():
    # over top-4 survivors {0, 1, 2, 5}: p = (.398, .241, .241, .120); tokens 1 and 2 have
    # mass .398 above them (< .5) so both stay although .398 + .241 already exceeds .5;
    # token 5 has .880 above it.
    row = [2.0, 1.5, 1.5, 0.3, -1.0, 0.8]
    assert sampled_set(row, temperature=1.0, top_k=4, top_p=0.5) == {0, 1, 2}
    assert sampled_set(row, temperature=1.0, top_k=4, top_p=0.35) == {0}


def test_top_p_uses_the_untempered_distribution_renormalised_over_top_k():
    row = [1.0, 0.0, -1.0, -1.0, -1.0, -1.0]
    # untempered, no top-k: p0 = .524, token 1 has .524 above it, the -1 group .717
    assert sampled_set(row, temperature=2.0, top_p=0.7) == {0, 1}
    # at temperature 2 the tempered distribution would keep everything (p0 = .32, .52 ...)
    # renormalised over top-2 {0, 1}: p0 = .731 >= .7, so token 1 is dropped
    assert sampled_set(row, temperature=2.0, top_k=2, top_p=0.7) == {0}


def test_top_p_of_one_keeps_tokens_whose_mass_above_rounds_to_one():
    # p = (1 - 1.3e-13, 9e-14, 3e-14): the mass above tokens 1 and 2 is 1.0 in fp32, yet
    # top_p = 1 keeps everything; a huge temperature makes the three equally likely.
    row = [0.0, -30.0, -31.0]
    assert sampled_set(row, temperature=1e6, top_p=1.0, count=200) == {0, 1, 2}
    assert sampled_set(row, temperature=1e6, top_p=0.999, count=200) == {0}


def test_tiny_or_zero_top_p_keeps_only_the_top_tokens():
    row = [3.0, 1.0, 3.0, 2.0]
    for top_p in (0.0, 1e-3):
        assert sampled_set(row, temperature=1.0, top_p=top_p) == {0, 2}


def test_minus_inf_and_nan_logits_are_never_sampled():
    row = [-INF, 0.0, NAN, 0.5, -INF, 1.0]
    assert sampled_set(row, temperature=5.0) == {1, 3, 5}


def test_plus_inf_logits_win_first_index_and_skip_top_p():
    row = [0.0, INF, 5.0, INF]
    assert sampled_set(row, temperature=1.0, top_p=0.5, count=200) == {1}
    assert sampled_set(row, temperature=1.0, top_k=1, count=200) == {1}


def test_row_with_only_minus_inf_samples_token_zero():
    assert sampled_set([-INF, -INF, -INF], temperature=1.0, count=50) == {0}
    assert sampled_set([NAN, -INF, NAN], temperature=1.0, top_k=1, top_p=0.5, count=50) == {0}


def test_sampled_frequencies_follow_the_filtered_tempered_softmax():
    """8000 rows, each its own sequence with its own random seed. The kept set of this row
    is {0, 1, 2} (see the top-p tie test); frequencies must follow softmax(x / T) over it."""
    row = [2.0, 1.5, 1.5, 0.3, -1.0, 0.8]
    temperature, count = 0.7, 8000
    logits = torch.tensor([row] * count)
    seeds = torch.randint(-(2**63), 2**63 - 1, (count,)).tolist()
    args = batch(logits, list(range(count + 1)), torch.randint(0, 2**40, (count,)).tolist(),
                 [temperature] * count, [4] * count, [0.5] * count, [INF] * count,
                 [0.0] * count, seeds)
    token, _, _ = wk.select_tokens(*args)
    observed = torch.bincount(token, minlength=len(row)).double()
    assert observed[3:].sum() == 0  # nothing outside the kept set
    weights = torch.tensor([math.exp(v / temperature) for v in row[:3]], dtype=torch.float64)
    expected = count * weights / weights.sum()
    chi2 = float(((observed[:3] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_bound(df=2, false_failure=1e-7), (observed, expected)


def test_sampling_without_filters_follows_the_tempered_softmax():
    row = [0.5, -0.3, 1.2, 0.0, -2.0, 0.9]
    temperature, count = 1.6, 8000
    logits = torch.tensor([row] * count)
    args = batch(logits, [0, count], list(range(count)), [temperature], [0], [1.0], [INF],
                 [0.0], [int(torch.randint(-(2**63), 2**63 - 1, ()))])
    token, _, _ = wk.select_tokens(*args)
    observed = torch.bincount(token, minlength=len(row)).double()
    weights = torch.tensor([math.exp(v / temperature) for v in row], dtype=torch.float64)
    expected = count * weights / weights.sum()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < chi2_bound(df=5, false_failure=1e-7), (observed, expected)


# ----------------------------------------------------------------------------------------
# Random stream: stateless per (seed, position, vocabulary index)
# ----------------------------------------------------------------------------------------


@given(case_seed=st.integers(0, 2**63 - 1))
def test_results_do_not_depend_on_batch_composition_or_row_order(case_seed):
    g = torch.Generator().manual_seed(case_seed)
    vocab = 50
    params = [
        dict(temperature=0.9, top_k=0, top_p=1.0, threshold=1e9, penalty=0.02, seed=11),
        dict(temperature=1.3, top_k=5, top_p=0.8, threshold=2.5, penalty=0.1, seed=-(2**40)),
        dict(temperature=0.5, top_k=0, top_p=0.9, threshold=-INF, penalty=0.0, seed=2**33 + 1),
    ]
    rows = {b: [(20 * b + slot, torch.randn(vocab, generator=g) * 2) for slot in (0, 2, 5)]
            for b in range(3)}

    def run(order, leading_padding, empty_copies):
        """Sequences in ``order`` with shuffled rows, a padding row each, padding rows in
        front, and an empty sequence (same parameters) before those in ``empty_copies``."""
        logits = [torch.full((vocab,), NAN)] * leading_padding
        row_pos = [3] * leading_padding
        cu_rows, sequence_params = [leading_padding], []
        for b in order:
            if b in empty_copies:
                cu_rows.append(cu_rows[-1])
                sequence_params.append(params[b])
            shuffled = [rows[b][i] for i in torch.randperm(3, generator=g).tolist()]
            logits += [row for _, row in shuffled] + [torch.zeros(vocab)]
            row_pos += [position for position, _ in shuffled] + [-1]
            cu_rows.append(cu_rows[-1] + 4)
            sequence_params.append(params[b])
        columns = [[p[name] for p in sequence_params] for name in
                   ("temperature", "top_k", "top_p", "threshold", "penalty", "seed")]
        token, selected, entropy = wk.select_tokens(
            *batch(torch.stack(logits), cu_rows, row_pos, *columns))
        return {position: (int(token[r]), bool(selected[r]), float(entropy[r]))
                for r, position in enumerate(row_pos) if r >= leading_padding and position >= 0}

    first = run([0, 1, 2], 0, set())
    second = run([2, 0, 1], 2, {0, 2})
    assert first == second
    assert sum(selected for _, selected, _ in first.values()) >= 3


# ----------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------


def test_penalty_distance_counts_from_the_smallest_valid_row_pos_not_row_order():
    uniform = [0.0, 0.0, 0.0, 0.0]  # entropy log 4
    h = math.log(4)
    # rows of sequence 0 in the order 13, -1 (padding), 11, 12; sequence 1 holds position 2
    args = batch([uniform] * 5, [0, 4, 5], [13, -1, 11, 12, 2], [0.0, 0.0], [0, 0],
                 [1.0, 1.0], [h + 0.15, h + 0.05], [0.1, 0.1], [0, 0])
    _, selected, entropy = wk.select_tokens(*args)
    # adjusted: 13 -> h + .2, 11 -> h, 12 -> h + .1
    assert selected.tolist() == [False, False, True, True, True]
    assert entropy[1] == 0


def test_no_row_passing_selects_the_first_row_with_the_smallest_adjusted_entropy():
    flat, sharp = [0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0]
    # identical rows, penalty 0: a tie, broken by row order (not by row_pos)
    _, selected, _ = wk.select_tokens(*one_sequence([flat, sharp, sharp], [5, 9, 8]))
    assert selected.tolist() == [False, True, False]
    # a positive penalty breaks the tie towards the smaller distance
    _, selected, _ = wk.select_tokens(*one_sequence([flat, sharp, sharp], [5, 9, 8],
                                                    penalty=0.01, threshold=0.0))
    assert selected.tolist() == [False, False, True]


def test_threshold_is_strict():
    h = float(wk.select_tokens(*one_sequence([[0.0, 0.0]], [0]))[2][0])  # fp32 log 2
    _, selected, _ = wk.select_tokens(*one_sequence(
        [[0.0, 0.0], [0.0, 0.0], [4.0, 0.0]], [0, 1, 2], threshold=h))
    assert selected.tolist() == [False, False, True]


def test_rows_exactly_at_their_threshold_are_not_selected():
    args, expected_selected, hot = exact_threshold_batch()
    token, selected, entropy = wk.select_tokens(*args)
    assert entropy.tolist() == [0.0] * len(hot)  # point masses: the adjusted values are exact
    assert selected.tolist() == expected_selected
    assert token.tolist() == hot


@pytest.mark.parametrize("case", range(len(dyadic_top_p_cases())))
def test_top_p_drops_a_token_whose_mass_above_equals_top_p_exactly(case):
    row, top_p, kept = dyadic_top_p_cases()[case]
    token, _, _ = wk.select_tokens(*top_p_sampling_batch(row, top_p))
    assert set(token.tolist()) == kept


def test_greedy_ties_far_apart_take_the_first_index():
    args, expected = greedy_tile_tie_batch()
    token, _, _ = wk.select_tokens(*args)
    assert token.tolist() == expected


def _pytorch_gumbel(seed, position, indices):
    noise = philox_gumbel(torch.tensor([seed]), torch.tensor([position]),
                                     max(indices) + 1)
    return noise[0, list(indices)].tolist()


@pytest.mark.parametrize("vocab,indices,top_k", [
    (3000, (5, 1031), 0), (3000, (1023, 1024), 0), (3000, (40, 1500, 2999), 3),
    (9000, (10, 4100, 8300), 0),
])
def test_sampled_ties_take_the_first_index(vocab, indices, top_k):
    args, expected = sampled_tie_batch(vocab, indices, _pytorch_gumbel, top_k=top_k)
    token, _, _ = wk.select_tokens(*args)
    assert token.tolist() == expected


@given(case_seed=st.integers(0, 2**63 - 1), num_seqs=st.integers(1, 5))
def test_threshold_minus_inf_selects_exactly_one_row_per_sequence_with_valid_rows(
        case_seed, num_seqs):
    g = torch.Generator().manual_seed(case_seed)
    lengths = torch.randint(0, 5, (num_seqs,), generator=g).tolist()
    cu_rows = [0]
    for length in lengths:
        cu_rows.append(cu_rows[-1] + length)
    num_rows = cu_rows[-1]
    row_pos = torch.randperm(num_rows + 3, generator=g)[:num_rows]
    row_pos[torch.rand(num_rows, generator=g) < 0.2] = -1
    logits = torch.randn(num_rows, 33, generator=g) * 3
    args = batch(logits, cu_rows, row_pos.tolist(), [1.0] * num_seqs, [0] * num_seqs,
                 [1.0] * num_seqs, [-INF] * num_seqs, [0.05] * num_seqs, list(range(num_seqs)))
    _, selected, _ = wk.select_tokens(*args)
    for b in range(num_seqs):
        rows = range(cu_rows[b], cu_rows[b + 1])
        has_valid = any(row_pos[r] >= 0 for r in rows)
        assert int(selected[list(rows)].sum()) == int(has_valid), b
        assert all(row_pos[r] >= 0 for r in rows if selected[r])


@pytest.mark.parametrize("case_seed", range(6))
def test_a_penalty_of_1e30_commits_the_leftmost_mask_whatever_the_threshold(case_seed):
    """Mask-AR order (docs/contracts.md, "Order of one token per step"): with penalty 1e30
    only the valid row of lowest position can pass, and the fallback picks it; with no
    penalty, one token per step is the lowest entropy, which is not always the leftmost."""
    g = torch.Generator().manual_seed(case_seed)
    num_seqs = 5
    lengths = torch.randint(1, 6, (num_seqs,), generator=g).tolist()
    cu_rows = [0]
    for length in lengths:
        cu_rows.append(cu_rows[-1] + length)
    num_rows = cu_rows[-1]
    row_pos = torch.randperm(num_rows + 4, generator=g)[:num_rows] + 10
    row_pos[torch.rand(num_rows, generator=g) < 0.2] = -1
    logits = torch.randn(num_rows, 33, generator=g) * torch.rand(num_rows, 1, generator=g) * 6
    thresholds = [-INF, 0.0, 0.5, 5.0, 1e29]
    leftmost = []
    for b in range(num_seqs):
        valid = [r for r in range(cu_rows[b], cu_rows[b + 1]) if row_pos[r] >= 0]
        leftmost.append(min(valid, key=lambda r: int(row_pos[r])) if valid else None)
    args = batch(logits, cu_rows, row_pos.tolist(), [0.8] * num_seqs, [0] * num_seqs,
                 [1.0] * num_seqs, thresholds, [1e30] * num_seqs, list(range(num_seqs)))
    _, selected, _ = wk.select_tokens(*args)
    assert selected.nonzero().flatten().tolist() == [r for r in leftmost if r is not None]
    if case_seed == 0:  # the order the penalty changes: lowest entropy, not leftmost
        lowest_entropy = batch(logits, cu_rows, row_pos.tolist(), [0.8] * num_seqs,
                               [0] * num_seqs, [1.0] * num_seqs, [-INF] * num_seqs,
                               [0.0] * num_seqs, list(range(num_seqs)))
        _, unpenalised, _ = wk.select_tokens(*lowest_entropy)
        assert unpenalised.nonzero().flatten().tolist() != selected.nonzero().flatten().tolist()


def test_nan_rows_never_pass_and_are_the_fallback_only_when_all_valid_rows_are_nan():
    nan_row, inf_row, flat = [NAN, 0.0, 0.0], [INF, 0.0, 0.0], [0.0, 0.0, 0.0]
    # NaN and +inf rows never pass, however high the threshold
    _, selected, _ = wk.select_tokens(*one_sequence([nan_row, flat, inf_row], [0, 1, 2],
                                                    threshold=1e30))
    assert selected.tolist() == [False, True, False]
    # the fallback skips them
    _, selected, _ = wk.select_tokens(*one_sequence([nan_row, inf_row, flat], [0, 1, 2]))
    assert selected.tolist() == [False, False, True]
    # every valid row NaN: the first valid row (padding rows skipped)
    token, selected, _ = wk.select_tokens(*one_sequence(
        [flat, nan_row, inf_row, [-INF] * 3], [-1, 4, 5, 6], threshold=1e30))
    assert selected.tolist() == [False, True, False, False]
    assert token.tolist() == [0, 1, 0, 0]


def test_sequence_without_valid_rows_selects_nothing():
    logits = [[0.0, 1.0]] * 3
    args = batch(logits, [0, 2, 2, 3], [-1, -1, 4], [0.0] * 3, [0] * 3, [1.0] * 3,
                 [-INF] * 3, [0.0] * 3, [0] * 3)
    token, selected, entropy = wk.select_tokens(*args)
    assert selected.tolist() == [False, False, True]
    assert token.tolist() == [0, 0, 1]


def test_padding_rows_give_token_zero_unselected_and_zero_entropy():
    row = [0.0, 3.0, 1.0]
    garbage = [NAN, INF, 2.0]
    # row 0 is before cu_rows[0], row 2 has row_pos -1, row 4 is after cu_rows[-1]
    args = batch([garbage, row, garbage, row, garbage], [1, 4], [7, 8, -1, 9, 10], [0.0],
                 [0], [1.0], [1e30], [0.0], [0])
    token, selected, entropy = wk.select_tokens(*args)
    assert token.tolist() == [0, 1, 0, 1, 0]
    assert selected.tolist() == [False, True, False, True, False]
    assert entropy[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------
# Shapes and layouts
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_rows", [[0], [0, 0, 0]])
def test_zero_rows_give_empty_outputs(cu_rows):
    num_seqs = len(cu_rows) - 1
    args = batch(torch.empty(0, 11), cu_rows, [], [1.0] * num_seqs, [0] * num_seqs,
                 [1.0] * num_seqs, [0.0] * num_seqs, [0.0] * num_seqs, [0] * num_seqs)
    token, selected, entropy = wk.select_tokens(*args)
    assert token.shape == selected.shape == entropy.shape == (0,)
    assert (token.dtype, selected.dtype, entropy.dtype) == (torch.int64, torch.bool,
                                                           torch.float32)


def test_vocabulary_of_one_gives_token_zero_and_zero_entropy():
    args = batch([[3.0], [-1.0], [0.5]], [0, 2, 3], [4, 5, 9], [0.0, 0.8], [0, 1],
                 [1.0, 0.1], [0.5, -INF], [0.0, 0.0], [1, 2])
    token, selected, entropy = wk.select_tokens(*args)
    assert token.tolist() == [0, 0, 0]
    assert entropy.tolist() == [0.0, 0.0, 0.0]
    assert selected.tolist() == [True, True, True]


def test_row_strided_logits_give_the_same_result_as_contiguous_ones():
    storage = torch.randn(6, 80) * 2
    strided = storage[:, 3:70]
    assert not strided.is_contiguous()
    params = ([0, 2, 6], [4, 5, 1, 2, 3, 9], [0.0, 0.9], [0, 7], [1.0, 0.8], [0.7, 1.5],
              [0.02, 0.02], [3, 4])
    actual = wk.select_tokens(*batch(strided, *params))
    expected = wk.select_tokens(*batch(strided.contiguous(), *params))
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_inputs_are_not_modified_and_outputs_are_fresh():
    args = batch(torch.randn(5, 40), [0, 3, 5], [1, 2, 3, 8, 9], [0.0, 1.0], [0, 4],
                 [1.0, 0.5], [1.0, 2.0], [0.1, 0.1], [5, 6])
    before = [a.clone() for a in args]
    outputs = wk.select_tokens(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    for out in outputs:
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args)


def test_out_of_range_cu_rows_do_not_crash_without_debug_checks(monkeypatch):
    monkeypatch.setattr(_backend, "DEBUG", False)
    for cu_rows in ([3, 1, 9], [-4, 2, 2], [0, 2, 100]):
        args = batch(torch.randn(4, 9), cu_rows, [1, 2, 3, 4], [0.0, 1.0], [0, 0],
                     [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1, 2])
        token, selected, entropy = wk.select_tokens(*args)
        assert token.shape == (4,)
        assert ((token >= 0) & (token < 9)).all()


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------


def _valid_args():
    return batch(torch.randn(4, 9), [0, 1, 4], [1, 2, 3, 4], [0.0, 1.0], [0, 3], [1.0, 0.9],
                 [0.5, 0.5], [0.02, 0.02], [1, 2])


ARG_NAMES = ["logits", "cu_rows", "row_pos", "temperature", "top_k", "top_p", "threshold",
             "penalty", "seed"]
WRONG_DTYPES = {
    "logits": torch.float64, "cu_rows": torch.int64, "row_pos": torch.int32,
    "temperature": torch.float64, "top_k": torch.int64, "top_p": torch.float16,
    "threshold": torch.bfloat16, "penalty": torch.float64, "seed": torch.int32,
}


def _replace(name, value):
    args = list(_valid_args())
    args[ARG_NAMES.index(name)] = value
    return args


@pytest.mark.parametrize("name", ARG_NAMES)
def test_wrong_dtype_is_a_type_error_naming_the_argument(name):
    args = _valid_args()
    wrong = args[ARG_NAMES.index(name)].to(WRONG_DTYPES[name])
    with pytest.raises(TypeError, match=f"`{name}`"):
        wk.select_tokens(*_replace(name, wrong))


@pytest.mark.parametrize("name", ARG_NAMES)
def test_non_tensor_argument_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=f"`{name}`"):
        wk.select_tokens(*_replace(name, [1, 2]))


@pytest.mark.parametrize("name", ARG_NAMES)
def test_wrong_size_is_a_value_error_naming_the_argument(name):
    args = _valid_args()
    value = args[ARG_NAMES.index(name)]
    longer = torch.cat([value, value[:1]])
    with pytest.raises(ValueError, match=f"`{name}`"):
        wk.select_tokens(*_replace(name, longer))


@pytest.mark.parametrize("name", ARG_NAMES)
def test_wrong_rank_is_a_value_error_naming_the_argument(name):
    args = _valid_args()
    value = args[ARG_NAMES.index(name)]
    with pytest.raises(ValueError, match=f"`{name}`"):
        wk.select_tokens(*_replace(name, value.unsqueeze(0)))


def test_empty_vocabulary_is_a_value_error_naming_logits():
    with pytest.raises(ValueError, match="`logits`"):
        wk.select_tokens(*_replace("logits", torch.empty(4, 0)))


def test_empty_cu_rows_is_a_value_error_naming_cu_rows():
    with pytest.raises(ValueError, match="`cu_rows`"):
        wk.select_tokens(*_replace("cu_rows", torch.empty(0, dtype=torch.int32)))


def test_logits_without_unit_last_stride_are_rejected():
    with pytest.raises(ValueError, match="`logits`"):
        wk.select_tokens(*_replace("logits", torch.randn(4, 18)[:, ::2]))


@pytest.mark.parametrize("cu_rows,message", [
    ([0, 3, 2], "non-decreasing"), ([-1, 1, 4], "cu_rows\\[0\\]"), ([0, 1, 5], "cu_rows\\[-1\\]"),
])
def test_debug_mode_checks_cu_rows_values(monkeypatch, cu_rows, message):
    monkeypatch.setattr(_backend, "DEBUG", True)
    with pytest.raises(ValueError, match=message):
        wk.select_tokens(*_replace("cu_rows", i32(*cu_rows)))
    wk.select_tokens(*_valid_args())  # valid values pass


@pytest.mark.cuda
def test_tensors_on_different_devices_are_rejected():
    args = list(_valid_args())
    args[0] = args[0].cuda()
    with pytest.raises(ValueError, match="device|cuda"):
        wk.select_tokens(*args)


def test_arguments_are_checked_once_per_signature_and_every_new_signature_is_checked(
        monkeypatch):
    """A decode loop's repeated calls pay the checks once per signature (dtypes, shapes,
    strides, devices, mode); a call that differs in any of them is checked again."""
    from wedlm_kernels.ops import select as select_module
    from wedlm_kernels.ops._validate import CheckedSignatures

    calls = []
    check = select_module._check_arguments
    monkeypatch.setattr(select_module, "_check_arguments",
                        lambda *args: calls.append(1) or check(*args))
    monkeypatch.setattr(select_module, "_CHECKED", CheckedSignatures())
    args = one_sequence([[0.0, 1.0, 2.0], [3.0, 1.0, 0.5]], [4, 5])
    for _ in range(3):
        wk.select_tokens(*args, sampling="greedy")
    assert len(calls) == 1
    wk.select_tokens(*args)  # another mode
    assert len(calls) == 2
    with pytest.raises(TypeError, match="`temperature`"):
        wk.select_tokens(*args[:3], args[3].double(), *args[4:])
    strided = torch.zeros(2, 6)[:, ::2]
    with pytest.raises(ValueError, match="`logits` must have stride 1"):
        wk.select_tokens(strided, *args[1:])
    with pytest.raises(ValueError, match="`sampling`"):
        wk.select_tokens(*args, sampling=["greedy"])
