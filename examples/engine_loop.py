"""A complete batched WeDLM decode loop on wedlm_kernels' public ops, as an engine writes it.

The engine owns everything around the ops: a model (a small Qwen3-shaped decoder of
``torch.nn`` layers with random weights), a paged K/V cache with a page allocator and block
tables, prefill, and the decode loop. ``docs/integrating.md`` walks through it; this file
runs as it is (``python examples/engine_loop.py``, on a GPU when there is one) and
``tests/test_engine_loop.py`` compares its tokens with a dense decoder that keeps no cache.

Allocated once per batch: the window state (:func:`wedlm_kernels.new_window_state`), the
block tables and the sampling parameters. Per step: the packed rows of
:func:`wedlm_kernels.reorder_window`, the hidden states, the logits of the mask rows.
An engine that has its own attention or RoPE replaces :meth:`Attention.forward` and keeps the
rest (the cache contract: ``docs/contracts.md``).
"""

from dataclasses import dataclass

import torch
from torch import nn

import wedlm_kernels as wk


@dataclass(frozen=True)
class Config:
    vocab: int = 96  # the last id is the mask token
    hidden: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6
    max_positions: int = 256

    @property
    def mask_id(self) -> int:
        return self.vocab - 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Attention(nn.Module):
    """QKV projection, per-head RMSNorm and RoPE at the rows' logical positions with the K/V
    append (``rope_kv_append``), paged attention, output projection."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        heads = config.q_heads + 2 * config.kv_heads
        self.qkv = nn.Linear(config.hidden, heads * config.head_dim, bias=False)
        self.out = nn.Linear(config.q_heads * config.head_dim, config.hidden, bias=False)
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(config.head_dim))
        self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(config.head_dim))

    def forward(self, x: torch.Tensor, step: "StepInputs", k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        rows = x.shape[0]
        q, k, v = self.qkv(x).split(
            [c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=1)
        q = wk.rope_kv_append(  # [N, Hq, D]; writes rotated k and v at step.slot_mapping
            q.view(rows, c.q_heads, c.head_dim), k.view(rows, c.kv_heads, c.head_dim),
            v.view(rows, c.kv_heads, c.head_dim), step.positions, step.cos_sin, k_cache,
            v_cache, step.slot_mapping, self.q_norm, self.k_norm, c.eps)
        attended = wk.paged_attention(q, k_cache, v_cache, step.block_table, step.query_start,
                                      step.ctx_len, scale=c.head_dim ** -0.5)
        return self.out(attended.reshape(rows, -1))


class Layer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.attention_norm = nn.Parameter(torch.ones(config.hidden))
        self.attention = Attention(config)
        self.mlp_norm = nn.Parameter(torch.ones(config.hidden))
        self.gate_up = nn.Linear(config.hidden, 2 * config.intermediate, bias=False)
        self.down = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x, step, k_cache, v_cache):
        eps = self.config.eps
        x = x + self.attention(rms_norm(x, self.attention_norm, eps), step, k_cache, v_cache)
        return x + self.down(wk.silu_mul(self.gate_up(rms_norm(x, self.mlp_norm, eps))))


@dataclass
class StepInputs:
    """What every layer of one forward reads besides the hidden states: N packed rows."""

    positions: torch.Tensor  # [N] int64: logical (RoPE) position of each row
    slot_mapping: torch.Tensor  # [N] int64: cache slot its K/V goes to (-1: none)
    query_start: torch.Tensor  # [B + 1] int32: sequence b owns rows query_start[b] ..
    ctx_len: torch.Tensor  # [B] int32: cached positions before each sequence's rows
    block_table: torch.Tensor  # [B, P] int32
    cos_sin: torch.Tensor  # [max_positions, D] float32 (rope_cache)


class TinyModel(nn.Module):
    def __init__(self, config: Config = Config(), seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden))
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        with torch.no_grad():  # peaked distributions, as a trained model's: entropies
            self.lm_head.weight.mul_(10.0)  # around the thresholds, several commits a step

    def forward(self, input_ids: torch.Tensor, step: StepInputs, cache: "PagedCache"):
        x = self.embed(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer(x, step, k_cache, v_cache)
        return x  # [N, hidden]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(hidden, self.final_norm, self.config.eps))


class PagedCache:
    """One K and one V tensor per layer, ``[num_pages, page_size, Hkv, D]`` each (the
    layout ``rope_kv_append`` writes and ``paged_attention`` reads, in the model's dtype),
    and a free list of pages."""

    def __init__(self, config: Config, num_pages: int, page_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_pages, page_size, config.kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.page_size = page_size
        self.free = list(range(num_pages))

    def block_table(self, positions: list[int]) -> torch.Tensor:
        """``[B, P]`` int32 pages enough for each sequence's positions, -1 padded."""
        pages = [[self.free.pop() for _ in range(-(-n // self.page_size))] for n in positions]
        width = max(len(p) for p in pages)
        return torch.tensor([p + [-1] * (width - len(p)) for p in pages], dtype=torch.int32,
                            device=self.k[0].device)


@dataclass
class Request:
    prompt: list[int]
    max_new: int
    window: int = 8  # this sequence's mask slots per step
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    threshold: float = 0.6  # commit the masks whose adjusted entropy is below it
    penalty: float = 0.1  # distance penalty per slot
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


def generate(model: TinyModel, requests: list[Request], page_size: int = 4,
             max_steps: int = 1000) -> list[list[int]]:
    """Decode ``requests`` as one batch, streaming; returns each one's output tokens."""
    c, device = model.config, model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    batch = len(requests)
    widest = max(r.window for r in requests)
    cos_sin = wk.rope_cache(c.max_positions, c.head_dim, c.rope_theta, device=device)

    # allocated once per batch: pages for prompt + outputs (a step's rows write K/V at
    # ctx_len .. ctx_len + win_len - 1, and win_len never passes what is left of max_new),
    # the window state (capacity 2W), the sampling parameters
    positions_needed = [len(r.prompt) + r.max_new for r in requests]
    cache = PagedCache(c, num_pages=sum(-(-n // page_size) for n in positions_needed),
                       page_size=page_size, device=device, dtype=dtype)
    block_table = cache.block_table(positions_needed)
    stops = max(1, max(len(r.stop_ids) for r in requests))
    state = wk.new_window_state(
        [len(r.prompt) for r in requests], [r.max_new for r in requests],
        window=torch.tensor([r.window for r in requests], device=device), mask_id=c.mask_id,
        stop_ids=torch.tensor([list(r.stop_ids) + [-1] * (stops - len(r.stop_ids))
                               for r in requests], device=device),
        slots=2 * widest, device=device)
    params = dict(
        temperature=torch.tensor([r.temperature for r in requests], device=device),
        top_k=torch.tensor([r.top_k for r in requests], dtype=torch.int32, device=device),
        top_p=torch.tensor([r.top_p for r in requests], device=device),
        threshold=torch.tensor([r.threshold for r in requests], device=device),
        penalty=torch.tensor([r.penalty for r in requests], device=device),
        seed=torch.tensor([r.seed for r in requests], device=device),
    )

    # prefill: every prompt's rows packed back to back, causal, no logits
    lengths = [len(r.prompt) for r in requests]
    starts = torch.tensor([sum(lengths[:b]) for b in range(batch + 1)], dtype=torch.int32,
                          device=device)
    nothing_cached = torch.zeros(batch, dtype=torch.int32, device=device)
    positions, slot_mapping = wk.prefill_slots(starts, nothing_cached, block_table, page_size,
                                               num_rows=sum(lengths))
    prompt_ids = torch.tensor([t for r in requests for t in r.prompt], device=device)
    with torch.no_grad():
        model(prompt_ids, StepInputs(positions, slot_mapping, starts, nothing_cached,
                                     block_table, cos_sin), cache)

    for _ in range(max_steps):
        # the one value a step reads back: its live rows (an engine with CUDA graphs rounds
        # it up to a captured row count; the rows past the live ones are padding)
        num_rows = int(state.win_len.sum())
        if num_rows == 0:
            break
        # 1. the windows, reordered (filled slots first) and packed, at logical positions
        input_ids, positions, slot_mapping, _, query_start, n_filled = wk.reorder_window(
            state.win_tokens, state.win_mask, state.win_len, state.ctx_len, block_table,
            page_size, num_rows)
        with torch.no_grad():
            hidden = model(input_ids, StepInputs(positions, slot_mapping, query_start,
                                                 state.ctx_len, block_table, cos_sin), cache)
            # 2. the LM head on the mask rows only, `widest` rows per sequence
            rows, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, widest)
            logits = model.logits(hidden[rows]).float()
        # 3. entropy, distance penalty, threshold, sampling; 4. commit and refill
        token, selected, _ = wk.select_tokens(logits, cu_rows, row_pos, **params)
        wk.commit_window(state.win_tokens, state.win_mask, state.win_len, state.ctx_len,
                         cu_rows, row_pos, token, selected, state.out_tokens, state.out_len,
                         state.finished, state.stop_ids, state.max_new, widest, c.mask_id)
    return [state.out_tokens[b, :int(state.out_len[b])].tolist() for b in range(batch)]


def example_requests() -> list[Request]:
    """Mixed prompt lengths, windows, sampling and stops."""
    return [
        Request(prompt=[5, 17, 3, 9, 41], max_new=12, window=8),
        Request(prompt=[7], max_new=9, window=4, temperature=0.8, top_k=20, seed=11),
        Request(prompt=[2, 60, 61, 62, 63, 64, 65, 66, 1], max_new=14, window=6,
                temperature=1.0, top_p=0.9, threshold=1.0, seed=3),
        Request(prompt=[30, 31, 32], max_new=10, window=1, stop_ids=(12, 40)),
    ]


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = TinyModel().to(device)
    for request, output in zip(example_requests(), generate(model, example_requests())):
        print(f"prompt {request.prompt} (window {request.window}) -> {output}")
