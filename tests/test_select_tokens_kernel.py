"""The Triton kernels of select_tokens, called through their launcher (Triton's interpreter
when there is no GPU), against reference/select.py, reference/philox.py and the PyTorch
implementation. Outputs and every intermediate tensor sit between guard bands, and outputs
start out as garbage so that an element the kernels skip shows. GPU-only checks (bf16, a
batch of more than 2^31 logits, CUDA graphs) are marked ``cuda``.

Interpreter programs cost milliseconds each, so the shapes are small (a few rows, V <= 3000
in the random tests) apart from a handful of single-row cases at real vocabulary sizes.
"""

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference import philox
from reference import select as ref
from tests.kernel_harness import guarded
from tests.numerics import (
    ENTROPY_TOLERANCE,
    GUMBEL_TOLERANCE,
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
    i64,
    one_sequence,
    random_logits,
    sampled_tie_batch,
    top_p_sampling_batch,
)
from wedlm_kernels.ops import select as select_ops
from wedlm_kernels.ops._triton import POINTER_TYPES
from wedlm_kernels.ops.philox import gumbel_from_bits, gumbel_from_bits_triton, philox_gumbel_triton
from wedlm_kernels.ops.select import (
    MAX_SPLITS,
    SelectWorkspace,
    kernel_variants,
    select_tokens_torch,
    select_tokens_triton,
    split_plan,
)

# Triton's interpreter converts 1-element arrays to ints (loop bounds that are tensors),
# takes maxima with numpy's nanmax (which warns on a tile of NaN logits) and lets numpy warn
# about the inf - inf of rows holding +inf (their entropy is NaN by the contract)
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

ON_GPU = torch.cuda.is_available()
# where the kernels run, as the `kernel_device` fixture (hypothesis tests cannot take
# function-scoped fixtures): the GPU, else Triton's interpreter on the CPU
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 -> bf16 casts truncate in the interpreter: bf16 logits only on the GPU
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
INF = float("inf")
NAN = float("nan")
# hypothesis examples of the costlier interpreter tests (a third of the profile's)
EXAMPLES = max(6, settings.default.max_examples // 3)

# how the filter kernel drew a top-k / top-p row (workspace.path)
PATHS = {name: code for code, name in select_ops.PATH_NAMES.items()}


def run_kernel(args, num_splits=None, max_candidates=select_ops.MAX_CANDIDATES):
    """The launcher on DEVICE with outputs and workspace between guard bands; the outputs
    start as garbage. ``max_candidates`` sizes the candidate list (a small one sends top-k /
    top-p rows to the whole-row search). Returns (token, selected, entropy, workspace) on
    the CPU."""
    args = tuple(a.to(DEVICE) for a in args)
    num_rows, vocab_size = args[0].shape
    garbage = (
        torch.full((num_rows,), 424242, dtype=torch.int64),
        torch.ones(num_rows, dtype=torch.bool),
        torch.full((num_rows,), -7.25, dtype=torch.float32),
    )
    outputs = [guarded(g.to(DEVICE)) for g in garbage]
    splits, _ = split_plan(num_rows, vocab_size, torch.device(DEVICE), num_splits)
    empty = SelectWorkspace.empty(num_rows, vocab_size, splits, torch.device(DEVICE),
                                  max_candidates)
    # junk in every intermediate: a value read before the kernels write it shows
    junk = {torch.float32: float("nan"), torch.int32: 0x5A5A5A5A}
    parts = {name: guarded(tensor.fill_(junk[tensor.dtype]))
             for name, tensor in vars(empty).items()}
    workspace = SelectWorkspace(**{name: g.tensor for name, g in parts.items()})
    select_tokens_triton(*args, out=tuple(o.tensor for o in outputs), num_splits=num_splits,
                         workspace=workspace)
    for name, g in zip(("token", "selected", "entropy"), outputs):
        g.check(name)
    for name, g in parts.items():
        g.check(name)
    token, selected, entropy = (o.tensor.cpu() for o in outputs)
    return token, selected, entropy, workspace


def _token_agrees(token, logits_row, temperature, top_k, top_p, seed, position):
    """Whether a sampled token is the reference's up to fp32 rounding (assert_same_token)."""
    try:
        assert_same_token(token, ref.sample_row(logits_row, temperature, top_k, top_p, seed,
                                                 position),
                           logits_row, temperature, top_k, top_p, seed, position)
    except AssertionError:
        return False
    return True


def _draw_batch(data, g, vocab, max_rows_per_sequence=3):
    num_seqs = data.draw(st.integers(0, 3), label="B")
    seq_lens = [data.draw(st.integers(0, max_rows_per_sequence)) for _ in range(num_seqs)]
    leading, trailing = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    num_rows = leading + sum(seq_lens) + trailing
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
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
    temperature = [data.draw(st.sampled_from([0.0, -1.0, 1.0, 0.35, 0.05, 1.7]))
                   for _ in seq_lens]
    top_k = [data.draw(st.sampled_from([0, -1, 1, 2, 5, vocab, vocab + 3, max(1, vocab // 3)]))
             for _ in seq_lens]
    top_p = [data.draw(st.sampled_from([1.0, 1.5, 0.0, 1e-3, 0.3, 0.9])) for _ in seq_lens]
    penalty = [data.draw(st.sampled_from([0.0, 0.02, 0.37])) for _ in seq_lens]
    seed = [data.draw(st.integers(-(2**63), 2**63 - 1)) for _ in seq_lens]
    threshold = choose_thresholds(data, logits, cu_rows, row_pos, penalty)
    params = (cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed)
    return batch(logits, *params), params


# ----------------------------------------------------------------------------------------
# Random batches against the reference and the PyTorch implementation
# ----------------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_kernel_matches_reference_and_pytorch_on_random_batches(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(st.one_of(st.integers(1, 40), st.sampled_from([7, 257, 1000, 3000])),
                      label="V")
    args, params = _draw_batch(data, g, vocab)
    cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed = params
    num_splits = data.draw(st.sampled_from([None, 1, 2, 3]), label="num_splits")
    max_candidates = data.draw(st.sampled_from([select_ops.MAX_CANDIDATES, 1, 3]),
                               label="max_candidates")

    token, selected, entropy, _ = run_kernel(args, num_splits, max_candidates)
    torch_token, torch_selected, torch_entropy = select_tokens_torch(*args)
    ref_token, ref_selected, ref_entropy = ref.select_tokens(*args)

    torch.testing.assert_close(entropy.double(), ref_entropy, **ENTROPY_TOLERANCE, equal_nan=True)
    torch.testing.assert_close(entropy, torch_entropy, **ENTROPY_TOLERANCE,
                               equal_nan=True)
    logits = args[0]
    for b in range(len(cu_rows) - 1):
        for r in range(cu_rows[b], cu_rows[b + 1]):
            for expected in (int(ref_token[r]), int(torch_token[r])):
                assert_same_token(int(token[r]), expected, logits[r], temperature[b],
                                   top_k[b], top_p[b], seed[b], row_pos[r])
            if row_pos[r] >= 0 and not temperature[b] > 0:  # greedy: exactly equal
                assert int(token[r]) == int(torch_token[r]) == int(ref_token[r]), r
    assert_selection(selected, ref_entropy, ref_selected, cu_rows, row_pos, threshold,
                      penalty)
    assert_selection(selected, ref_entropy, torch_selected, cu_rows, row_pos, threshold,
                      penalty)
    padding = [r for r in range(len(row_pos)) if row_pos[r] < 0 or not any(
        cu_rows[b] <= r < cu_rows[b + 1] for b in range(len(cu_rows) - 1))]
    for r in padding:
        assert token[r] == 0 and not selected[r] and entropy[r] == 0, r


@settings(max_examples=max(4, EXAMPLES // 2))
@given(data=st.data())
def test_vocabulary_split_changes_no_token_or_selection(data):
    """One batch, the vocabulary cut into 1, 2, 3 and the default number of slices (slices
    are whole 2048-entry tiles, so V > 8192 gives three real slices). Argmax ties
    resolve to the first index and the noise is stateless, so tokens are identical; the
    entropy sums run in another order, so it agrees to fp32 rounding."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(st.sampled_from([8193, 9000, 12288]), label="V")
    args, params = _draw_batch(data, g, vocab, max_rows_per_sequence=2)
    cu_rows, row_pos, _, _, _, threshold, penalty, _ = params
    results = [run_kernel(args, num_splits) for num_splits in (1, 2, 3, None)]
    token, selected, entropy, _ = results[0]
    for other_token, other_selected, other_entropy, _ in results[1:]:
        assert torch.equal(other_token, token)
        torch.testing.assert_close(other_entropy, entropy, rtol=2e-6, atol=1e-6,
                                   equal_nan=True)
        assert_selection(other_selected, entropy.double(), selected, cu_rows, row_pos,
                          threshold, penalty)


@settings(max_examples=EXAMPLES)
@given(
    case_seed=st.integers(0, 2**63 - 1),
    vocab=st.integers(2, 600),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01, 0.0]),
    kind=st.sampled_from(["normal", "ties", "signed zeros", "minus inf"]),
    max_candidates=st.sampled_from([None, 2]),
)
@example(case_seed=0, vocab=2, top_k=1, top_p=1.0, kind="ties", max_candidates=None)
@example(case_seed=1, vocab=600, top_k=12, top_p=0.0, kind="signed zeros", max_candidates=None)
@example(case_seed=2, vocab=97, top_k=3, top_p=0.6, kind="minus inf", max_candidates=None)
@example(case_seed=3, vocab=300, top_k=0, top_p=0.2, kind="ties", max_candidates=None)
@example(case_seed=4, vocab=600, top_k=7, top_p=0.6, kind="ties", max_candidates=2)
def test_sampling_floor_is_exactly_the_top_k_and_top_p_cutoff(case_seed, vocab, top_k, top_p,
                                                            kind, max_candidates):
    """At a huge temperature the floor of a sampling row is max(k-th largest value, top-p
    cutoff); the entries at or above it must be exactly the reference's kept set (ties, -0.0
    next to +0.0 and -inf entries included), up to top-p decisions within TOP_P_MARGIN.
    ``max_candidates`` 2 sends most rows to the whole-row search."""
    g = torch.Generator().manual_seed(case_seed)
    if kind == "ties":
        row = torch.randint(-4, 4, (vocab,), generator=g).float()
    elif kind == "signed zeros":
        row = torch.randint(-1, 2, (vocab,), generator=g).float() * 0.0  # -0.0, 0.0, +0.0
        row[torch.rand(vocab, generator=g) < 0.3] = 1.0
    else:
        row = torch.randn(vocab, generator=g) * 3
        if kind == "minus inf":
            row[torch.rand(vocab, generator=g) < 0.5] = -INF
    args = one_sequence([row.tolist()], [3], temperature=1e4, top_k=top_k, top_p=top_p,
                        seed=case_seed)
    token, _, _, workspace = run_kernel(args, max_candidates=max_candidates or
                                        select_ops.MAX_CANDIDATES)
    if not (0 < top_k < vocab or top_p < 1) or int(workspace.path[0]) == PATHS["checked draws"]:
        # no floor: temperature only, or top-p alone checked on the scan's four best draws
        assert _token_agrees(int(token[0]), row, 1e4, top_k, top_p, case_seed, 3)
        return
    floor = float(workspace.floor[0])
    kept = [v >= floor for v in row.tolist()]
    expected = ref.kept_tokens(row, top_k, top_p)
    if kept != expected:
        wider = ref.kept_tokens(row, top_k, min(top_p + TOP_P_MARGIN, 1.0))
        narrower = ref.kept_tokens(row, top_k, top_p - TOP_P_MARGIN)
        assert all(n <= k <= w for n, k, w in zip(narrower, kept, wider)), floor


# ----------------------------------------------------------------------------------------
# The random stream
# ----------------------------------------------------------------------------------------


def test_philox_stream_at_zero_is_the_random123_known_answer():
    # Random123 kat_vectors, philox4x32_10 at counter 0, key 0: the words of indices 0..3
    zero = i64(0, 0, 0, 0).to(DEVICE)
    word, _ = philox_gumbel_triton(zero, zero, i64(0, 1, 2, 3).to(DEVICE))
    assert word.tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@given(
    seeds=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6),
    positions=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=6),
)
@example(seeds=[-(2**63), -1, 0, 2**63 - 1], positions=[0, 2**32 - 1, 2**32, 2**63 - 1])
def test_philox_words_and_gumbel_noise_equal_the_reference_stream(seeds, positions):
    triples = [(s, p, v) for s in seeds for p in positions
               for v in (0, 1, 151935, 2**31 - 1, *range(7, 40, 5))]
    seed, position, vocab_index = (i64(*column) for column in zip(*triples))
    word, gumbel = philox_gumbel_triton(seed.to(DEVICE), position.to(DEVICE),
                                        vocab_index.to(DEVICE))
    expected_words = [int(philox.philox_word(s, p, np.array([v]))[0])
                      for s, p, v in triples]
    assert word.cpu().tolist() == expected_words
    expected_gumbel = philox.gumbel_from_word(np.array(expected_words, dtype=np.uint64))
    torch.testing.assert_close(gumbel.cpu().double(), torch.from_numpy(expected_gumbel),
                               **GUMBEL_TOLERANCE)


def test_gumbel_transform_matches_float64_and_pytorch_including_the_extreme_words():
    # A naive fp32 u rounds the largest one to 1.0 and gives g = +inf.
    edge_words = [0, 1, 255, 256, 2**31 - 256, 2**31 - 1, 2**31, 2**31 + 256,
                  2**32 - 512, 2**32 - 257, 2**32 - 256, 2**32 - 1]
    words = torch.tensor(edge_words + torch.randint(0, 2**32, (3000,)).tolist())
    actual = gumbel_from_bits_triton(words.to(DEVICE)).cpu()
    expected = philox.gumbel_from_word(words.numpy().astype(np.uint64))
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.double(), torch.from_numpy(expected), **GUMBEL_TOLERANCE)
    torch.testing.assert_close(actual, gumbel_from_bits(words), **GUMBEL_TOLERANCE)


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


def test_gumbel_max_over_the_kernel_noise_follows_the_softmax():
    """The kernel's noise for 6 tokens at 4000 (seed, position) pairs: argmax of x / T + g is
    distributed as softmax(x / T) (the Gumbel-max property needs independent, exactly
    Gumbel-distributed noise, so this checks the stream and the transform together)."""
    row = torch.tensor([0.5, -0.3, 1.2, 0.0, -2.0, 0.9], dtype=torch.float64)
    temperature, count = 1.6, 4000
    seeds = torch.randint(-(2**63), 2**63 - 1, (count,))
    positions = torch.randint(0, 2**40, (count,))
    vocab = torch.arange(6).repeat(count)
    _, noise = philox_gumbel_triton(seeds.repeat_interleave(6).to(DEVICE),
                                    positions.repeat_interleave(6).to(DEVICE),
                                    vocab.to(DEVICE))
    token = torch.argmax(row / temperature + noise.cpu().double().view(count, 6), dim=1)
    observed = torch.bincount(token, minlength=6).double()
    weights = torch.exp(row / temperature)
    expected = count * weights / weights.sum()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < chi2_bound(df=5, false_failure=1e-7), (observed, expected)


def _assert_follows_filtered_softmax(row, temperature, top_k, top_p, count, kept_count):
    """``count`` rows of one logit row in sequences of 20 rows, each sequence with its own
    random seed and each row at its own random position (the noise of distinct (seed,
    position) pairs is independent): no token outside the first ``kept_count`` entries (the
    kept set), and the frequencies follow softmax(x / T) over them."""
    num_seqs = count // 20
    seeds = torch.randint(-(2**63), 2**63 - 1, (num_seqs,)).tolist()
    positions = torch.randperm(2**20)[:count] + 2**33
    args = batch([row] * count, list(range(0, count + 1, 20)), positions.tolist(),
                 [temperature] * num_seqs, [top_k] * num_seqs, [top_p] * num_seqs,
                 [INF] * num_seqs, [0.0] * num_seqs, seeds)
    token, _, _, _ = run_kernel(args)
    observed = torch.bincount(token, minlength=len(row)).double()
    assert observed[kept_count:].sum() == 0  # nothing outside the kept set
    weights = torch.tensor([math.exp(v / temperature) for v in row[:kept_count]],
                           dtype=torch.float64)
    expected = count * weights / weights.sum()
    chi2 = float(((observed[:kept_count] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_bound(df=kept_count - 1, false_failure=1e-7), (observed, expected)


def test_sampled_tokens_follow_the_filtered_softmax_and_stay_in_the_kept_set():
    """Through the kernels, 100 rows (a coarse check: interpreter programs are slow; the
    GPU version below draws 20000). Top-k 3 keeps {0, 1, 2} (the tie at 1.5 included);
    NaN and -inf entries are never drawn."""
    _assert_follows_filtered_softmax([2.0, 1.5, 1.5, 0.3, NAN, -INF, 0.8], temperature=0.7,
                                     top_k=3, top_p=1.0, count=100, kept_count=3)


@pytest.mark.cuda
def test_sampled_tokens_follow_the_filtered_softmax_on_gpu():
    # top-k 4 keeps {0, 1, 2, 3}; over those, top-p 0.5 keeps the tokens with less than
    # half of the (untempered) mass strictly above them: 2.0, then the tie at 1.5
    _assert_follows_filtered_softmax([2.0, 1.5, 1.5, 0.8, 0.3, -1.0, NAN], temperature=0.7,
                                     top_k=4, top_p=0.5, count=20000, kept_count=3)


# ----------------------------------------------------------------------------------------
# Exact decisions (the same cases as the op tests, tests/select_inputs.py): a strict
# comparison at equality, and ties between tiles and between vocabulary splits
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [None, 1])
def test_rows_exactly_at_their_threshold_are_not_selected(num_splits):
    args, expected_selected, hot = exact_threshold_batch()
    token, selected, entropy, _ = run_kernel(args, num_splits)
    assert entropy.tolist() == [0.0] * len(hot)  # point masses: the adjusted values are exact
    assert selected.tolist() == expected_selected
    assert token.tolist() == hot


@pytest.mark.parametrize("case", range(len(dyadic_top_p_cases())))
def test_top_p_drops_a_token_whose_mass_above_equals_top_p_exactly(case):
    row, top_p, kept = dyadic_top_p_cases()[case]
    token, _, _, workspace = run_kernel(top_p_sampling_batch(row, top_p, count=32))
    assert set(token.tolist()) == kept
    floors = workspace.floor.cpu()
    assert (floors == floors[0]).all()
    assert {v for v, x in enumerate(row) if x >= float(floors[0])} == kept


def _filter_path_rows(vocab, seed):
    """Rows that send a top-k / top-p row to each path of the filter kernel at
    ``max_candidates`` 8: ``{name: (row, top_k, top_p, paths)}`` with the names of
    ``select_ops.PATH_NAMES``: the first path is taken by some rows, the others may be (a
    checked row whose four draws all fall outside top-p searches its whole row)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(vocab, generator=g) * 2
    peaked = torch.randn(vocab, generator=g)
    peaked[torch.randint(0, vocab, (3,), generator=g)] += torch.tensor([15.0, 14.0, 13.0])
    ties = torch.randint(-3, 3, (vocab,), generator=g).float()  # the maximum in every granule
    with_nan = peaked.clone()
    with_nan[vocab // 2] = NAN
    return {
        "top-k, distinct values": (normal, 5, 1.0, ("candidates",)),
        "top-k tied across many granules": (ties, 5, 1.0, ("whole row",)),
        "top-k larger than the list": (normal, 40 * 8, 1.0, ("whole row",)),
        "top-k and top-p": (normal, 6, 0.5, ("candidates",)),
        "top-p alone, peaked": (peaked, 0, 0.9, ("candidates",)),
        "top-p alone, flat": (normal * 0.1, 0, 0.5, ("checked draws", "whole row")),
        "top-p alone, flat, none of four draws kept": (normal * 0.1, 0, 0.05, ("whole row", "checked draws")),
        "top-p alone, NaN in the row": (with_nan, 0, 0.9, ("whole row",)),
        "top-p 0": (normal, 0, 0.0, ("candidates",)),
    }


@pytest.mark.parametrize("name", list(_filter_path_rows(3000, 0)))
def test_each_filter_path_keeps_the_reference_set_and_samples_its_tokens(name):
    """Each row at 12 positions (12 draws), temperature 0.8, the vocabulary in two splits:
    the path the filter took, the kept set (the sampling floor) against the reference, the
    tokens against the reference and the PyTorch implementation, and the same tokens and
    floor when the list may hold every granule."""
    row, top_k, top_p, path = _filter_path_rows(3000, 1)[name]
    count = 12
    args = batch([row.tolist()] * count, [0, count], list(range(100, 100 + count)), [0.8],
                 [top_k], [top_p], [INF], [0.0], [77])
    token, _, _, workspace = run_kernel(args, num_splits=2, max_candidates=8)
    paths = workspace.path.tolist()  # path[0] is required, the others allowed
    assert PATHS[path[0]] in paths and set(paths) <= {PATHS[name] for name in path}, paths
    expected_kept = ref.kept_tokens(row, top_k, top_p)
    for r in range(count):
        if paths[r] != PATHS["checked draws"]:  # the checked draws need no floor
            assert [x >= float(workspace.floor[r]) for x in row.tolist()] == expected_kept
    torch_token = select_tokens_torch(*args)[0]
    for r in range(count):
        expected = ref.sample_row(row, 0.8, top_k, top_p, 77, 100 + r)
        assert int(token[r]) == expected == int(torch_token[r]), r
    roomy = run_kernel(args, max_candidates=64)  # a NaN row always searches its whole row
    assert roomy[3].path.tolist() == [PATHS["whole row" if torch.isnan(row).any()
                                            else "candidates"]] * count
    assert torch.equal(roomy[0], token)


@pytest.mark.parametrize("num_splits", [1, 2, 4, None])
def test_greedy_tie_between_tiles_or_splits_takes_the_first_index(num_splits):
    """1 split: four tiles in one program; 2: two tiles per program; 4: one tile each."""
    args, expected = greedy_tile_tie_batch()
    token, _, _, _ = run_kernel(args, num_splits)
    assert token.tolist() == expected


def _kernel_gumbel(seed, position, indices):
    count = len(indices)
    _, noise = philox_gumbel_triton(i64(*[seed] * count).to(DEVICE),
                                    i64(*[position] * count).to(DEVICE),
                                    i64(*indices).to(DEVICE))
    return noise.cpu().tolist()


@pytest.mark.parametrize("vocab,indices,num_splits,top_k", [
    (3000, (5, 1031), 1, 0),            # 1024-entry sampling tiles 0 and 1 of one program
    (3000, (1023, 1024), 1, 0),         # adjacent entries across a tile boundary
    (3000, (40, 1500, 2999), 1, 3),     # three tiles, top-k keeping exactly the tied three
    (3000, (40, *range(200, 1800, 200), 2999), 1, 10),  # ten candidate granules: two tiles
    (9000, (10, 4100, 8300), 3, 0),     # three programs (4096-entry splits)
    (9000, (4097, 8191), 2, 0),         # the two programs of 6144 and 2856 entries
])
def test_sampled_tie_between_tiles_or_splits_takes_the_first_index(vocab, indices, num_splits,
                                                                   top_k):
    args, expected = sampled_tie_batch(vocab, indices, _kernel_gumbel, top_k=top_k)
    assert split_plan(3, vocab, torch.device(DEVICE), num_splits)[0] == num_splits
    token, _, _, _ = run_kernel(args, num_splits)
    assert token.tolist() == expected


# ----------------------------------------------------------------------------------------
# Edge cases of docs/contracts.md
# ----------------------------------------------------------------------------------------


def _assert_matches_reference(args, num_splits=None):
    """Entropy and selection equal the reference's, tokens the reference's and the PyTorch
    implementation's (the reference treats a NaN temperature as greedy, the contract and the
    PyTorch implementation as sampling with NaN scores: token 0; the kernel follows the
    contract)."""
    token, selected, entropy, _ = run_kernel(args, num_splits)
    ref_token, ref_selected, ref_entropy = ref.select_tokens(*args)
    torch_token, _, _ = select_tokens_torch(*args)
    torch.testing.assert_close(entropy.double(), ref_entropy, **ENTROPY_TOLERANCE, equal_nan=True)
    assert token.tolist() == torch_token.tolist()
    if not torch.isnan(args[3]).any():
        assert token.tolist() == ref_token.tolist()
    assert selected.tolist() == ref_selected.tolist()
    return token, selected, entropy


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 2, 1.0), (0.8, 0, 0.5), (NAN, 0, 1.0), (INF, 2, 0.9),
])
def test_nan_inf_and_all_minus_inf_rows(temperature, top_k, top_p):
    logits = [
        [0.0, NAN, 1.0, 1.0],       # NaN: entropy NaN, NaN counts as -inf for the token
        [0.0, INF, 1.0, INF],       # +inf: entropy NaN, the first +inf wins
        [-INF, -INF, -INF, -INF],   # nothing above -inf: token 0
        [NAN, NAN, NAN, NAN],
        [-INF, 2.0, -INF, -INF],    # a point mass: entropy 0
        [3.0, -INF, 3.0, -INF],     # ties among the finite entries
    ]
    args = one_sequence(logits, [4, 5, 6, 7, 8, 9], temperature=temperature, top_k=top_k,
                        top_p=top_p, threshold=1e30, seed=11)
    token, selected, entropy = _assert_matches_reference(args)
    assert torch.isnan(entropy[:4]).all() and entropy[4] == 0
    assert selected.tolist() == [False, False, False, False, True, True]
    assert token[2] == token[3] == 0
    if temperature == 0:
        assert token.tolist() == [2, 1, 0, 0, 1, 0]
    if math.isnan(temperature):
        assert token.tolist() == [0] * 6


def test_nan_rows_are_the_fallback_only_when_every_valid_row_is_nan():
    nan_row, inf_row, flat = [NAN, 0.0, 0.0], [INF, 0.0, 0.0], [0.0, 0.0, 0.0]
    token, selected, _, _ = run_kernel(one_sequence([nan_row, inf_row, flat], [0, 1, 2]))
    assert selected.tolist() == [False, False, True]
    token, selected, _, _ = run_kernel(one_sequence(
        [flat, nan_row, inf_row, [-INF] * 3], [-1, 4, 5, 6], threshold=1e30))
    assert selected.tolist() == [False, True, False, False]
    assert token.tolist() == [0, 1, 0, 0]


def test_fallback_takes_the_first_row_with_the_smallest_adjusted_entropy():
    flat, sharp = [0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0]
    _, selected, _, _ = run_kernel(one_sequence([flat, sharp, sharp], [5, 9, 8]))
    assert selected.tolist() == [False, True, False]  # a tie, broken by row order
    _, selected, _, _ = run_kernel(one_sequence([flat, sharp, sharp], [5, 9, 8],
                                                penalty=0.01, threshold=0.0))
    assert selected.tolist() == [False, False, True]  # the penalty breaks the tie


def test_penalty_counts_from_the_smallest_valid_row_pos_and_threshold_is_strict():
    uniform = [0.0, 0.0, 0.0, 0.0]
    h = float(run_kernel(one_sequence([uniform], [0]))[2][0])  # the kernel's log 4
    args = batch([uniform] * 5, [0, 4, 5], [13, -1, 11, 12, 2], [0.0, 0.0], [0, 0],
                 [1.0, 1.0], [h + 0.15, h], [0.1, 0.1], [0, 0])
    _, selected, entropy, _ = run_kernel(args)
    # adjusted: 13 -> h + .2, 11 -> h, 12 -> h + .1; sequence 1: h < h fails, fallback
    assert selected.tolist() == [False, False, True, True, True]
    assert entropy[1] == 0


def _two_roundings_apart(entropy: float, distance: int) -> tuple[float, float, float]:
    """A penalty p for which fp32(entropy + fp32(p * distance)) and the fused fp32(entropy +
    p * distance) (one rounding, as an FMA computes it) differ, and both values."""
    rng = np.random.default_rng(int(distance))
    e, d = np.float32(entropy), np.float32(distance)
    for _ in range(100000):
        p = np.float32(rng.uniform(0.001, 0.05))
        twice = np.float32(e + np.float32(p * d))
        fused = np.float32(np.float64(e) + np.float64(p) * np.float64(d))
        if twice != fused:
            return float(p), float(twice), float(fused)
    raise AssertionError("no penalty found whose two roundings differ")


@pytest.mark.parametrize("distance", [3, 7, 13])
def test_adjusted_entropy_rounds_twice_like_pytorch_at_a_knife_edge_threshold(distance):
    """``entropy + penalty * distance`` is rounded after the product and after the sum (as
    the PyTorch path computes it), not once as a fused multiply-add: the threshold is set
    between the two results, so each way of rounding selects the row differently."""
    peaked = [2.0, 0.5, 0.0, -1.0, 0.25]
    h = float(run_kernel(one_sequence([peaked], [0]))[2][0])  # the kernel's entropy
    penalty, twice, fused = _two_roundings_apart(h, distance)
    threshold = max(twice, fused)  # strict: only the smaller value passes
    args = one_sequence([peaked, peaked], [0, distance], threshold=threshold, penalty=penalty)
    _, selected, entropy, _ = run_kernel(args)
    assert float(entropy[1]) == h
    assert bool(selected[1]) == (twice < threshold)
    _, torch_selected, torch_entropy = select_tokens_torch(*args)
    torch_twice = np.float32(np.float32(torch_entropy[1]) + np.float32(
        np.float32(penalty) * np.float32(distance)))
    assert bool(torch_selected[1]) == (torch_twice < threshold)


def test_rows_outside_every_sequence_and_sequences_without_valid_rows():
    garbage, row = [NAN, INF, 2.0], [0.0, 3.0, 1.0]
    # row 0 is before cu_rows[0], row 2 has row_pos -1, row 4 is after cu_rows[-1];
    # sequence 1 is empty and sequence 2 only holds a padding row
    args = batch([garbage, row, garbage, row, garbage], [1, 3, 3, 4], [7, 8, -1, -1, 10],
                 [0.0] * 3, [0] * 3, [1.0] * 3, [1e30] * 3, [0.0] * 3, [0] * 3)
    token, selected, entropy, workspace = run_kernel(args)
    assert token.tolist() == [0, 1, 0, 0, 0]
    assert selected.tolist() == [False, True, False, False, False]
    assert entropy[[0, 2, 3, 4]].tolist() == [0.0] * 4
    assert workspace.row_sequence.tolist() == [-1, 0, -1, -1, -1]


def test_batch_without_sequences_is_all_padding():
    args = batch(torch.randn(3, 50), [0], [1, 2, 3], [], [], [], [], [], [])
    token, selected, entropy, _ = run_kernel(args)
    assert token.tolist() == [0, 0, 0] and not selected.any() and entropy.tolist() == [0.0] * 3


class _Unlaunchable:
    def __getitem__(self, grid):
        raise AssertionError(f"a kernel was launched with grid {grid}")


@pytest.mark.parametrize("cu_rows", [[0], [0, 0, 0]])
def test_zero_rows_give_empty_outputs_without_a_launch(monkeypatch, cu_rows):
    for name in ("_select_scan_kernel", "_select_filter_kernel", "_select_sequences_kernel"):
        monkeypatch.setattr(select_ops, name, _Unlaunchable())
    num_seqs = len(cu_rows) - 1
    args = batch(torch.empty(0, 11), cu_rows, [], [1.0] * num_seqs, [0] * num_seqs,
                 [1.0] * num_seqs, [0.0] * num_seqs, [0.0] * num_seqs, [0] * num_seqs)
    token, selected, entropy = select_tokens_triton(*(a.to(DEVICE) for a in args))
    assert token.shape == selected.shape == entropy.shape == (0,)
    assert (token.dtype, selected.dtype, entropy.dtype) == (torch.int64, torch.bool,
                                                           torch.float32)


def test_vocabulary_of_one():
    args = batch([[3.0], [-1.0], [0.5]], [0, 2, 3], [4, 5, 9], [0.0, 0.8], [0, 1],
                 [1.0, 0.1], [0.5, -INF], [0.0, 0.0], [1, 2])
    token, selected, entropy = _assert_matches_reference(args)
    assert token.tolist() == [0, 0, 0] and entropy.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p", [
    (151936, 0.0, 0, 1.0), (152064, 0.1, 0, 1.0), (32000, 0.9, 40, 0.9), (1000, 0.6, 7, 0.8),
    (7, 1.3, 3, 0.7),
])
def test_vocabulary_sizes_that_are_not_multiples_of_the_tile(vocab, temperature, top_k, top_p):
    """Real vocabulary sizes (one or two rows: the interpreter is slow), the maximum near
    the end of the row, split across three programs."""
    g = torch.Generator().manual_seed(vocab)
    num_rows = 1 if vocab > 100000 else 2
    logits = torch.randn(num_rows, vocab, generator=g) * 2
    logits[:, -3] += 9.0  # in the last, partial tile
    args = batch(logits, [0, num_rows], [40 + r for r in range(num_rows)], [temperature],
                 [top_k], [top_p], [INF], [0.02], [vocab])
    token, _, entropy, _ = run_kernel(args, num_splits=3)
    torch_token, _, torch_entropy = select_tokens_torch(*args)
    torch.testing.assert_close(entropy, torch_entropy, **ENTROPY_TOLERANCE)
    for r in range(num_rows):
        expected = ref.sample_row(logits[r], temperature, top_k, top_p, vocab, 40 + r)
        for other in (expected, int(torch_token[r])):
            assert_same_token(int(token[r]), other, logits[r], temperature, top_k, top_p,
                               vocab, 40 + r)


def test_row_strided_logits_give_the_results_of_contiguous_ones():
    storage = torch.randn(5, 90) * 2
    params = ([0, 2, 5], [4, 5, 1, 2, 3], [0.0, 0.9], [0, 7], [1.0, 0.8], [0.7, 1.5],
              [0.02, 0.02], [3, 4])
    for dtype in DTYPES:
        strided = storage.to(dtype)[:, 3:70]
        assert not strided.is_contiguous()
        actual = run_kernel(batch(strided, *params))
        expected = run_kernel(batch(strided.contiguous(), *params))
        for a, e in zip(actual[:3], expected[:3]):
            assert torch.equal(a, e), dtype


def test_a_workspace_shaped_for_another_launch_is_a_value_error():
    args = tuple(a.to(DEVICE) for a in batch(
        torch.randn(3, 5000), [0, 3], [1, 2, 3], [0.8], [0], [0.9], [1.0], [0.1], [5]))
    splits, _ = split_plan(3, 5000, torch.device(DEVICE), 2)
    select_tokens_triton(*args, num_splits=2,
                         workspace=SelectWorkspace.empty(3, 5000, splits, torch.device(DEVICE)))
    for rows, vocab, num_splits, name in ((3, 5000, 1, "partial_float"),
                                          (2, 5000, splits, "row_sequence"),
                                          (3, 3000, splits, "granule_max")):
        wrong = SelectWorkspace.empty(rows, vocab, num_splits, torch.device(DEVICE))
        with pytest.raises(ValueError, match=f"`workspace.{name}` has shape"):
            select_tokens_triton(*args, num_splits=2, workspace=wrong)


def test_launcher_returns_fresh_outputs_and_leaves_inputs_unchanged():
    args = tuple(a.to(DEVICE) for a in batch(
        torch.randn(5, 40), [0, 3, 5], [1, 2, 3, 8, 9], [0.0, 1.0], [0, 4], [1.0, 0.5],
        [1.0, 2.0], [0.1, 0.1], [5, 6]))
    before = [a.clone() for a in args]
    outputs = select_tokens_triton(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    for out in outputs:
        assert out.is_contiguous() and out.device.type == DEVICE
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args)


# ----------------------------------------------------------------------------------------
# Kernel variants
# ----------------------------------------------------------------------------------------


class _RecordingKernel:
    """Stands in for a @triton.jit kernel and records the specialisation of each launch."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, num_warps, enable_fp_fusion=True, **constexprs):
            types = [POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor) else "i32"
                     for a in args]
            self.launches.append((self.name, tuple(types), tuple(sorted(constexprs.items())),
                                  num_warps, enable_fp_fusion))
        return launch


def test_kernel_variants_list_every_specialisation_the_launcher_produces(monkeypatch):
    variants = kernel_variants()
    for variant in variants:
        assert list(variant.signature) == list(inspect.signature(variant.kernel.fn).parameters)
    listed = {
        (variant.name.split("_")[0], tuple(t for t in variant.signature.values()
                                           if t != "constexpr"),
         tuple(sorted(variant.constexprs.items())), variant.num_warps, variant.enable_fp_fusion)
        for variant in variants
    }
    launches = []
    for short in ("scan", "filter", "sequences"):
        monkeypatch.setattr(select_ops, f"_select_{short}_kernel",
                            _RecordingKernel(short, launches))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for vocab in (1, 7, 4097, 151936, 152064):
            for num_splits in (None, *range(1, MAX_SPLITS + 1)):
                args = batch(torch.zeros(2, vocab, dtype=dtype), [0, 2], [1, 2], [0.0], [0],
                             [1.0], [0.0], [0.0], [0])
                select_tokens_triton(*args, num_splits=num_splits)
    assert {launch[0] for launch in launches} == {"scan", "filter", "sequences"}
    for launch in set(launches):
        assert launch in listed, launch


# ---------------------------------------------------------------------------- GPU only


def _decode_batch(g, num_seqs, rows_per_seq, vocab, dtype, sampling=True):
    num_rows = num_seqs * rows_per_seq
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(dtype)
    params = (
        [rows_per_seq * b for b in range(num_seqs + 1)],
        [1000 + r for r in range(num_rows)],
        [(0.0 if b % 3 == 0 or not sampling else 0.4 + 0.3 * (b % 4)) for b in range(num_seqs)],
        [[0, 20, 50, 0][b % 4] for b in range(num_seqs)],
        [[1.0, 0.9, 1.0, 0.7][b % 4] for b in range(num_seqs)],
        [0.5] * num_seqs, [0.02] * num_seqs, list(range(num_seqs)),
    )
    return batch(logits, *params), params


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_shapes_match_pytorch_on_gpu(dtype):
    g = torch.Generator().manual_seed(3)
    args, params = _decode_batch(g, 16, 16, 151936, dtype)
    cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed = params
    token, selected, entropy = select_tokens_triton(*(a.cuda() for a in args))
    torch_token, torch_selected, torch_entropy = select_tokens_torch(*(a.cuda() for a in args))
    torch.testing.assert_close(entropy, torch_entropy, **ENTROPY_TOLERANCE)
    logits = args[0].cpu()
    for b in range(len(cu_rows) - 1):
        for r in range(cu_rows[b], cu_rows[b + 1]):
            assert_same_token(int(token[r]), int(torch_token[r]), logits[r], temperature[b],
                               top_k[b], top_p[b], seed[b], row_pos[r])
    ref_entropy = torch_entropy.cpu().double()
    assert_selection(selected.cpu(), ref_entropy, torch_selected.cpu(), cu_rows, row_pos,
                      threshold, penalty)


@pytest.mark.cuda
def test_batch_beyond_2_31_logits_on_gpu():
    """15000 rows of 151936 bf16 logits (2.28e9 elements, 4.6 GB): rows at the end of the
    batch, past 2^31 elements, match the PyTorch implementation run on those rows alone."""
    free, _ = torch.cuda.mem_get_info()
    if free < 8 * 2**30:
        pytest.skip("needs 8 GiB of free GPU memory")
    num_rows, vocab = 15000, 151936
    assert num_rows * vocab > 2**31
    g = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randn(num_rows, vocab, generator=g, device="cuda", dtype=torch.bfloat16)
    logits.mul_(3)
    # every row its own sequence; the last ten sample with top-k and top-p
    temperature = torch.zeros(num_rows, device="cuda")
    temperature[-10:] = 0.8
    args = (
        logits, torch.arange(num_rows + 1, dtype=torch.int32, device="cuda"),
        torch.arange(num_rows, device="cuda") + 7, temperature,
        torch.full((num_rows,), 40, dtype=torch.int32, device="cuda"),
        torch.full((num_rows,), 0.9, device="cuda"), torch.full((num_rows,), INF, device="cuda"),
        torch.zeros(num_rows, device="cuda"), torch.arange(num_rows, device="cuda"),
    )
    token, selected, entropy = select_tokens_triton(*args)
    tail = slice(num_rows - 16, num_rows)
    tail_args = (args[0][tail], torch.arange(17, dtype=torch.int32, device="cuda"),
                 *(a[tail] for a in args[2:]))
    torch_token, _, torch_entropy = select_tokens_torch(*tail_args)
    torch.testing.assert_close(entropy[tail], torch_entropy, **ENTROPY_TOLERANCE)
    assert torch.equal(token[tail], torch_token)
    assert selected.all()


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_inputs_matches_eager():
    g = torch.Generator().manual_seed(12)
    static = [a.cuda() for a in _decode_batch(g, 8, 4, 151936, torch.bfloat16)[0]]
    select_tokens_triton(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = select_tokens_triton(*static)
    for round_index in range(2):
        fresh = _decode_batch(g, 8, 4, 151936, torch.bfloat16, sampling=round_index == 0)[0]
        fresh = [a.cuda() for a in fresh]
        fresh[3] = fresh[3] * (1.5 if round_index else 1.0)  # new temperatures
        fresh[8] = fresh[8] + 1000 * (round_index + 1)  # new seeds
        for target, source in zip(static, fresh):
            target.copy_(source)
        graph.replay()
        eager = select_tokens_triton(*fresh)
        for replayed, expected in zip(outputs, eager):
            assert torch.equal(replayed, expected)
