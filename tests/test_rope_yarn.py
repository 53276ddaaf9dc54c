"""rope_cache with YaRN scaling against transformers' own YaRN (the frequencies and the
attention factor Qwen3's long-context configs get there), and its argument checks."""

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import wedlm_kernels as wk


def transformers_yarn(head_dim: int, theta: float, **parameters):
    config = Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=4096, rope_parameters={
                             "rope_type": "yarn", "rope_theta": theta, **parameters})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return inv_freq.double(), attention_factor


@pytest.mark.parametrize("head_dim, theta, parameters", [
    (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3's
    (64, 1e4, {"factor": 4.0, "original_max_position_embeddings": 64}),
    (32, 1e4, {"factor": 2.5, "original_max_position_embeddings": 128, "beta_fast": 16.0,
               "beta_slow": 2.0}),
    (128, 5e5, {"factor": 8.0, "original_max_position_embeddings": 8192, "truncate": False}),
    (64, 1e6, {"factor": 4.0, "original_max_position_embeddings": 256,
               "attention_factor": 1.25}),
    (16, 1e4, {"factor": 1.0, "original_max_position_embeddings": 64}),
])
def test_yarn_frequencies_and_attention_factor_are_transformers(head_dim, theta, parameters):
    want_freq, want_factor = transformers_yarn(head_dim, theta, **parameters)
    yarn = wk.YarnScaling(**parameters)
    # transformers computes in float32; this in float64
    torch.testing.assert_close(yarn.inv_freq(head_dim, theta), want_freq, rtol=2e-7, atol=0)
    assert yarn.scale == pytest.approx(want_factor, rel=1e-12)
    positions = torch.tensor([0, 1, 7, 100, 4000], dtype=torch.float64)
    table = wk.rope_cache(4001, head_dim, theta, yarn=yarn)[positions.long()].double()
    angles = positions[:, None] * yarn.inv_freq(head_dim, theta)[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], dim=1) * want_factor
    torch.testing.assert_close(table, expected, rtol=0, atol=2e-7 * want_factor)


def test_factor_one_with_the_default_attention_factor_is_plain_rope():
    plain = wk.rope_cache(300, 64, 1e4)
    assert torch.equal(wk.rope_cache(300, 64, 1e4, yarn=wk.YarnScaling(1.0, 64)), plain)


def test_yarn_slows_the_low_frequencies_only():
    yarn = wk.YarnScaling(4.0, 64)
    scaled, plain = yarn.inv_freq(64, 1e4), wk.YarnScaling(1.0, 64).inv_freq(64, 1e4)
    assert float(scaled[0]) == float(plain[0])  # turns many times in 64 positions: kept
    # turns rarely: divided by the factor
    assert float(scaled[-1]) == pytest.approx(float(plain[-1]) / 4, rel=1e-12)
    assert torch.all(scaled <= plain)


@pytest.mark.parametrize("changes, message", [
    ({"factor": 0.5}, "`factor` must be a finite number >= 1"),
    ({"factor": math.inf}, "`factor` must be finite"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"beta_fast": 0.0}, "`beta_fast` must be > 0"),
    ({"attention_factor": -1.0}, "`attention_factor` must be > 0"),
])
def test_bad_yarn_parameters_are_refused_naming_them(changes, message):
    with pytest.raises(ValueError, match=message):
        wk.YarnScaling(**{"factor": 4.0, "original_max_position_embeddings": 64, **changes})


def test_rope_cache_refuses_a_yarn_that_is_not_one():
    with pytest.raises(TypeError, match="`yarn` must be a YarnScaling"):
        wk.rope_cache(8, 64, 1e4, yarn={"factor": 4.0})
