"""bench/compile_facts.py: the programs-per-SM and bytes-in-flight arithmetic, and the
committed sm_90 compile facts (bench/results/sm90_compile/select_tokens.json) cover every
select_tokens scan and one-launch variant as the kernels list them now. Nothing is compiled
here: ``make compile-facts`` refreshes the facts."""

import json
from pathlib import Path

import pytest

from bench.compile_facts import (
    QUOTED_1CD776F,
    bytes_in_flight_per_sm,
    programs_per_sm,
    tiles_in_flight,
)
from wedlm_kernels.ops import select

FACTS = Path(__file__).resolve().parents[1] / "bench/results/sm90_compile/select_tokens.json"


@pytest.mark.parametrize("registers, warps, shared, expected", [
    (80, 8, 128, (3, "registers")),  # 80 x 256 threads = 20480 registers per program
    (81, 8, 0, (2, "registers")),  # rounded up to 88: 22528 per program
    (64, 8, 0, (4, "registers")),
    (65, 8, 0, (3, "registers")),  # 72
    (1, 4, 0, (16, "threads")),  # 8 registers: the register file would hold 64
    (16, 8, 0, (8, "threads")),
    (16, 1, 0, (32, "programs")),
    (32, 4, 48 * 1024, (4, "shared memory")),  # 233472 // (49152 + 1024)
    (32, 4, 227 * 1024, (1, "shared memory")),
    (32, 4, 227 * 1024 + 1, (0, "shared memory")),  # over the per-program maximum
])
def test_programs_per_sm(registers, warps, shared, expected):
    assert programs_per_sm(registers, warps, shared) == expected


def test_the_quoted_1cd776f_figures_follow_from_the_same_arithmetic():
    programs, _ = programs_per_sm(QUOTED_1CD776F["registers"], 8, 0)
    assert programs == QUOTED_1CD776F["programs_per_sm"] == 5
    assert bytes_in_flight_per_sm(programs, 1, 4096, 2) == 40960 == QUOTED_1CD776F[
        "bytes_in_flight_per_sm"]


def test_bytes_in_flight_per_sm():
    assert bytes_in_flight_per_sm(3, 1, 2048, 2) == 12288
    assert bytes_in_flight_per_sm(4, 3, 4096, 2) == 98304
    assert bytes_in_flight_per_sm(2, 2, 4096, 4) == 65536


def test_tiles_in_flight_of_each_kernel():
    variants = {variant.name: variant for variant in select.kernel_variants()}
    scan = variants["scan_bf16_aligned16"]
    tile = scan.constexprs["TILE_GRANULES"] * select.GRANULE
    assert tiles_in_flight(scan, 128, 2) == (tile, 1)
    one = variants["one_launch_greedy_bf16_aligned16"]
    block, stages = one.constexprs["BLOCK"], one.constexprs["STAGES"]
    # as many as the compile's pipeline buffers hold, at most STAGES - 1; 1 without
    assert tiles_in_flight(one, (stages - 1) * block * 2 + 96, 2) == (block, stages - 1)
    assert tiles_in_flight(one, 64 * block * 2, 2) == (block, stages - 1)
    assert tiles_in_flight(one, 256, 2) == (block, 1)
    assert tiles_in_flight(variants["filter_bf16_aligned16"], 2048, 2) is None


def test_committed_facts_cover_every_scan_and_one_launch_variant_as_listed_now():
    """A new variant, or a changed tile, stage count or warp count, needs fresh facts
    (make compile-facts)."""
    facts = json.loads(FACTS.read_text())
    variants = facts["variants"]
    listed = [variant for variant in select.kernel_variants()
              if variant.name.startswith(("scan_", "one_launch_"))]
    assert listed
    missing = [variant.name for variant in listed if variant.name not in variants]
    assert not missing, f"no compile facts for {missing}: run make compile-facts"
    for variant in listed:
        entry = variants[variant.name]
        assert entry["num_warps"] == variant.num_warps, variant.name
        assert entry["constexprs"] == variant.constexprs, (
            f"{variant.name}: compiled with {entry['constexprs']}, listed with "
            f"{variant.constexprs}: run make compile-facts")


def test_committed_facts_are_consistent():
    facts = json.loads(FACTS.read_text())
    assert facts["summary"]["failed_variants"] == []
    assert facts["summary"]["quoted_1cd776f_bytes_in_flight_per_sm"] == 40960
    for name, entry in facts["variants"].items():
        assert (entry["programs_per_sm"], entry["limit"]) == programs_per_sm(
            entry["registers"], entry["num_warps"], entry["shared_bytes"]), name
    for shape in facts["shapes"]:
        assert all(launch["variant"] in facts["variants"] for launch in shape["launches"])
        assert shape["launches_per_call"] == len(shape["launches"]) + len(
            shape["other_device_ops"])
    for key in ("greedy_bytes_in_flight_per_sm_one_launch_bf16",
                "greedy_bytes_in_flight_per_sm_three_launch_bf16",
                "temperature_bytes_in_flight_per_sm_one_launch_bf16"):
        assert facts["summary"][key] > 0
