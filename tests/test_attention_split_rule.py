"""paged_attention's FA2 split rule (``WEDLM_KERNELS_ATTENTION_SPLITS=fa2``): pure Python,
checked on schedule tables worked out by hand and on the rule's defining properties."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wedlm_kernels.ops import attention
from wedlm_kernels.ops.attention import fa2_split_count, schedule

H200 = 132


def efficiency(programs: int, splits: int, slots: int) -> float:
    waves = programs * splits / slots
    return waves / math.ceil(waves)


def changes_the_chunks(splits: int, key_tiles: int) -> bool:
    return splits == 1 or -(-key_tiles // splits) != -(-key_tiles // (splits - 1))


# (rows, sequences, capacity) at Qwen3-8B's heads (8 KV heads, GQA 4, head_dim 128, bf16) on
# an H200, with the FA2 rule's tiles and splits, each worked out by hand:
# - B=1, 16 queries, context 4k: 64 x 64 tiles (2 resident: 264 slots), 8 programs; at most
#   4112 // (8 * 64) = 8 splits; w = 8s/264 < 1 so efficiency = w, best at s = 8 (0.242);
#   the fewest within 85%: 8s/264 >= 0.206, s = 7 (65 key tiles: 10 per chunk, eligible);
# - the same at context 16k: at most 32 splits, 0.85 * 256/264 -> s >= 27.2; 28 gives the
#   same 10 tiles per chunk as 27 (ineligible), so 29;
# - contexts 512: 512 // 512 = 1 split at most: a short table is not split;
# - B=16, 32 queries, context 512: 128 x 64 tiles, not split (short table);
# - B=16, 16 queries, context 16k: 64 x 64, 8 x 16 = 128 programs < 0.8 * 264; at most 32
#   splits; 128s/264: s = 2 fills 0.97 of one wave, the best there is: 2;
# - B=64, 16 queries, context 16k: 512 programs >= 211: 1.
TABLE = [
    ((16, 1, 4096 + 16), (64, 64), 7),
    ((16, 1, 16384), (64, 64), 29),
    ((16, 1, 512), (64, 64), 1),
    ((32, 1, 512), (128, 64), 1),
    ((32 * 16, 16, 512), (128, 64), 1),
    ((16 * 16, 16, 16384), (64, 64), 2),
    ((64 * 16, 64, 16384), (64, 64), 1),
]


@pytest.mark.parametrize("shape, tile, splits", TABLE)
def test_the_fa2_rule_on_qwen3_decode_shapes_of_an_h200(shape, tile, splits):
    rows, batch, capacity = shape
    config, chosen = schedule(torch.bfloat16, rows, batch, 8, 4, 128, capacity, H200, "fa2")
    assert ((config.block_m, config.block_n), chosen) == (tile, splits)


def test_prefill_is_never_split_by_the_fa2_rule():
    _, splits = schedule(torch.bfloat16, 4096, 1, 8, 4, 128, 8192, H200, "fa2")
    assert splits == 1


def test_the_measured_rule_stays_the_default():
    assert attention.schedule.__wrapped__.__defaults__[-1] == "measured"
    measured = schedule(torch.bfloat16, 16, 1, 8, 4, 128, 16384, H200)
    assert measured == schedule(torch.bfloat16, 16, 1, 8, 4, 128, 16384, H200, "measured")
    assert measured[1] == 33  # the schedule the 2026-12-04 H200 run measured at 48 us


@given(programs=st.integers(1, 2000), slots=st.integers(1, 600),
       key_tiles=st.integers(1, 600), most_splits=st.integers(1, 64))
def test_the_fa2_rule_takes_the_fewest_eligible_splits_within_85_percent_of_the_best(
        programs, slots, key_tiles, most_splits):
    splits = fa2_split_count(programs, slots, key_tiles, most_splits)
    if programs >= 0.8 * slots:
        assert splits == 1
        return
    most = min(most_splits, slots, key_tiles)
    assert 1 <= splits <= max(most, 1)
    eligible = [s for s in range(1, most + 1) if changes_the_chunks(s, key_tiles)]
    if not eligible or most <= 1:
        assert splits == 1
        return
    assert splits in eligible
    best = max(efficiency(programs, s, slots) for s in eligible)
    assert efficiency(programs, splits, slots) >= 0.85 * best
    assert all(efficiency(programs, s, slots) < 0.85 * best for s in eligible if s < splits)


def test_keys_per_split_are_at_least_eight_per_pair_of_the_tile():
    config = attention.LaunchConfig(64, 64, 4, 3)
    assert attention.fa2_split_limit(8 * 64 * 5 + 63, config) == 5
    assert attention.fa2_split_limit(8 * 64 - 1, config) == 1
    assert attention.fa2_split_limit(10**7, config) == attention.MAX_SPLITS
