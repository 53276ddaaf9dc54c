"""Reference Qwen3 / Qwen2.5 decoder forward (docs/algorithm.md section 1), in float64.

Per layer (pre-norm):

    h  = x + o_proj(attention(rmsnorm(x)))
    x' = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))

then a final RMSNorm and ``lm_head``. Attention projects q, k, v (with a bias on Qwen2.5),
RMS-normalises q and k per head on Qwen3, rotates both at the given RoPE positions and
takes the softmax of ``q.k / sqrt(head_dim)``; query head ``h`` reads KV head
``h // (Hq // Hkv)`` (grouped-query attention).

Two forwards compute the same model:

- :func:`forward`: no cache; row ``i`` attends to rows ``0..i`` of the given order (a plain
  causal mask) and RoPE uses the explicit ``position_ids``, which need not be monotone.
- :func:`forward_paged`: the cached path of the real decoder, built from the reference ops
  (``reference.rope.rope_kv_append`` and ``reference.attention.paged_attention``).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from safetensors.torch import load_file

from reference.attention import paged_attention
from reference.rope import apply_rope, rms_norm, rope_cache, rope_kv_append

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "wedlm")


@dataclass(frozen=True)
class ModelConfig:
    """The sizes and flavour flags of a Qwen3 / Qwen2.5 checkpoint."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    qkv_bias: bool  # bias on the q, k, v projections (Qwen2.5)
    o_proj_bias: bool  # bias on the output projection (Qwen3 with attention_bias)
    mask_token_id: int | None = None


def _rope_theta(config: dict) -> float:
    """RoPE base from ``rope_theta`` or ``rope_parameters["rope_theta"]``; rejects scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: {key} must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json: unsupported RoPE scaling {key}.rope_type={rope_type!r} "
                "(only the plain 'default' RoPE is implemented)"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
    top_level = config.get("rope_theta")
    nested = (config.get("rope_parameters") or {}).get("rope_theta")
    if top_level is not None and nested is not None and float(top_level) != float(nested):
        raise ValueError(
            f"config.json: rope_theta={top_level} disagrees with "
            f"rope_parameters.rope_theta={nested}"
        )
    theta = top_level if top_level is not None else nested
    if theta is None:
        raise ValueError("config.json: no rope_theta (top level or in rope_parameters)")
    return float(theta)


def config_from_dict(config: dict) -> ModelConfig:
    """Parse a Qwen3 (``model_type`` "qwen3"), Qwen2.5 ("qwen2") or WeDLM ("wedlm") config.

    A "wedlm" config is Qwen3-shaped when ``qk_norm`` is true; its ``attention_bias``
    defaults to ``not qk_norm`` (the Qwen2.5-shaped checkpoint has q/k/v biases).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: unsupported model_type {model_type!r}; "
            f"expected one of {SUPPORTED_MODEL_TYPES}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: unsupported hidden_act {config['hidden_act']!r}")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ValueError("config.json: sliding-window attention is not supported")

    if model_type == "qwen3":
        qk_norm = True
        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias, o_proj_bias = attention_bias, attention_bias
    elif model_type == "qwen2":
        qk_norm, qkv_bias, o_proj_bias = False, True, False
    else:
        qk_norm = bool(config.get("qk_norm", False))
        attention_bias = bool(config.get("attention_bias", not qk_norm))
        qkv_bias = attention_bias
        o_proj_bias = attention_bias and qk_norm

    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or hidden_size // num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"config.json: head_dim={head_dim} must be even for RoPE")
    mask_token_id = config.get("mask_token_id")
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden_size,
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
    )


def load_config(path: Union[str, Path]) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    with open(path) as file:
        return config_from_dict(json.load(file))


def load_weights(path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors``, or the shards listed
    by ``model.safetensors.index.json``."""
    path = Path(path)
    index_path = path / "model.safetensors.index.json"
    single_path = path / "model.safetensors"
    if index_path.exists():
        with open(index_path) as file:
            weight_map: dict[str, str] = json.load(file)["weight_map"]
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            weights.update(load_file(path / shard))
        missing = sorted(set(weight_map) - set(weights))
        if missing:
            raise ValueError(f"{index_path}: tensors listed but not in any shard: {missing}")
        return weights
    if single_path.exists():
        return load_file(single_path)
    raise FileNotFoundError(
        f"{path}: neither model.safetensors nor model.safetensors.index.json found"
    )


def lm_head_weight(weights: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """``lm_head.weight``, or the input embedding when the embeddings are tied."""
    if "lm_head.weight" in weights:
        return weights["lm_head.weight"]
    if config.tie_word_embeddings:
        return weights["model.embed_tokens.weight"]
    raise KeyError("lm_head.weight is missing and tie_word_embeddings is false")


def _linear(x: torch.Tensor, weights: dict, name: str, bias: bool) -> torch.Tensor:
    """``x @ W.T (+ b)`` in float64 for the projection ``name`` (``W`` is [out, in])."""
    y = x @ weights[name + ".weight"].to(torch.float64).T
    if bias:
        y = y + weights[name + ".bias"].to(torch.float64)
    return y


def _mlp(x: torch.Tensor, weights: dict, prefix: str) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
    gate = _linear(x, weights, prefix + "mlp.gate_proj", False)
    up = _linear(x, weights, prefix + "mlp.up_proj", False)
    return _linear(torch.nn.functional.silu(gate) * up, weights, prefix + "mlp.down_proj", False)


def _qkv(x: torch.Tensor, weights: dict, config: ModelConfig, prefix: str):
    """The q ``[..., Hq, D]``, k and v ``[..., Hkv, D]`` projections (no norm, no RoPE)."""
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    q = _linear(x, weights, prefix + "self_attn.q_proj", config.qkv_bias)
    k = _linear(x, weights, prefix + "self_attn.k_proj", config.qkv_bias)
    v = _linear(x, weights, prefix + "self_attn.v_proj", config.qkv_bias)
    lead = x.shape[:-1]
    return (
        q.reshape(*lead, heads, head_dim),
        k.reshape(*lead, kv_heads, head_dim),
        v.reshape(*lead, kv_heads, head_dim),
    )


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Row ``i`` attends to rows ``0..i``: q ``[N, Hq, D]``, k/v ``[N, Hkv, D]`` -> ``[N, Hq, D]``."""
    num_rows, heads, head_dim = q.shape
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    future = torch.ones(num_rows, num_rows, dtype=torch.bool).triu(diagonal=1)
    for h in range(heads):
        scores = (q[:, h] @ k[:, h // group].T) * scale
        scores = scores.masked_fill(future, -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def forward(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    return_kv: bool = False,
):
    """Logits ``[N, V]`` float64 of the rows ``input_ids [N]`` under a plain causal mask over
    the given order, with RoPE at ``position_ids [N]`` (any order, not necessarily monotone).

    With ``return_kv`` also returns, per layer, ``(k [N, Hkv, D], v [N, Hkv, D])``: the keys
    after the q/k norm and RoPE, and the values, exactly what a KV cache would hold.
    """
    eps = config.rms_norm_eps
    position_ids = position_ids.to(torch.int64)
    cos_sin = rope_cache(int(position_ids.max()) + 1, config.head_dim, config.rope_theta)
    rotation = cos_sin[position_ids].unsqueeze(1)  # [N, 1, D], broadcast over heads

    x = weights["model.embed_tokens.weight"][input_ids].to(torch.float64)
    kv_per_layer = []
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        h = rms_norm(x, weights[prefix + "input_layernorm.weight"], eps)
        q, k, v = _qkv(h, weights, config, prefix)
        if config.qk_norm:
            q = rms_norm(q, weights[prefix + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, weights[prefix + "self_attn.k_norm.weight"], eps)
        q = apply_rope(q, rotation)
        k = apply_rope(k, rotation)
        kv_per_layer.append((k, v))
        attention = _causal_attention(q, k, v).reshape(x.shape[0], -1)
        x = x + _linear(attention, weights, prefix + "self_attn.o_proj", config.o_proj_bias)
        h = rms_norm(x, weights[prefix + "post_attention_layernorm.weight"], eps)
        x = x + _mlp(h, weights, prefix)
    x = rms_norm(x, weights["model.norm.weight"], eps)
    logits = x @ lm_head_weight(weights, config).to(torch.float64).T
    if return_kv:
        return logits, kv_per_layer
    return logits


def forward_paged(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    kv_caches: list,
    cos_sin: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    ctx_len: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[N, V]`` float64 of packed rows through the paged KV cache (the decoder's
    cached path).

    ``kv_caches``: one ``(k_cache, v_cache)`` pair per layer, each
    ``[num_pages, page_size, Hkv, D]``, mutated. Rows ``query_start[b] ..
    query_start[b+1] - 1`` belong to sequence ``b``; row ``r`` carries token
    ``input_ids[r]`` at RoPE position ``positions[r]``, its K/V is written at
    ``slot_mapping[r]`` (-1: dropped) and the ``j``-th row of sequence ``b`` attends to cache
    positions ``0 .. ctx_len[b] + j``; rows at or after ``query_start[B]`` are padding (their
    logits are meaningless).
    """
    heads, head_dim = config.num_attention_heads, config.head_dim
    eps = config.rms_norm_eps
    scale = 1.0 / math.sqrt(head_dim)

    x = weights["model.embed_tokens.weight"][input_ids].to(torch.float64)  # [N, H]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        k_cache, v_cache = kv_caches[layer]
        h = rms_norm(x, weights[prefix + "input_layernorm.weight"], eps)
        q, k, v = _qkv(h, weights, config, prefix)
        q_norm = weights[prefix + "self_attn.q_norm.weight"] if config.qk_norm else None
        k_norm = weights[prefix + "self_attn.k_norm.weight"] if config.qk_norm else None
        q = rope_kv_append(
            q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps
        )
        attention = paged_attention(
            q.reshape(-1, heads, head_dim), k_cache, v_cache, block_table, query_start,
            ctx_len, scale,
        ).reshape(-1, heads * head_dim)
        x = x + _linear(attention, weights, prefix + "self_attn.o_proj", config.o_proj_bias)
        h = rms_norm(x, weights[prefix + "post_attention_layernorm.weight"], eps)
        x = x + _mlp(h, weights, prefix)
    x = rms_norm(x, weights["model.norm.weight"], eps)
    return x @ lm_head_weight(weights, config).to(torch.float64).T
