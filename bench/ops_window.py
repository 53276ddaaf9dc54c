"""Microbenchmark of the window ops: rope_kv_append, reorder_window, commit_window.

    python -m bench.ops_window [--out-dir bench/results/<device>/] [--quick] [--ops OP ...]
    python -m bench.ops_window --cpu-smoke [--interpret] [--out-dir DIR]

On a CUDA GPU, at Qwen3-8B shapes (32 q heads, 8 KV heads, head_dim 128, bf16; RoPE theta
1e6, q/k RMSNorm), it times each op's Triton launcher (``<op>_triton``), its PyTorch
implementation (``<op>_torch``) and, for rope_kv_append, the unfused sequence of separate
ops (:func:`rope_kv_append_unfused`), in two modes (see ``bench/common.py``): ``eager``
(``do_bench``, L2 flushed before each call) and ``graph`` (calls captured in a CUDA graph,
warm L2, no launch overhead). For every case it reports the median microseconds and the
sample count, the bytes-moved model of the op, the achieved GB/s, the fraction of the
device-to-device copy bandwidth measured in the same run, and the speed-up of the Triton
launcher over the others. Before timing, each case checks that the Triton launcher computes
what the PyTorch implementation computes on the same inputs.

Cases: rope_kv_append for tokens N in 16..4096 and page sizes 16 and 256 (the tokens come in
sequences of 2 * window = 32 at random context lengths, their slots go through a random page
table, so a page holds consecutive positions as in decoding); reorder_window for batches 1,
16, 64 (window 16, 32 slots) and both page sizes; commit_window for the same batches.

commit_window mutates its state. Its seven state tensors are views of one byte buffer with a
pristine copy, so one copy kernel restores the state: every timed call is "restore + commit",
"restore" alone is timed the same way, and the op's figure is the difference (the raw figures
are in the JSON as ``with_restore_us`` and ``timings.restore``).

Results: ``ops_window.json``, ``ops_window.md`` and ``ops_window.png`` (when matplotlib is
installed) in ``--out-dir`` (default ``bench/results/<device-name-slug>/``). Without a CUDA
GPU the default mode prints that GPU benchmarks are skipped and exits 0; ``--cpu-smoke`` runs
the whole code path on CPU tensors at tiny shapes with the PyTorch implementations only
(``time.perf_counter``; ``--interpret`` adds the Triton launchers through Triton's
interpreter), writing to a temporary folder unless ``--out-dir`` is given.
"""

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench import common
from bench.common import (
    PackedState,
    Timer,
    add_derived,
    fmt,
    fmt_rate,
    markdown_table,
    median_us,
    subtract_restore,
    with_total,
)

OPS = ("rope_kv_append", "reorder_window", "commit_window")
MODULES = {"rope_kv_append": "rope", "reorder_window": "reorder", "commit_window": "commit"}
NO_TRITON = "no Triton kernel"
IMPL_ORDER = ("triton", "torch", "unfused")


@dataclass(frozen=True)
class Sizes:
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens: tuple[int, ...]
    page_sizes: tuple[int, ...]
    batches: tuple[int, ...]
    window: int  # W; a sequence's window capacity is S = 2W
    output_capacity: int  # T of out_tokens
    max_context: int  # context lengths are drawn from [0, max_context)
    vocab: int
    stop_ids: int  # K
    rope_theta: float = 1e6
    eps: float = 1e-6

    @property
    def slots(self) -> int:
        return 2 * self.window

    @property
    def mask_id(self) -> int:
        return self.vocab - 1


QWEN3_8B = Sizes(
    q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
    tokens=(16, 64, 256, 1024, 4096), page_sizes=(16, 256), batches=(1, 16, 64),
    window=16, output_capacity=1024, max_context=4000, vocab=151936, stop_ids=2,
)
QUICK = replace(QWEN3_8B, tokens=(16, 256, 4096), batches=(1, 64))
SMOKE = Sizes(
    q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, tokens=(3, 8),
    page_sizes=(4, 16), batches=(1, 3), window=4, output_capacity=64, max_context=40,
    vocab=1000, stop_ids=2,
)

# relative error ||a - b|| / ||b|| accepted between two float implementations, per dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# the unfused sequence rotates in the model dtype (as Hugging Face does): one more rounding
UNFUSED_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------- launchers


def load_launchers(ops: tuple[str, ...]) -> dict[str, dict[str, Callable | None]]:
    """``{op: {"torch": <op>_torch, "triton": <op>_triton or None}}``."""
    import importlib

    launchers = {}
    for op in ops:
        module = importlib.import_module(f"wedlm_kernels.ops.{MODULES[op]}")
        launchers[op] = {
            "torch": getattr(module, f"{op}_torch"),
            "triton": getattr(module, f"{op}_triton", None),
        }
    return launchers


# ------------------------------------------------------------------------- rope_kv_append


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``Qwen3RMSNorm``: normalise in fp32, round to x's dtype, times weight."""
    normalised = x.float()
    normalised = normalised * torch.rsqrt(normalised.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalised.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_kv_append_unfused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The same step as separate PyTorch ops, as Hugging Face's Qwen3 attention does it.

    RMSNorm of q and k (``Qwen3RMSNorm``), RoPE (``apply_rotary_pos_emb``: cos/sin rows of
    the positions cast to the model dtype, ``x * cos + rotate_half(x) * sin`` in that dtype),
    then the cache writes as ``index_copy_`` into the flat slots. Every slot must be valid
    (this baseline does not drop -1 slots; the benchmark's slots are all valid).
    """
    half = q.shape[-1] // 2
    q = rms_norm_hf(q, q_norm_weight, eps)
    k = rms_norm_hf(k, k_norm_weight, eps)
    rows = cos_sin.index_select(0, positions)  # [N, D]: D/2 cosines, then D/2 sines
    cos = torch.cat((rows[:, :half], rows[:, :half]), dim=-1).to(q.dtype)[:, None, :]
    sin = torch.cat((rows[:, half:], rows[:, half:]), dim=-1).to(q.dtype)[:, None, :]
    q_out = q * cos + rotate_half(q) * sin
    k_rotated = k * cos + rotate_half(k) * sin
    num_slots, kv_heads, head_dim = k_cache.shape[0] * k_cache.shape[1], k.shape[1], k.shape[2]
    k_cache.view(num_slots, kv_heads, head_dim).index_copy_(
        0, slot_mapping, k_rotated.to(k_cache.dtype))
    v_cache.view(num_slots, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q_out


def rope_inputs(sizes: Sizes, num_tokens: int, page_size: int, device: torch.device,
                seed: int) -> dict:
    """Inputs of one rope_kv_append call at N = ``num_tokens``.

    q, k and v are strided views of one fused projection output ``[N, (Hq + 2 Hkv) * D]``.
    The tokens come in sequences of up to ``2 * window`` consecutive positions, each at a
    random context length; every (sequence, page index) gets its own page at a random place
    in a cache of twice the pages needed, so all slots are valid and distinct.
    """
    generator = torch.Generator().manual_seed(seed)
    device_generator = torch.Generator(device=device).manual_seed(seed)
    seq_tokens = min(num_tokens, sizes.slots)
    token = torch.arange(num_tokens)
    sequence, offset = token // seq_tokens, token % seq_tokens
    num_sequences = int(sequence[-1]) + 1
    context = torch.randint(0, sizes.max_context, (num_sequences,), generator=generator)
    positions = context[sequence] + offset
    pages_per_sequence = (sizes.max_context + sizes.slots) // page_size + 1
    page_key = sequence * pages_per_sequence + positions // page_size
    keys, key_index = torch.unique(page_key, return_inverse=True)  # setup, not timed
    num_pages = 2 * keys.numel()
    page_id = torch.randperm(num_pages, generator=generator)[: keys.numel()]
    slot_mapping = page_id[key_index] * page_size + positions % page_size

    heads, kv_heads, head_dim = sizes.q_heads, sizes.kv_heads, sizes.head_dim
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device=device,
                      dtype=sizes.dtype, generator=device_generator)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    from wedlm_kernels.ops.rope import rope_cache

    return {
        "q": q.view(num_tokens, heads, head_dim),
        "k": k.view(num_tokens, kv_heads, head_dim),
        "v": v.view(num_tokens, kv_heads, head_dim),
        "positions": positions.to(device),
        "cos_sin": rope_cache(sizes.max_context + sizes.slots, head_dim, sizes.rope_theta,
                              device=device),
        "k_cache": torch.empty(cache_shape, dtype=sizes.dtype, device=device)
        .normal_(generator=device_generator),
        "v_cache": torch.empty(cache_shape, dtype=sizes.dtype, device=device)
        .normal_(generator=device_generator),
        "slot_mapping": slot_mapping.to(device),
        "q_norm_weight": norm_weight(head_dim, sizes.dtype, device_generator),
        "k_norm_weight": norm_weight(head_dim, sizes.dtype, device_generator),
        "eps": sizes.eps,
    }


def norm_weight(head_dim: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """An RMSNorm weight near 1 (uniform in [0.75, 1.25])."""
    weight = torch.rand(head_dim, generator=generator, device=generator.device)
    return (0.75 + 0.5 * weight).to(dtype)


def rope_bytes(inputs: dict) -> dict[str, int]:
    """Bytes one rope_kv_append call must move: each input element it needs read once, each
    output element written once.

    Reads q, k, v (only the used elements of the fused projection), positions and
    slot_mapping (int64), one fp32 cos/sin row per distinct position, both norm weights;
    writes q_out, and one k row and one v row per token into the caches. The cache pages
    around the written rows are not read.
    """
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    num_tokens, head_dim = q.shape[0], q.shape[2]
    cache_element = inputs["k_cache"].element_size()
    distinct_positions = int(torch.unique(inputs["positions"]).numel())
    return {
        "read q": q.numel() * q.element_size(),
        "read k": k.numel() * k.element_size(),
        "read v": v.numel() * v.element_size(),
        "read positions": 8 * num_tokens,
        "read slot_mapping": 8 * num_tokens,
        "read cos_sin rows": distinct_positions * head_dim * 4,
        "read norm weights": 2 * head_dim * inputs["q_norm_weight"].element_size(),
        "write q_out": q.numel() * q.element_size(),
        "write k_cache rows": k.numel() * cache_element,
        "write v_cache rows": v.numel() * cache_element,
    }


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    scale = torch.linalg.vector_norm(expected).item() or 1.0
    return torch.linalg.vector_norm(actual.double() - expected).item() / scale


def rope_case(sizes: Sizes, launchers: dict, num_tokens: int, page_size: int, timer: Timer,
              seed: int) -> dict:
    inputs = rope_inputs(sizes, num_tokens, page_size, timer.device, seed)
    impls = {"torch": launchers["torch"], "unfused": rope_kv_append_unfused}
    if launchers["triton"] is not None:
        impls = {"triton": launchers["triton"], **impls}
    calls = {name: (lambda impl=impl: impl(**inputs)) for name, impl in impls.items()}

    # check: every implementation against the PyTorch one, on fresh cache copies
    slots = inputs["slot_mapping"]
    results = {}
    for name, impl in impls.items():
        caches = {"k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
        q_out = impl(**{**inputs, **caches})
        flat = {key: cache.view(-1, *cache.shape[2:]).index_select(0, slots)
                for key, cache in caches.items()}
        results[name] = (q_out, flat["k_cache"], flat["v_cache"])
    check = {}
    for name in results:
        if name == "torch":
            continue
        errors = [relative_error(a, b) for a, b in zip(results[name], results["torch"])]
        limit = (UNFUSED_TOLERANCE if name == "unfused" else TOLERANCE)[sizes.dtype]
        check[f"{name}_vs_torch"] = {
            "q_out_rel_err": errors[0], "k_cache_rel_err": errors[1],
            "v_cache_rel_err": errors[2], "tolerance": limit,
            "ok": all(e <= limit for e in errors),
        }
    del results

    case = {
        "params": {"tokens": num_tokens, "page_size": page_size,
                   "sequences": math.ceil(num_tokens / min(num_tokens, sizes.slots)),
                   "num_pages": inputs["k_cache"].shape[0]},
        "bytes": with_total(rope_bytes(inputs)),
        "check": check,
        "timings": {name: timer.all_modes(call) for name, call in calls.items()},
    }
    return case


# ------------------------------------------------------------------------- window state


def window_state(sizes: Sizes, batch: int, generator: torch.Generator) -> dict:
    """A decoding window per sequence (CPU tensors): ``win_len`` in ``[W, S]``, a leading
    run of 0..3 filled slots, then each slot a mask with probability 1/2."""
    slots, vocab = sizes.slots, sizes.vocab
    win_len = torch.randint(sizes.window, slots + 1, (batch,), generator=generator)
    win_mask = torch.rand(batch, slots, generator=generator) < 0.5
    run = torch.randint(0, 4, (batch, 1), generator=generator)
    win_mask &= torch.arange(slots) >= run
    tokens = torch.randint(0, vocab - 1, (batch, slots), generator=generator)
    return {
        "win_tokens": torch.where(win_mask, sizes.mask_id, tokens),
        "win_mask": win_mask,
        "win_len": win_len.to(torch.int32),
        "ctx_len": torch.randint(0, sizes.max_context, (batch,), generator=generator)
        .to(torch.int32),
    }


def block_table_for(sizes: Sizes, batch: int, page_size: int,
                    generator: torch.Generator) -> torch.Tensor:
    """``[B, P]`` int32 distinct page ids covering every position a window can reach."""
    pages = (sizes.max_context + sizes.slots) // page_size + 1
    return torch.randperm(batch * pages, generator=generator).view(batch, pages).to(torch.int32)


def live_slots(state: dict) -> int:
    return int(state["win_len"].clamp(min=0).sum())


def reorder_bytes(state: dict, page_size: int) -> dict[str, int]:
    """Bytes one reorder_window call must move.

    Reads the tokens (int64) and mask bits of the live slots, win_len and ctx_len, and the
    block_table entries of the pages the live rows' positions fall in; writes the packed
    outputs, one row per live slot: input_ids, positions, slot_mapping int64, order int32,
    and query_start [B+1], n_filled [B] int32.
    """
    batch, slots = state["win_tokens"].shape
    live = live_slots(state)
    first = state["ctx_len"].long() // page_size
    last = (state["ctx_len"].long() + state["win_len"].long() - 1) // page_size
    pages_touched = int(torch.where(state["win_len"] > 0, last - first + 1, 0).sum())
    return {
        "read win_tokens (live slots)": 8 * live,
        "read win_mask (live slots)": live,
        "read win_len, ctx_len": 8 * batch,
        "read block_table entries": 4 * pages_touched,
        "write input_ids, positions, slot_mapping": 3 * 8 * live,
        "write order": 4 * live,
        "write query_start, n_filled": 4 * (2 * batch + 1),
    }


def reorder_case(sizes: Sizes, launchers: dict, batch: int, page_size: int, timer: Timer,
                 seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    state = window_state(sizes, batch, generator)
    block_table = block_table_for(sizes, batch, page_size, generator)
    args = [state["win_tokens"], state["win_mask"], state["win_len"], state["ctx_len"],
            block_table]
    args = [tensor.to(timer.device) for tensor in args] + [page_size, live_slots(state)]
    impls = {"torch": launchers["torch"]}
    if launchers["triton"] is not None:
        impls = {"triton": launchers["triton"], **impls}

    check = {}
    if "triton" in impls:
        names = ("input_ids", "positions", "slot_mapping", "order", "query_start", "n_filled")
        got, expected = impls["triton"](*args), impls["torch"](*args)
        equal = {name: bool(torch.equal(a, b)) for name, a, b in zip(names, got, expected)}
        check["triton_vs_torch"] = {"equal": equal, "ok": all(equal.values())}

    return {
        "params": {"batch": batch, "window": sizes.window, "slots": sizes.slots,
                   "page_size": page_size, "live_slots": live_slots(state)},
        "bytes": with_total(reorder_bytes(state, page_size)),
        "check": check,
        "timings": {name: timer.all_modes(lambda impl=impl: impl(*args))
                    for name, impl in impls.items()},
    }


# -------------------------------------------------------------------------- commit_window

STATE_NAMES = ("win_tokens", "win_mask", "win_len", "ctx_len", "out_tokens", "out_len",
               "finished")


def commit_inputs(sizes: Sizes, batch: int, seed: int, reorder_torch: Callable) -> tuple:
    """(state tensors, other arguments) of one decode step's commit_window (CPU tensors).

    The rows are laid out as the decoder lays them out: W rows per sequence holding the
    mask rows of the reordered window (``row_pos`` = their logical position, -1 for
    padding); half of them are selected; each sampled token is a random id.
    """
    generator = torch.Generator().manual_seed(seed)
    window, vocab = sizes.window, sizes.vocab
    state = window_state(sizes, batch, generator)
    block_table = block_table_for(sizes, batch, 16, generator)
    live = live_slots(state)
    _, positions, _, _, query_start, n_filled = reorder_torch(
        state["win_tokens"], state["win_mask"], state["win_len"], state["ctx_len"],
        block_table, 16, live)
    mask_row = (query_start[:-1] + n_filled)[:, None].long() + torch.arange(window)
    is_mask_row = mask_row < query_start[1:, None]
    # a mask row predicts its logical position ctx_len + order, its RoPE position
    row_pos = torch.where(is_mask_row, positions[mask_row.clamp(max=max(live - 1, 0))],
                          -1).reshape(-1)
    rows = batch * window
    state.update(
        out_tokens=torch.randint(0, vocab - 1, (batch, sizes.output_capacity),
                                 generator=generator),
        out_len=torch.randint(0, 64, (batch,), generator=generator).to(torch.int32),
        finished=torch.zeros(batch, dtype=torch.bool),
    )
    others = {
        "cu_rows": torch.arange(0, rows + 1, window, dtype=torch.int32),
        "row_pos": row_pos,
        "token": torch.randint(0, vocab - 1, (rows,), generator=generator),
        "selected": torch.rand(rows, generator=generator) < 0.5,
        "stop_ids": torch.randint(0, vocab - 1, (batch, sizes.stop_ids), generator=generator),
        "max_new": torch.full((batch,), sizes.output_capacity, dtype=torch.int32),
    }
    return {name: state[name] for name in STATE_NAMES}, others


def commit_bytes(state: dict, others: dict, committed: int) -> dict[str, int]:
    """Bytes one commit_window call must move.

    Reads the tokens and mask bits of the live slots, the per-sequence lengths (win_len,
    ctx_len, out_len, max_new int32, finished bool), cu_rows, every row's row_pos, token
    (int64) and selected bit, and the stop ids; writes the window rows in full (slots past
    the new win_len are reset), the per-sequence lengths and flags, and only the committed
    tokens of out_tokens (counted by running the step once on a copy).
    """
    batch, slots = state["win_tokens"].shape
    rows = others["row_pos"].numel()
    live = live_slots(state)
    return {
        "read win_tokens, win_mask (live slots)": 9 * live,
        "read win_len, ctx_len, out_len, max_new, finished": 17 * batch,
        "read cu_rows": 4 * (batch + 1),
        "read row_pos, token, selected": 17 * rows,
        "read stop_ids": others["stop_ids"].numel() * 8,
        "write win_tokens, win_mask": 9 * batch * slots,
        "write win_len, ctx_len, out_len, finished": 13 * batch,
        "write out_tokens (committed tokens)": 8 * committed,
    }


def commit_case(sizes: Sizes, launchers: dict, batch: int, timer: Timer, seed: int) -> dict:
    device = timer.device
    state, others = commit_inputs(sizes, batch, seed, launchers["reorder_torch"])
    scalars = {"window": sizes.window, "mask_id": sizes.mask_id, "blockwise": False}

    # committed tokens of this step, for the bytes model (a CPU run on a copy)
    copy = {name: tensor.clone() for name, tensor in state.items()}
    launchers["torch"](**copy, **others, **scalars)
    committed = int((copy["out_len"] - state["out_len"]).sum())

    packed = PackedState(state, device)
    others_device = {name: tensor.to(device) for name, tensor in others.items()}
    impls = {"torch": launchers["torch"]}
    if launchers["triton"] is not None:
        impls = {"triton": launchers["triton"], **impls}

    def step(impl):
        return lambda: (packed.restore(), impl(**packed.views, **others_device, **scalars))

    check = {}
    if "triton" in impls:
        after = {}
        for name, impl in impls.items():
            packed.restore()
            impl(**packed.views, **others_device, **scalars)
            after[name] = {key: view.clone() for key, view in packed.views.items()}
        equal = {key: bool(torch.equal(after["triton"][key], after["torch"][key]))
                 for key in STATE_NAMES}
        check["triton_vs_torch"] = {"equal": equal, "ok": all(equal.values())}

    timings = {"restore": timer.all_modes(packed.restore)}
    for name, impl in impls.items():
        timings[name] = subtract_restore(timer.all_modes(step(impl)), timings["restore"])
    packed.restore()
    return {
        "params": {"batch": batch, "window": sizes.window, "slots": sizes.slots,
                   "output_capacity": sizes.output_capacity, "rows": batch * sizes.window,
                   "live_slots": live_slots(state), "committed_tokens": committed},
        "bytes": with_total(commit_bytes(state, others, committed)),
        "check": check,
        "timings": timings,
    }


# ------------------------------------------------------------------------------ reporting

METHODS = {
    "eager": (
        "triton.testing.do_bench, every per-call time kept: the L2 cache is flushed before "
        "each call and device events bracket one call (cold L2). The flush lets the host "
        "run ahead, so launch overhead shows only where issuing a call takes longer than "
        "running it (the PyTorch implementations)."
    ),
    "graph": (
        "calls_per_sample calls captured back to back in one CUDA graph, each replay "
        "bracketed by device events, sample = replay time / calls: no launch overhead, warm "
        "L2 (the cost inside a captured decode step). For small cases the data stays in L2, "
        "so GB/s can exceed the copy bandwidth."
    ),
    "cpu": "time.perf_counter around single calls on CPU tensors after one warm-up.",
    "commit_window": (
        "commit_window mutates its state: its seven state tensors are views of one byte "
        "buffer restored from a pristine copy by one copy kernel before every call; "
        "restore alone is timed the same way and median_us = median(restore + commit) - "
        "median(restore) (raw figures: with_restore_us, restore_us, timings.restore)."
    ),
    "copy_bandwidth": (
        "a device-to-device torch copy of random bytes, (bytes read + bytes written) / "
        "median time, timed like the eager mode in the same run."
    ),
    "bytes_model": (
        "the fewest bytes each call must move: every input element it needs read once, every "
        "output element written once (per-op breakdown in each case)."
    ),
    "unfused": (
        "rope_kv_append as separate PyTorch ops the way Hugging Face's Qwen3 attention does "
        "it: Qwen3RMSNorm of q and k, apply_rotary_pos_emb in the model dtype, then "
        "index_copy_ of k and v into the cache (bench.ops_window.rope_kv_append_unfused)."
    ),
}


def case_label(op: str, params: dict) -> list[str]:
    if op == "rope_kv_append":
        return [str(params["tokens"]), str(params["page_size"])]
    if op == "reorder_window":
        return [str(params["batch"]), str(params["page_size"])]
    return [str(params["batch"]), str(params["committed_tokens"])]


LABEL_HEADERS = {
    "rope_kv_append": ["N", "page"],
    "reorder_window": ["B", "page"],
    "commit_window": ["B", "committed"],
}


def op_table(op: str, result: dict, mode: str) -> list[str]:
    cases = result["cases"]
    impls = [name for name in IMPL_ORDER if any(name in case["timings"] for case in cases)]
    primary = "triton" if "triton" in impls else impls[0]
    headers = LABEL_HEADERS[op] + ["KB moved"] + [f"{name} µs" for name in impls]
    if op == "commit_window":
        headers.append("restore µs")
    headers += [f"{primary} GB/s", f"{primary} % copy BW"]
    baselines = [name for name in ("torch", "unfused") if name in impls and primary == "triton"]
    headers += [f"× over {name}" for name in baselines] + ["check"]
    rows = []
    for case in cases:
        row = case_label(op, case["params"]) + [fmt(case["bytes"]["total"] / 1e3, 1)]
        for name in impls:
            timing = case["timings"].get(name, {}).get(mode, {})
            row.append("error" if "error" in timing else fmt(timing.get("median_us"), 1))
        if op == "commit_window":
            row.append(fmt(median_us(case, "restore", mode), 1))
        fraction = case["fraction_of_copy_bandwidth"].get(primary, {}).get(mode)
        row += [fmt_rate(case["gb_per_s"].get(primary, {}).get(mode)),
                fmt(None if fraction is None else 100 * fraction, 1, "%")]
        for name in baselines:
            row.append(fmt(case["speedup"].get(f"triton_over_{name}", {}).get(mode), 2, "×"))
        checks = case["check"].values()
        row.append("—" if not checks else ("ok" if all(c["ok"] for c in checks) else "MISMATCH"))
        rows.append(row)
    return markdown_table(headers, rows)


def write_markdown(report: dict, path: Path) -> None:
    device, versions = report["device"], report["versions"]
    copy = report["copy_bandwidth"]
    lines = [
        "# Window ops microbenchmark (rope_kv_append, reorder_window, commit_window)",
        "",
        f"{report['date']} on **{device['name']}**; torch {versions['torch']}, triton "
        f"{versions['triton']}, CUDA {versions['cuda']}, Python {versions['python']}.",
        f"Command: `{report['command']}`.",
        "",
    ]
    if report["mode"] == "cpu-smoke":
        lines += ["CPU smoke run: tiny shapes, CPU tensors, every figure a CPU time "
                  "(no GPU figure).", ""]
    shapes = report["shapes"]
    lines += [
        f"Shapes: {shapes['q_heads']} q heads, {shapes['kv_heads']} KV heads, head_dim "
        f"{shapes['head_dim']}, {shapes['dtype']}; window {shapes['window']} "
        f"(S = {2 * shapes['window']}), out_tokens capacity {shapes['output_capacity']}.",
        f"Copy bandwidth (same run): **{fmt(copy['gb_per_s'], 0)} GB/s** "
        f"({copy['bytes_copied'] / 2**20:.0f} MiB copied, bytes read + written over the "
        f"median of {copy['timing']['samples']} copies).",
        "",
    ]
    for op, result in report["ops"].items():
        lines += [f"## {op}", "", f"Triton launcher: {result['triton']}."]
        if result.get("error"):
            lines += ["", f"**Error:** {result['error']}"]
        for message in result.get("case_errors", []):
            lines += ["", f"**Case failed:** {message}"]
        for mode in report["modes"]:
            if not result["cases"]:
                continue
            lines += ["", f"Mode `{mode}`: {METHODS[mode]}", ""]
            lines += op_table(op, result, mode)
        lines.append("")
    lines += ["## How it is measured", ""]
    lines += [f"- **{name}**: {text}" for name, text in METHODS.items()]
    lines += [f"- **plot**: {report['plot']}", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> Path | str:
    """rope_kv_append's µs and GB/s, reorder_window's and commit_window's µs
    (``common.save_plot``)."""
    return common.save_plot(lambda figure: draw_plot(figure, report), path, size=(12, 9))


def draw_plot(figure, report: dict) -> None:
    mode = report["modes"][0]
    axes = figure.subplots(2, 2)
    styles = {"triton": "C0", "torch": "C1", "unfused": "C2"}
    rope = report["ops"].get("rope_kv_append", {"cases": []})["cases"]
    for page_size, line in zip(report["shapes"]["page_sizes"], ("-", "--")):
        cases = [c for c in rope if c["params"]["page_size"] == page_size]
        for impl, color in styles.items():
            points = [(c["params"]["tokens"], median_us(c, impl, mode)) for c in cases]
            points = [(x, y) for x, y in points if y]
            if points:
                axes[0, 0].plot(*zip(*points), line, color=color, marker="o",
                                label=f"{impl}, page {page_size}")
            rates = [(c["params"]["tokens"], c["gb_per_s"].get(impl, {}).get(mode))
                     for c in cases]
            rates = [(x, y) for x, y in rates if y]
            if rates:
                axes[0, 1].plot(*zip(*rates), line, color=color, marker="o",
                                label=f"{impl}, page {page_size}")
    if report["copy_bandwidth"]["gb_per_s"]:
        axes[0, 1].axhline(report["copy_bandwidth"]["gb_per_s"], color="k", linestyle=":",
                           label="device copy")
    axes[0, 0].set(title=f"rope_kv_append ({mode})", xlabel="tokens N", ylabel="µs")
    axes[0, 1].set(title=f"rope_kv_append achieved bandwidth ({mode})", xlabel="tokens N",
                   ylabel="GB/s")
    for axis, op in ((axes[1, 0], "reorder_window"), (axes[1, 1], "commit_window")):
        cases = report["ops"].get(op, {"cases": []})["cases"]
        for impl, color in styles.items():
            for page_size, line in zip(report["shapes"]["page_sizes"], ("-", "--")):
                chosen = [c for c in cases if c["params"].get("page_size", page_size)
                          == page_size]
                points = [(c["params"]["batch"], median_us(c, impl, mode)) for c in chosen]
                points = [(x, y) for x, y in points if y and y > 0]
                if points:
                    label = impl if op == "commit_window" else f"{impl}, page {page_size}"
                    axis.plot(*zip(*points), line, color=color, marker="o", label=label)
                if op == "commit_window":
                    break
        axis.set(title=f"{op} ({mode})", xlabel="batch B", ylabel="µs")
    for axis in axes.flat:
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        if axis.lines:
            axis.legend(fontsize=7)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(f"{report['device']['name']}: window ops, {report['date']}")


def summarise(report: dict) -> dict:
    """Headline figures per op of the triton kernel, graph mode, over its cases: the highest
    fraction of copy bandwidth and the lowest speed-up over the PyTorch implementation. None
    where a case did not run."""
    summary = {}
    for op, result in report["ops"].items():
        cases = result.get("cases", [])
        summary[f"{op}_max_copy_bw_fraction"] = common.extreme(
            [common.figure(c, "fraction_of_copy_bandwidth", "triton", "graph") for c in cases],
            max)
        summary[f"{op}_min_speedup_over_torch"] = common.extreme(
            [common.figure(c, "speedup", "triton_over_torch", "graph") for c in cases], min)
    return summary


def write_outputs(run: common.OpRun, report: dict, final: bool) -> None:
    run.write(report, final, write_markdown, write_plot, summarise)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.op_parser("bench.ops_window", __doc__.split("\n\n")[0],
                              "tiny shapes on CPU tensors, PyTorch implementations only")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    return common.parse_op_args(parser, argv)


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = SMOKE if args.cpu_smoke else QUICK if args.quick else QWEN3_8B
    bench = common.start_op_run("ops_window", args, argv,
                                8 * 2**20 if args.cpu_smoke else 2**30)
    print(f"copy bandwidth: {fmt(bench.copy['gb_per_s'], 0)} GB/s", flush=True)
    timer = bench.timer
    launchers = load_launchers(tuple(args.ops))
    if not bench.with_triton:
        for op in launchers:
            launchers[op]["triton"] = None
    if "commit_window" in launchers:
        from wedlm_kernels.ops.reorder import reorder_window_torch

        launchers["commit_window"]["reorder_torch"] = reorder_window_torch

    report = bench.report(
        shapes={
            "q_heads": sizes.q_heads, "kv_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
            "dtype": str(sizes.dtype).replace("torch.", ""), "tokens": list(sizes.tokens),
            "page_sizes": list(sizes.page_sizes), "batches": list(sizes.batches),
            "window": sizes.window, "output_capacity": sizes.output_capacity,
            "max_context": sizes.max_context, "vocab": sizes.vocab, "stop_ids": sizes.stop_ids,
            "rope_theta": sizes.rope_theta, "eps": sizes.eps,
        },
        methods=METHODS, ops={},
    )

    def cases_of(op: str):
        if op == "rope_kv_append":
            return [(f"N={n} page={p}", lambda n=n, p=p: rope_case(
                sizes, launchers[op], n, p, timer, args.seed))
                for p in sizes.page_sizes for n in sizes.tokens]
        if op == "reorder_window":
            return [(f"B={b} page={p}", lambda b=b, p=p: reorder_case(
                sizes, launchers[op], b, p, timer, args.seed))
                for p in sizes.page_sizes for b in sizes.batches]
        return [(f"B={b}", lambda b=b: commit_case(sizes, launchers[op], b, timer, args.seed))
                for b in sizes.batches]

    context_lost = None
    for op in args.ops:
        if launchers[op]["triton"] is None and bench.with_triton:
            triton_state = NO_TRITON
        else:
            triton_state = bench.triton_state(f"{op}_triton", "PyTorch implementations only")
        result = {"triton": triton_state, "cases": []}
        report["ops"][op] = result
        if context_lost:
            result["error"] = f"not run: the CUDA context was lost ({context_lost})"
            continue
        context_lost = bench.run_group(
            result, cases_of(op), lambda case: add_derived(case, bench.copy["gb_per_s"]),
            lambda final: write_outputs(bench, report, final), prefix=f"{op} ")
    report["complete"] = context_lost is None
    write_outputs(bench, report, final=True)
    report["out_dir"] = str(bench.out_dir)
    return report


def failures(report: dict) -> list[str]:
    """Errors and mismatches of a finished report (the exit status is 1 if any)."""
    return [failure for op, result in report["ops"].items()
            for failure in common.group_failures(result, op, lambda case: str(case["params"]))]


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(argv, parse_args, run, failures, "ops_window.md")


if __name__ == "__main__":
    sys.exit(main())
