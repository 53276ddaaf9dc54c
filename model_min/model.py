"""The Qwen-family decoder (docs/algorithm.md section 1) on the paged KV cache.

Per layer (pre-norm)::

    h  = x + o_proj(attention(rmsnorm(x)))
    x' = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))

then a final RMSNorm and ``lm_head``. q, k and v come out of one fused projection and are
handed to ``wedlm_kernels.rope_kv_append`` as strided views of it (per-head q/k RMSNorm on
Qwen3, RoPE at the logical positions, K/V appended to the cache); attention reads the cache
through ``wedlm_kernels.paged_attention``. Each residual add is folded into the RMSNorm that
follows it and the MLP's activation reads the fused gate/up projection in place
(``model_min.layers``: fused kernels on CUDA, PyTorch with the same roundings on CPU). The
forward returns hidden states only: the caller picks the rows that need logits (the mask
rows of a decode step) and calls :meth:`Model.logits` on those alone.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import wedlm_kernels as wk

from .cache import KVCache
from .config import ModelConfig
from .layers import add_rms_norm, rms_norm, silu_mul


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D] (Qwen2.5)
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D] (Qwen3)
    o_weight: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None  # [H]
    post_attention_norm: torch.Tensor  # [H]
    gate_up_weight: torch.Tensor  # [2 I, H]: gate_proj, up_proj stacked
    down_weight: torch.Tensor  # [H, I]


class Model:
    """Weights plus the forward over the paged cache. Build it with ``loader.load_model``."""

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        # the ids the checkpoint's tokenizer decodes (load_model reads them from its
        # tokenizer.json; None: unknown), for the ids a Generator never outputs
        self.tokenizer_ids: frozenset[int] | None = None
        self.device = embed_tokens.device
        self.dtype = embed_tokens.dtype
        self.scale = config.head_dim**-0.5
        self.cos_sin = wk.rope_cache(
            config.max_position_embeddings, config.head_dim, config.rope_theta, self.device,
            yarn=config.rope_scaling,
        )

    def ensure_positions(self, num_positions: int) -> bool:
        """Grow the RoPE table to cover positions ``< num_positions``; True if it grew (a
        captured CUDA graph that reads the old table is then stale)."""
        if num_positions <= self.cos_sin.shape[0]:
            return False
        self.cos_sin = wk.rope_cache(
            num_positions, self.config.head_dim, self.config.rope_theta, self.device,
            yarn=self.config.rope_scaling,
        )
        return True

    def new_cache(self, num_pages: int, page_size: int) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        query_start: torch.Tensor,
        ctx_len: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` (before the final norm) of the packed rows
        ``input_ids [N]``.

        Rows ``query_start[b] .. query_start[b+1] - 1`` belong to sequence ``b``; row ``r``
        has RoPE position ``positions[r]`` and writes its K/V at ``slot_mapping[r]`` (-1:
        nowhere); the ``j``-th row of sequence ``b`` attends to cache positions
        ``0 .. ctx_len[b] + j``. Rows at or after ``query_start[B]`` are padding.
        """
        c = self.config
        x = F.embedding(input_ids, self.embed_tokens)  # [N, hidden]
        # The residual stream x and the normalised input h of the next block: every residual
        # add is folded into the norm that follows it (one fused launch on CUDA), the last
        # one is a plain add.
        h = rms_norm(x, self.layers[0].input_norm, c.rms_norm_eps)
        for layer, weights in enumerate(self.layers):
            qkv = F.linear(h, weights.qkv_weight, weights.qkv_bias)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = wk.rope_kv_append(
                q.unflatten(-1, (c.num_heads, c.head_dim)),
                k.unflatten(-1, (c.num_kv_heads, c.head_dim)),
                v.unflatten(-1, (c.num_kv_heads, c.head_dim)),
                positions,
                self.cos_sin,
                cache.k[layer],
                cache.v[layer],
                slot_mapping,
                weights.q_norm,
                weights.k_norm,
                c.rms_norm_eps,
            )
            attention = wk.paged_attention(
                q, cache.k[layer], cache.v[layer], block_table, query_start, ctx_len,
                self.scale,
            )
            attention_out = F.linear(attention.flatten(1), weights.o_weight, weights.o_bias)
            h, x = add_rms_norm(attention_out, x, weights.post_attention_norm, c.rms_norm_eps)
            mlp_out = F.linear(silu_mul(F.linear(h, weights.gate_up_weight)), weights.down_weight)
            if layer + 1 < len(self.layers):
                h, x = add_rms_norm(mlp_out, x, self.layers[layer + 1].input_norm,
                                    c.rms_norm_eps)
            else:
                x = x + mlp_out
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and ``lm_head`` of the rows ``hidden [..., hidden]`` -> ``[..., V]``."""
        return F.linear(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)

    def prefill(
        self,
        prompts: list[list[int]],
        block_table: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Run the prompts causally, packed back to back, to fill the cache at positions
        ``0 .. len(prompt) - 1``. Computes no logits; returns the hidden state ``[B, hidden]``
        of each prompt's last row (meaningless for an empty prompt), which only AR decoding
        turns into logits."""
        lengths = [len(prompt) for prompt in prompts]
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        device = self.device
        input_ids = torch.tensor([t for prompt in prompts for t in prompt], dtype=torch.int64,
                                 device=device)
        query_start = torch.tensor(starts, dtype=torch.int32, device=device)
        ctx_len = torch.zeros(len(prompts), dtype=torch.int32, device=device)
        positions, slot_mapping = wk.prefill_slots(query_start, ctx_len, block_table,
                                                   cache.page_size, num_rows=starts[-1])
        hidden = self.forward(
            input_ids, positions, slot_mapping, block_table, query_start, ctx_len, cache
        )
        last = torch.tensor([max(start - 1, 0) for start in starts[1:]], device=device)
        return hidden[last]
