"""A checkpoint's ``config.json`` (and ``generation_config.json``) read from its directory.

What the file means is :mod:`wedlm_kernels.checkpoints.config`'s one reading, which the vLLM
plugin shares: Qwen3, Qwen2.5 and WeDLM configs, every size from the file, plain or YaRN
RoPE (any other RoPE scaling is refused).
"""

import json
from pathlib import Path
from typing import Union

from wedlm_kernels.checkpoints.config import (  # noqa: F401  (re-exported)
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    config_from_dict,
    is_integer,
    is_real,
)


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; a ValueError naming the file if it is not one."""
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a JSON file")
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_config(path: Union[str, Path]) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present) from a checkpoint
    directory."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: no config.json")
    config = _read_json(config_path)
    generation_path = config_path.parent / "generation_config.json"
    generation_config = _read_json(generation_path) if generation_path.exists() else None
    try:
        return config_from_dict(config, generation_config)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
