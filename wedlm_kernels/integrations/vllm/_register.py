"""What :func:`wedlm_kernels.integrations.vllm.register` does, with vLLM imported."""

import dataclasses
import re

import msgspec
from vllm import ModelRegistry
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.renderers.base import BaseRenderer
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.config import _CONFIG_REGISTRY
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from wedlm_kernels.requests.params import INT32_MAX

from . import ARCHITECTURE
from .config import WeDLMConfig
from .settings import (
    SettingsError,
    WeDLMSettings,
    bad_words_token_ids,
    check_request,
    checkpoint_eos_ids,
    engine_settings,
    unsupported_parameters,
)

_registered = False
# vLLM's diffusion schedulers, with the asynchronous-scheduling rule of .scheduler added
SCHEDULER = "wedlm_kernels.integrations.vllm.scheduler.make_scheduler"


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
        if vllm_config.speculative_config is not None:
            raise ValueError(f"{ARCHITECTURE} does not take a speculative_config: WeDLM's "
                             "window uses vLLM's draft-token rows itself")
        # ctx_len, max_new and win_len are int32 on the device
        if vllm_config.model_config.max_model_len + canvas > INT32_MAX:
            raise ValueError(f"{ARCHITECTURE}: max_model_len "
                             f"({vllm_config.model_config.max_model_len}) plus the canvas "
                             f"must stay below 2**31 (int32 lengths)")
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls is None:  # else the one asked for, as vLLM does
            scheduler.scheduler_cls = SCHEDULER
        hf_config.wedlm_structured_refusal = _structured_refusal(vllm_config)
        hf_config.wedlm_never_output = list(_never_output(vllm_config.model_config))
        if scheduler.max_num_batched_tokens < canvas:
            raise ValueError(f"{ARCHITECTURE}: max_num_batched_tokens "
                             f"({scheduler.max_num_batched_tokens}) must hold one request's "
                             f"canvas of 2 * window = {canvas} rows")


def _never_output(model_config) -> tuple[int, ...]:
    """The ids no request outputs (:mod:`wedlm_kernels.requests.output_ids`): the mask id and the ids
    the engine's tokenizer does not decode, from the tokenizer folder's ``tokenizer.json``
    (as model_min reads the checkpoint's) or else vLLM's tokenizer of the engine; without
    either (no tokenizer the engine can load), the mask id alone."""
    from pathlib import Path

    from vllm.logger import init_logger

    from wedlm_kernels.requests.output_ids import never_output_ids, tokenizer_ids

    source = model_config.tokenizer
    known = tokenizer_ids(source) if source and Path(source).is_dir() else None
    if known is None and not model_config.skip_tokenizer_init:
        from vllm.tokenizers import cached_tokenizer_from_config

        try:
            tokenizer = cached_tokenizer_from_config(model_config)
        except Exception as error:  # vLLM's own start fails on it next, with its message
            init_logger(__name__).warning("WeDLM: the tokenizer %s does not load (%s)",
                                          source, error)
            tokenizer = None
        if tokenizer is not None:
            known = set(tokenizer.get_vocab().values())
    if known is None:
        init_logger(__name__).warning(
            "WeDLM: no tokenizer to read at %s: only the mask id is kept from the output "
            "(ids the tokenizer would not decode are not known)", source)
    return never_output_ids(model_config.get_vocab_size(),
                            int(model_config.hf_config.mask_token_id), known)


def _structured_refusal(vllm_config) -> str | None:
    """Why this engine cannot serve structured outputs, or None (the request check reads
    it, in the frontend process)."""
    import vllm

    from .live_canvas import PATCHED_VERSIONS, is_patched_version

    if not is_patched_version(vllm.__version__):
        return (f"WeDLM's structured outputs were written for vLLM {list(PATCHED_VERSIONS)}, "
                f"this is vLLM {vllm.__version__}")
    if vllm_config.scheduler_config.scheduler_cls != SCHEDULER:
        return ("WeDLM's structured outputs need the plugin's scheduler, and this engine "
                f"runs {vllm_config.scheduler_config.scheduler_cls!r}")
    from .structured import PLAN_WORDS

    vocab_size = vllm_config.model_config.get_vocab_size()
    if vocab_size < 32 * PLAN_WORDS:
        return (f"WeDLM's grammar rows carry {PLAN_WORDS} words of metadata in a mask row, "
                f"which a vocabulary of {vocab_size} tokens (under {32 * PLAN_WORDS}) cannot "
                "hold")
    outputs = vllm_config.structured_outputs_config
    if getattr(outputs, "reasoning_parser", None) and not getattr(
            outputs, "enable_in_reasoning", False):
        return ("this engine has a reasoning parser, whose grammar starts after the "
                "reasoning; WeDLM's window walk does not track where reasoning ends yet")
    return None


def _verify(self: SamplingParams, model_config, *args, **kwargs) -> None:
    """Replaces SamplingParams.verify: for WeDLM models the plugin's check runs first, so a
    value of a field it reads is refused by name before vLLM's own checks index it (vLLM's
    ``_validate_logit_bias`` iterates whatever ``logit_bias`` holds and raises a bare
    TypeError for a number), then vLLM's checks as for any model."""
    if is_wedlm(model_config):
        tokenizer = args[2] if len(args) > 2 else kwargs.get("tokenizer")
        _validate_request(self, model_config, tokenizer)
    return _vllm_verify(self, model_config, *args, **kwargs)


def _validate_diffusion(self: SamplingParams, model_config) -> None:
    """Replaces SamplingParams._validate_diffusion: WeDLM's requests were checked by
    :func:`_verify` (vLLM's diffusion check refuses what WeDLM serves); others keep
    vLLM's."""
    if not is_wedlm(model_config):
        return _vllm_validate_diffusion(self, model_config)
    return None


def _validate_structured_outputs(self: SamplingParams, model_config, *args, **kwargs
                                 ) -> None:
    """Replaces SamplingParams._validate_structured_outputs: for WeDLM models vLLM's checks
    without its refusal of every diffusion model (the plugin serves WeDLM's grammar
    requests, docs/vllm.md "Structured outputs"; it is the only use vLLM's check makes of
    ``model_config``), and a refusal that names no field (a regex xgrammar cannot compile,
    a JSON schema with features it lacks) names ``structured_outputs``."""
    if not is_wedlm(model_config):
        return _vllm_validate_structured_outputs(self, model_config, *args, **kwargs)
    try:
        return _vllm_validate_structured_outputs(self, _NOT_DIFFUSION, *args, **kwargs)
    except (VLLMValidationError, ValueError) as error:  # (vLLM names no field in most)
        if getattr(error, "parameter", None):
            raise
        raise VLLMValidationError(f"structured_outputs: {error}",
                                  parameter="structured_outputs") from error


class _NotDiffusion:
    is_diffusion = False


_NOT_DIFFUSION = _NotDiffusion()


def _validate_request(self: SamplingParams, model_config, tokenizer=None) -> None:
    """The plugin's check of a request to a WeDLM model (from :func:`_verify`; the
    tokenizer finds bad_words' tokens as vLLM will)."""
    refused = unsupported_parameters(self)
    if not refused and self.structured_outputs is not None:
        why = getattr(model_config.hf_config, "wedlm_structured_refusal", None)
        if why:
            refused = [("structured_outputs", why)]
    if refused:
        name, why = refused[0]
        raise VLLMValidationError(f"{name} is not supported by WeDLM decoding: {why}",
                                  parameter=name)
    engine = getattr(model_config.hf_config, "wedlm_settings", None)
    if engine is None:  # the config hook did not run in this process: nothing to check by
        raise RuntimeError(f"{ARCHITECTURE}: the engine's WeDLM settings are unknown here "
                           "(hf_config.wedlm_settings); the request cannot be checked")
    try:
        check_request(WeDLMSettings(**engine), self, model_config.get_vocab_size(),
                      model_config.max_model_len,
                      tuple(getattr(model_config.hf_config, "wedlm_eos_ids", ())))
        bad_words_token_ids(self, tokenizer, model_config.get_vocab_size())
    except SettingsError as error:
        raise VLLMValidationError(str(error), parameter=error.parameter) from None
    _check_engine_can_read(self)  # the fields WeDLM does not read, after the ones it does


_vllm_validate_diffusion = SamplingParams._validate_diffusion
_vllm_validate_structured_outputs = SamplingParams._validate_structured_outputs
_vllm_verify = SamplingParams.verify
_ENCODER, _DECODER = MsgpackEncoder(), MsgpackDecoder(SamplingParams)


def _check_engine_can_read(params: SamplingParams) -> None:
    """Refuse, naming the field, a request that vLLM cannot hand to its engine process.

    vLLM does not type-check most SamplingParams fields, and its engine process decodes each
    request strictly (msgspec): through a multiprocess ``LLM``, ``ignore_eos=1``, ``n=True``
    or ``presence_penalty=False`` stops the engine's input thread, and a numpy number (which
    its encoder refuses) leaves the request registered but never sent; either way the
    engine hangs. This is the same round trip, on the request alone (about 10 us)."""
    try:
        _DECODER.decode(_ENCODER.encode(params))
    except msgspec.ValidationError as error:  # "Expected `bool`, got `int` - at `$.n`"
        found = re.search(r"at `\$\.(\w+)", str(error))
        name = found.group(1) if found else "sampling_params"
        raise VLLMValidationError(f"{name}: {error} (vLLM's engine cannot read this value)",
                                  parameter=name) from None
    except (TypeError, OverflowError) as error:  # a numpy number; an int past 64 bits
        name = next((field for field in msgspec.structs.fields(SamplingParams)
                     if not _encodes(getattr(params, field.name, None))), None)
        name = name.name if name is not None else "sampling_params"
        raise VLLMValidationError(f"{name}: {error} (vLLM cannot send this value to its "
                                  "engine; use Python numbers)", parameter=name) from None


def _encodes(value) -> bool:
    try:
        _ENCODER.encode(value)
    except (TypeError, OverflowError):
        return False
    return True


def _validate_prompt_ids(self: BaseRenderer, token_ids, *, parameter: str | None = None
                         ) -> None:
    """Replaces BaseRenderer.validate_token_ids: vLLM's check, then, for WeDLM models, every
    prompt id within the model's vocabulary. vLLM's own check skips an engine without a
    tokenizer (``skip_tokenizer_init``) and admits ids up to the tokenizer's largest, so an
    id past the embedding would reach the forward in the worker and stop the engine."""
    _vllm_validate_token_ids(self, token_ids, parameter=parameter)
    if not token_ids or not is_wedlm(self.model_config):
        return
    vocab_size = self.model_config.get_vocab_size()
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        raise VLLMValidationError(
            f"prompt token id {low if low < 0 else high} is outside the model's vocabulary "
            f"[0, {vocab_size})", parameter=parameter or "prompt")


_vllm_validate_token_ids = BaseRenderer.validate_token_ids


def _response_format_checked(convert):
    """vLLM's ``structured_outputs_from_response_format`` (the OpenAI server's completions
    and chat requests), with a ``json_schema`` response format that holds no schema refused
    naming it: vLLM builds a constraint of nothing from it and answers "You must use one
    kind of structured outputs constraint but none are specified", naming no field. The same
    400, for every model the process serves, with the field named."""
    def structured_outputs_from_response_format(structured_outputs, response_format):
        if getattr(response_format, "type", None) == "json_schema":
            schema = getattr(response_format, "json_schema", None)
            if schema is not None and getattr(schema, "json_schema", None) is None:
                raise VLLMValidationError(
                    "response_format: a response format of type 'json_schema' needs its "
                    "JSON schema in response_format.json_schema.schema",
                    parameter="response_format")
        return convert(structured_outputs, response_format)

    structured_outputs_from_response_format._wedlm_original = convert
    return structured_outputs_from_response_format


def _check_response_formats() -> None:
    """Install :func:`_response_format_checked` where the OpenAI server's request models
    call it (idempotent)."""
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as completion

    for module in (chat, completion):
        convert = module.structured_outputs_from_response_format
        if getattr(convert, "_wedlm_original", None) is None:
            module.structured_outputs_from_response_format = _response_format_checked(convert)


def register_all() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    ModelRegistry.register_model(ARCHITECTURE,
                                 "wedlm_kernels.integrations.vllm.model:WeDLMForCausalLM")
    _CONFIG_REGISTRY["wedlm"] = WeDLMConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = WeDLMConfigHook
    SamplingParams._validate_diffusion = _validate_diffusion
    SamplingParams._validate_structured_outputs = _validate_structured_outputs
    SamplingParams.verify = _verify
    BaseRenderer.validate_token_ids = _validate_prompt_ids
    _check_response_formats()
    from . import shutdown

    shutdown.install()
