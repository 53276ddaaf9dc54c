"""One reading of a checkpoint in both front ends (docs/vllm.md, "One reading of a
checkpoint").

A checkpoint reaches the math through two readers: :mod:`wedlm_kernels.checkpoints.config` (what
model_min decodes) and the vLLM model class the plugin builds on (``Qwen3Model`` or
``Qwen2Model``, from vLLM's own config object). Where they would read a config differently
(vLLM's ``Qwen2Model`` derives the head size from ``hidden_size / num_attention_heads`` and
ignores ``head_dim``; its ``Qwen3Attention`` has no output-projection bias), both engines
would start and decode, and disagree without a word. So at startup the plugin reads the
checkpoint's ``config.json`` (with the engine's ``hf_overrides``) the shared way and
compares every field that changes the math with what the vLLM model it built uses: a
disagreement stops the engine, naming the field and both readings. :func:`check_tensor`
then holds every tensor ``load_weights`` receives to the same reading.
"""

import math
from typing import Any

import torch

import wedlm_kernels as wk
from wedlm_kernels.checkpoints.config import (
    IGNORED_SUFFIXES,
    CheckpointError,
    ModelConfig,
    config_from_dict,
    expected_shapes,
)

from . import ARCHITECTURE

# RoPE rows compared number by number (vLLM builds its table in float32, this library in
# float64 rounded to float32)
ROPE_ROWS_COMPARED = 256


class ConfigMismatchError(ValueError):
    """vLLM's model reads the checkpoint's config otherwise than model_min does."""


def checkpoint_config(model_config: Any) -> ModelConfig:
    """The shared reading of the engine's checkpoint: its ``config.json`` with the
    engine's ``hf_overrides`` applied (a dict's entries replace the file's, a dict-valued
    one whole, as vLLM applies them to a text model's config; a callable's result is read
    from vLLM's config object instead, as ``to_dict()`` gives it, which carries the config
    class's defaults where the file was silent)."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    overrides = model_config.hf_overrides
    if callable(overrides):
        raw = model_config.hf_config.to_dict()
    else:
        source = model_config.hf_config_path or model_config.model
        raw = get_hf_file_to_dict("config.json", source, model_config.revision)
        if raw is None:
            raise ConfigMismatchError(f"{ARCHITECTURE}: no config.json found for {source}")
        raw.update(overrides or {})  # vLLM replaces a dict-valued field too
    try:
        return config_from_dict(raw)
    except ValueError as error:
        raise ConfigMismatchError(f"{ARCHITECTURE}: {error}") from None


def _disagree(field: str, ours: Any, theirs: Any, decoder: str, hint: str = "") -> None:
    raise ConfigMismatchError(
        f"{ARCHITECTURE}: the checkpoint's {field} reads {ours!r} as model_min decodes it "
        f"(wedlm_kernels.checkpoints.config), but vLLM's {decoder} uses {theirs!r}; the two would "
        f"decode differently{'. ' + hint if hint else ''}")


def check_model_reads_config(model: torch.nn.Module, config: ModelConfig,
                             model_config: Any) -> None:
    """Compare the vLLM model ``model`` (a ``WeDLMForCausalLM`` just built, before its
    weights load) with the shared reading ``config``; raise :class:`ConfigMismatchError`
    naming the first field they disagree on. ``model_config``: vLLM's ``ModelConfig``
    (its ``hf_config`` holds the mask id the window state masks with)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding import (
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm.v1.attention.backend import AttentionType

    decoder = type(model.model).__name__
    kinds = {RotaryEmbedding: "default", YaRNScalingRotaryEmbedding: "yarn"}
    if getattr(model_config.hf_config, "quantization_config", None) is not None:
        raise ConfigMismatchError(
            f"{ARCHITECTURE}: the checkpoint is pre-quantized (config.json has a "
            "quantization_config); WeDLM is served from unquantized weights, which model_min "
            "reads too (vLLM's online quantization, --quantization, takes them)")

    def same(field: str, ours: Any, theirs: Any, hint: str = "") -> None:
        if ours != theirs:
            _disagree(field, ours, theirs, decoder, hint)

    # With pipeline parallelism a stage holds its own layers only (the others are
    # PPMissingLayer placeholders): each stage checks what it holds, so together they
    # check everything.
    def held(module: torch.nn.Module) -> bool:
        return not isinstance(module, PPMissingLayer)

    layers = model.model.layers
    same("num_hidden_layers", config.num_layers, len(layers))
    embed, head = model.model.embed_tokens, model.lm_head
    if held(embed):
        same("vocab_size", config.vocab_size, embed.org_vocab_size)
        same("hidden_size", config.hidden_size, embed.embedding_dim)
    if held(head):
        same("vocab_size (lm_head)", config.vocab_size, head.org_vocab_size)
    same("vocab_size (logits)", config.vocab_size, model.logits_processor.org_vocab_size)
    if held(embed) and held(head):
        # a tied config whose checkpoint stores a head of its own: vLLM unties the two
        # (and ties them again after loading where they are equal), as model_min reads
        # that head
        untied = getattr(model_config, "word_embeddings_untied_by_checkpoint", False)
        same("tie_word_embeddings", config.tie_word_embeddings and not untied,
             getattr(head, "weight", None) is embed.weight)
    if held(model.model.norm):
        same("rms_norm_eps (final norm)", config.rms_norm_eps,
             model.model.norm.variance_epsilon)
    same("mask_token_id", config.mask_token_id,
         getattr(model_config.hf_config, "mask_token_id", None))
    for index, layer in enumerate(layers):
        if not held(layer):
            continue
        where = f"layer {index}: "
        attention = layer.self_attn
        same(where + "num_attention_heads", config.num_heads, attention.total_num_heads)
        same(where + "num_key_value_heads", config.num_kv_heads, attention.total_num_kv_heads)
        same(where + "head_dim", config.head_dim, attention.head_dim,
             "vLLM's Qwen2 decoder derives the head size from hidden_size / "
             "num_attention_heads" if decoder == "Qwen2Model" else "")
        same(where + "q/k/v bias", config.qkv_bias, attention.qkv_proj.bias is not None)
        same(where + "o_proj bias", config.o_proj_bias, attention.o_proj.bias is not None,
             "vLLM's Qwen3 attention has no output-projection bias"
             if decoder == "Qwen3Model" else "")
        same(where + "q/k norm", config.qk_norm, hasattr(attention, "q_norm"))
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if config.qk_norm:
            norms += [attention.q_norm, attention.k_norm]
        for norm in norms:
            same(where + "rms_norm_eps", config.rms_norm_eps, norm.variance_epsilon)
        same(where + "intermediate_size", config.intermediate_size,
             layer.mlp.down_proj.input_size)
        same(where + "hidden_act", "silu",
             "silu" if isinstance(layer.mlp.act_fn, SiluAndMul) else type(layer.mlp.act_fn))
        same(where + "attention type", AttentionType.DECODER, attention.attn.attn_type)
        same(where + "sliding window", None, getattr(attention.attn, "sliding_window", None))
        _check_rope(where, config, attention.rotary_emb, kinds, same)


def _check_rope(where: str, config: ModelConfig, rotary: Any, kinds: dict[type, str],
                same) -> None:
    """``kinds``: vLLM's rotary embedding classes by the ``rope_type`` they implement."""
    yarn = config.rope_scaling
    same(where + "RoPE scaling", "default" if yarn is None else "yarn",
         kinds.get(type(rotary), type(rotary).__name__))
    same(where + "RoPE dimension", config.head_dim, rotary.rotary_dim)
    same(where + "RoPE layout (split halves)", True, rotary.is_neox_style)
    same(where + "rope_theta", config.rope_theta, float(rotary.base))
    if yarn is None:
        same(where + "max_position_embeddings", config.max_position_embeddings,
             rotary.max_position_embeddings)
    else:  # vLLM's YaRN keeps the trained length there, and a table factor times as long
        same(where + "original_max_position_embeddings",
             yarn.original_max_position_embeddings, rotary.max_position_embeddings)
        same(where + "YaRN factor", yarn.factor, float(rotary.scaling_factor))
        same(where + "YaRN beta_fast, beta_slow, truncate",
             (yarn.beta_fast, yarn.beta_slow, yarn.truncate),
             (float(rotary.beta_fast), float(rotary.beta_slow), rotary.truncate))
        if not math.isclose(yarn.scale, float(rotary.mscale), rel_tol=1e-9):
            same(where + "YaRN attention factor", yarn.scale, float(rotary.mscale))
    # vLLM keeps its table in the engine's dtype (bf16 in a bf16 engine): compare the
    # float32 table it builds that from where the method is there, else the stored one
    # within that dtype's rounding
    compute = getattr(rotary, "_compute_cos_sin_cache", None)
    stored = rotary.cos_sin_cache
    table = compute() if callable(compute) else stored
    rows = min(ROPE_ROWS_COMPARED, table.shape[0])
    theirs = table[:rows].float().cpu()
    ours = wk.rope_cache(rows, config.head_dim, config.rope_theta, yarn=yarn)
    # float32 angles: position * inv_freq rounds to about position * 2**-24 radians
    scale = 1.0 if yarn is None else yarn.scale
    rounding = 1e-6 if table.dtype == torch.float32 else torch.finfo(table.dtype).eps
    tolerance = (torch.arange(rows, dtype=torch.float32)[:, None] * 2.0**-21 + rounding) * scale
    excess = ((theirs - ours).abs() - tolerance).max().item()  # startup, not a decode step
    if not excess <= 0:
        raise ConfigMismatchError(
            f"{ARCHITECTURE}: {where}vLLM's RoPE table differs from the one model_min "
            f"builds from rope_theta = {config.rope_theta} (head_dim {config.head_dim}"
            f"{', ' + repr(yarn) if yarn else ''}) by more than float32 rounding in its "
            f"first {rows} positions; the two would decode differently")


def check_tensor(name: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]],
                 seen: set[str]) -> bool:
    """Hold one tensor ``load_weights`` receives to the shared reading: a name the model
    does not have, a shape that differs from the config's, or a tensor sent twice is a
    :class:`CheckpointError` naming it. Returns False for a tensor to skip (a stored RoPE
    buffer)."""
    if name.endswith(IGNORED_SUFFIXES):
        return False
    if name not in expected:
        raise CheckpointError(f"{ARCHITECTURE}: unexpected tensor {name} (not part of a model "
                              "with this config)")
    if name in seen:
        raise CheckpointError(f"{ARCHITECTURE}: tensor {name} is stored twice")
    if tuple(shape) != expected[name]:
        raise CheckpointError(f"{ARCHITECTURE}: tensor {name} has shape {list(shape)}, "
                              f"expected {list(expected[name])}")
    seen.add(name)
    return True


__all__ = ["ConfigMismatchError", "check_model_reads_config", "check_tensor",
           "checkpoint_config", "expected_shapes"]
