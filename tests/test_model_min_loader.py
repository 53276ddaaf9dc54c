"""model_min config parsing and safetensors loading: what Hugging Face `transformers` writes
loads into the right fused weights, and every broken checkpoint fails naming the culprit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import wedlm_kernels as wk
from bench.tiny_models import build_tiny_model, save_checkpoint
from model_min import CheckpointError, config_from_dict, load_config, load_model

BASE_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 300,
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_checkpoint(build_tiny_model("qwen3"), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture()
def broken_dir(qwen3_dir, tmp_path):
    """A fresh copy of the tiny Qwen3 checkpoint to damage."""
    target = tmp_path / "checkpoint"
    shutil.copytree(qwen3_dir, target)
    return target


def rewrite(directory, change):
    """Apply ``change`` to the tensor dict of ``model.safetensors`` and write it back."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ------------------------------------------------------------------------------ config


def test_rope_theta_is_read_from_top_level_or_rope_parameters():
    top = config_from_dict({**BASE_CONFIG, "rope_theta": 1e6})
    nested = config_from_dict(
        {**BASE_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert top.rope_theta == 1e6
    assert nested.rope_theta == 5e5


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_yarn_scaling_is_read_from_either_key(key):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = config_from_dict({**BASE_CONFIG, "rope_theta": 1e6, key: yarn})
    assert config.rope_scaling == wk.YarnScaling(4.0, 64)
    assert config_from_dict({**BASE_CONFIG, "rope_theta": 1e6}).rope_scaling is None


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "linear", "factor": 2.0}, "unsupported RoPE scaling .*'linear'"),
    ({"type": "dynamic", "factor": 2.0}, "unsupported RoPE scaling .*'dynamic'"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings is missing"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "factor is missing"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64},
     "factor must be a finite number >= 1"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "mscale": 1.0, "mscale_all_dim": 1.0}, "mscale is not supported"),
    ({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 64},
     "factor must be a number"),
])
def test_rope_scaling_other_than_yarn_or_a_bad_yarn_is_rejected_by_name(rope, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict({**BASE_CONFIG, "rope_theta": 1e6, "rope_scaling": rope})


def test_head_dim_defaults_to_hidden_size_over_heads():
    assert config_from_dict({**BASE_CONFIG, "rope_theta": 1e4}).head_dim == 16
    assert config_from_dict({**BASE_CONFIG, "rope_theta": 1e4, "head_dim": 32}).head_dim == 32


def test_flavours_qwen2_has_qkv_bias_qwen3_has_qk_norm():
    qwen2 = config_from_dict({**BASE_CONFIG, "model_type": "qwen2", "rope_theta": 1e4})
    qwen3 = config_from_dict({**BASE_CONFIG, "rope_theta": 1e4})
    qwen3_bias = config_from_dict({**BASE_CONFIG, "rope_theta": 1e4, "attention_bias": True})
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_proj_bias) == (False, True, False)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_proj_bias) == (True, False, False)
    assert (qwen3_bias.qkv_bias, qwen3_bias.o_proj_bias) == (True, True)


def test_wedlm_model_type_follows_its_qk_norm_flag():
    qwen3_like = config_from_dict(
        {**BASE_CONFIG, "model_type": "wedlm", "rope_theta": 1e6, "qk_norm": True})
    qwen2_like = config_from_dict({**BASE_CONFIG, "model_type": "wedlm", "rope_theta": 1e6})
    assert (qwen3_like.qk_norm, qwen3_like.qkv_bias) == (True, False)
    assert (qwen2_like.qk_norm, qwen2_like.qkv_bias, qwen2_like.o_proj_bias) == (False, True, False)


def test_unsupported_model_type_is_rejected():
    with pytest.raises(ValueError, match="llama"):
        config_from_dict({**BASE_CONFIG, "model_type": "llama", "rope_theta": 1e4})


@pytest.mark.parametrize("name, text, message", [
    ("config.json", '{ hidden_size: 64 }', "not valid JSON"),
    ("config.json", "[1, 2]", "expected a JSON object, got list"),
    ("generation_config.json", '{"eos_token_id": 3,}', "not valid JSON"),
])
def test_malformed_json_names_its_file(broken_dir, name, text, message):
    (broken_dir / name).write_text(text)
    with pytest.raises(ValueError, match=f"{name}: {message}") as caught:
        load_config(broken_dir)
    assert str(broken_dir / name) in str(caught.value)


def test_mask_and_eos_ids_come_from_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE_CONFIG, "rope_theta": 1e4, "mask_token_id": 297,
                    "eos_token_id": 7})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = load_config(tmp_path)
    assert config.mask_token_id == 297
    assert config.eos_token_ids == (7, 9)


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_fused_projections_hold_the_hf_weights(kind, tmp_path):
    hf = build_tiny_model(kind)
    model = load_model(save_checkpoint(hf, tmp_path))
    state = hf.state_dict()
    attention = "model.layers.1.self_attn."
    expected_qkv = torch.cat([state[attention + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(model.layers[1].qkv_weight, expected_qkv)
    if kind == "qwen2":
        expected_bias = torch.cat([state[attention + f"{n}_proj.bias"] for n in "qkv"])
        assert torch.equal(model.layers[1].qkv_bias, expected_bias)
        assert model.layers[1].q_norm is None
    else:
        assert torch.equal(model.layers[1].k_norm, state[attention + "k_norm.weight"])
        assert model.layers[1].qkv_bias is None
    mlp = "model.layers.1.mlp."
    expected_gate_up = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
    assert torch.equal(model.layers[1].gate_up_weight, expected_gate_up)
    assert torch.equal(model.lm_head, state["lm_head.weight"])


def test_tied_checkpoint_uses_the_embedding_as_lm_head(tmp_path):
    hf = build_tiny_model("qwen3", tie_word_embeddings=True)
    directory = save_checkpoint(hf, tmp_path)
    assert "lm_head.weight" not in load_file(directory / "model.safetensors")
    model = load_model(directory)
    assert torch.equal(model.lm_head, hf.state_dict()["model.embed_tokens.weight"])


def test_a_tied_checkpoint_that_stores_a_head_of_its_own_decodes_with_it_as_transformers(
        tmp_path):
    hf = build_tiny_model("qwen3", tie_word_embeddings=True)
    directory = save_checkpoint(hf, tmp_path)
    state = load_file(directory / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, directory / "model.safetensors")
    # transformers (>= 5) unties the two where they differ; so does vLLM
    reloaded = type(hf).from_pretrained(directory)
    assert torch.equal(reloaded.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(reloaded.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    model = load_model(directory)
    assert torch.equal(model.lm_head, state["lm_head.weight"])
    assert torch.equal(model.embed_tokens, state["model.embed_tokens.weight"])


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = build_tiny_model("qwen2")
    single = load_model(save_checkpoint(hf, tmp_path / "single"))
    sharded_dir = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    sharded = load_model(sharded_dir)
    for a, b in zip(single.layers, sharded.layers):
        assert torch.equal(a.qkv_weight, b.qkv_weight) and torch.equal(a.qkv_bias, b.qkv_bias)
    assert torch.equal(single.embed_tokens, sharded.embed_tokens)


def test_dtype_argument_converts_weights(qwen3_dir):
    model = load_model(qwen3_dir, dtype=torch.bfloat16)
    assert model.layers[0].qkv_weight.dtype == torch.bfloat16
    assert model.lm_head.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ errors


def test_missing_tensor_is_named(broken_dir):
    rewrite(broken_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"):
        load_model(broken_dir)


def test_missing_untied_lm_head_is_named(broken_dir):
    rewrite(broken_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        load_model(broken_dir)


def test_unexpected_tensor_is_named(broken_dir):
    rewrite(broken_dir, lambda t: t.update({"model.layers.0.self_attn.extra.weight":
                                             torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.extra"):
        load_model(broken_dir)


def test_tensor_with_wrong_shape_is_named_with_both_shapes(broken_dir):
    rewrite(broken_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                             torch.zeros(16, 64)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight .*\[16, 64\].*\[32, 64\]"):
        load_model(broken_dir)


def test_integer_tensor_is_rejected_by_name(broken_dir):
    rewrite(broken_dir, lambda t: t.update({"model.norm.weight":
                                             torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .*dtype I64"):
        load_model(broken_dir)


def test_truncated_file_is_reported_with_its_name(broken_dir):
    path = broken_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(broken_dir)


def test_missing_shard_is_reported(tmp_path):
    directory = save_checkpoint(build_tiny_model("qwen3"), tmp_path, max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(directory)


def test_pickled_checkpoint_is_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, "rope_theta": 1e4}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_model(tmp_path)
