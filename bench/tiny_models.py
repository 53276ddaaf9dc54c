"""Tiny random Qwen3 / Qwen2.5 checkpoints for the tests and the CPU decoder benchmark (built
from config objects, no downloads).

The weights are random but scaled so that the model is not degenerate: logits spread over
several nats (so entropies vary between rows and the threshold selection has something to
choose), attention scores depend on the context, and the RMSNorm weights are not all ones
(so a missing norm weight shows up).
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()

VOCAB_SIZE = 300
MASK_TOKEN_ID = VOCAB_SIZE - 1


def tiny_config(
    kind: str = "qwen3",
    *,
    num_hidden_layers: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    attention_bias: bool = False,
    yarn: dict | None = None,
):
    """A tiny ``Qwen3Config`` / ``Qwen2Config``: hidden 64, 4 query heads, 2 KV heads, fp32,
    eager attention, ``mask_token_id`` = the last vocabulary row. ``attention_bias`` adds
    q/k/v/o biases to Qwen3 (Qwen2 always has q/k/v biases); ``yarn`` (``factor``,
    ``original_max_position_embeddings``, ...) makes its RoPE YaRN's."""
    common = dict(
        hidden_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=({"rope_type": "default", "rope_theta": rope_theta} if yarn is None
                         else {"rope_type": "yarn", "rope_theta": rope_theta, **yarn}),
        attn_implementation="eager",
    )
    if kind == "qwen3":
        config = Qwen3Config(head_dim=head_dim, attention_bias=attention_bias, **common)
    elif kind == "qwen2":
        config = Qwen2Config(**common)  # head_dim = hidden_size // num_attention_heads = 16
    else:
        raise ValueError(f"unknown kind {kind!r}")
    config.mask_token_id = MASK_TOKEN_ID
    return config


@torch.no_grad()
def build_tiny_model(kind: str = "qwen3", seed: int = 0, **config_options):
    """A ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` with random, well-scaled fp32 weights."""
    config = tiny_config(kind, **config_options)
    model = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM}[kind](config)
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        if "norm" in name:
            parameter.copy_(1.0 + 0.25 * noise)
        elif name.endswith(".bias"):
            parameter.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            parameter.copy_(noise)
        elif "lm_head" in name:
            parameter.copy_(0.35 * noise)
        else:
            # 1/sqrt(fan_in) keeps activations O(1); the factor makes attention peaky
            parameter.copy_(1.5 * noise / parameter.shape[1] ** 0.5)
    return model.to(torch.float32).eval()


def save_checkpoint(model, directory, max_shard_size=None):
    """Write ``config.json`` and safetensors (sharded with an index when ``max_shard_size``
    is given, e.g. "20KB") to ``directory``; returns it."""
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **options)
    return directory


@torch.no_grad()
def hf_logits(model, input_ids, position_ids) -> torch.Tensor:
    """HF logits ``[N, V]`` of one sequence with explicit RoPE positions and a plain causal
    mask over the row order.

    The explicit all-ones ``attention_mask`` matters: without it (and without a cache) HF
    reads non-consecutive ``position_ids`` as several packed sequences and masks attention
    across them.
    """
    input_ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)
    position_ids = torch.as_tensor(position_ids, dtype=torch.int64).reshape(1, -1)
    output = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=torch.ones_like(input_ids),
        use_cache=False,
    )
    return output.logits[0]


@torch.no_grad()
def hf_key_values(model, input_ids) -> list:
    """Per layer ``(k [N, Hkv, D], v [N, Hkv, D])`` from HF's cache after a plain causal
    forward over ``input_ids`` (positions ``0..N-1``): the keys after q/k norm and RoPE."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)
    output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
    cache = output["cache"] if "cache" in output else output["past_key_values"]
    return [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in cache.layers
    ]
