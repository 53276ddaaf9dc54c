"""Checkpoint loading: ``config.json`` plus safetensors (one file or shards listed in
``model.safetensors.index.json``). Pickled checkpoints (``*.bin``, ``*.pt``) are never read.

Every tensor is checked against the config before anything is loaded: a missing,
unexpected or mis-shaped tensor, an integer tensor where a float weight belongs, or a file
that is truncated or corrupt fails with a :class:`CheckpointError` naming the tensor or the
file. q/k/v projections are fused into one matrix (and bias), gate/up into another.
"""

import json
from pathlib import Path
from typing import Union

import torch
from safetensors import SafetensorError, safe_open

from wedlm_kernels.checkpoints.config import (  # noqa: F401  (CheckpointError re-exported)
    FLOAT_DTYPES,
    IGNORED_SUFFIXES,
    CheckpointError,
    ModelConfig,
    check_no_missing,
    expected_shapes,
)
from wedlm_kernels.requests.output_ids import tokenizer_ids

from .config import load_config
from .model import LayerWeights, Model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory."""
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        try:
            with open(index_path) as file:
                weight_map = json.load(file)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: unreadable index ({error})") from None
        files = [path / shard for shard in sorted(set(weight_map.values()))]
        for file in files:
            if not file.exists():
                raise CheckpointError(f"{index_path}: lists shard {file.name}, which is missing")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {', '.join(pickles)}: pickled checkpoints are not loaded)" if pickles else ""
    raise FileNotFoundError(
        f"{path}: neither model.safetensors nor model.safetensors.index.json found{hint}"
    )


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """``name -> (file, shape, safetensors dtype)`` for every tensor of every file."""
    headers: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensor_slice = handle.get_slice(name)
                    if name in headers:
                        raise CheckpointError(
                            f"tensor {name} is stored twice: in {headers[name][0].name} "
                            f"and {file.name}"
                        )
                    headers[name] = (file, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"{file}: cannot read the safetensors file, it may be truncated or corrupt "
                f"({error})"
            ) from None
    return headers


def _check(headers: dict, config: ModelConfig) -> None:
    check_no_missing(config, headers)
    shapes = expected_shapes(config)
    unexpected = [
        name for name in headers if name not in shapes and not name.endswith(IGNORED_SUFFIXES)
    ]
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]} in {headers[unexpected[0]][0].name} "
            f"(not part of a {config.model_type} model with this config): "
            f"{', '.join(sorted(unexpected)[:8])}"
        )
    for name, shape in shapes.items():
        if name not in headers:
            continue
        file, actual, dtype = headers[name]
        if actual != shape:
            raise CheckpointError(
                f"tensor {name} in {file.name} has shape {list(actual)}, expected {list(shape)}"
            )
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name} in {file.name} has dtype {dtype}, expected a float dtype "
                f"({', '.join(sorted(FLOAT_DTYPES))})"
            )


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# The dtypes the decoder computes in (its weights, activations and K/V cache).
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_model(
    path: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype | None = None,
) -> Model:
    """Load a Qwen3 / Qwen2.5 / WeDLM checkpoint directory onto ``device`` in ``dtype``
    (default: bf16 on CUDA, fp32 elsewhere)."""
    path = Path(path)
    device = torch.device(device)
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in MODEL_DTYPES]} or None, got "
                         f"{dtype!r}")
    dtype = dtype or default_dtype(device)
    config = load_config(path)
    headers = _read_headers(checkpoint_files(path))
    _check(headers, config)

    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        file = headers[name][0]
        try:
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            tensor = handles[file].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise CheckpointError(
                f"{file}: cannot read tensor {name}, the file may be truncated or corrupt "
                f"({error})"
            ) from None
        return tensor.to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}.self_attn."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([get(p + f"{n}_proj.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                qkv_weight=torch.cat([get(p + f"{n}_proj.weight") for n in "qkv"]),
                qkv_bias=qkv_bias,
                q_norm=get(p + "q_norm.weight") if config.qk_norm else None,
                k_norm=get(p + "k_norm.weight") if config.qk_norm else None,
                o_weight=get(p + "o_proj.weight"),
                o_bias=get(p + "o_proj.bias") if config.o_proj_bias else None,
                post_attention_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up_weight=torch.cat(
                    [get(f"model.layers.{i}.mlp.{n}_proj.weight") for n in ("gate", "up")]
                ),
                down_weight=get(f"model.layers.{i}.mlp.down_proj.weight"),
            )
        )
    embed_tokens = get("model.embed_tokens.weight")
    # tied, but the file stores a head of its own: that head (transformers >= 5 and vLLM
    # untie the two then too, where they differ)
    lm_head = get("lm_head.weight") if "lm_head.weight" in headers else embed_tokens
    model = Model(config, embed_tokens, layers, get("model.norm.weight"), lm_head)
    model.tokenizer_ids = tokenizer_ids(path)
    return model
