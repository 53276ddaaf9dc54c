"""WeDLM decoding in vLLM (Model Runner V2): an out-of-tree plugin on this library's ops.

``register()`` is vLLM's ``vllm.general_plugins`` entry point (pyproject.toml), called in
every vLLM process. It registers

- the architecture ``WeDLMForCausalLM`` (:mod:`.model`; vLLM's Qwen3/Qwen2 layers, WeDLM's
  loop from :mod:`.state`) and a config class for ``model_type: "wedlm"`` checkpoints;
- a config hook that turns vLLM's diffusion scheduling on for it: ``canvas_length = 2W``
  query rows per request per step (``additional_config={"wedlm": {"window": W}}``);
- the request check: vLLM refuses temperature and seed for diffusion models, WeDLM serves
  them, and refuses what it does not serve (logprobs, penalties, n > 1, ...) by name.

Nothing here imports vLLM until vLLM calls it; docs/vllm.md has the whole story.
"""

ARCHITECTURE = "WeDLMForCausalLM"


def register() -> None:
    """Register WeDLM with vLLM (idempotent)."""
    from ._register import register_all

    register_all()
