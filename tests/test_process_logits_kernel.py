"""The Triton kernels of process_logits through their launcher (Triton's interpreter when
there is no GPU) against reference/logits.py and the PyTorch implementation, bit for bit.
The logits sit between guard bands (an out-of-bounds write shows), vocabularies are not
multiples of the rules kernel's 1024-entry tile nor of a bitmask word, and some span
several tiles of both kernels (the min_p kernel walks a row in 2048-entry blocks). bf16
only on the GPU (the interpreter truncates fp32 -> bf16 casts).

Interpreter programs cost tens of milliseconds each, so batches hold a few rows.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import logits as ref
from tests.kernel_harness import guarded
from tests.test_process_logits import (
    GROUPS,
    INF,
    INT_VIEW,
    NAN,
    OPTIONAL,
    assert_identical_bits,
    assert_same_bits,
    draw_inputs,
    every_group,
    f32,
    i32,
    i64,
    mask_words,
    valid_rows,
)
from wedlm_kernels.ops import logits as logits_ops
from wedlm_kernels.ops._triton import POINTER_TYPES
from wedlm_kernels.ops.logits import (
    kernel_variants,
    process_logits_torch,
    process_logits_triton,
)

# the interpreter evaluates the rules with numpy, which warns about inf - inf and NaN
# comparisons of the special values the tests feed it
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings(
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 -> bf16 casts truncate in the interpreter: bf16 logits only on the GPU
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
# hypothesis examples of the interpreter tests (a third of the profile's)
EXAMPLES = max(6, settings.default.max_examples // 3)
SENTINEL = 4352.0  # exact in every dtype; no rule maps a logit to it by chance
BLOCK = logits_ops._BLOCK
MIN_P_BLOCK = logits_ops._MIN_P_BLOCK
# vocabularies: tiny, around a bitmask word, around and past the rules tile and the min_p
# block (several tiles, several min_p iterations)
KERNEL_VOCABS = st.one_of(st.integers(1, 40),
                          st.sampled_from([31, 33, 1000, 1023, 1025, 1100, 2049, 2100]))


def run_kernel(args, options, pad_columns=0):
    """The launcher on DEVICE with the logits between guard bands (and, with
    ``pad_columns``, as a view of a wider buffer); returns the processed logits on the CPU
    after checking that nothing outside them changed."""
    logits = args[0]
    rows, vocab = logits.shape
    storage = torch.full((rows, vocab + pad_columns), SENTINEL, dtype=logits.dtype)
    left = pad_columns // 2
    storage[:, left:left + vocab] = logits
    buffer = guarded(storage.to(DEVICE), sentinel=SENTINEL)
    before = buffer.tensor.clone()
    view = buffer.tensor[:, left:left + vocab]
    moved = [a.to(DEVICE) for a in args[1:]]
    extra = [None if options[name] is None else options[name].to(DEVICE) for name in OPTIONAL]
    process_logits_triton(view, *moved, *extra)
    buffer.check("logits")
    outside = torch.ones(rows, vocab + pad_columns, dtype=torch.bool)
    outside[:, left:left + vocab] = False
    assert_identical_bits(buffer.tensor.cpu()[outside], before.cpu()[outside],
                          "the columns outside the logits")
    return view.cpu()


def torch_result(args, options):
    logits = args[0].clone()
    process_logits_torch(logits, *args[1:], *[options[name] for name in OPTIONAL])
    return logits


def check(args, options, pad_columns=0):
    """The kernel's result equals the reference's and the PyTorch path's bit for bit, and
    the rows that are not valid keep their bits. Returns it."""
    out = run_kernel(args, options, pad_columns)
    assert_same_bits(out, ref.process_logits(*args, **options), "kernel vs reference")
    assert_same_bits(out, torch_result(args, options), "kernel vs PyTorch")
    valid = valid_rows(args[1].tolist(), args[2].tolist(), args[0].shape[0])
    for r, is_valid in enumerate(valid):
        if not is_valid:
            assert_identical_bits(out[r], args[0][r], f"row {r} is not valid but changed")
    return out


# ----------------------------------------------------------------------------------------
# Random batches
# ----------------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_kernel_matches_reference_and_pytorch_on_random_batches(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(KERNEL_VOCABS, label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    args, options = draw_inputs(data, g, vocab, dtype, max_seqs=3)
    pad_columns = data.draw(st.sampled_from([0, 0, 5]), label="pad columns")
    check(args, options, pad_columns)


@pytest.mark.parametrize("groups", [(group,) for group in GROUPS] + [tuple(GROUPS)],
                         ids=[*GROUPS, "all"])
@settings(max_examples=max(2, EXAMPLES // 8))
@given(data=st.data())
def test_each_group_alone_and_all_together(groups, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**63 - 1), label="seed"))
    vocab = data.draw(st.sampled_from([45, 1100, 2100]), label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    args, options = draw_inputs(data, g, vocab, dtype, max_seqs=2, groups=groups)
    check(args, options)


# ----------------------------------------------------------------------------------------
# Tiles, bits and values
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rules_at_tile_and_word_edges_of_a_large_vocabulary(dtype):
    """Ids and bitmask bits at the last entry of a tile, the first of the next, bit 31 of a
    word and the last token of a vocabulary that is not a multiple of 32; two rows span
    three rules tiles and two min_p blocks."""
    vocab = 2 * BLOCK + MIN_P_BLOCK // 2 + 7
    edges = [0, 31, 32, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, MIN_P_BLOCK - 1,
             MIN_P_BLOCK, vocab - 2, vocab - 1]
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, vocab, generator=g) * 2).to(dtype)
    allowed = [v for v in range(vocab) if v % 5 != 0 or v in edges]
    stop_ids = i64(BLOCK, vocab - 1, vocab, -1).view(1, 4)
    bias_ids = i64(BLOCK - 1, 2 * BLOCK, vocab - 2, vocab, 31).view(1, 5)
    bias_values = f32(9.0, -3.0, 3.0, 100.0, -0.0).view(1, 5)
    counts = torch.zeros(1, vocab, dtype=torch.int32)
    counts[0, edges] = 3
    options = dict.fromkeys(OPTIONAL)
    options.update(
        min_p=f32(1e-6), min_tokens=i32(1), stop_ids=stop_ids, bias_ids=bias_ids,
        bias_values=bias_values, output_counts=counts,
        prompt_mask=torch.arange(vocab)[None, :] % 7 == 0, presence_penalty=f32(0.5),
        frequency_penalty=f32(0.25), repetition_penalty=f32(1.5),
        allowed_mask=mask_words([allowed], vocab),
        token_bitmask=mask_words([list(range(vocab)), [v for v in range(vocab)
                                                       if v not in edges[1::2]], []], vocab),
    )
    args = (logits, i32(0, 3), i64(8, 9, 10), i32(8), f32(1.0))
    out = check(args, options, pad_columns=3)
    assert out[0, vocab - 1] == -INF and out[0, BLOCK] == -INF  # stop ids (output index 0)
    assert out[1, 31] == -INF and out[2].isinf().all()  # the rows' bitmasks


def test_min_p_finds_the_maximum_in_the_last_block_and_cuts_every_block():
    vocab = 2 * MIN_P_BLOCK + 37
    logits = torch.full((2, vocab), -1.0)
    logits[:, ::3] = -6.0  # below the cut in every block
    logits[0, vocab - 1] = 8.0  # the maximum of row 0 in its last, partial block
    logits[1, MIN_P_BLOCK] = 1.0  # row 1's at the first entry of its second block
    args = (logits, i32(0, 2), i64(3, 4), i32(0), f32(2.0))
    options = dict.fromkeys(OPTIONAL)
    options["min_p"] = f32(0.05)  # cut = max + 2 * log(0.05) = max - 5.99
    out = check(args, options)
    # row 0: cut 2.01: every -1 and -6 entry goes; row 1: cut -4.99: only the -6 entries
    # (from the maximum of the last block, -1, the cut would be -6.99)
    assert torch.equal(out[0], torch.where(torch.arange(vocab) == vocab - 1, 8.0, -INF))
    assert torch.equal(out[1], torch.where(logits[1] == -6.0, -INF, logits[1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_and_signed_zero_logits(dtype):
    rows = [
        [NAN, 0.0, -0.0, 1.0, -INF, INF],       # NaN row: no min_p cut
        [-0.0, -0.0, 0.0, -1.0, -INF, 2.0],
        [INF, 1.0, -0.0, -INF, 0.0, -5.0],      # +inf maximum: no min_p cut
        [-INF] * 6,
        [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0],      # min_p 1e-45 cuts none of them
    ]
    logits = torch.tensor(rows).to(dtype)
    args = (logits, i32(0, 2, 5), i64(1, 2, 3, 4, 5), i32(0, 0), f32(1.0, 0.5))
    options = every_group(2, 5, 6, allowed_word=-1)
    options.update(bias_ids=i64(0, 2, 1, 5).view(2, 2),
                   bias_values=f32(-0.0, 0.0, -0.0, -INF).view(2, 2),
                   output_counts=i32(0, 1, 0, 2, 0, 1, 0, 0, 3, 0, 1, 0).view(2, 6),
                   prompt_mask=torch.tensor([[True, False, False, True, True, False],
                                             [False, True, False, False, True, True]]),
                   frequency_penalty=f32(-2.0, -0.5), presence_penalty=f32(-0.0, 1.0),
                   min_p=f32(0.9, 1e-45))
    out = check(args, options)
    # row 4 (rep 2, frequency -1/2, presence 1): token 0 (unseen, no bias): -0.0 - (-0.5 *
    # 0) = -0.0 - -0.0 = 0.0; token 1 (prompt, bias -0.0): -0.0 * 2 - -0.0 = 0.0; token 2
    # (count 3): -0.0 * 2 + 1.5 - 1 = 0.5; token 4 (count 1): -0.0 + 0.5 - 1 = -0.5
    expected = torch.tensor([0.0, 0.0, 0.5, 0.0, -0.5, -INF]).to(dtype)
    assert_identical_bits(out[4], expected, "row 4")


def test_frequency_product_is_rounded_before_the_difference():
    # float32(0.2) * 5 rounds to exactly 1: 1 - 1 = 0 (a fused multiply-add gives -1.5e-8);
    # count 2**24 + 1 is 2**24 in float32: 3 - 2**24 = -16777213
    args = (torch.tensor([[1.0, 3.0]]), i32(0, 1), i64(0), i32(0), f32(1.0))
    options = dict.fromkeys(OPTIONAL)
    options.update(output_counts=i32(5, 0).view(1, 2),
                   prompt_mask=torch.tensor([[False, False]]), presence_penalty=f32(0.0),
                   frequency_penalty=f32(0.2), repetition_penalty=f32(1.0))
    assert torch.equal(check(args, options), torch.tensor([[0.0, 3.0]]))
    options.update(output_counts=i32(0, 2**24 + 1).view(1, 2), frequency_penalty=f32(1.0))
    assert torch.equal(check(args, options), torch.tensor([[1.0, -16777213.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_are_not_valid_keep_their_bits(dtype):
    vocab = 1030
    view = INT_VIEW[dtype]
    info = torch.iinfo(view)
    logits = torch.randint(info.min, info.max, (6, vocab), dtype=view,
                           generator=torch.Generator().manual_seed(3)).view(dtype)
    # row 0 before cu_rows[0], row 2 row_pos -1, sequence 1 empty, row 5 past cu_rows[B]
    args = (logits, i32(1, 2, 2, 5), i64(4, 5, -1, 6, 7, 8), i32(0, 0, 0), f32(1.0, 1.0, 1.0))
    out = check(args, every_group(3, 6, vocab), pad_columns=4)
    assert torch.equal(out[[1, 3, 4]], torch.full((3, vocab), -INF, dtype=dtype))


# ----------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------


class _Recording:
    """Stands in for a kernel: records each launch's grid, argument types and constexprs."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, num_warps, enable_fp_fusion, **constexprs):
            types = tuple(POINTER_TYPES[a.dtype] if isinstance(a, torch.Tensor) else "i32"
                          for a in args)
            self.launches.append((self.name, grid, types, tuple(sorted(constexprs.items())),
                                  num_warps, enable_fp_fusion))
        return launch


def _record(monkeypatch):
    launches = []
    monkeypatch.setattr(logits_ops, "_process_logits_kernel", _Recording("rules", launches))
    monkeypatch.setattr(logits_ops, "_min_p_kernel", _Recording("min_p", launches))
    return launches


@pytest.mark.parametrize("shape,cu_rows", [((0, 9), [0]), ((0, 9), [0, 0, 0]),
                                           ((3, 9), [0]), ((3, 0), [0, 2, 3])])
def test_no_rows_no_sequences_or_no_vocabulary_launch_nothing(monkeypatch, shape, cu_rows):
    launches = _record(monkeypatch)
    num_seqs, (num_rows, vocab) = len(cu_rows) - 1, shape
    options = every_group(num_seqs, num_rows, vocab)
    process_logits_triton(torch.randn(shape), i32(*cu_rows), i64(*range(num_rows)),
                          i32(*[0] * num_seqs), f32(*[1.0] * num_seqs),
                          *[options[name] for name in OPTIONAL])
    assert launches == []


def test_only_the_kernels_of_the_given_groups_launch(monkeypatch):
    launches = _record(monkeypatch)
    args = (torch.randn(3, 2100), i32(0, 3), i64(0, 1, 2), i32(0), f32(1.0))
    process_logits_triton(*args, *[None] * len(OPTIONAL))
    assert launches == []
    min_p_only = [f32(0.5)] + [None] * (len(OPTIONAL) - 1)
    process_logits_triton(*args, *min_p_only)
    assert [(name, grid) for name, grid, *_ in launches] == [("min_p", (3,))]
    launches.clear()
    options = every_group(1, 3, 2100)
    process_logits_triton(*args, *[options[name] for name in OPTIONAL])
    assert [(name, grid) for name, grid, *_ in launches] == [("rules", (3, 3)),
                                                             ("min_p", (3,))]
    launches.clear()
    options["bias_ids"], options["bias_values"] = i64().view(1, 0), f32().view(1, 0)
    options["min_p"] = None
    process_logits_triton(*args, *[options[name] for name in OPTIONAL])
    assert dict(launches[0][3])["HAS_BIAS"] is False  # an empty bias list is no bias


# the pointers each rule flag reads; the launcher passes row_pos (an int64 pointer) for
# those of a group that is not given, which the kernel never reads
FLAG_POINTERS = {
    "HAS_MIN_TOKENS": ("min_tokens_ptr", "stop_ids_ptr"),
    "HAS_BIAS": ("bias_ids_ptr", "bias_values_ptr"),
    "HAS_PENALTIES": ("output_counts_ptr", "prompt_mask_ptr", "presence_ptr", "frequency_ptr",
                      "repetition_ptr"),
    "HAS_ALLOWED": ("allowed_mask_ptr",),
    "HAS_BITMASK": ("token_bitmask_ptr",),
}


def _read_types(kernel, types, constexprs):
    """The argument types of a launch with those of unread pointers blanked out."""
    names = [name for name in inspect.signature(kernel.fn).parameters
             if name not in dict(constexprs) and name != "BLOCK"]
    unread = {pointer for flag, pointers in FLAG_POINTERS.items()
              if dict(constexprs).get(flag) is False for pointer in pointers}
    return tuple("unread" if name in unread else kind for name, kind in zip(names, types))


def test_kernel_variants_list_the_launches_of_their_rule_sets(monkeypatch):
    """Each listed variant's signature is its kernel's parameter list, and a launch with the
    groups of a listed rule set (or min_p) is listed (up to the types of the pointers it
    never reads), as the sm_90 compile test builds it."""
    variants = kernel_variants()
    kernels = {"rules": logits_ops._process_logits_kernel, "min_p": logits_ops._min_p_kernel}
    listed = set()
    for v in variants:
        assert list(v.signature) == list(inspect.signature(v.kernel.fn).parameters)
        name = "rules" if v.kernel is kernels["rules"] else "min_p"
        constexprs = tuple(sorted(v.constexprs.items()))
        types = tuple(t for t in v.signature.values() if t != "constexpr")
        listed.add((name, _read_types(v.kernel, types, constexprs), constexprs, v.num_warps,
                    v.enable_fp_fusion))
    launches = _record(monkeypatch)
    rule_sets = {"all": tuple(GROUPS), "penalties": ("penalties",), "bitmask": ("bitmask",),
                 "bias_min_tokens": ("bias", "min_tokens")}
    assert set(rule_sets) == set(logits_ops._RULE_SETS)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for groups in rule_sets.values():
            for vocab in (7, 4097):
                options = every_group(2, 3, vocab)
                given = {name for group in groups for name in GROUPS[group]}
                options = {name: value if name in given else None
                           for name, value in options.items()}
                process_logits_triton(torch.zeros(3, vocab, dtype=dtype), i32(0, 1, 3),
                                      i64(0, 1, 2), i32(0, 0), f32(1.0, 1.0),
                                      *[options[name] for name in OPTIONAL])
    assert {launch[0] for launch in launches} == {"rules", "min_p"}
    for name, _, types, constexprs, num_warps, fusion in launches:
        launch = (name, _read_types(kernels[name], types, constexprs), constexprs, num_warps,
                  fusion)
        assert launch in listed, launch
        assert fusion is False  # each operation rounds once


_DIVISIONS_CHILD = r"""
import json, re
from tests.kernel_harness import compile_sm90
from wedlm_kernels.ops import logits
variant = next(v for v in logits.kernel_variants() if v.name == "rules_penalties_fp32")
ptx = compile_sm90(variant).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"\bdiv\.[a-z0-9.]+", ptx)))))
"""


def test_repetition_penalty_divides_with_ieee_rounding_on_the_gpu():
    """The interpreter divides with numpy; on the GPU Triton's ``/`` on fp32 is
    ``div.full.f32`` (approximate, up to 2 ulp off), which would break the bit-for-bit
    agreement: the rules kernel compiled for sm_90 (in a child without TRITON_INTERPRET, as
    tests/test_kernels_compile_sm90.py does) divides with ``div.rn.f32`` only."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _DIVISIONS_CHILD],
                          cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["div.rn.f32"]


# ----------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_shapes_match_pytorch_on_gpu(dtype):
    g = torch.Generator().manual_seed(7)
    vocab, rows = 151936, 64
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    cu_rows = i32(*range(0, rows + 1, 16))
    options = every_group(4, rows, vocab, allowed_word=-1)
    options["output_counts"] = torch.randint(0, 3, (4, vocab), generator=g, dtype=torch.int32)
    options["prompt_mask"] = torch.rand(4, vocab, generator=g) < 0.1
    options["min_p"] = f32(0.05, 0.0, 0.3, 1.0)
    args = (logits, cu_rows, i64(*range(rows)), i32(0, 0, 0, 0), f32(1.0, 0.7, 1.3, 0.0))
    out = run_kernel(args, options)
    assert_same_bits(out, torch_result(args, options), "kernel vs PyTorch")

