"""What a checkpoint's ``config.json`` means for the math, read once for every front end.

``model_min`` and the vLLM plugin both decode a checkpoint through this reading: the sizes
(layers, heads, KV heads, head size, hidden and MLP sizes, vocabulary), the flavour (tied or
untied head, q/k norm, q/k/v and output-projection bias), RMSNorm's eps, RoPE's base, the
mask id, the maximum positions and the tensors a checkpoint must hold (``expected_shapes``).
The plugin compares what vLLM's model class builds with this reading at startup
(docs/vllm.md, "One reading of a checkpoint"). RoPE is plain or YaRN-scaled
(``rope_type: "yarn"``, as Qwen3's long-context configs set it); any other scaling is
refused, by both front ends.

Every size is read from the file; nothing is hard-coded. RoPE settings are accepted either
as a top-level ``rope_theta`` or inside ``rope_parameters`` (newer configs).
"""

from collections.abc import Collection
from dataclasses import dataclass

# an integer / a real number (Python's or numpy's), not a bool: the checks of every number
# a front end takes (config values, token ids, counts), as for request parameters
from ..ops.rope import YarnScaling
from ..requests.params import is_integer
from ..requests.params import is_number as is_real

__all__ = ["CheckpointError", "ModelConfig", "SUPPORTED_MODEL_TYPES", "check_no_missing",
           "config_from_dict", "expected_shapes", "is_integer", "is_real"]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "wedlm")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and flavour flags of a Qwen-family decoder."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    qkv_bias: bool  # bias on the q, k, v projections (Qwen2.5; Qwen3 with attention_bias)
    o_proj_bias: bool  # bias on the output projection (Qwen3 with attention_bias)
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: YarnScaling | None = None  # None: plain RoPE

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _fail(message: str) -> None:
    raise ValueError(f"config.json: {message}")


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "truncate")


def _yarn(rope: dict, key: str) -> YarnScaling:
    """``key`` (``rope_scaling`` / ``rope_parameters``) of ``rope_type`` ``yarn``, as
    transformers and vLLM read it; the DeepSeek variant's ``mscale`` keys are refused."""
    for name in ("mscale", "mscale_all_dim"):
        if rope.get(name) is not None:
            _fail(f"{key}.{name} is not supported (DeepSeek's YaRN variant); plain YaRN "
                  "takes factor, original_max_position_embeddings, beta_fast, beta_slow, "
                  "attention_factor and truncate")
    for name in ("factor", "original_max_position_embeddings"):
        if rope.get(name) is None:
            _fail(f"{key}.{name} is missing: YaRN needs it")
    values = {name: rope[name] for name in YARN_KEYS if rope.get(name) is not None}
    for name, value in values.items():
        if name == "truncate":
            if not isinstance(value, bool):
                _fail(f"{key}.truncate must be true or false, got {value!r}")
        elif name == "original_max_position_embeddings":
            if not is_integer(value):
                _fail(f"{key}.{name} must be an integer >= 1, got {value!r}")
        elif not is_real(value):
            _fail(f"{key}.{name} must be a number, got {value!r}")
    numbers = {name: (value if name in ("truncate", "original_max_position_embeddings")
                      else float(value)) for name, value in values.items()}
    try:
        return YarnScaling(**numbers)
    except (TypeError, ValueError) as error:
        _fail(f"{key}: {str(error).replace('`', '')}")


def _rope(config: dict) -> tuple[float, YarnScaling | None]:
    """RoPE base from ``rope_theta`` or ``rope_parameters.rope_theta``, and YaRN scaling
    from ``rope_scaling`` / ``rope_parameters`` (``rope_type`` ``yarn``); refuses any other
    scaling and a partial rotary factor."""
    yarn: YarnScaling | None = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            _fail(f"{key} must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            _fail(
                f"unsupported RoPE scaling {key}.rope_type={rope_type!r}; plain ('default') "
                "RoPE and YaRN ('yarn') are implemented"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            _fail("partial_rotary_factor != 1 is not supported")
        if rope_type == "yarn":
            found = _yarn(rope, key)
            if yarn is not None and found != yarn:
                _fail("rope_scaling and rope_parameters give different YaRN settings")
            yarn = found
    top_level = config.get("rope_theta")
    nested = (config.get("rope_parameters") or {}).get("rope_theta")
    if top_level is not None and nested is not None and float(top_level) != float(nested):
        _fail(f"rope_theta={top_level} disagrees with rope_parameters.rope_theta={nested}")
    theta = top_level if top_level is not None else nested
    if theta is None:
        _fail("no rope_theta (neither at the top level nor in rope_parameters)")
    return _positive_float({"rope_theta": theta}, "rope_theta", 0.0), yarn


_MISSING = object()


def _int(config: dict, key: str, minimum: int, default=_MISSING) -> int:
    """``config[key]`` as an integer >= ``minimum`` (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            found = "null" if key in config else "nothing (missing)"
            _fail(f"{key} must be an integer >= {minimum}, got {found}")
        return default
    if not is_integer(value) or value < minimum:
        _fail(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(config: dict, key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    if not is_real(value) or not 0 < value < float("inf"):
        _fail(f"{key} must be a finite number > 0, got {value!r}")
    return float(value)


def _token_ids(value, key: str, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id`` may be absent, one id or a list of ids, each in the vocabulary."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    for token in values:
        if not is_integer(token) or not 0 <= token < vocab_size:
            _fail(f"{key} must be token ids in [0, {vocab_size}) (vocab_size), got {value!r}")
    return tuple(values)


def _flavour(config: dict, model_type: str) -> tuple[bool, bool, bool]:
    """``(qk_norm, qkv_bias, o_proj_bias)`` of a config."""
    if model_type == "qwen3":
        bias = bool(config.get("attention_bias", False))
        return True, bias, bias
    if model_type == "qwen2":
        return False, True, False
    # "wedlm": Qwen3-shaped with qk_norm, Qwen2.5-shaped (q/k/v bias) without it.
    qk_norm = bool(config.get("qk_norm", False))
    bias = bool(config.get("attention_bias", not qk_norm))
    return qk_norm, bias, bias and qk_norm


def config_from_dict(config: dict, generation_config: dict | None = None) -> ModelConfig:
    """Parse a ``config.json`` dictionary (and optionally ``generation_config.json`` for
    extra end-of-sequence ids)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        _fail(f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    if config.get("hidden_act", "silu") != "silu":
        _fail(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window") or layer_types != {"full_attention"}:
        _fail("sliding-window attention is not supported")
    hidden_size = _int(config, "hidden_size", 1)
    num_layers = _int(config, "num_hidden_layers", 1)
    num_heads = _int(config, "num_attention_heads", 1)
    intermediate_size = _int(config, "intermediate_size", 1)
    vocab_size = _int(config, "vocab_size", 2)
    num_kv_heads = _int(config, "num_key_value_heads", 1, default=num_heads)
    head_dim = _int(config, "head_dim", 2, default=hidden_size // num_heads)
    max_positions = _int(config, "max_position_embeddings", 1, default=32768)
    if head_dim < 2:
        _fail(f"hidden_size={hidden_size} / num_attention_heads={num_heads} gives head_dim "
              f"{head_dim}; set head_dim (>= 2)")
    if num_heads % num_kv_heads != 0:
        _fail(
            f"num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    if head_dim % 2 != 0:
        _fail(f"head_dim={head_dim} must be even for RoPE")
    qk_norm, qkv_bias, o_proj_bias = _flavour(config, model_type)
    mask_token_id = config.get("mask_token_id")
    if mask_token_id is not None and (not is_integer(mask_token_id)
                                      or not 0 <= mask_token_id < vocab_size):
        _fail(f"mask_token_id must be a token id in [0, {vocab_size}) (vocab_size), got "
              f"{mask_token_id!r}")
    eos = _token_ids(config.get("eos_token_id"), "eos_token_id", vocab_size)
    generation_eos = _token_ids((generation_config or {}).get("eos_token_id"),
                                "generation_config.json eos_token_id", vocab_size)
    eos += tuple(t for t in generation_eos if t not in eos)
    rope_theta, rope_scaling = _rope(config)
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        rms_norm_eps=_positive_float(config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        eos_token_ids=eos,
        rope_scaling=rope_scaling,
    )


class CheckpointError(ValueError):
    """A checkpoint does not match its config or cannot be read."""


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints store


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model needs, with its shape (``lm_head.weight`` included even
    when the embeddings are tied: optional then, and where it is stored, the head; as
    transformers >= 5 and vLLM read such a checkpoint)."""
    c = config
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def check_no_missing(config: ModelConfig, names: Collection[str], prefix: str = "") -> None:
    """Raise :class:`CheckpointError` naming the first of :func:`expected_shapes`' tensors
    (and how many more) that ``names``, the tensors a checkpoint holds, lacks.
    ``lm_head.weight`` may be absent when the embeddings are tied. ``prefix`` starts the
    message (who read the checkpoint)."""
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [name for name in expected_shapes(config)
               if name not in names and name not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{prefix}missing tensor {missing[0]}{more}: "
                              f"{', '.join(missing[:8])}")
