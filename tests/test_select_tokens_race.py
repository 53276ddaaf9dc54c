"""Race stress of select_tokens' filter kernel: flat top-p rows, whose short candidate list
sends them to the checked-draws path (each split's program sums its draws' masses and the
last one of the row to arrive, by an atomic count, decides), decoded many times at many
split counts. Every run must give bit-identical outputs, and the tokens of one split.

On a GPU this is a stress test (50 runs at 2, 7, 38 and 128 requested splits on a
vocabulary large enough for 128). Triton's interpreter runs programs one after another, so
on the CPU it only keeps the test itself working (two runs, small vocabulary).
"""

import pytest
import torch

from reference import select as ref
from tests.numerics import assert_same_token
from tests.select_inputs import batch
from wedlm_kernels.ops import select as select_ops
from wedlm_kernels.ops.select import SelectWorkspace, select_tokens_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TILE = select_ops.GRANULE * 32  # entries per scan tile (a split holds whole tiles)
VOCAB = select_ops.MAX_SPLITS * TILE + 777 if ON_GPU else 3 * TILE + 5
SPLITS = [2, 7, 38, 128] if ON_GPU else [3]
RUNS = 50 if ON_GPU else 2
MAX_CANDIDATES = 8
TEMPERATURE = 0.8
TOP_P = [0.5, 0.05, 0.9, 0.3] if ON_GPU else [0.5, 0.05]  # per sequence
ROWS_PER_SEQUENCE = 4 if ON_GPU else 2
CHECKED_DRAWS = {code for code, name in select_ops.PATH_NAMES.items() if name == "checked draws"}


def _flat_top_p_batch():
    g = torch.Generator().manual_seed(2024)
    num_rows = ROWS_PER_SEQUENCE * len(TOP_P)
    logits = torch.randn(num_rows, VOCAB, generator=g) * 0.1
    cu_rows = [ROWS_PER_SEQUENCE * b for b in range(len(TOP_P) + 1)]
    return batch(logits, cu_rows, [500 + r for r in range(num_rows)],
                 [TEMPERATURE] * len(TOP_P), [0] * len(TOP_P), TOP_P, [0.5] * len(TOP_P),
                 [0.02] * len(TOP_P), [11 + b for b in range(len(TOP_P))])


def _decode(args, num_splits, runs):
    """``runs`` launches reusing one workspace (as a captured graph replays), which starts
    as junk; returns every run's outputs on the CPU and the paths of the last run."""
    num_rows, vocab = args[0].shape
    splits, _ = select_ops.split_plan(num_rows, vocab, DEVICE, num_splits)
    workspace = SelectWorkspace.empty(num_rows, vocab, splits, DEVICE, MAX_CANDIDATES)
    for part in vars(workspace).values():
        part.fill_(0x5A5A5A5A if part.dtype == torch.int32 else float("nan"))
    outputs = []
    for _ in range(runs):
        token, selected, entropy = select_tokens_triton(*args, num_splits=num_splits,
                                                        workspace=workspace)
        outputs.append((token.cpu(), selected.cpu(), entropy.cpu()))
    return outputs, workspace.path.cpu()


def test_flat_top_p_rows_are_bit_identical_across_runs_and_split_counts():
    args = tuple(a.to(DEVICE) for a in _flat_top_p_batch())
    (one_split,), _ = _decode(args, 1, 1)
    cpu_args = tuple(a.cpu() for a in args)
    for num_splits in SPLITS:
        outputs, paths = _decode(args, num_splits, RUNS)
        assert set(paths.tolist()) & CHECKED_DRAWS, (num_splits, paths.tolist())
        first = outputs[0]
        for run, output in enumerate(outputs[1:], 1):
            for name, a, b in zip(("token", "selected", "entropy"), first, output):
                assert torch.equal(a, b), f"{name} differs in run {run} at {num_splits} splits"
        differ = (first[0] != one_split[0]).nonzero().flatten().tolist()
        # the sum order of a row's mass depends on the split count: only a token whose
        # top-p mass lies within rounding of the cutoff may differ, and then both tokens
        # must be the reference's up to that rounding
        for r in differ:
            b = r // ROWS_PER_SEQUENCE
            row = cpu_args[0][r]
            expected = ref.sample_row(row, TEMPERATURE, 0, TOP_P[b], 11 + b, 500 + r)
            for token in (int(first[0][r]), int(one_split[0][r])):
                assert_same_token(token, expected, row, TEMPERATURE, 0, TOP_P[b], 11 + b,
                                  500 + r)


ONE_LAUNCH_SPLITS = [2, 7, 37] if ON_GPU else [2]
ONE_LAUNCH_SEQUENCES = 16 if ON_GPU else 3


@pytest.mark.parametrize("sampling", ["greedy", "temperature"])
def test_one_launch_sequence_tickets_give_bit_identical_runs(sampling):
    """The one-launch kernel merges a sequence in whichever program of it arrives last (its
    ticket): every run, at every split count, gives the outputs of the first, and its tokens
    are the three-launch kernels'."""
    from wedlm_kernels.ops import select_one_launch

    g = torch.Generator().manual_seed(7)
    rows_per_sequence = 16 if ON_GPU else 2
    num_rows = rows_per_sequence * ONE_LAUNCH_SEQUENCES
    vocab = 151936 if ON_GPU else 9000
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(DEVICE)
    cu_rows = [rows_per_sequence * b for b in range(ONE_LAUNCH_SEQUENCES + 1)]
    args = tuple(a.to(DEVICE) for a in batch(
        logits, cu_rows, [900 + r for r in range(num_rows)],
        [0.7 * (b % 3) for b in range(ONE_LAUNCH_SEQUENCES)], [0] * ONE_LAUNCH_SEQUENCES,
        [1.0] * ONE_LAUNCH_SEQUENCES, [0.5] * ONE_LAUNCH_SEQUENCES,
        [0.02] * ONE_LAUNCH_SEQUENCES, list(range(ONE_LAUNCH_SEQUENCES))))
    three = select_tokens_triton(*args, sampling, kernel="three_launch")
    for num_splits in ONE_LAUNCH_SPLITS:
        first = None
        for run in range(RUNS):
            outputs = tuple(t.cpu() for t in select_one_launch.select_tokens_one_launch(
                args[0], args[1], args[2], args[3], args[6], args[7], args[8],
                sampling=sampling == "temperature", num_splits=num_splits))
            if first is None:
                first = outputs
                assert torch.equal(first[0], three[0].cpu()), num_splits
            for name, a, b in zip(("token", "selected", "entropy"), first, outputs):
                assert torch.equal(a, b), f"{name} differs in run {run} at {num_splits} splits"
