"""Smoke test of ``bench.decoder_cpu`` in its ``--quick`` configuration (a few seconds)."""

import json
import statistics
from types import SimpleNamespace

import pytest

from bench.decoder_cpu import check_same_decoding, main


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "decoder_cpu.json"
    report = main(["--quick", "--repeats", "2", "--out", str(out)])
    return report, out


def measured_figures(node, key=""):
    """``(key, figure)`` of every ``{"median", "samples"}`` dict in the report."""
    if isinstance(node, dict):
        if {"median", "samples"} <= node.keys():
            yield key, node
        for name, value in node.items():
            yield from measured_figures(value, name)
    elif isinstance(node, list):
        for value in node:
            yield from measured_figures(value, key)


def test_quick_run_writes_the_json_it_returns_and_a_markdown_table(quick_run):
    report, out = quick_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    markdown = out.with_suffix(".md").read_text()
    assert "CPU measurement" in markdown
    for case in report["cases"]:
        assert f"W={case['window']}" in markdown
        ratio = case["ratios"]["reference_forward_over_generator_step"]
        assert f"**{ratio:.2f}**" in markdown
    assert report["command"].startswith("python -m bench.decoder_cpu --quick")
    assert "CPU only" in report["machine"]["label"]
    assert report["versions"]["torch"] and report["versions"]["python"]


def test_every_figure_is_a_cpu_median_of_its_samples(quick_run):
    report, _ = quick_run
    figures = list(measured_figures(report["cases"]))
    assert figures
    for key, figure in figures:
        assert key.endswith("_cpu_ms"), key
        assert figure["samples"] and all(s > 0 for s in figure["samples"])
        assert figure["median"] == statistics.median(figure["samples"])
    for case in report["cases"]:
        assert case["device"] == "cpu"
        assert len(case["generator"]["generate_per_step_cpu_ms"]["samples"]) == 2


def test_ratios_are_quotients_of_the_reported_medians(quick_run):
    report, _ = quick_run
    for case in report["cases"]:
        ratios = case["ratios"]
        generator_step = case["generator"]["generate_per_step_cpu_ms"]["median"]
        reference_forward = case["reference"]["per_forward_cpu_ms"]["median"]
        assert ratios["reference_forward_over_generator_step"] == pytest.approx(
            reference_forward / generator_step)
        assert ratios["reference_total_over_generator_total"] == pytest.approx(
            case["reference"]["total_cpu_ms"]["median"]
            / case["generator"]["generate_total_cpu_ms"]["median"])
        assert ratios["host_over_generator_step"] == pytest.approx(
            case["host"]["host_step_cpu_ms"]["median"] / case["host"]["full_step_cpu_ms"]["median"])


def test_generator_and_reference_decode_the_same_tokens_per_forward(quick_run):
    report, _ = quick_run
    for case in report["cases"]:
        per_request = case["tokens_per_forward"]
        assert per_request["generator"] == per_request["reference"]
        assert case["tokens_generated"] / case["sequence_forwards"] == pytest.approx(
            per_request["overall"])
        assert case["generator_batch_steps"] > 0 and case["sequence_forwards"] > 0


def test_a_decoding_mismatch_fails_the_benchmark():
    def result(tokens, forwards):
        return SimpleNamespace(token_ids=tokens, finish_reason="length", forwards=forwards,
                               rows=forwards * 4, tokens_per_forward=len(tokens) / forwards)

    check_same_decoding([result([1, 2], 1)], [result([1, 2], 1)])
    with pytest.raises(AssertionError, match="token_ids"):
        check_same_decoding([result([1, 2], 1)], [result([1, 3], 1)])
    with pytest.raises(AssertionError, match="forwards"):
        check_same_decoding([result([1, 2], 1)], [result([1, 2], 2)])
