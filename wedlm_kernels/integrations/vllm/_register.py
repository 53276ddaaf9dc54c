"""What :func:`wedlm_kernels.integrations.vllm.register` does, with vLLM imported."""

import dataclasses

from vllm import ModelRegistry
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.config import _CONFIG_REGISTRY

from wedlm_kernels.request_params import INT32_MAX

from . import ARCHITECTURE
from .config import WeDLMConfig
from .settings import (
    SettingsError,
    WeDLMSettings,
    check_request,
    checkpoint_eos_ids,
    engine_settings,
    unsupported_parameters,
)

_registered = False


def is_wedlm(model_config) -> bool:
    return ARCHITECTURE in (getattr(model_config.hf_config, "architectures", None) or [])


class WeDLMConfigHook(VerifyAndUpdateConfig):
    """Turns vLLM's diffusion scheduling on for WeDLM: every decode step gives a request
    ``canvas_length = 2W`` query rows (vLLM reads ``hf_config.canvas_length``)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        hf_config = model_config.hf_config
        if getattr(hf_config, "mask_token_id", None) is None:
            raise ValueError(f"{ARCHITECTURE} needs the checkpoint's mask_token_id "
                             "(config.json, or hf_overrides={'mask_token_id': ID})")
        if getattr(hf_config, "canvas_length", None) is None:
            hf_config.canvas_length = 32  # until the engine's window is known (below)
            model_config.__dict__.pop("is_diffusion", None)

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from vllm.config.diffusion import DiffusionConfig

        settings = engine_settings(vllm_config.additional_config)
        canvas = settings.canvas_length
        hf_config = vllm_config.model_config.hf_config
        hf_config.canvas_length = canvas
        # The request check (in the frontend process) reads the engine's settings and the
        # checkpoint's eos ids (which its stop id count leaves out) here.
        hf_config.wedlm_settings = dataclasses.asdict(settings)
        hf_config.wedlm_eos_ids = list(checkpoint_eos_ids(
            getattr(hf_config, "eos_token_id", None),
            vllm_config.model_config.try_get_generation_config().get("eos_token_id")))
        diffusion = vllm_config.diffusion_config
        if diffusion is None:
            vllm_config.diffusion_config = DiffusionConfig(canvas_length=canvas)
        elif diffusion.canvas_length != canvas:
            raise ValueError(f"{ARCHITECTURE}: diffusion_config.canvas_length must be 2 * "
                             f"window = {canvas} (set the window with additional_config="
                             f"{{'wedlm': {{'window': W}}}}), got {diffusion.canvas_length}")
        if not vllm_config.use_v2_model_runner:
            raise ValueError(f"{ARCHITECTURE} runs on vLLM's Model Runner V2 (its ModelState "
                             "hooks carry the WeDLM loop): set VLLM_USE_V2_MODEL_RUNNER=1")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"{ARCHITECTURE} does not support pipeline parallelism: the "
                             "sampler, which moves the window state, runs on the last stage "
                             "only (tensor parallelism is the way to shard it)")
        if vllm_config.speculative_config is not None:
            raise ValueError(f"{ARCHITECTURE} does not take a speculative_config: WeDLM's "
                             "window uses vLLM's draft-token rows itself")
        # ctx_len, max_new and win_len are int32 on the device
        if vllm_config.model_config.max_model_len + canvas > INT32_MAX:
            raise ValueError(f"{ARCHITECTURE}: max_model_len "
                             f"({vllm_config.model_config.max_model_len}) plus the canvas "
                             f"must stay below 2**31 (int32 lengths)")
        scheduler = vllm_config.scheduler_config
        if scheduler.max_num_batched_tokens < canvas:
            raise ValueError(f"{ARCHITECTURE}: max_num_batched_tokens "
                             f"({scheduler.max_num_batched_tokens}) must hold one request's "
                             f"canvas of 2 * window = {canvas} rows")


def _validate_request(self: SamplingParams, model_config) -> None:
    """Replaces SamplingParams._validate_diffusion for WeDLM models (others keep vLLM's)."""
    if not is_wedlm(model_config):
        return _vllm_validate_diffusion(self, model_config)
    refused = unsupported_parameters(self)
    if refused:
        name, why = refused[0]
        raise VLLMValidationError(f"{name} is not supported by WeDLM decoding: {why}",
                                  parameter=name)
    engine = getattr(model_config.hf_config, "wedlm_settings", None) or {}
    try:
        check_request(WeDLMSettings(**engine), self, model_config.get_vocab_size(),
                      model_config.max_model_len,
                      tuple(getattr(model_config.hf_config, "wedlm_eos_ids", ())))
    except SettingsError as error:
        raise VLLMValidationError(str(error), parameter=error.parameter) from None


_vllm_validate_diffusion = SamplingParams._validate_diffusion


def register_all() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    ModelRegistry.register_model(ARCHITECTURE,
                                 "wedlm_kernels.integrations.vllm.model:WeDLMForCausalLM")
    _CONFIG_REGISTRY["wedlm"] = WeDLMConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = WeDLMConfigHook
    SamplingParams._validate_diffusion = _validate_request
