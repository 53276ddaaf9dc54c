"""model_min: a minimal WeDLM decoder composed from the ``wedlm_kernels`` ops.

Installed with ``wedlm_kernels`` (with its demo model; ``[model]`` adds the tokenizer
package text prompts need), so from any directory::

    python -m model_min generate --prompt "count: 3 "          # the shipped demo model
    python -m model_min generate --model DIR --prompt "..."

or from Python::

    import torch
    from model_min import Generator, SamplingParams, load_model, load_tokenizer
    model = load_model(DIR, device="cuda", dtype=torch.bfloat16)
    generator = Generator(model, window=16, tokenizer=load_tokenizer(DIR))
    [result] = generator.generate(["Hello"], SamplingParams(max_new_tokens=64))
"""

from .cache import CacheFullError, KVCache
from .config import ModelConfig, config_from_dict, load_config
from .generator import Generator, Result, SamplingParams, auto_window
from .loader import CheckpointError, load_model
from .model import Model
from .tokenizer import Tokenizer, chat_prompt, load_tokenizer

__all__ = [
    "CacheFullError",
    "CheckpointError",
    "Generator",
    "KVCache",
    "Model",
    "ModelConfig",
    "Result",
    "SamplingParams",
    "Tokenizer",
    "auto_window",
    "chat_prompt",
    "config_from_dict",
    "load_config",
    "load_model",
    "load_tokenizer",
]
