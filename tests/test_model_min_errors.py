"""model_min at its public boundaries: bad input is a clear error that names the argument,
file or key, and a request that fails validation changes no state. (The CLI's errors are in
tests/test_model_min_cli.py.)"""

import json

import numpy as np
import pytest
import torch

from model_min import Generator, SamplingParams, load_model
from model_min.config import load_config
from model_min.demo import DEMO_MODEL_DIR
from model_min.tokenizer import load_tokenizer

CONFIG = {
    "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 48,
    "vocab_size": 90, "rope_theta": 5e5, "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def tiny():
    return load_model(DEMO_MODEL_DIR)


def _config_dir(tmp_path, **overrides):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **overrides}))
    return tmp_path


@pytest.mark.parametrize("key, value", [
    ("hidden_size", None), ("num_hidden_layers", "2"), ("num_attention_heads", 0),
    ("num_key_value_heads", -1), ("intermediate_size", 12.5), ("vocab_size", -7),
    ("vocab_size", True), ("max_position_embeddings", 0), ("head_dim", 1),
    ("rms_norm_eps", -1e-5), ("rope_theta", 0), ("mask_token_id", 90),
    ("eos_token_id", [3, 400]),
])
def test_bad_config_values_name_the_file_and_the_key(tmp_path, key, value):
    directory = _config_dir(tmp_path, **{key: value})
    with pytest.raises(ValueError) as error:
        load_config(directory)
    assert str(directory / "config.json") in str(error.value) and key in str(error.value)


def test_a_missing_size_is_named(tmp_path):
    config = dict(CONFIG)
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="intermediate_size must be an integer >= 1, got "
                                         "nothing"):
        load_config(tmp_path)


def test_config_that_is_not_utf8_text_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "qwen3", "x": "\xe9\xff"}')
    with pytest.raises(ValueError, match=r"config\.json: not UTF-8 text"):
        load_config(tmp_path)


def test_a_directory_in_place_of_config_json_is_named(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config\.json: is a directory"):
        load_config(tmp_path)


def test_a_corrupt_tokenizer_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer\.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, "bfloat16"])
def test_load_model_rejects_a_dtype_the_decoder_cannot_compute_in(dtype):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(DEMO_MODEL_DIR, dtype=dtype)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(stop_token_ids=17), TypeError, "stop_token_ids"),
    (dict(stop_token_ids="17"), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=(5, 2**64)), ValueError, "stop_token_ids"),
    (dict(stop_token_ids=(1.0,)), ValueError, "stop_token_ids"),
    (dict(max_new_tokens=False), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=8.0), TypeError, "max_new_tokens"),
    (dict(top_k=True, temperature=0.5), TypeError, "top_k"),
    (dict(temperature="0.5"), ValueError, "temperature"),
    (dict(top_p=float("inf")), ValueError, "top_p"),
    (dict(threshold=float("nan")), ValueError, "threshold"),
    (dict(seed=3.0), TypeError, "seed"),
])
def test_sampling_params_reject_bad_values_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_generator_rejects_a_cache_without_room(tiny, value):
    with pytest.raises(ValueError, match="max_cache_tokens"):
        Generator(tiny, max_cache_tokens=value)


def test_a_sampling_params_changed_after_it_was_made_is_checked_again(tiny):
    generator = Generator(tiny, window=4, max_batch=1)
    params = SamplingParams(max_new_tokens=4)
    params.penalty = 1e300
    with pytest.raises(ValueError, match=r"SamplingParams\.penalty must be a number from 0"):
        generator.generate([[5, 6, 7]], params)


def test_stop_ids_outside_the_vocabulary_are_rejected(tiny):
    generator = Generator(tiny, window=4, max_batch=1)
    vocab = tiny.config.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids has token ids outside the vocabulary "
                                         rf"\[0, {vocab}\): \[{vocab + 3}\]"):
        generator.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4,
                                                       stop_token_ids=(2, vocab + 3)))


@pytest.mark.parametrize("prompt, error", [
    ([4.0, 5.0], TypeError), ([4, True], TypeError),
    (torch.tensor([[[4, 5]]]), TypeError), (torch.tensor([4.0, 5.0]), TypeError),
    (np.array([4.5, 5.0]), TypeError), ([[4, 5], 3], TypeError),
])
def test_prompts_that_are_not_integer_token_ids_are_rejected(tiny, prompt, error):
    with pytest.raises(error, match="prompt"):
        Generator(tiny, window=4, max_batch=2).generate(prompt, SamplingParams(max_new_tokens=2))


def test_a_one_dimensional_integer_tensor_or_array_is_one_prompt(tiny):
    """... and a 2-D one is a batch of equal-length prompts, one per row."""
    params = SamplingParams(max_new_tokens=6, seed=4)
    ids = [40, 41, 42, 43]
    expected = Generator(tiny, window=4).generate([ids], params)[0].token_ids
    for prompt in (torch.tensor(ids), np.array(ids, dtype=np.int32)):
        [result] = Generator(tiny, window=4).generate(prompt, params)
        assert result.token_ids == expected
        [result] = Generator(tiny, window=4).generate([prompt], params)
        assert result.token_ids == expected
    rows = Generator(tiny, window=4).generate(torch.tensor([ids, ids]), params)
    assert [r.token_ids for r in rows] == [expected, expected]


@pytest.mark.parametrize("params", [{"max_new_tokens": 3}, "greedy", [SamplingParams(), 3]])
def test_params_that_are_not_sampling_params_are_rejected(tiny, params):
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        Generator(tiny, window=4).generate([[7, 8], [9, 10]], params)


def test_a_rejected_request_draws_no_seed(tiny):
    """Validation comes before any state change: after a rejected request, the next
    unseeded request gets the seed a fresh Generator would give it."""
    good = SamplingParams(max_new_tokens=3, temperature=0.9)
    bad = SamplingParams(max_new_tokens=3, stop_token_ids=(tiny.config.vocab_size,))
    used = Generator(tiny, window=4, seed=123)
    with pytest.raises(ValueError):
        used.generate([[11, 12], [13, 14]], [good, bad])
    fresh = Generator(tiny, window=4, seed=123)
    assert used.generate([[15, 16]], good)[0].seed == fresh.generate([[15, 16]], good)[0].seed


def test_numpy_integers_are_token_ids(tiny):
    params = SamplingParams(max_new_tokens=4, seed=2, stop_token_ids=[np.int64(3)])
    assert params.stop_token_ids == (3,) and type(params.stop_token_ids[0]) is int
    ids = [np.int32(21), np.int64(22), 23]
    [result] = Generator(tiny, window=4).generate([ids], params)
    [expected] = Generator(tiny, window=4).generate([[21, 22, 23]], params)
    assert result.token_ids == expected.token_ids
