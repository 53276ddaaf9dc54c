"""The tiny-model trainer: byte-level tokenizer, dual-stream masking, the training forward
against the reference forward, the loss weighting, determinism."""

import math
import random

import pytest
import torch

from model_min import load_model
from model_min import train_tiny as tt
from reference import model as ref_model

SMALL = tt.TinyConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48)


def test_tokenizer_json_is_byte_level_with_special_tokens(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    import json

    path.write_text(json.dumps(tt.tokenizer_json(), ensure_ascii=False))
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    text = "count: 7 8 9\n\tnaïve ∑ | x"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8")) == tt.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<|endoftext|>") == tt.EOS_ID == 256
    assert tokenizer.token_to_id("<|mask|>") == tt.MASK_ID == 257
    assert tokenizer.encode("a<|endoftext|>b", add_special_tokens=False).ids == [97, 256, 98]
    assert tokenizer.get_vocab_size() <= tt.VOCAB_SIZE


def test_dual_stream_mask_matches_hand_built_example():
    # N = 4, block = 2. Clean rows 0..3 causal; masked rows 4..7: block 0 (rows 4, 5) sees no
    # clean row, block 1 (rows 6, 7) sees clean positions 0 and 1; causal inside each block.
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(tt.dual_stream_mask(4, 2), expected)


def test_dual_stream_mask_with_a_phase_matches_hand_built_example():
    # N = 5, block = 4, phase = 2: blocks are positions [0, 2) and [2, 5). Masked rows 5, 6
    # (first block) see no clean row; rows 7..9 see clean positions 0 and 1. Each masked row
    # sees its own block's rows up to itself.
    mask = tt.dual_stream_mask(5, 4, phase=2)
    clean_part = torch.tensor([[0, 0, 0, 0, 0],
                               [0, 0, 0, 0, 0],
                               [1, 1, 0, 0, 0],
                               [1, 1, 0, 0, 0],
                               [1, 1, 0, 0, 0]], dtype=torch.bool)
    masked_part = torch.tensor([[1, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0],
                                [0, 0, 1, 0, 0],
                                [0, 0, 1, 1, 0],
                                [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[5:, :5], clean_part)
    assert torch.equal(mask[5:, 5:], masked_part)
    assert torch.equal(mask[:5, :5], torch.ones(5, 5, dtype=torch.bool).tril())
    assert not mask[:5, 5:].any()


@pytest.mark.parametrize(("length", "block", "phase", "bounds"), [
    (20, 8, 0, [(0, 8), (8, 16), (16, 20)]),
    (16, 8, 0, [(0, 8), (8, 16)]),
    (20, 8, 3, [(0, 5), (5, 13), (13, 20)]),
    (20, 8, 7, [(0, 1), (1, 9), (9, 17), (17, 20)]),
    (4, 8, 3, [(0, 4)]),
])
def test_block_bounds_start_where_position_plus_phase_is_a_multiple_of_the_block(
        length, block, phase, bounds):
    assert tt.block_bounds(length, block, phase) == bounds


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("phase", [0, 5, 15])
def test_masked_stream_reorders_each_block_observed_first(seed, phase):
    generator = torch.Generator().manual_seed(seed)
    batch, length, block = 3, 48, 16
    tokens = torch.randint(0, 256, (batch, length), generator=generator)
    input_ids, positions, targets, weights = tt.masked_stream(tokens, block, generator, phase)
    for b in range(batch):
        for start, end in tt.block_bounds(length, block, phase):
            size, rows = end - start, slice(start, end)
            pos = positions[b, rows].tolist()
            assert sorted(pos) == list(range(start, end))  # a permutation of the block
            is_mask = (input_ids[b, rows] == tt.MASK_ID).tolist()
            masked = sum(is_mask)
            assert 1 <= masked <= size
            assert is_mask == [False] * (size - masked) + [True] * masked  # observed first
            observed, mask_pos = pos[: size - masked], pos[size - masked:]
            assert observed == sorted(observed) and mask_pos == sorted(mask_pos)  # stable
            for j, p in enumerate(pos):
                assert targets[b, start + j] == tokens[b, p]
                if not is_mask[j]:
                    assert input_ids[b, start + j] == tokens[b, p]
            # 1/ratio weighting: ratio = masked / size on every mask row, 0 on observed rows
            expected = [0.0] * (size - masked) + [size / masked] * masked
            assert weights[b, rows].tolist() == pytest.approx(expected)


def test_mask_ratio_is_uniform_over_block_sizes():
    generator = torch.Generator().manual_seed(0)
    block = 4
    tokens = torch.zeros(2000, block, dtype=torch.long)
    input_ids, *_ = tt.masked_stream(tokens, block, generator)
    counts = torch.bincount((input_ids == tt.MASK_ID).sum(-1), minlength=block + 1)
    assert counts[0] == 0
    # 2000 draws from uniform{1..4}: 500 each, standard deviation ~19
    assert ((counts[1:].float() - 500).abs() < 100).all(), counts


def test_all_masked_masks_that_share_of_blocks_whole():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.zeros(2000, 4, dtype=torch.long)
    input_ids, _, _, weights = tt.masked_stream(tokens, 4, generator, all_masked=1.0)
    assert (input_ids == tt.MASK_ID).all() and (weights == 1.0).all()
    input_ids, *_ = tt.masked_stream(tokens, 4, generator, all_masked=0.5)
    counts = torch.bincount((input_ids == tt.MASK_ID).sum(-1), minlength=5)
    # whole blocks: 1/2 + 1/2 * 1/4 of 2000 = 1250 (sd ~19); each other count 250 (sd ~15)
    assert abs(int(counts[4]) - 1250) < 100 and ((counts[1:4] - 250).abs() < 80).all(), counts


def _saved_small_model(tmp_path, seed=0):
    torch.manual_seed(seed)
    model = tt.TinyQwen3(SMALL)
    with torch.no_grad():  # move the norms away from 1 so that a missing norm shows up
        for name in model.names:
            if "norm" in name:
                model.w(name).add_(0.3 * torch.randn_like(model.w(name)))
            else:
                model.w(name).mul_(20.0)
    tt.save(model, tt.TrainConfig(steps=0), tmp_path)
    return model


@pytest.mark.parametrize("phase", [0, 3])
def test_training_forward_equals_reference_forward_on_both_streams(tmp_path, phase):
    """The model the trainer optimises is the model the decoder runs: the clean stream equals
    a causal forward, and every masked-stream block equals a causal forward over the clean
    prefix followed by the block's reordered rows (what a decode step feeds), wherever the
    blocks start."""
    model = _saved_small_model(tmp_path)
    weights = ref_model.load_weights(tmp_path)
    config = ref_model.load_config(tmp_path)
    generator = torch.Generator().manual_seed(1)
    length, block = 32, 8
    tokens = torch.randint(0, 256, (1, length), generator=generator)
    masked_ids, masked_positions, _, _ = tt.masked_stream(tokens, block, generator, phase)
    with torch.no_grad():
        logits = model(torch.cat([tokens, masked_ids], 1),
                       torch.cat([torch.arange(length)[None], masked_positions], 1),
                       tt.dual_stream_mask(length, block, phase))[0].double()
    clean = ref_model.forward(weights, config, tokens[0], torch.arange(length))
    torch.testing.assert_close(logits[:length], clean, rtol=1e-4, atol=1e-4)
    bounds = tt.block_bounds(length, block, phase)
    assert len(bounds) == (4 if phase == 0 else 5)
    for start, end in bounds:
        ids = torch.cat([tokens[0, :start], masked_ids[0, start:end]])
        positions = torch.cat([torch.arange(start), masked_positions[0, start:end]])
        expected = ref_model.forward(weights, config, ids, positions)[start:]
        torch.testing.assert_close(logits[length + start:length + end], expected,
                                   rtol=1e-4, atol=1e-4)


def test_saved_checkpoint_loads_through_load_model(tmp_path):
    model = _saved_small_model(tmp_path)
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.config.mask_token_id == tt.MASK_ID
    assert loaded.config.eos_token_ids == (tt.EOS_ID,)
    assert loaded.config.vocab_size == SMALL.vocab_size
    torch.testing.assert_close(loaded.embed_tokens, model.w("model.embed_tokens.weight"))
    torch.testing.assert_close(loaded.lm_head, model.w("lm_head.weight"))


def test_loss_is_log_vocab_for_uniform_predictions():
    """With all-zero logits every cross-entropy is log V; the 1/ratio weights of a block sum
    to the block size, so the masked loss is log V too, and so is their average."""
    model = tt.TinyQwen3(SMALL)
    with torch.no_grad():
        model.w("lm_head.weight").zero_()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (3, 32), generator=generator)
    loss, mask_loss, ar_loss = tt.wedlm_loss(model, tokens, 8, tt.dual_stream_mask(32, 8),
                                             generator)
    log_vocab = math.log(SMALL.vocab_size)
    assert loss.item() == pytest.approx(log_vocab, rel=1e-5)
    assert mask_loss == pytest.approx(log_vocab, rel=1e-5)
    assert ar_loss == pytest.approx(log_vocab, rel=1e-5)


def test_training_sequences_have_the_requested_length_and_valid_tokens():
    rng = random.Random(0)
    for _ in range(200):
        ids = tt.training_sequence(rng, 96)
        assert len(ids) == 96
        assert all(0 <= t < 256 or t == tt.EOS_ID for t in ids)


def test_count_documents_count():
    rng = random.Random(3)
    for _ in range(100):
        text = tt.pattern_document(rng, 80)
        if not text.startswith("count"):
            continue
        header, body = text.split(": ", 1)
        step = int(header.split()[-1]) if header != "count" else 1
        numbers = [int(n) for n in body.split()]
        assert numbers == list(range(numbers[0], numbers[0] + step * len(numbers), step))


def _train_small(seed, steps=3, random_phase=False):
    config = tt.TrainConfig(steps=steps, batch_size=2, seq_len=32, block=8, warmup=1, seed=seed,
                            random_phase=random_phase)
    model = tt.train(SMALL, config, log=lambda *_: None)
    return model.state_dict_for_save()


def test_training_is_deterministic_for_a_seed():
    first, second, other = _train_small(0), _train_small(0), _train_small(1)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


def test_random_phase_training_is_deterministic_and_trains_differently():
    first, second = _train_small(0, random_phase=True), _train_small(0, random_phase=True)
    aligned = _train_small(0)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not all(torch.equal(first[name], aligned[name]) for name in first)


def test_training_lowers_the_loss():
    def loss_after(steps):
        config = tt.TrainConfig(steps=steps, batch_size=4, seq_len=32, block=8, warmup=4, seed=0)
        model = tt.train(SMALL, config, log=lambda *_: None)
        rng, generator = random.Random(99), torch.Generator().manual_seed(99)
        tokens = torch.tensor([tt.training_sequence(rng, 32) for _ in range(8)])
        with torch.no_grad():
            return tt.wedlm_loss(model, tokens, 8, tt.dual_stream_mask(32, 8), generator)[0]

    assert loss_after(40) < loss_after(0) - 1.0


def test_seq_len_must_be_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="seq_len"):
        tt.train(SMALL, tt.TrainConfig(steps=1, seq_len=30, block=8), log=lambda *_: None)


def test_command_line_writes_a_loadable_checkpoint_and_restores_torch_settings(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "model"
    assert tt.main(["--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                    "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    assert "sha256" in capsys.readouterr().out
    model = load_model(out, device="cpu")
    assert model.config.num_layers == tt.TinyConfig().num_hidden_layers
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
                                               "tokenizer.json", "generation_config.json"}


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_all_masked_outside_zero_to_one_is_refused_naming_the_option(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tt.main(["--out", str(tmp_path / "model"), "--all-masked", value])
    assert exit_info.value.code == 2
    assert "--all-masked" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
