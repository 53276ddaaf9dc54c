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


# Summary keys added after the committed H200 run: read off its cases they are None (no
# one-launch timing; the host time is bench.host_time's), or, for the implementations
# behind max_sampling_over_greedy, the three launches of every set.
LATER_KEYS = {"select_tokens": {"new_over_old_min": None, "select_host_us_eager": None,
                                "max_sampling_over_greedy_impls": "triton: greedy, sampling"},
              # the committed run predates the FA2 split rule, the one-launch merge and the
              # heaviest-first order it times beside the defaults
              "paged_attention": {"fa2_over_measured_decode_min": None,
                                  "fa2_over_measured_decode_max": None,
                                  "merged_over_combine_decode_min": None,
                                  "merged_over_combine_decode_max": None,
                                  "heaviest_first_over_forward_prefill_min": None}}


def test_committed_gpu_results_carry_the_summary_of_their_own_cases():
    for name, module in MODULES.items():
        report = load(name)
        assert report["summary"] | LATER_KEYS.get(name, {}) == module.summarise(report), name
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


def test_select_tokens_summary_names_the_cost_of_each_rule_set_per_rows():
    """The committed run predates the rules cases: its summary has no process_logits figure.
    Given rules cases (figures made up here), each set's added µs and its ratio to the plain
    call at rows 1, 16 and 256 are read off the cases' graph medians."""
    report = copy.deepcopy(load("select_tokens"))
    assert "rules" not in report and not any(key.startswith("process_logits_")
                                             for key in report["summary"])
    plain = {1: 8.0, 16: 10.0, 64: 20.0, 256: 40.0}
    extra = {"penalties_bias": 2.0, "bitmask": 1.0, "all": 6.0}
    report["rules"] = {"cases": []}
    for rows, base in plain.items():
        case = {"params": {"rows": rows}, "timings": {
            "plain": {"graph": {"median_us": base}, "eager": {"median_us": 3 * base}},
            **{name: {"graph": {"median_us": base + rows / 16 * us},
                      "eager": {"median_us": 99.0}} for name, us in extra.items()}}}
        select_tokens.add_rules_derived(case)
        report["rules"]["cases"].append(case)
    summary = select_tokens.summarise(report)
    rules = {key: value for key, value in summary.items() if key.startswith("process_logits_")}
    assert len(rules) == 3 * 2 * 3
    for name, us in extra.items():
        for rows in (1, 16, 256):
            added = rows / 16 * us
            assert abs(rules.pop(f"process_logits_{name}_added_us_r{rows}") - added) < 1e-9
            assert abs(rules.pop(f"process_logits_{name}_added_over_plain_r{rows}")
                       - added / plain[rows]) < 1e-9
    assert rules == {}
    first = report["rules"]["cases"][0]
    first["timings"]["bitmask"]["graph"] = {"error": "capture failed"}  # R=1 did not run
    select_tokens.add_rules_derived(first)
    summary = select_tokens.summarise(report)
    assert summary["process_logits_bitmask_added_us_r1"] is None
    assert summary["process_logits_bitmask_added_us_r16"] is not None


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
