"""The Hugging Face config class of ``model_type: "wedlm"`` checkpoints, for vLLM.

A WeDLM checkpoint is a Qwen3-shaped decoder (``qk_norm: true``) or a Qwen2.5-shaped one
(q/k/v bias); both read Qwen3's config fields, plus ``qk_norm`` and ``mask_token_id``.
"""

from transformers import Qwen3Config


class WeDLMConfig(Qwen3Config):
    model_type = "wedlm"

    def __init__(self, qk_norm: bool = False, mask_token_id: int | None = None,
                 attention_bias: bool | None = None, **kwargs) -> None:
        # As model_min reads it: q/k/v bias unless the checkpoint has qk_norm.
        if attention_bias is None:
            attention_bias = not qk_norm
        super().__init__(attention_bias=attention_bias, **kwargs)
        self.qk_norm = qk_norm
        self.mask_token_id = mask_token_id
