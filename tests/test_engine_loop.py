"""examples/engine_loop.py, the integration guide's decode loop, decodes what a dense decoder
without a cache decodes: each step recomputes every sequence from its committed tokens and
its reordered window (filled slots first, each at its logical position) under a causal mask,
with plain PyTorch layers. Same model weights, same selection and commit ops: what is
compared is the glue (reorder, packed rows, prefill and cache slots, paged K/V, mask rows)."""

import importlib.util
import math
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import wedlm_kernels as wk

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half) of ``x [T, H, D]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = (f(angles).float()[:, None, :] for f in (torch.cos, torch.sin))
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def dense_hidden(model, tokens: list[int], positions: list[int]) -> torch.Tensor:
    """The model over one sequence's rows in the given (physical) order, causal, at the
    given logical positions: ``[T, hidden]``."""
    c = model.config
    ids, pos = torch.tensor(tokens), torch.tensor(positions)
    x = model.embed.weight[ids]
    for layer in model.layers:
        attention = layer.attention
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps) * layer.attention_norm
        q, k, v = (h @ attention.qkv.weight.T).split(
            [c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], 1)
        q, k, v = (t.view(len(tokens), -1, c.head_dim) for t in (q, k, v))

        def head_norm(t, weight):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.eps) * weight

        q = rotate(head_norm(q, attention.q_norm), pos, c.rope_theta)
        k = rotate(head_norm(k, attention.k_norm), pos, c.rope_theta)
        group = c.q_heads // c.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True,
                                             scale=1 / math.sqrt(c.head_dim))
        x = x + out.transpose(0, 1).reshape(len(tokens), -1) @ attention.out.weight.T
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps) * layer.mlp_norm
        gate, up = (h @ layer.gate_up.weight.T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer.down.weight.T
    return x


def dense_generate(example, model, requests, max_steps: int = 1000) -> list[list[int]]:
    """The same streaming decode, every step recomputed densely per sequence."""
    c = model.config
    batch, widest = len(requests), max(r.window for r in requests)
    stops = max(1, max(len(r.stop_ids) for r in requests))
    state = wk.new_window_state(
        [len(r.prompt) for r in requests], [r.max_new for r in requests],
        window=torch.tensor([r.window for r in requests]), mask_id=c.mask_id,
        stop_ids=torch.tensor([list(r.stop_ids) + [-1] * (stops - len(r.stop_ids))
                               for r in requests]), slots=2 * widest)
    params = dict(
        temperature=torch.tensor([r.temperature for r in requests]),
        top_k=torch.tensor([r.top_k for r in requests], dtype=torch.int32),
        top_p=torch.tensor([r.top_p for r in requests]),
        threshold=torch.tensor([r.threshold for r in requests]),
        penalty=torch.tensor([r.penalty for r in requests]),
        seed=torch.tensor([r.seed for r in requests]))
    cu_rows = torch.arange(0, batch * widest + 1, widest, dtype=torch.int32)
    for _ in range(max_steps):
        if int(state.win_len.sum()) == 0:
            break
        logits = torch.zeros(batch * widest, c.vocab)
        row_pos = torch.full((batch * widest,), -1, dtype=torch.int64)
        for b, request in enumerate(requests):
            live = int(state.win_len[b])
            if live == 0:
                continue
            committed = request.prompt + state.out_tokens[b, :int(state.out_len[b])].tolist()
            context = len(committed)
            assert context == int(state.ctx_len[b])
            filled = [s for s in range(live) if not bool(state.win_mask[b, s])]
            masks = [s for s in range(live) if bool(state.win_mask[b, s])]
            order = filled + masks
            with torch.no_grad():
                hidden = dense_hidden(
                    model, committed + [int(state.win_tokens[b, s]) for s in order],
                    list(range(context)) + [context + s for s in order])
                mask_hidden = hidden[context + len(filled):][:widest]
                logits[b * widest:b * widest + len(mask_hidden)] = model.logits(mask_hidden)
            for j, slot in enumerate(masks[:widest]):
                row_pos[b * widest + j] = context + slot
        token, selected, _ = wk.select_tokens(logits, cu_rows, row_pos, **params)
        wk.commit_window(state.win_tokens, state.win_mask, state.win_len, state.ctx_len,
                         cu_rows, row_pos, token, selected, state.out_tokens, state.out_len,
                         state.finished, state.stop_ids, state.max_new, widest, c.mask_id)
    return [state.out_tokens[b, :int(state.out_len[b])].tolist() for b in range(batch)]


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [1, 4, 5])
def test_the_engine_loop_decodes_what_a_dense_decoder_without_a_cache_decodes(example, seed,
                                                                             page_size):
    """(Seeds whose models commit several tokens a step and leave filled slots behind the
    leading run: a loop that mistakes filled rows for masks decodes other tokens there.)"""
    model = example.TinyModel(seed=seed)
    requests = example.example_requests()
    engine = example.generate(model, requests, page_size=page_size)
    dense = dense_generate(example, model, requests)
    assert engine == dense
    # every request wrote its tokens up to its limit or a stop id
    for request, output in zip(requests, engine):
        assert len(output) == request.max_new or output[-1] in request.stop_ids
    assert len({tuple(o) for o in engine}) > 1


def test_the_engine_loop_runs_as_a_script(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(" -> [" in line for line in lines)
