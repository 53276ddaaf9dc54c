"""The Hugging Face config class of ``model_type: "wedlm"`` checkpoints, for vLLM.

A WeDLM checkpoint is a Qwen3-shaped decoder (``qk_norm: true``) or a Qwen2.5-shaped one
(q/k/v bias); both read Qwen3's config fields, plus ``qk_norm`` and ``mask_token_id``, with
the defaults model_min reads them with where Qwen3's differ (docs/vllm.md, "One reading of a
checkpoint").
"""

from transformers import Qwen3Config


class WeDLMConfig(Qwen3Config):
    model_type = "wedlm"

    def __init__(self, qk_norm: bool = False, mask_token_id: int | None = None,
                 attention_bias: bool | None = None, head_dim: int | None = None,
                 **kwargs) -> None:
        # As model_min reads it (wedlm_kernels.checkpoints.config): q/k/v bias unless the
        # checkpoint has qk_norm, and without a head_dim, hidden_size / num_attention_heads
        # (Qwen3Config's own default is 128, which vLLM's Qwen3 decoder would then use)
        if attention_bias is None:
            attention_bias = not qk_norm
        super().__init__(attention_bias=attention_bias, **kwargs)
        self.qk_norm = qk_norm
        self.mask_token_id = mask_token_id
        self.head_dim = (head_dim if head_dim is not None
                         else self.hidden_size // self.num_attention_heads)
