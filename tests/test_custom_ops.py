"""Every public op is a well-formed ``torch.library`` custom op.

``opcheck`` validates the schema (including the declared mutations), the fake kernel against
the real one, and the dispatcher registrations; ``torch.compile(fullgraph=True)`` must trace
the public function (validation included) without a graph break and give the eager result.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

import wedlm_kernels as wk
from wedlm_kernels.ops import attention as attention_ops


def _reorder_args():
    g = torch.Generator().manual_seed(0)
    batch, slots, page_size = 3, 8, 4
    win_tokens = torch.randint(0, 50, (batch, slots), generator=g)
    win_mask = torch.rand(batch, slots, generator=g) < 0.5
    win_len = torch.tensor([8, 5, 0], dtype=torch.int32)
    ctx_len = torch.tensor([3, 9, 0], dtype=torch.int32)
    block_table = torch.randperm(12, generator=g).to(torch.int32).view(batch, 4)
    return (win_tokens, win_mask, win_len, ctx_len, block_table, page_size, 15)


def _rope_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, head_dim, page_size, num_pages = 5, 4, 2, 16, 4, 3
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([7, 3, 4, 9, 0])
    cos_sin = wk.rope_cache(16, head_dim, 10000.0)
    k_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([0, 5, -1, 6, 11])
    q_norm = torch.rand(head_dim, generator=g) + 0.5
    k_norm = torch.rand(head_dim, generator=g) + 0.5
    return (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, 1e-6)


def _attention_args():
    g = torch.Generator().manual_seed(2)
    q_heads, kv_heads, head_dim, page_size = 4, 2, 16, 4
    q = torch.randn(7, q_heads, head_dim, generator=g)  # 4 + 2 rows and one padding row
    k_cache = torch.randn(6, page_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(6, page_size, kv_heads, head_dim, generator=g)
    block_table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    query_start = torch.tensor([0, 4, 6], dtype=torch.int32)
    ctx_len = torch.tensor([5, 0], dtype=torch.int32)
    return (q, k_cache, v_cache, block_table, query_start, ctx_len, head_dim**-0.5)


def _select_args():
    g = torch.Generator().manual_seed(3)
    rows, vocab = 6, 37
    logits = torch.randn(rows, vocab, generator=g) * 3
    cu_rows = torch.tensor([0, 3, 3, 6], dtype=torch.int32)
    row_pos = torch.tensor([10, 12, 13, 4, -1, 6])
    temperature = torch.tensor([0.0, 1.0, 0.7])
    top_k = torch.tensor([0, 0, 5], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.9])
    threshold = torch.tensor([2.5, -float("inf"), 3.0])
    penalty = torch.tensor([0.02, 0.0, 0.1])
    seed = torch.tensor([1, 2, -3])
    return (logits, cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed)


def _commit_args():
    mask_id, window = 99, 4
    win_tokens = torch.tensor([[5, 99, 7, 99, 99, 99, 99, 99], [99, 99, 99, 99, 99, 99, 99, 99]])
    win_mask = win_tokens == mask_id
    win_len = torch.tensor([5, 4], dtype=torch.int32)
    ctx_len = torch.tensor([10, 3], dtype=torch.int32)
    cu_rows = torch.tensor([0, 3, 7], dtype=torch.int32)
    row_pos = torch.tensor([11, 13, 14, 3, 4, 5, 6])
    token = torch.tensor([21, 22, 23, 31, 32, 33, 34])
    selected = torch.tensor([True, True, False, False, True, False, False])
    out_tokens = torch.full((2, 16), -7)
    out_len = torch.tensor([2, 0], dtype=torch.int32)
    finished = torch.tensor([False, False])
    stop_ids = torch.tensor([[2, -1], [7, 8]])
    max_new = torch.tensor([12, 9], dtype=torch.int32)
    return (win_tokens, win_mask, win_len, ctx_len, cu_rows, row_pos, token, selected,
            out_tokens, out_len, finished, stop_ids, max_new, window, mask_id, False)


def _silu_mul_args():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(3, 2 * 7 + 2, generator=g)[:, :14],)


def _process_logits_args():
    g = torch.Generator().manual_seed(6)
    rows, vocab = 6, 37
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[1, 4] = float("nan")
    cu_rows = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # an empty sequence, row 5 past
    row_pos = torch.tensor([10, -1, 12, 4, 5, 9])
    output_start = torch.tensor([10, 0, 4], dtype=torch.int32)
    temperature = torch.tensor([1.0, 0.0, 0.7])
    min_p = torch.tensor([0.1, 0.0, 0.05])
    min_tokens = torch.tensor([2, 0, 1], dtype=torch.int32)
    stop_ids = torch.tensor([[3, -1], [0, 1], [7, 36]])
    bias_ids = torch.tensor([[5, -1, 40], [1, 2, 3], [0, 36, -1]])
    bias_values = torch.tensor([[2.0, 1.0, 1.0], [0.5, 0.5, 0.5], [-1.0, 3.0, 0.0]])
    output_counts = torch.randint(0, 3, (3, vocab), generator=g, dtype=torch.int32)
    prompt_mask = torch.rand(3, vocab, generator=g) < 0.3
    presence_penalty = torch.tensor([0.5, 0.0, -1.0])
    frequency_penalty = torch.tensor([0.25, 0.0, 1.0])
    repetition_penalty = torch.tensor([1.3, 1.0, 0.8])
    allowed_mask = torch.tensor([[-1, 0x0F], [-1, -1], [0x7FFFFFFF, -1]], dtype=torch.int32)
    token_bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, 2), generator=g,
                                  dtype=torch.int32)
    return (logits, cu_rows, row_pos, output_start, temperature, min_p, min_tokens, stop_ids,
            bias_ids, bias_values, output_counts, prompt_mask, presence_penalty,
            frequency_penalty, repetition_penalty, allowed_mask, token_bitmask)


def _process_logits_public(logits, cu_rows, row_pos, output_start, temperature, *optional):
    """``wk.process_logits`` called with the optional arguments by keyword (the op's schema
    takes them positionally)."""
    names = ("min_p", "min_tokens", "stop_ids", "bias_ids", "bias_values", "output_counts",
             "prompt_mask", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "allowed_mask", "token_bitmask")
    return wk.process_logits(logits, cu_rows, row_pos, output_start, temperature,
                             **dict(zip(names, optional)))


CASES = {
    "reorder_window": (wk.reorder_window, _reorder_args),
    "rope_kv_append": (wk.rope_kv_append, _rope_args),
    "paged_attention": (wk.paged_attention, _attention_args),
    "process_logits": (_process_logits_public, _process_logits_args),
    "select_tokens": (wk.select_tokens, _select_args),
    "commit_window": (wk.commit_window, _commit_args),
    "silu_mul": (wk.silu_mul, _silu_mul_args),
}


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _assert_same(actual, expected):
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    else:
        assert actual == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_passes_opcheck(name):
    _, make_args = CASES[name]
    torch.library.opcheck(getattr(torch.ops.wedlm, name).default, _clone(make_args()))


PACKAGE = Path(wk.__file__).resolve().parent
PACKAGE_FILES = sorted({path.name for path in PACKAGE.rglob("*.py")})


def warnings_about_the_package(caught) -> list[str]:
    """The warnings emitted from the package's files or naming one of them (Dynamo names
    the file and line of what it traced, as in ``'_validate.py:90'``)."""
    return [str(w.message) for w in caught
            if Path(w.filename).resolve().is_relative_to(PACKAGE)
            or any(re.search(rf"\b{re.escape(name)}:\d+", str(w.message))
                   for name in PACKAGE_FILES)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_compiles_fullgraph_without_a_warning_and_matches_eager(name):
    public, make_args = CASES[name]
    eager_args, compiled_args = _clone(make_args()), _clone(make_args())
    expected = public(*eager_args)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = torch.compile(public, fullgraph=True)(*compiled_args)
    assert warnings_about_the_package(caught) == []
    _assert_same(actual, expected)
    # mutated arguments end up identical too
    _assert_same(compiled_args, eager_args)


def test_commit_window_with_a_commit_limit_passes_opcheck_and_compiles_fullgraph():
    def make_args():
        return _commit_args() + (torch.tensor([0, 5], dtype=torch.int32),)

    torch.library.opcheck(torch.ops.wedlm.commit_window.default, _clone(make_args()))
    eager_args, compiled_args = _clone(make_args()), _clone(make_args())
    wk.commit_window(*eager_args)
    torch._dynamo.reset()
    torch.compile(wk.commit_window, fullgraph=True)(*compiled_args)
    _assert_same(compiled_args, eager_args)
    unlimited = _clone(_commit_args())
    wk.commit_window(*unlimited)
    assert not torch.equal(unlimited[9], eager_args[9])  # the limit changed the commits


def test_every_public_op_is_registered_in_the_wedlm_namespace():
    for name in CASES:
        assert hasattr(torch.ops.wedlm, name), name
    assert set(CASES) == set(wk._library.OPS)


SYNC_FREE_PATHS = {"paged_attention": attention_ops.paged_attention_torch_gathered}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pytorch_implementation_traces_without_host_sync(name):
    """Dynamo traces the op body itself: `.item()`, `.tolist()`, `nonzero`, boolean-mask
    indexing or a Python branch on a tensor value would break the graph and fail here.
    paged_attention's PyTorch path loops over sequences on CPU tensors by design (free on
    a CPU); its path for every other device is the one traced. select_tokens samples only
    the sampling rows of CPU tensors, eagerly; compiled, it takes the device path, so this
    also compares the two."""
    module, _ = wk._library.OPS[name]
    impl = SYNC_FREE_PATHS.get(name) or getattr(module, f"{name}_torch")
    _, make_args = CASES[name]
    eager_args, traced_args = _clone(make_args()), _clone(make_args())
    expected = impl(*eager_args)
    torch._dynamo.reset()
    actual = torch.compile(impl, fullgraph=True, backend="eager", dynamic=False)(*traced_args)
    _assert_same(actual, expected)
    _assert_same(traced_args, eager_args)
