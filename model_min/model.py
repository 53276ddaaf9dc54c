"""The Qwen-family decoder (ALGORITHM.md section 1) on the paged KV cache.

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

from .cache import KVCache, slot_mapping_for
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
        self.device = embed_tokens.device
        self.dtype = embed_tokens.dtype
        self.scale = config.head_dim**-0.5
        self.cos_sin = wk.rope_cache(
            config.max_position_embeddings, config.head_dim, config.rope_theta, self.device
        )

    def ensure_positions(self, num_positions: int) -> bool:
        """Grow the RoPE table to cover positions ``< num_positions``; True if it grew (a
        captured CUDA graph that reads the old table is then stale)."""
        if num_positions <= self.cos_sin.shape[0]:
            return False
        self.cos_sin = wk.rope_cache(
            num_positions, self.config.head_dim, self.config.rope_theta, self.device
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
        ctx_len: torch.Tensor,
        q_len: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Hidden states ``[B, S, hidden]`` (before the final norm) of the rows
        ``input_ids [B, S]``.

        Row ``j`` of sequence ``b`` has RoPE position ``positions[b, j]``, writes its K/V at
        ``slot_mapping[b, j]`` (-1: nowhere) and attends to cache positions
        ``0 .. ctx_len[b] + j``; rows ``j >= q_len[b]`` are padding.
        """
        c = self.config
        batch, rows = input_ids.shape
        flat_positions = positions.reshape(-1)
        flat_slots = slot_mapping.reshape(-1)
        x = F.embedding(input_ids.reshape(-1), self.embed_tokens)  # [B*S, hidden]
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
                flat_positions,
                self.cos_sin,
                cache.k[layer],
                cache.v[layer],
                flat_slots,
                weights.q_norm,
                weights.k_norm,
                c.rms_norm_eps,
            )
            attention = wk.paged_attention(
                q.view(batch, rows, c.num_heads, c.head_dim),
                cache.k[layer],
                cache.v[layer],
                block_table,
                ctx_len,
                q_len,
                self.scale,
            )
            attention_out = F.linear(attention.reshape(batch * rows, -1), weights.o_weight,
                                     weights.o_bias)
            h, x = add_rms_norm(attention_out, x, weights.post_attention_norm, c.rms_norm_eps)
            mlp_out = F.linear(silu_mul(F.linear(h, weights.gate_up_weight)), weights.down_weight)
            if layer + 1 < len(self.layers):
                h, x = add_rms_norm(mlp_out, x, self.layers[layer + 1].input_norm,
                                    c.rms_norm_eps)
            else:
                x = x + mlp_out
        return x.view(batch, rows, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and ``lm_head`` of the rows ``hidden [..., hidden]`` -> ``[..., V]``."""
        return F.linear(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)

    def prefill(
        self,
        input_ids: torch.Tensor,
        prompt_len: torch.Tensor,
        block_table: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Run the prompts ``input_ids [B, Lmax]`` (row ``b`` valid for ``j < prompt_len[b]``)
        causally to fill the cache at positions ``0 .. prompt_len[b]-1``. Computes no logits;
        returns the hidden state ``[B, hidden]`` of each prompt's last row (row 0 for an
        empty prompt), which only AR decoding turns into logits."""
        batch, rows = input_ids.shape
        positions = torch.arange(rows, device=self.device).expand(batch, rows)
        valid = positions < prompt_len[:, None]
        slot_mapping = slot_mapping_for(block_table, positions, valid, cache.page_size)
        ctx_len = torch.zeros_like(prompt_len)
        hidden = self.forward(
            input_ids, positions, slot_mapping, block_table, ctx_len, prompt_len, cache
        )
        last = (prompt_len.long() - 1).clamp(min=0)
        return hidden[torch.arange(batch, device=self.device), last]
