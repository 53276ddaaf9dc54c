"""The checkpoint flavours WeDLMForCausalLM serves: a WeDLM checkpoint of the Qwen2.5
flavour (q/k/v bias, no qk-norm), and a plain Qwen3 checkpoint through hf_overrides, each
equal to model_min token for token."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

import model_min

from .conftest import TINY, WINDOW, write_checkpoint
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate


@pytest.fixture(scope="module")
def qwen2_flavour_checkpoint(tmp_path_factory):
    """The tiny model's weights without the q/k norms and with random q/k/v biases."""
    weights = load_file(TINY / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in list(weights):
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            del weights[name]
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            rows = weights[name].shape[0]
            weights[name.replace(".weight", ".bias")] = 0.05 * torch.randn(
                rows, generator=generator)
    folder = tmp_path_factory.mktemp("qwen2-flavour")
    save_file(weights, folder / "weights.safetensors")
    return write_checkpoint(folder / "tiny-wedlm-qwen2", {
        "model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], "qk_norm": False,
        "attention_bias": True,
    }, weights=folder / "weights.safetensors")


def reference(path, prompts, max_new_tokens, mode="streaming", **params):
    """model_min on the checkpoint at ``path``."""
    return reference_generate((model_min.load_model(path), None), prompts,
                              model_min.SamplingParams(max_new_tokens=max_new_tokens, **params),
                              mode=mode)


def test_the_qwen2_flavour_and_engine_wide_settings_equal_model_min(engines,
                                                                    qwen2_flavour_checkpoint):
    # the engine's own settings, not the defaults: block-wise, threshold 1.0, penalty 0.05
    settings = {"window": WINDOW, "mode": "blockwise", "entropy_threshold": 1.0,
                "distance_penalty": 0.05}
    with engines.own(qwen2_flavour_checkpoint, additional_config={"wedlm": settings}) as engine:
        blockwise = vllm_generate(engine, PROMPTS, SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))
        streaming = vllm_generate(engine, PROMPTS, SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True,
            extra_args={"wedlm_mode": "streaming"}))
    selection = dict(threshold=1.0, penalty=0.05)
    assert blockwise == reference(qwen2_flavour_checkpoint, PROMPTS, 24, "blockwise",
                                  **selection)
    assert streaming == reference(qwen2_flavour_checkpoint, PROMPTS, 24, **selection)


def test_a_plain_qwen3_checkpoint_is_served_through_hf_overrides(engines):
    with engines.own(TINY, skip_tokenizer_init=True,
                     hf_overrides={"architectures": ["WeDLMForCausalLM"]}) as engine:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                detokenize=False)
        got = vllm_generate(engine, PROMPTS, params)
        # without a tokenizer vLLM checks no prompt id; the plugin checks them against the
        # model's vocabulary, so an id past the embedding is a 400, not a dead engine
        for bad in ([5, 264], [-1, 5], [2**31]):
            with pytest.raises(VLLMValidationError, match="outside the model's vocabulary"):
                engine.generate([{"prompt_token_ids": bad}], params, use_tqdm=False)
        assert vllm_generate(engine, PROMPTS[:1], params) == got[:1]
    assert got == reference(TINY, PROMPTS, 24)


def _stored_stop_ids(worker) -> dict:
    """Per running request: the stop ids its slot holds on the device, and the width."""
    state = worker.model_runner.model_state
    return {req_id: ([t for t in state.stop_ids[slot].tolist() if t >= 0], state.num_stop_ids)
            for req_id, slot in state._slot_of.items()}


def test_the_stop_id_buffer_holds_the_tokenizers_eos_the_generation_eos_and_24_more(
        engines, tmp_path):
    # config.json's eos 251, generation_config.json's 251 and 252, the tokenizer's 256: vLLM
    # adds 252 and 256 to a request's 24 stop_token_ids, 27 ids, and the buffer is as wide
    checkpoint = write_checkpoint(tmp_path / "eos", {
        "model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], "qk_norm": True,
        "attention_bias": False, "eos_token_id": 251})
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [251, 252]}))
    stops = list(range(100, 124))
    with engines.own(checkpoint) as engine:
        engine.llm_engine.add_request("many-stops", {"prompt_token_ids": PROMPTS[0]},
                                      SamplingParams(max_tokens=30, temperature=0,
                                                     stop_token_ids=stops))
        engine.llm_engine.step()
        [(stored, width)] = engine.collective_rpc(_stored_stop_ids)[0].values()
        while engine.llm_engine.has_unfinished_requests():
            engine.llm_engine.step()
    assert sorted(stored) == sorted([*stops, 251, 252, 256]) and width == 27
