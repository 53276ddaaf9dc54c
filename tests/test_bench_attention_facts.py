"""bench/attention_facts.py: paged_attention's schedule and traffic arithmetic at the
benchmark shapes, the TTGIR reading, and the committed facts
(bench/results/sm90_compile/paged_attention.json) against the launcher's schedules now.
Nothing is compiled here: ``make compile-facts`` refreshes the facts."""

import json
from pathlib import Path

import pytest

from bench.attention_facts import (
    MERGES,
    PARTIAL_BOUND,
    RULES,
    integer_divisions,
    pipeline_facts,
    plan,
    shapes,
)

FACTS = Path(__file__).resolve().parents[1] / "bench/results/sm90_compile/paged_attention.json"
KV_BYTES_PER_KEY = 8 * 2 * 128 * 2  # KV heads x (K and V) x head_dim x bf16


def test_traffic_of_a_decode_window_split_four_ways_by_hand():
    """B=1, 16 rows after 2048 positions, GQA 4: the FA2 rule picks one 64-pair tile and
    4 chunks; the tile reads keys 0 .. 2063 once per KV head; each chunk writes 64 pairs of
    129 fp32 (output and LSE), read back once by the merge."""
    launch = plan({"kind": "decode", "batch": 1, "q_len": 16, "context": 2048}, "fa2",
                  "last_program")
    assert launch["schedule"]["num_splits"] == 4
    assert (launch["schedule"]["block_m"], launch["schedule"]["block_n"]) == (64, 64)
    assert launch["traffic"]["kv"] == 2064 * KV_BYTES_PER_KEY
    assert launch["traffic"]["partials"] == 8 * 2 * 4 * 64 * 129 * 4
    assert launch["launches"] == {"triton": 1, "fills": 1}
    assert launch["variants"] == ["attention_bf16_d128_m64_n64_w4_p16_g4_merged"]
    # rows 0 .. 15 see keys 0 .. 2048 + j: keys 2048 .. 2063 are masked per row, in the one
    # tile 2048 .. 2111
    assert launch["schedule"]["diagonal_tiles_max"] == 1
    combined = plan({"kind": "decode", "batch": 1, "q_len": 16, "context": 2048}, "fa2",
                    "combine")
    assert combined["launches"] == {"triton": 2, "fills": 0}
    assert combined["variants"] == ["attention_bf16_d128_m64_n64_w4_p16_g4",
                                    "combine_bf16_d128_n64"]


def test_a_window_across_a_key_tile_boundary_masks_two_tiles():
    """16 rows after 2040 positions: row 0 sees keys 0 .. 2040, so the last whole tile every
    row sees ends at 1984; keys 1984 .. 2055 are masked per row, two 64-key tiles."""
    launch = plan({"kind": "decode", "batch": 1, "q_len": 16, "context": 2040}, "fa2",
                  "combine")
    assert launch["schedule"]["diagonal_tiles_max"] == 2


def test_a_prefill_reads_each_tiles_causal_keys_and_writes_no_partials():
    """1024 tokens (4096 (row, head) pairs, GQA 4), one chunk: tile t of block_m pairs
    holds rows t * block_m / 4 .. and reads keys 0 .. its last row, K and V per KV head."""
    launch = plan({"kind": "prefill", "batch": 1, "q_len": 1024, "context": 0}, "measured",
                  "combine")
    block_m = launch["schedule"]["block_m"]
    rows_per_tile = block_m // 4
    tiles = 1024 // rows_per_tile
    keys = sum((tile + 1) * rows_per_tile for tile in range(tiles))
    assert launch["schedule"]["num_splits"] == 1
    assert launch["traffic"] == {"kv": keys * KV_BYTES_PER_KEY, "partials": 0,
                                 "partial_over_kv": 0.0}
    assert launch["launches"] == {"triton": 1, "fills": 0}


def test_the_fa2_rule_keeps_partials_within_a_quarter_of_the_keys_at_every_shape():
    """The issue's bound, met by the FA2 rule (at least 8 keys per pair and chunk) at every
    benchmark shape; the measured rule (one 64-key tile per chunk allowed) is not."""
    for case in shapes():
        for merge in MERGES:
            assert plan(case, "fa2", merge)["traffic"]["partial_over_kv"] <= PARTIAL_BOUND, case
    assert max(plan(case, "measured", "combine")["traffic"]["partial_over_kv"]
               for case in shapes()) > 1


def test_the_pipeline_is_read_from_the_ttgir():
    ttgir = """
    %k = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable> loc(#a)
    %v = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared3, #smem, mutable> loc(#b)
    %p = ttg.local_alloc : () -> !ttg.memdesc<1x1xi32, #shared1, #smem, mutable> loc(#c)
    %x = ttg.local_alloc %v_finite : (tensor<64x128xbf16, #blocked>) -> !ttg.memdesc<64x128xbf16>
    %w = ttg.async_wait %k_1, %v_1 {num = 2 : i32} loc(#d)
    %w2 = ttg.async_wait {num = 0 : i32} loc(#e)
    %s:3 = ttng.warp_group_dot_wait %a, %b {pendings = 1 : i32} : tensor<64x64xf32, #mma>
    """
    assert pipeline_facts(ttgir) == {"ring_depths": [2, 3], "async_wait_nums": [0, 2],
                                     "mma_wait_pendings": [1]}


def test_integer_divisions_are_counted_in_the_ptx():
    ptx = """
    div.s32 %r5, %r3, %r4;
    rem.u32 %r6, %r3, 7;
    div.rn.f32 %f2, %f1, %f0;
    div.full.f32 %f3, %f1, %f0;
    shr.s32 %r7, %r3, 4;
    rem.s64 %rd2, %rd1, %rd0;
    """
    assert integer_divisions(ptx) == 3


@pytest.mark.skipif(not FACTS.exists(), reason="no committed facts yet")
def test_committed_facts_are_the_launchers_schedules_now():
    """A changed schedule, tile or variant needs fresh facts (make compile-facts)."""
    facts = json.loads(FACTS.read_text())
    assert [{k: case[k] for k in ("kind", "batch", "q_len", "context")}
            for case in facts["cases"]] == shapes()
    for case in facts["cases"]:
        shape = {k: case[k] for k in ("kind", "batch", "q_len", "context")}
        for launch in case["launches"]:
            assert (launch["rule"], launch["merge"]) in {(r, m) for r in RULES for m in MERGES}
            now = plan(shape, launch["rule"], launch["merge"])
            for key in ("traffic", "launches", "variants"):
                assert launch[key] == now[key], (shape, launch["rule"], launch["merge"], key)
            schedule = {k: v for k, v in launch["schedule"].items() if k != "waves"}
            assert schedule == now["schedule"], (shape, launch["rule"], launch["merge"])
            for name in launch["variants"]:
                assert "registers" in facts["variants"][name], (name, facts["variants"][name])
