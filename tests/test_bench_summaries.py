"""The ``"summary"`` of the CUDA microbenchmarks' JSON: headline figures read off their cases
(graph mode), checked here against the committed H200 results by direct lookups."""

import copy
import json
from pathlib import Path

from bench import ops_window, paged_attention, select_tokens

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "nvidia-h200"
MODULES = {"ops_window": ops_window, "paged_attention": paged_attention,
           "select_tokens": select_tokens}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def graph(case: dict, impl: str = "triton") -> float:
    return case["timings"][impl]["graph"]["median_us"]


def test_committed_gpu_results_carry_the_summary_of_their_own_cases():
    for name, module in MODULES.items():
        report = load(name)
        assert report["summary"] == module.summarise(report), name
        assert all(value is not None for value in report["summary"].values()), name


def test_paged_attention_summary_reads_the_probe_and_the_extremes():
    report = load("paged_attention")
    summary, cases = report["summary"], report["cases"]
    [probe] = [c for c in cases if c["kind"] == "decode" and c["params"]["batch"] == 1
               and c["params"]["q_len"] == 32 and c["params"]["context"] == 512]
    assert summary["b1_q32_ctx512_us"] == graph(probe)
    small = [graph(c, "sdpa") / graph(c) for c in cases
             if c["kind"] == "decode" and c["params"]["batch"] <= 4]
    assert abs(summary["decode_b_le_4_min_speedup_over_sdpa"] - min(small)) < 1e-9
    prefill = [graph(c, "sdpa") / graph(c) for c in cases if c["kind"] == "prefill"]
    assert abs(summary["prefill_min_speedup_over_sdpa"] - min(prefill)) < 1e-9


def test_select_tokens_summary_compares_sampling_with_greedy_at_the_same_rows():
    report = load("select_tokens")
    summary = report["summary"]
    times = {name: {c["params"]["rows"]: graph(c) for c in result["cases"]}
             for name, result in report["parameters"].items()}
    ratios = [times["sampling"][rows] / times["greedy"][rows] for rows in (1, 16, 256, 1024)]
    assert abs(summary["max_sampling_over_greedy"] - max(ratios)) < 1e-9
    assert summary["max_sampling_1row_us"] == times["sampling"][1]
    [case] = [c for c in report["parameters"]["sampling"]["cases"]
              if c["params"]["rows"] == 256 and c["params"]["sequences"] == 16]
    engine = case["timings"]["engine"]["eager"]["median_us"]
    assert abs(summary["speedup_over_engine_16x16"]
               - engine / case["timings"]["triton"]["eager"]["median_us"]) < 1e-9


def test_ops_window_summary_has_two_figures_per_op():
    report = load("ops_window")
    for op, result in report["ops"].items():
        speedups = [graph(c, "torch") / graph(c) for c in result["cases"]]
        assert abs(report["summary"][f"{op}_min_speedup_over_torch"] - min(speedups)) < 1e-9
        assert 0 < report["summary"][f"{op}_max_copy_bw_fraction"] <= 1


def test_a_case_that_did_not_run_leaves_its_figures_none():
    report = copy.deepcopy(load("paged_attention"))
    for case in report["cases"]:
        if case["kind"] == "prefill":
            del case["timings"]["triton"]["graph"]
            case["speedup"]["triton_over_sdpa"].pop("graph")
    summary = paged_attention.summarise(report)
    assert summary["prefill_min_speedup_over_sdpa"] is None
    assert summary["b1_q32_ctx512_us"] is not None
