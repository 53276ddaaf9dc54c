"""The reference Qwen forward (reference/model.py) against Hugging Face transformers.

HF runs the tiny models in fp32, the reference in float64. The observed gap on these models
is about 1e-5 on logits of magnitude ~10 (fp32 rounding, unit 6e-8, accumulated over a few
layers and 64-96-term dot products), so logits are compared with ``atol = 1e-4``: ten
times the rounding gap, and far below the effect of one wrong position or one wrong mask
entry (several units, see ``test_wrong_positions_change_logits_far_beyond_tolerance``).
"""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.tiny_models import (
    MASK_TOKEN_ID,
    VOCAB_SIZE,
    build_tiny_model,
    hf_key_values,
    hf_logits,
    save_checkpoint,
)
from reference.model import (
    config_from_dict,
    forward,
    forward_paged,
    lm_head_weight,
    load_config,
    load_weights,
)
from reference.rope import rope_cache
from reference.window import reorder_window

LOGIT_ATOL = 1e-4
KV_ATOL = 1e-5  # keys/values are O(1): the same fp32-rounding argument

MODEL_VARIANTS = {
    # Qwen3 with head_dim 32 != hidden/heads = 16, three layers
    "qwen3": dict(kind="qwen3", num_hidden_layers=3, head_dim=32),
    "qwen2": dict(kind="qwen2", num_hidden_layers=2),
    "qwen3_bias": dict(kind="qwen3", attention_bias=True),
    "qwen3_tied": dict(kind="qwen3", tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per variant: (HF model, reference config, reference weights, checkpoint dir)."""
    built = {}
    for seed, (name, options) in enumerate(MODEL_VARIANTS.items()):
        model = build_tiny_model(seed=seed, **options)
        directory = save_checkpoint(model, tmp_path_factory.mktemp(name))
        built[name] = (model, load_config(directory), load_weights(directory), directory)
    return built


def wedlm_step_inputs(rng: torch.Generator, ctx_len: int, win_len: int):
    """``committed ++ reordered window`` ids and position ids for a random window state
    (docs/algorithm.md section 3): filled slots first, then masks, at ``ctx_len + slot``."""
    committed = torch.randint(0, VOCAB_SIZE - 1, (ctx_len,), generator=rng).tolist()
    is_mask = (torch.rand(win_len, generator=rng) < 0.5).tolist()
    window = torch.randint(0, VOCAB_SIZE - 1, (win_len,), generator=rng).tolist()
    order = [s for s in range(win_len) if not is_mask[s]] + [s for s in range(win_len) if is_mask[s]]
    ids = committed + [MASK_TOKEN_ID if is_mask[s] else window[s] for s in order]
    positions = list(range(ctx_len)) + [ctx_len + s for s in order]
    return torch.tensor(ids), torch.tensor(positions)


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
@given(
    ctx_len=st.integers(0, 12), win_len=st.integers(1, 10), seed=st.integers(0, 2**31 - 1)
)
def test_forward_matches_hf_on_reordered_window(checkpoints, variant, ctx_len, win_len, seed):
    model, config, weights, _ = checkpoints[variant]
    ids, positions = wedlm_step_inputs(torch.Generator().manual_seed(seed), ctx_len, win_len)
    expected = hf_logits(model, ids, positions).to(torch.float64)
    actual = forward(weights, config, ids, positions)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3", "qwen2"])
@given(num_rows=st.integers(1, 16), offset=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_forward_matches_hf_on_arbitrary_position_permutations(
    checkpoints, variant, num_rows, offset, seed
):
    model, config, weights, _ = checkpoints[variant]
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_SIZE, (num_rows,), generator=rng)
    positions = offset + torch.randperm(num_rows, generator=rng)
    expected = hf_logits(model, ids, positions).to(torch.float64)
    torch.testing.assert_close(
        forward(weights, config, ids, positions), expected, atol=LOGIT_ATOL, rtol=0
    )


def test_wrong_positions_change_logits_far_beyond_tolerance(checkpoints):
    # the comparisons above can fail: swapping the RoPE positions of two rows moves logits
    model, config, weights, _ = checkpoints["qwen3"]
    ids = torch.tensor([5, 17, 42, 7, MASK_TOKEN_ID, 99, MASK_TOKEN_ID])
    positions = torch.tensor([0, 1, 2, 3, 5, 4, 6])
    swapped = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    gap = (forward(weights, config, ids, swapped) - hf_logits(model, ids, positions)).abs()
    assert gap[4:].max() > 100 * LOGIT_ATOL


def test_forward_is_causal_over_row_order(checkpoints):
    _, config, weights, _ = checkpoints["qwen3"]
    ids = torch.tensor([5, 17, 42, 7, 99, 3])
    positions = torch.tensor([0, 1, 2, 4, 5, 3])  # a reordered tail
    base = forward(weights, config, ids, positions)
    changed_last = ids.clone()
    changed_last[-1] = 250
    # rows before the change do not see it, even the ones at larger RoPE positions
    assert torch.equal(forward(weights, config, changed_last, positions)[:-1], base[:-1])
    changed_first = ids.clone()
    changed_first[0] = 250
    assert not torch.allclose(forward(weights, config, changed_first, positions)[1:], base[1:])


@pytest.mark.parametrize("variant", ["qwen3", "qwen2"])
def test_return_kv_equals_hf_cache_of_plain_causal_forward(checkpoints, variant):
    model, config, weights, _ = checkpoints[variant]
    ids = torch.tensor([5, 17, 42, 7, 99, 3, 250, 11, 0])
    logits, kv = forward(weights, config, ids, torch.arange(len(ids)), return_kv=True)
    expected = hf_key_values(model, ids)
    assert len(kv) == config.num_hidden_layers == len(expected)
    for (k, v), (hf_k, hf_v) in zip(kv, expected):
        assert k.shape == (len(ids), config.num_key_value_heads, config.head_dim)
        torch.testing.assert_close(k, hf_k.to(torch.float64), atol=KV_ATOL, rtol=0)
        torch.testing.assert_close(v, hf_v.to(torch.float64), atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(
        logits, hf_logits(model, ids, torch.arange(len(ids))).double(), atol=LOGIT_ATOL, rtol=0
    )


def test_sharded_checkpoint_loads_the_same_weights(checkpoints, tmp_path):
    model, _, single_file_weights, _ = checkpoints["qwen3"]
    directory = save_checkpoint(model, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    sharded = load_weights(directory)
    assert sharded.keys() == single_file_weights.keys() == model.state_dict().keys()
    for name, tensor in sharded.items():
        assert torch.equal(tensor, single_file_weights[name]), name
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_load_weights_without_safetensors_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(tmp_path)


def test_tied_checkpoint_uses_embeddings_as_lm_head(checkpoints):
    model, config, weights, _ = checkpoints["qwen3_tied"]
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in weights
    assert lm_head_weight(weights, config) is weights["model.embed_tokens.weight"]
    ids = torch.tensor([5, 17, 42, 7])
    torch.testing.assert_close(
        forward(weights, config, ids, torch.arange(4)),
        hf_logits(model, ids, torch.arange(4)).double(),
        atol=LOGIT_ATOL,
        rtol=0,
    )


def test_untied_config_without_lm_head_raises(checkpoints):
    _, config, weights, _ = checkpoints["qwen3"]
    without_head = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match="lm_head"):
        forward(without_head, config, torch.tensor([1, 2]), torch.tensor([0, 1]))


# ---- forward_paged: the cached path through the reference ops ----------------------------


@given(
    variant=st.sampled_from(["qwen3_bias", "qwen2"]),
    prompt_lens=st.lists(st.integers(0, 7), min_size=1, max_size=2),
    window=st.integers(1, 4),
    page_size=st.sampled_from([2, 3, 4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_forward_paged_matches_no_cache_forward(
    checkpoints, variant, prompt_lens, window, page_size, seed
):
    """Prefill each prompt (ctx_len 0), then one reordered window step; every live row's
    logits equal the no-cache forward over ``committed ++ reordered window``."""
    _, config, weights, _ = checkpoints[variant]
    rng = torch.Generator().manual_seed(seed)
    batch, slots = len(prompt_lens), 2 * window
    pages_per_sequence = -(-(max(prompt_lens) + slots) // page_size)
    num_pages = batch * pages_per_sequence + 1
    # pages handed out in a shuffled order so that page ids differ from page indices
    block_table = torch.randperm(num_pages, generator=rng)[: batch * pages_per_sequence]
    block_table = block_table.reshape(batch, pages_per_sequence).to(torch.int32)
    shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [
        (torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
        for _ in range(config.num_hidden_layers)
    ]
    cos_sin = rope_cache(max(prompt_lens) + slots, config.head_dim, config.rope_theta)

    prompts = [torch.randint(0, VOCAB_SIZE - 1, (n,), generator=rng) for n in prompt_lens]
    # prefill: the prompts packed back to back
    prefill_ids = torch.cat(prompts)
    prefill_positions = torch.cat([torch.arange(n) for n in prompt_lens])
    prefill_slots = torch.cat([
        block_table[b, torch.arange(n) // page_size].long() * page_size
        + torch.arange(n) % page_size for b, n in enumerate(prompt_lens)
    ])
    prompt_len = torch.tensor(prompt_lens, dtype=torch.int32)
    prefill_start = torch.tensor([0, *torch.tensor(prompt_lens).cumsum(0).tolist()],
                                 dtype=torch.int32)
    prefill_logits = forward_paged(
        weights, config, kv_caches, cos_sin, prefill_ids, prefill_positions, prefill_slots,
        block_table, prefill_start, torch.zeros(batch, dtype=torch.int32),
    )

    win_len = torch.randint(1, slots + 1, (batch,), generator=rng).to(torch.int32)
    win_mask = torch.rand(batch, slots, generator=rng) < 0.5
    win_tokens = torch.randint(0, VOCAB_SIZE - 1, (batch, slots), generator=rng)
    win_tokens[win_mask] = MASK_TOKEN_ID
    input_ids, positions, slot_mapping, _, query_start, _ = reorder_window(
        win_tokens, win_mask, win_len, prompt_len, block_table, page_size,
        int(win_len.sum()) + 1,
    )
    step_logits = forward_paged(
        weights, config, kv_caches, cos_sin, input_ids, positions, slot_mapping,
        block_table, query_start, prompt_len,
    )

    for b in range(batch):
        ctx = prompt_lens[b]
        rows = slice(int(query_start[b]), int(query_start[b + 1]))
        if ctx > 0:
            expected_prefill = forward(weights, config, prompts[b], torch.arange(ctx))
            torch.testing.assert_close(
                prefill_logits[int(prefill_start[b]): int(prefill_start[b + 1])],
                expected_prefill, atol=1e-9, rtol=1e-9,
            )
        expected = forward(
            weights,
            config,
            torch.cat([prompts[b], input_ids[rows]]),
            torch.cat([torch.arange(ctx), positions[rows]]),
        )
        torch.testing.assert_close(step_logits[rows], expected[ctx:], atol=1e-9, rtol=1e-9)


# ---- config parsing -----------------------------------------------------------------------

QWEN3_8B_LIKE = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "hidden_act": "silu",
}


def test_config_reads_every_size_of_a_qwen3_config():
    config = config_from_dict({**QWEN3_8B_LIKE, "mask_token_id": 151665})
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (4096, 36, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (32, 8)
    assert (config.intermediate_size, config.vocab_size) == (12288, 151936)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 40960
    assert config.qk_norm and not config.qkv_bias and not config.o_proj_bias
    assert config.mask_token_id == 151665


def test_config_without_mask_token_id_gives_none():
    assert config_from_dict(QWEN3_8B_LIKE).mask_token_id is None


def test_config_reads_rope_theta_from_rope_parameters():
    options = {k: v for k, v in QWEN3_8B_LIKE.items() if k not in ("rope_theta", "rope_scaling")}
    options["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert config_from_dict(options).rope_theta == 5e5


def test_config_written_by_installed_transformers_parses(checkpoints):
    _, config, _, directory = checkpoints["qwen2"]
    raw = json.loads((directory / "config.json").read_text())
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    assert config.rope_theta == theta == 10000.0
    assert config.head_dim == 16  # hidden_size // num_attention_heads
    assert config.mask_token_id == MASK_TOKEN_ID


def test_config_rejects_conflicting_rope_theta():
    options = {**QWEN3_8B_LIKE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="rope_theta"):
        config_from_dict(options)


def test_config_without_rope_theta_raises():
    options = {k: v for k, v in QWEN3_8B_LIKE.items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="rope_theta"):
        config_from_dict(options)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
    ],
)
def test_config_rejects_rope_scaling(rope):
    with pytest.raises(ValueError, match="unsupported RoPE scaling"):
        config_from_dict({**QWEN3_8B_LIKE, **rope})


def test_qwen2_config_has_qkv_bias_and_no_qk_norm():
    options = {k: v for k, v in QWEN3_8B_LIKE.items() if k not in ("head_dim", "attention_bias")}
    config = config_from_dict({**options, "model_type": "qwen2", "hidden_size": 3584,
                               "num_attention_heads": 28, "num_key_value_heads": 4})
    assert config.qkv_bias and not config.o_proj_bias and not config.qk_norm
    assert config.head_dim == 128  # 3584 // 28


def test_qwen3_attention_bias_adds_qkv_and_output_bias():
    config = config_from_dict({**QWEN3_8B_LIKE, "attention_bias": True})
    assert config.qkv_bias and config.o_proj_bias and config.qk_norm


@pytest.mark.parametrize("qk_norm", [True, False])
def test_wedlm_config_flavour_follows_qk_norm(qk_norm):
    config = config_from_dict({**QWEN3_8B_LIKE, "model_type": "wedlm", "qk_norm": qk_norm,
                               "attention_bias": not qk_norm})
    assert config.qk_norm == qk_norm
    assert config.qkv_bias == (not qk_norm)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"use_sliding_window": True}, "sliding"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ],
)
def test_config_rejects_unsupported_models(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({**QWEN3_8B_LIKE, **change})


def test_load_config_accepts_directory_or_file(checkpoints):
    _, config, _, directory = checkpoints["qwen3"]
    assert load_config(directory / "config.json") == config
    assert math.isclose(config.rope_theta, 10000.0)
