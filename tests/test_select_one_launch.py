"""select_tokens' one-launch kernel (ops/select_one_launch.py) for ``sampling="greedy"`` and
``sampling="temperature"`` calls: bit for bit the tokens of the three-launch kernels (same
random stream, same exact score), the reference's tokens and selection, and the bound that
lets it score most entries cheaply, checked on every one of the 2^24 random words.

Runs on the GPU where there is one, else through Triton's interpreter (small shapes).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import philox as ref_philox
from reference import select as ref
from tests.kernel_harness import guarded
from tests.numerics import ENTROPY_TOLERANCE, assert_selection
from tests.select_inputs import (
    ONE_LAUNCH_INTERPRETER_WARNINGS,
    batch,
    choose_thresholds,
    greedy_tile_tie_batch,
    i64,
    one_sequence,
    random_logits,
    sampled_tie_batch,
)
from wedlm_kernels.ops import select as select_ops
from wedlm_kernels.ops import select_one_launch as one_launch
from wedlm_kernels.ops.philox import gumbel_from_bits, philox_gumbel_triton

pytestmark = [
    *ONE_LAUNCH_INTERPRETER_WARNINGS,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
INF, NAN = float("inf"), float("nan")
EXAMPLES = max(6, settings.default.max_examples // 3)
MODES = ("greedy", "temperature")


def run_one_launch(args, sampling, num_splits=None, calls=1):
    """The one-launch kernel on DEVICE, outputs and workspace between guard bands, outputs
    and scratch full of junk first; ``calls`` launches on the same workspace (its tickets
    must be zeroed for each). Returns (token, selected, entropy, workspace) on the CPU."""
    args = tuple(a.to(DEVICE) for a in args)
    logits, cu_rows, row_pos, temperature, _, _, threshold, penalty, seed = args
    num_rows, vocab_size = logits.shape
    splits, _ = one_launch.split_plan(num_rows, vocab_size, torch.device(DEVICE), num_splits)
    shapes = one_launch.Workspace.shapes(num_rows, cu_rows.shape[0] - 1, splits)
    parts = {name: guarded(torch.full(shape, 0x5A5A5A5A, dtype=torch.int32, device=DEVICE))
             for name, shape in shapes.items()}
    parts["partial_float"] = guarded(torch.full(shapes["partial_float"], NAN, device=DEVICE))
    workspace = one_launch.Workspace(**{name: g.tensor for name, g in parts.items()})
    workspace.tickets.fill_(3)  # junk: the launcher zeroes them
    results = []
    for _ in range(calls):
        outputs = [guarded(torch.full((num_rows,), 424242, dtype=torch.int64, device=DEVICE)),
                   guarded(torch.ones(num_rows, dtype=torch.bool, device=DEVICE)),
                   guarded(torch.full((num_rows,), -7.25, device=DEVICE))]
        one_launch.select_tokens_one_launch(
            logits, cu_rows, row_pos, temperature, threshold, penalty, seed,
            sampling=sampling == "temperature", out=tuple(o.tensor for o in outputs),
            num_splits=num_splits, workspace=workspace)
        for name, g in zip(("token", "selected", "entropy"), outputs):
            g.check(name)
        results.append([o.tensor.cpu() for o in outputs])
    for name, g in parts.items():
        g.check(name)
    token, selected, entropy = results[0]
    for later in results[1:]:  # every call gives the first one's results
        assert torch.equal(later[0], token) and torch.equal(later[1], selected)
        torch.testing.assert_close(later[2], entropy, rtol=0, atol=0, equal_nan=True)
    return token, selected, entropy, workspace


def run_three_launch(args, sampling, num_splits=None):
    args = tuple(a.to(DEVICE) for a in args)
    return tuple(t.cpu() for t in select_ops.select_tokens_triton(
        *args, sampling, kernel="three_launch", num_splits=num_splits))


def in_mode(args, sampling):
    """The arguments as the rule reads them under ``sampling`` (for the reference)."""
    logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed = args
    if sampling == "greedy":
        temperature = torch.zeros_like(temperature)
    return (logits, cu_rows, row_pos, temperature, torch.zeros_like(top_k),
            torch.ones_like(top_p), threshold, penalty, seed)


def _draw_batch(data, g, vocab, max_rows_per_sequence=3):
    num_seqs = data.draw(st.integers(0, 4), label="B")
    seq_lens = [data.draw(st.integers(0, max_rows_per_sequence)) for _ in range(num_seqs)]
    leading, trailing = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    num_rows = leading + sum(seq_lens) + trailing
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    logits = random_logits(data, g, num_rows, vocab).to(dtype)
    cu_rows = [leading]
    for length in seq_lens:
        cu_rows.append(cu_rows[-1] + length)
    row_pos = [5] * num_rows
    for b, length in enumerate(seq_lens):
        context = data.draw(st.sampled_from([0, 17, 2**32 - 2, 2**40 + 5]))
        for j, slot in enumerate(torch.randperm(length + 2, generator=g)[:length].tolist()):
            row_pos[cu_rows[b] + j] = context + slot
        if length and data.draw(st.booleans(), label="padding row"):
            row_pos[cu_rows[b] + data.draw(st.integers(0, length - 1))] = -1
    temperature = [data.draw(st.sampled_from([0.0, -1.0, 1.0, 0.7, 0.05, 1.7, 1e-20, 3e38, INF,
                                              NAN])) for _ in seq_lens]
    top_k = [data.draw(st.sampled_from([0, 1, 5])) for _ in seq_lens]  # not read in these modes
    top_p = [data.draw(st.sampled_from([1.0, 0.3])) for _ in seq_lens]
    penalty = [data.draw(st.sampled_from([0.0, 0.02, 0.37])) for _ in seq_lens]
    seed = [data.draw(st.integers(-(2**63), 2**63 - 1)) for _ in seq_lens]
    threshold = choose_thresholds(data, logits, cu_rows, row_pos, penalty)
    params = (cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed)
    return batch(logits, *params), params


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_one_launch_gives_the_three_launch_tokens_bit_for_bit_and_the_reference_selection(data):
    """Random batches (odd vocabularies, NaN / +-inf rows, padding rows, empty sequences,
    temperatures from 1e-30 to +inf and NaN, 1-4 splits): tokens equal to the three-launch
    kernels' exactly (same stream, same score), entropy to fp32 summation order, and the
    selection the reference's where fp32 can decide it."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(st.one_of(st.integers(1, 40), st.sampled_from([257, 1000, 4097, 9000])),
                      label="V")
    args, params = _draw_batch(data, g, vocab)
    cu_rows, row_pos, _, _, _, threshold, penalty, _ = params
    sampling = data.draw(st.sampled_from(MODES), label="sampling")
    num_splits = data.draw(st.sampled_from([None, 1, 2, 3]), label="num_splits")

    token, selected, entropy, _ = run_one_launch(args, sampling, num_splits)
    three_token, _, three_entropy = run_three_launch(args, sampling, num_splits)
    ref_token, ref_selected, ref_entropy = ref.select_tokens(*in_mode(args, sampling))

    assert torch.equal(token, three_token)
    torch.testing.assert_close(entropy, three_entropy, rtol=2e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(entropy.double(), ref_entropy, **ENTROPY_TOLERANCE, equal_nan=True)
    if sampling == "greedy":
        assert torch.equal(token, ref_token)
    assert_selection(selected, ref_entropy, ref_selected, cu_rows, row_pos, threshold, penalty)


@pytest.mark.parametrize("sampling", MODES)
def test_splits_and_repeated_calls_change_nothing(sampling):
    """One batch at 1, 2, 3 and the default splits, each launched twice on one workspace
    (its tickets are zeroed for every launch: a ticket carried over would leave rows to
    junk or merge a sequence early)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 9000, generator=g) * 4
    args = batch(logits, [0, 2, 2, 5], [3, 4, 9, 10, 11, 7], [0.7, 1.0, 0.0], [0, 0, 0],
                 [1.0, 1.0, 1.0], [1.0, -INF, 5.0], [0.02, 0.0, 0.1], [1, -2, 3])
    results = [run_one_launch(args, sampling, num_splits, calls=2)
               for num_splits in (1, 2, 3, None)]
    three = run_three_launch(args, sampling)
    for token, selected, entropy, _ in results:
        assert torch.equal(token, three[0])
        assert torch.equal(selected, three[1])
        torch.testing.assert_close(entropy, three[2], rtol=2e-6, atol=1e-6)


def test_every_random_word_has_a_score_bound_at_least_its_noise():
    """The bound the kernel prunes with, on all 2^24 distinct words (the 8 low bits do not
    enter the noise): never below the kernel's own noise, nor the PyTorch path's, and within
    0.015 of it where the noise is at least 2 (where winning entries are)."""
    words = (torch.arange(1 << 24, dtype=torch.int64) << 8) | 0xA5
    bound, gumbel = one_launch.gumbel_bound_triton(words.to(DEVICE))
    bound, gumbel = bound.cpu(), gumbel.cpu()
    assert bool((bound >= gumbel).all())
    assert bool((bound >= gumbel_from_bits(words)).all())
    high = gumbel >= 2
    assert float((bound - gumbel)[high].max()) < 0.015
    assert float(gumbel.max()) < 17.4  # the kernel's largest-noise constant is 17.5


def _just_below_the_peak_row(vocab, peak_index, seed, position):
    """A row whose peak (logit 12) scores S and whose other entries score S - 0.25 where
    their noise is at least 2 (there the bound exceeds the noise by at most 0.015, see the
    test above) and are -inf elsewhere: no other entry can win, and a bound looser by 0.25
    makes every sub-tile a candidate."""
    words = torch.from_numpy(ref_philox.philox_word(seed, position, torch.arange(vocab).numpy())
                             .astype("int64"))
    _, noise = (t.cpu() for t in one_launch.gumbel_bound_triton(words.to(DEVICE)))
    best_score = torch.tensor(12.0) + noise[peak_index]  # fp32, at temperature 1
    row = torch.where(noise >= 2, best_score - 0.25 - noise, -INF)
    row[peak_index] = 12.0
    return row.tolist()


@pytest.mark.parametrize("peak_index", [5, 5000])
def test_only_sub_tiles_whose_bound_reaches_the_best_score_are_scored_exactly(peak_index):
    """On a row where other entries score 0.25 below the peak, the sub-tiles up to the
    peak's are scored exactly (before the peak the best score is another entry's, below its
    own bound, so each sub-tile's bound reaches it) and none after it. A bound looser by
    0.25 rescores every sub-tile."""
    vocab, seed, position = 8192, 3, 9
    args = one_sequence([_just_below_the_peak_row(vocab, peak_index, seed, position)],
                        [position], temperature=1.0, seed=seed)
    token, _, _, workspace = run_one_launch(args, "temperature", num_splits=1)
    assert int(token[0]) == peak_index
    assert int(workspace.rescored[0, 0]) == peak_index // (one_launch.SUB_GRANULES * 64) + 1


def test_ties_between_tiles_and_splits_take_the_first_index():
    """Greedy maxima and sampled scores tied across tiles and splits: the first index."""
    args, expected = greedy_tile_tie_batch(9000, ((3, 4100), (4095, 4096, 8999), (100, 101)))
    for num_splits in (1, 2, None):
        token, _, _, _ = run_one_launch(args, "greedy", num_splits)
        assert token.tolist() == expected

    def gumbel_of(seed, position, indices):
        count = len(indices)
        _, noise = philox_gumbel_triton(i64(*[seed] * count).to(DEVICE),
                                        i64(*[position] * count).to(DEVICE),
                                        i64(*indices).to(DEVICE))
        return noise.cpu()

    args, expected = sampled_tie_batch(9000, (40, 4200, 8999), gumbel_of)
    for num_splits in (1, 3):
        token, _, _, _ = run_one_launch(args, "temperature", num_splits)
        assert token.tolist() == expected


@pytest.mark.parametrize("temperature", [1e-30, 3e38, INF, NAN, -0.0])
def test_temperatures_at_the_bounds_give_the_three_launch_tokens(temperature):
    """Tiny, huge, +inf (pure noise), NaN (no entry scores: token 0) and -0.0 (greedy)."""
    args = _bounds_batch(temperature)
    token, _, _, _ = run_one_launch(args, "temperature")
    assert torch.equal(token, run_three_launch(args, "temperature")[0])


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_scores_that_overflow_take_the_first_infinite_one_like_the_pytorch_path(temperature):
    """Where ``x / T`` overflows fp32 the overflowed entries tie at +inf: the first index
    wins, as in the PyTorch path (docs/contracts.md, "Sampling modes"; the three-launch
    kernel takes the first one at or above its floor, the running maximum less 24 T). At
    1e-45 the inverse temperature overflows too and the kernel scores every sub-tile."""
    args = _bounds_batch(temperature)
    token, _, _, _ = run_one_launch(args, "temperature")
    assert torch.equal(token, select_ops.select_tokens_torch(*args, "temperature")[0])


def _bounds_batch(temperature):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3000, generator=g) * 3
    logits[1, :100] = 0.0
    logits[2] = -INF
    logits[3] = 0.0  # x / T = 0 at any temperature: the noise alone decides
    return batch(logits, [0, 4], [4, 5, 6, 7], [temperature], [0], [1.0], [-INF], [0.0], [77])


def test_a_workspace_shaped_for_another_launch_is_a_value_error():
    args = one_sequence([[0.0, 1.0]], [3])
    workspace = one_launch.Workspace.view(torch.zeros(64, dtype=torch.int32), 2, 1, 1)
    with pytest.raises(ValueError, match="workspace.row_sequence"):
        one_launch.select_tokens_one_launch(
            args[0], args[1], args[2], args[3], args[6], args[7], args[8], sampling=False,
            workspace=workspace)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", MODES)
def test_cuda_graph_replay_with_changed_inputs_matches_eager(sampling):
    """Captured, the launch takes its own workspace (the graph keeps it) and zeroes its
    tickets at every replay."""
    g = torch.Generator().manual_seed(2)
    args = [a.cuda() for a in batch(torch.randn(32, 151936, generator=g).bfloat16(),
                                    [0, 16, 32], list(range(100, 132)), [0.7, 0.0], [0, 0],
                                    [1.0, 1.0], [0.5, 0.5], [0.02, 0.02], [1, 2])]
    static = [a.clone() for a in args]
    launch = lambda: select_ops.select_tokens_triton(*static, sampling, kernel="one_launch")  # noqa: E731
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch()
    for trial in range(3):
        static[0].copy_(torch.randn(32, 151936, generator=g).bfloat16())
        graph.replay()
        eager = select_ops.select_tokens_triton(*static, sampling, kernel="three_launch")
        for mine, theirs in zip(captured, eager):
            assert torch.equal(mine, theirs), trial


@pytest.mark.parametrize("sampling", MODES)
def test_the_one_reduction_form_gives_the_same_results(sampling):
    """The GPU's form of the tile statistics, one ``tl.reduce`` of (max, sum, sum), gives
    what the interpreter's three reductions give (rows with NaN, +inf, -inf, ties)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=g) * 3
    logits[1, 7] = NAN
    logits[2, 9] = INF
    logits[3] = -INF
    logits[4, ::3] = 2.5
    args = [a.to(DEVICE) for a in batch(logits, [0, 2, 5], [3, 4, 5, 6, 7], [0.8, 0.0],
                                        [0, 0], [1.0, 1.0], [1.0, 0.5], [0.02, 0.0], [9, 8])]
    results = [one_launch.select_tokens_one_launch(
        args[0], args[1], args[2], args[3], args[6], args[7], args[8],
        sampling=sampling == "temperature", one_reduction=one_reduction)
        for one_reduction in (True, False)]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-6, atol=1e-6,
                               equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_kept_launch_handles_are_the_kernels_triton_picks(monkeypatch):
    """Launches through kept compiled handles (ops/_triton.CachedLaunch) at specialisations
    that differ in what Triton specialises on (one split, an odd vocabulary and row stride,
    a misaligned logits pointer, fp16): with WEDLM_KERNELS_DEBUG Triton's own choice is
    checked at every launch, and the tokens are the three-launch kernels'."""
    from wedlm_kernels import _backend

    monkeypatch.setattr(_backend, "DEBUG", True)
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(8, 50001, generator=g).cuda()
    cases = [(wide[:, :50000].bfloat16(), None), (wide[:, :50000].bfloat16(), 1),
             (wide[:, 1:].half(), None), (wide[:, :4099], 3), (wide.bfloat16()[:, 1:], 2)]
    for logits, num_splits in cases * 2:  # the second round reuses the kept handles
        args = batch(logits.float().cpu(), [0, 3, 8], list(range(8)), [0.7, 0.0], [0, 0],
                     [1.0, 1.0], [0.5, 0.5], [0.02, 0.02], [4, 5])
        args = (logits,) + tuple(a.cuda() for a in args[1:])
        for sampling in MODES:
            mine = select_ops.select_tokens_triton(*args, sampling, kernel="one_launch",
                                                   num_splits=num_splits)
            theirs = select_ops.select_tokens_triton(*args, sampling, kernel="three_launch")
            assert torch.equal(mine[0], theirs[0])
            assert torch.equal(mine[1], theirs[1])
