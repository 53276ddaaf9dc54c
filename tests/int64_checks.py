"""Kernels addressing tensors of more than 2^31 elements: every offset past 2^31 must be
computed in int64. Each check runs one launcher on tensors that are *reserved*, not filled:
``torch.empty`` of a few GiB maps pages lazily, and only the pages a check writes or the
kernel reads become real memory.

On the CPU the kernels run in Triton's interpreter, where an offset computed in int32 wraps
exactly as on the GPU and the load or store then lands on the wrong element or outside the
buffer (garbage or a segmentation fault). ``tests/test_int64_offsets.py`` therefore runs each
check in its own Python process: a crash is a clean test failure, not the end of the pytest
run. ``python -m tests.int64_checks NAME [DEVICE]`` runs one check; it prints ``ok`` and the
process's peak resident memory in MiB, or ``skip`` and the reason when the buffers cannot be
reserved.
"""

import resource
import sys

import torch

FAR = 2**31  # element offsets at or past this do not fit in int32


class CannotReserve(Exception):
    """The machine refused to reserve the buffer (the check is skipped, not failed)."""


def _reserve(numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as error:
        raise CannotReserve(f"cannot reserve {numel} {dtype} elements: {error}") from error


def rope_kv_append_cache(device: str = "cpu", kv_heads: int = 1, head_dim: int = 8,
                         page_size: int = 3) -> None:
    """Write into the last slots of fp16 caches of more than 2^31 elements: their element
    offsets (slot * Hkv * D) only fit in int64. Only the touched rows are compared; the
    neighbours of every written slot must keep their value."""
    import wedlm_kernels as wk
    from wedlm_kernels.ops.rope import rope_kv_append_torch, rope_kv_append_triton

    row = kv_heads * head_dim
    first_far_slot = FAR // row  # offset >= 2^31 - row, the next slots beyond 2^31
    num_pages = (first_far_slot + 3) // page_size + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = (_reserve(num_pages * page_size * row, torch.float16, device).view(shape)
                        for _ in range(2))
    num_slots = num_pages * page_size
    assert k_cache.numel() > FAR
    slots = torch.tensor([num_slots - 1, first_far_slot + 1, 5, first_far_slot], device=device)
    neighbours = torch.tensor([num_slots - 2, first_far_slot + 2, 4, 6], device=device)
    assert not set(slots.tolist()) & set(neighbours.tolist())
    flat_k, flat_v = k_cache.view(num_slots, row), v_cache.view(num_slots, row)
    for flat in (flat_k, flat_v):
        flat[slots] = 0.0
        flat[neighbours] = 7.0
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(4, kv_heads, head_dim, generator=g).half().to(device)
               for _ in range(3))
    positions = torch.tensor([1, 2, 3, 4], device=device)
    cos_sin = wk.rope_cache(8, head_dim, 1e4, device)
    rope_kv_append_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    small_caches = [torch.zeros(4, 1, kv_heads, head_dim, dtype=torch.float16, device=device)
                    for _ in range(2)]
    rope_kv_append_torch(q, k, v, positions, cos_sin, *small_caches,
                         torch.arange(4, device=device))
    torch.testing.assert_close(flat_k[slots].float(), small_caches[0].view(4, row).float(),
                               rtol=2e-3, atol=1e-4)
    assert torch.equal(flat_v[slots], v.reshape(4, row))
    assert (flat_k[neighbours] == 7.0).all() and (flat_v[neighbours] == 7.0).all()


def paged_attention_cache(device: str = "cpu") -> None:
    """Attention over pages that lie past 2^31 elements of fp16 caches (one KV head of 16,
    pages of 16 positions): 103 keys through seven pages, six of them far, in every schedule
    (one pass with and without a tile of keys visible to every row, and split-KV), against
    the PyTorch implementation on a compact copy of the same pages."""
    from wedlm_kernels.ops.attention import paged_attention_into, paged_attention_torch

    kv_heads, head_dim, page_size, group, rows = 1, 16, 16, 2, 3
    row = kv_heads * head_dim
    first_far_page = FAR // (row * page_size)  # its first element is at offset 2^31
    num_pages = first_far_page + 8
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = (_reserve(num_pages * page_size * row, torch.float16, device).view(shape)
                        for _ in range(2))
    assert k_cache.numel() > FAR
    pages = [num_pages - 1, first_far_page, num_pages - 4, first_far_page + 2, 5,
             num_pages - 2, first_far_page + 1]
    g = torch.Generator().manual_seed(4)
    for cache in (k_cache, v_cache):
        cache[pages] = torch.randn(len(pages), page_size, kv_heads, head_dim,
                                   generator=g).half().to(device)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=g).half().to(device)
    ctx_len = torch.tensor([100], dtype=torch.int32, device=device)
    query_start = torch.tensor([0, rows], dtype=torch.int32, device=device)
    block_table = torch.tensor([pages], dtype=torch.int32, device=device)
    compact = [cache[pages].clone() for cache in (k_cache, v_cache)]
    compact_table = torch.arange(len(pages), dtype=torch.int32, device=device)[None]
    scale = head_dim**-0.5
    expected = paged_attention_torch(q, *compact, compact_table, query_start, ctx_len, scale)
    assert torch.isfinite(expected).all()
    # (num_splits, block_n): BLOCK_N 64 gives a tile of keys 0..63 visible to every row
    # (the loop without a mask) and a masked tile; BLOCK_N 128 only a masked one
    for num_splits, block_n in ((1, 64), (1, 128), (2, 16), (3, 64)):
        out = torch.full(q.shape, 777.0, dtype=q.dtype, device=device)
        paged_attention_into(out, q, k_cache, v_cache, block_table, query_start, ctx_len,
                             scale, num_splits=num_splits, block_m=16, block_n=block_n)
        case = f"splits {num_splits}, BLOCK_N {block_n}"
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-3, atol=5e-4,
                                   msg=lambda message, case=case: f"{case}: {message}")


def select_tokens_rows(device: str = "cpu") -> None:
    """Four rows of fp16 logits 2^30 + 64 elements apart (a view into a reserved buffer):
    rows 2 and 3 start past 2^31, where ``row * row_stride`` only fits in int64 (the stride
    itself fits in int32, so Triton passes it as an i32). A greedy and a sampling row
    (top-k and top-p, which run the filter kernel's searches) on each side of 2^31; then
    the one-launch kernel's greedy and temperature calls on the same rows."""
    from wedlm_kernels.ops.select import select_tokens_torch, select_tokens_triton

    vocab, num_rows, stride = 300, 4, 2**30 + 64
    storage = _reserve(stride * (num_rows - 1) + vocab, torch.float16, device)
    logits = storage.as_strided((num_rows, vocab), (stride, 1))
    assert logits.stride(0) < FAR <= 2 * stride
    g = torch.Generator().manual_seed(5)
    values = (torch.randn(num_rows, vocab, generator=g) * 2).half()
    values[[0, 2], [17, 250]] = 12.0  # the greedy rows' clear maxima
    logits.copy_(values.to(device))
    cu_rows = torch.arange(num_rows + 1, dtype=torch.int32)
    row_pos = torch.tensor([7, 8, 9, 10])
    temperature = torch.tensor([0.0, 0.8, 0.0, 0.8])
    top_k = torch.tensor([0, 5, 0, 20], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.7])
    threshold = torch.full((num_rows,), 2.0)
    penalty = torch.zeros(num_rows)
    seed = torch.tensor([21, 22, 23, 24])
    params = (cu_rows, row_pos, temperature, top_k, top_p, threshold, penalty, seed)
    token, selected, entropy = select_tokens_triton(logits, *(p.to(device) for p in params))
    expected_token, expected_selected, expected_entropy = select_tokens_torch(values, *params)
    assert token.tolist()[0] == 17 and token.tolist()[2] == 250
    assert token.cpu().tolist() == expected_token.tolist()
    assert selected.cpu().tolist() == expected_selected.tolist()
    torch.testing.assert_close(entropy.cpu(), expected_entropy, rtol=1e-5, atol=5e-6)
    # the one-launch kernel, its greedy and its temperature variant
    for sampling in ("greedy", "temperature"):
        token, selected, entropy = select_tokens_triton(
            logits, *(p.to(device) for p in params), sampling, kernel="one_launch")
        expected = select_tokens_torch(values, *params, sampling)
        assert token.cpu().tolist() == expected[0].tolist(), sampling
        assert selected.cpu().tolist() == expected[1].tolist(), sampling
        torch.testing.assert_close(entropy.cpu(), expected[2], rtol=1e-5, atol=5e-6)


def silu_mul_rows(device: str = "cpu") -> None:
    """Three rows of fp16 gate/up values 2^30 + 64 elements apart: the third row starts
    past 2^31, where ``row * row_stride`` only fits in int64."""
    from wedlm_kernels.ops.silu_mul import silu_mul_torch, silu_mul_triton

    width, num_rows, stride = 96, 3, 2**30 + 64
    storage = _reserve(stride * (num_rows - 1) + width, torch.float16, device)
    gate_up = storage.as_strided((num_rows, width), (stride, 1))
    values = (torch.randn(num_rows, width, generator=torch.Generator().manual_seed(6)) * 3)
    gate_up.copy_(values.half().to(device))
    torch.testing.assert_close(silu_mul_triton(gate_up).cpu(), silu_mul_torch(values.half()),
                               rtol=1e-3, atol=1e-6)


CHECKS = {
    "rope_kv_append_cache": rope_kv_append_cache,
    "paged_attention_cache": paged_attention_cache,
    "select_tokens_rows": select_tokens_rows,
    "silu_mul_rows": silu_mul_rows,
}


def peak_memory_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    try:
        CHECKS[sys.argv[1]](*sys.argv[2:])
    except CannotReserve as reason:
        print(f"skip {reason}")
    else:
        print(f"ok {peak_memory_mib():.0f}")
