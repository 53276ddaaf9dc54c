"""Smoke tests of ``bench.select_tokens`` (its CPU code path).

The GPU figures can only be produced on a GPU; these tests pin what can be checked without
one: the no-GPU exit, the report plumbing (bytes model, GB/s, fractions, speed-ups, the
Triton-vs-PyTorch check), the one-launch kernel timed beside the three launches in the
greedy and temperature sets (checked against them, and read by the summary), the batch
layout, that the engine-sampler baseline computes
what the engine computes (entropy, greedy tokens, threshold selection with its fallback),
and the logit-rules cases: their inputs, the arguments each rule set passes, the added cost
read off the medians, and checks that fail when the rules are not applied.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import common
from bench import select_tokens as bench
from tests.numerics import ENTROPY_TOLERANCE
from tests.plot_checks import assert_png, hide_matplotlib, needs_matplotlib
from tests.select_inputs import ONE_LAUNCH_INTERPRETER_WARNINGS, batch
from wedlm_kernels.ops.select import select_tokens_torch

REPO = Path(__file__).resolve().parent.parent
pytestmark = ONE_LAUNCH_INTERPRETER_WARNINGS


ROUNDS = 3  # interleaved rounds of the rules cases in these tests (the benchmark's: 15)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "RULES_CPU_ROUNDS", ROUNDS)
        status = bench.main(["--cpu-smoke", "--out-dir", str(out_dir)])
    report = json.loads((out_dir / "select_tokens.json").read_text())
    markdown = (out_dir / "select_tokens.md").read_text()
    return status, report, markdown, out_dir


def test_default_mode_without_gpu_says_so_exits_0_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.select_tokens", "--out-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == common.NO_GPU_MESSAGE
    assert not (tmp_path / "out").exists()


def test_cpu_smoke_times_every_case_of_every_parameter_set(smoke):
    status, report, markdown, out_dir = smoke
    assert status == 0, bench.failures(report)
    assert report["mode"] == "cpu-smoke" and report["complete"]
    assert report["command"] == f"python -m bench.select_tokens --cpu-smoke --out-dir {out_dir}"
    assert set(report["parameters"]) == {"greedy", "temperature", "top_k", "top_p",
                                         "top_k_top_p"}
    # the summary's figures are the triton kernel's, graph mode: none from a CPU run
    rules = {f"process_logits_{name}_{figure}_r{rows}" for name in ("penalties_bias", "bitmask",
                                                                    "all")
             for figure in ("added_us", "added_over_plain") for rows in (1, 16, 256)}
    assert set(report["summary"]) == {"max_sampling_over_greedy", "max_sampling_1row_us",
                                      "greedy_min_copy_bw_fraction_256plus",
                                      "speedup_over_engine_16x16",
                                      "max_sampling_over_greedy_impls", "new_over_old_min",
                                      "select_host_us_eager"} | rules
    assert all(value is None for value in report["summary"].values())
    for name, result in report["parameters"].items():
        assert [c["params"]["rows"] for c in result["cases"]] == list(bench.SMOKE.rows)
        for case in result["cases"]:
            # no Triton without --interpret; the engine sampler on two sets only
            engine = name in ("greedy", "top_k_top_p")
            assert set(case["timings"]) == {"torch"} | ({"engine"} if engine else set())
            for timing in case["timings"].values():
                assert timing["cpu"]["samples"] >= 3 and timing["cpu"]["median_us"] > 0
            assert case["speedup"] == {} and case["check"] == {}
    assert markdown.count("| rows | B × rows | MB moved |") == 5
    assert "CPU smoke run" in markdown


def test_cpu_smoke_prices_each_rule_set_against_the_plain_call_at_every_rows(smoke):
    status, report, markdown, _ = smoke
    rules = report["rules"]
    assert rules["implementation"] == "torch" and rules["params"]["parameters"] == "temperature"
    assert rules["sets"] == {"penalties_bias": ["penalties", "bias"], "bitmask": ["bitmask"],
                             "all": list(bench.RULE_GROUPS)}
    assert [c["params"]["rows"] for c in rules["cases"]] == list(bench.SMOKE.rows)
    sets = list(bench.RULE_SETS)
    for case in rules["cases"]:
        assert list(case["timings"]) == ["restore", "plain", *sets,
                                         *[f"process_logits_{name}" for name in sets]]
        restore = case["timings"]["restore"]["cpu"]["median_us"]
        for name, timing in case["timings"].items():
            cpu = timing["cpu"]
            assert cpu["samples"] == ROUNDS
            if name != "restore":  # the restore subtracted from every call's median
                assert cpu["median_us"] == pytest.approx(cpu["with_restore_us"] - restore)
        plain = case["timings"]["plain"]["cpu"]["median_us"]
        for name in sets:
            added = case["timings"][name]["cpu"]["median_us"] - plain
            assert case["added_us"][name]["cpu"] == pytest.approx(added)
            assert case["added_over_plain"][name]["cpu"] == pytest.approx(added / plain)
        # no Triton: the PyTorch implementation is not checked against itself
        assert set(case["check"]) == {"bans_respected"} and case["check"]["bans_respected"]["ok"]
    assert "## Logit rules: process_logits + select_tokens against select_tokens alone" in markdown
    assert markdown.count("| rows | B × rows | plain µs | penalties_bias µs |") == 1


@needs_matplotlib
def test_cpu_smoke_plot_is_a_png_with_a_panel_per_parameter_set(smoke):
    _, report, markdown, out_dir = smoke
    assert report["plot"] == "select_tokens.png"
    count = len(report["parameters"]) + 1  # and the rules panel
    assert_png(out_dir / "select_tokens.png", size=(round(4.5 * count * 110), round(4.5 * 110)))
    assert "- **plot**: select_tokens.png" in markdown


def test_plot_without_matplotlib_is_the_reason_not_an_error(smoke, tmp_path, monkeypatch):
    _, report, _, _ = smoke
    hide_matplotlib(monkeypatch)
    assert bench.write_plot(report, tmp_path / "select_tokens.png") == common.NO_MATPLOTLIB
    assert not (tmp_path / "select_tokens.png").exists()


def test_cpu_smoke_derived_figures_follow_from_the_medians(smoke):
    _, report, _, _ = smoke
    copy = report["copy_bandwidth"]
    assert copy["gb_per_s"] == pytest.approx(
        copy["bytes_read_plus_written"] / (copy["timing"]["median_us"] * 1e3))
    vocab = report["shapes"]["vocab"]
    for result in report["parameters"].values():
        for case in result["cases"]:
            rows = case["params"]["rows"]
            assert case["bytes"]["total"] == rows * vocab * 4 + rows * 13  # fp32 smoke logits
            for impl, timing in case["timings"].items():
                rate = case["bytes"]["total"] / (timing["cpu"]["median_us"] * 1e3)
                assert case["gb_per_s"][impl]["cpu"] == pytest.approx(rate)
                assert case["fraction_of_copy_bandwidth"][impl]["cpu"] == pytest.approx(
                    rate / copy["gb_per_s"])


def test_case_with_the_triton_launcher_checks_it_and_reports_speedups():
    """Both Triton kernels (the one launch in the greedy and temperature sets only), each
    checked before timing: the three launches against PyTorch, the one launch against the
    three (tokens and selection equal exactly)."""
    sizes = replace(bench.SMOKE, vocab=40)
    launchers = bench.load_launchers(with_triton=True)  # Triton's interpreter without a GPU
    timer = common.Timer(torch.device("cpu"), quick=True)
    for params in bench.PARAMS:
        case = bench.run_case(sizes, params, 2, launchers, timer, seed=3)
        bench.add_derived(case, 10.0)
        one_launch = params.name in ("greedy", "temperature")
        assert set(case["check"]) == {"triton_vs_torch"} | (
            {"triton_one_launch_vs_triton"} if one_launch else set())
        assert all(check["ok"] for check in case["check"].values()), case["check"]
        filtered = 0 < params.top_k < sizes.vocab or params.top_p < 1
        assert case["filter_paths"] == {"candidates": 2 if filtered else 0, "whole row": 0,
                                        "checked draws": 0}
        assert set(case["timings"]) == {"triton", "torch"} | (
            {"triton_one_launch"} if one_launch else set()) | (
            {"engine"} if params.engine else set())
        assert case.get("one_launch_sampling") == (params.name if one_launch else None)
        assert set(case["speedup"]) == {"triton_over_torch"} | (
            {"triton_over_engine"} if params.engine else set()) | (
            {"triton_over_triton_one_launch"} if one_launch else set())
        for name, speedup in case["speedup"].items():
            baseline = name.removeprefix("triton_over_")
            assert speedup["cpu"] == pytest.approx(
                case["timings"][baseline]["cpu"]["median_us"]
                / case["timings"]["triton"]["cpu"]["median_us"])


# The Triton kernels of the in-process smoke runs below go through Triton's interpreter
# (conftest sets TRITON_INTERPRET without a GPU); on a GPU machine they are compiled for it.
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                       reason="Triton's interpreter runs on machines without a GPU")


def fake_gpu_modes(monkeypatch) -> None:
    """The CPU timer measures the two GPU modes (``eager`` and ``graph``, each a short
    ``time_cpu``), so that a --cpu-smoke run fills the summary's graph-mode figures."""
    monkeypatch.setitem(common.Timer.MODES, "cpu", ("eager", "graph"))
    monkeypatch.setattr(common, "time_eager_cuda", lambda fn, warmup_ms, rep_ms: common.Timing(
        common.time_cpu(fn, 1).median_us, 3, "eager"))
    monkeypatch.setattr(common, "time_graph_cuda", lambda fn, replays, estimate_us=None:
                        common.Timing(common.time_cpu(fn, 1).median_us, replays, "graph", 10))


@needs_interpreter
def test_interpreted_smoke_times_the_one_launch_kernel_beside_the_three(monkeypatch, tmp_path):
    """``--cpu-smoke --interpret`` (tiny sizes, three parameter sets, both timing modes):
    the one launch runs, checked and timed, in the greedy and temperature sets only, and
    the summary reads each set's figures off the implementation it names."""
    fake_gpu_modes(monkeypatch)
    monkeypatch.setattr(bench, "SMOKE", replace(bench.SMOKE, vocab=48, rows=(1, 2),
                                                rows_per_sequence=2))
    monkeypatch.setattr(bench, "PARAMS", bench.PARAMS[:3])  # greedy, temperature, top_k
    monkeypatch.setattr(bench, "RULES_CPU_ROUNDS", 1)
    status = bench.main(["--cpu-smoke", "--interpret", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "select_tokens.json").read_text())
    markdown = (tmp_path / "select_tokens.md").read_text()
    assert status == 0, bench.failures(report)
    assert report["modes"] == ["eager", "graph"] and report["complete"]
    for name, result in report["parameters"].items():
        one_launch = name != "top_k"
        assert [c["params"]["rows"] for c in result["cases"]] == [1, 2]
        for case in result["cases"]:
            assert ("triton_one_launch" in case["timings"]) == one_launch
            assert ("triton_one_launch_vs_triton" in case["check"]) == one_launch
            assert all(check["ok"] for check in case["check"].values()), case["check"]
            if one_launch:
                assert case["one_launch_sampling"] == name
                assert case["check"]["triton_one_launch_vs_triton"]["equal_tokens"]
                for mode in ("eager", "graph"):  # as every speed-up of triton
                    assert case["speedup"]["triton_over_triton_one_launch"][mode] == (
                        pytest.approx(case["timings"]["triton_one_launch"][mode]["median_us"]
                                      / case["timings"]["triton"][mode]["median_us"]))

    def graph(name, rows, impl):
        [case] = [c for c in report["parameters"][name]["cases"] if c["params"]["rows"] == rows]
        return case["timings"][impl]["graph"]["median_us"]

    summary = report["summary"]
    assert summary["max_sampling_over_greedy_impls"] == (
        "triton_one_launch: greedy, temperature; triton: top_k")
    assert summary["max_sampling_over_greedy"] == pytest.approx(max(
        graph(name, 1, impl) / graph("greedy", 1, "triton_one_launch")
        for name, impl in (("temperature", "triton_one_launch"), ("top_k", "triton"))))
    assert summary["max_sampling_1row_us"] == max(graph("temperature", 1, "triton_one_launch"),
                                                  graph("top_k", 1, "triton"))
    assert summary["new_over_old_min"] == pytest.approx(min(
        graph(name, rows, "triton") / graph(name, rows, "triton_one_launch")
        for name in ("greedy", "temperature") for rows in (1, 2)))
    # no case of 256 rows or more; the host time is bench.host_time's
    assert summary["greedy_min_copy_bw_fraction_256plus"] is None
    assert summary["select_host_us_eager"] is None
    assert markdown.count("| triton_one_launch GB/s | triton_one_launch % copy BW |") == 4
    assert markdown.count("one launch × over three | check |") == 4  # greedy, temperature x 2
    assert "MISMATCH" not in markdown


def test_one_launch_check_fails_on_any_token_or_selection_difference():
    token, selected = torch.tensor([3, 1, 4]), torch.tensor([True, False, True])
    entropy = torch.tensor([0.5, 1.0, 2.0])
    three = (token, selected, entropy)
    same = bench.check_one_launch((token.clone(), selected.clone(), entropy * (1 + 1e-6)), three)
    assert same["ok"] and same["equal_tokens"] and same["equal_selection"]
    other_token = bench.check_one_launch((torch.tensor([3, 1, 5]), selected, entropy), three)
    assert not other_token["ok"] and not other_token["equal_tokens"]
    other_selection = bench.check_one_launch((token, ~selected, entropy), three)
    assert not other_selection["ok"] and not other_selection["equal_selection"]
    far_entropy = bench.check_one_launch((token, selected, entropy * 1.01), three)
    assert not far_entropy["ok"] and far_entropy["max_relative_entropy_error"] > 1e-4


def test_one_launch_runs_the_sets_without_top_k_or_top_p_under_their_hint():
    modes = {params.name: bench.one_launch_mode(params) for params in bench.PARAMS}
    assert modes == {"greedy": "greedy", "temperature": "temperature", "top_k": None,
                     "top_p": None, "top_k_top_p": None}


def synthetic_report(graph_us: dict, rows=(1, 256, 1024)) -> dict:
    """A two-mode report whose cases have the graph medians ``graph_us[set][impl](rows)``
    (the eager ones twice those), with the bytes model of the GPU run's sizes."""
    report = {"shapes": {"rows": list(rows)}, "parameters": {}}
    for name, impls in graph_us.items():
        params = next(p for p in bench.PARAMS if p.name == name)
        cases = []
        for num_rows in rows:
            case = {"params": {"rows": num_rows, "sequences": max(1, num_rows // 16)},
                    "bytes": {"total": num_rows * 151936 * 2 + 13 * num_rows},
                    "timings": {impl: {"graph": {"median_us": us(num_rows)},
                                       "eager": {"median_us": 2 * us(num_rows)}}
                                for impl, us in impls.items()}, "check": {}}
            common.add_derived(case, 4000.0)
            cases.append(case)
        report["parameters"][name] = {
            "params": {"temperature": params.temperature, "top_k": params.top_k,
                       "top_p": params.top_p}, "cases": cases}
    return report


def test_summary_compares_the_kernels_and_takes_the_faster_ones_bandwidth():
    """The one launch is faster at 1 and 256 rows and slower at 1024: the greedy bandwidth
    figure takes the faster kernel per rows, new_over_old_min the worst case."""
    one = {1: 4.0, 256: 50.0, 1024: 300.0}
    report = synthetic_report({
        "greedy": {"triton": lambda r: 2 * one[r] if r < 1024 else 250.0,
                   "triton_one_launch": lambda r: one[r], "torch": lambda r: 10 * one[r]},
        "temperature": {"triton": lambda r: 3 * one[r],
                        "triton_one_launch": lambda r: 1.5 * one[r]},
        "top_p": {"triton": lambda r: 8 * one[r]},
    })
    summary = bench.summarise(report)
    fraction = {rows: (rows * 151936 * 2 + 13 * rows) / (us * 1e3) / 4000.0
                for rows, us in ((256, 50.0), (1024, 250.0))}  # the faster kernel's
    assert summary["greedy_min_copy_bw_fraction_256plus"] == pytest.approx(min(fraction.values()))
    assert summary["new_over_old_min"] == pytest.approx(250.0 / 300.0)
    # greedy by the one launch; temperature by the one launch, top_p by the three launches
    assert summary["max_sampling_over_greedy"] == pytest.approx(8.0)
    assert summary["max_sampling_over_greedy_impls"] == (
        "triton_one_launch: greedy, temperature; triton: top_p")
    assert summary["max_sampling_1row_us"] == 32.0
    assert summary["speedup_over_engine_16x16"] is None and summary["select_host_us_eager"] is None
    # a one-launch graph timing that failed leaves its figures None
    report["parameters"]["greedy"]["cases"][1]["timings"]["triton_one_launch"]["graph"] = {
        "error": "capture failed"}
    common.add_derived(report["parameters"]["greedy"]["cases"][1], 4000.0)
    summary = bench.summarise(report)
    assert summary["new_over_old_min"] is None
    assert summary["greedy_min_copy_bw_fraction_256plus"] is None
    assert summary["max_sampling_over_greedy"] is None
    assert summary["max_sampling_over_greedy_impls"] is None


def test_failures_lists_mismatches_and_errors():
    report = {"parameters": {"greedy": {"cases": [{
        "params": {"rows": 4}, "timings": {"torch": {"eager": {"error": "boom"}}},
        "check": {"triton_vs_torch": {"ok": False}}}], "case_errors": ["R=16: failed"]}},
        "rules": {"cases": [{"params": {"rows": 1}, "timings": {},
                             "check": {"bans_respected": {"ok": False}}}],
                  "error": "R=16: CUDA context lost"}}
    problems = bench.failures(report)
    assert len(problems) == 5 and any("boom" in p for p in problems)
    assert "rules R=1: bans_respected mismatch {'ok': False}" in problems
    assert "rules: R=16: CUDA context lost" in problems


def rule_case_inputs(vocab: int, num_rows: int, seed: int = 0) -> tuple[tuple, dict]:
    sizes = replace(bench.SMOKE, vocab=vocab)
    args = bench.make_inputs(sizes, bench.RULES_PARAMS, num_rows, torch.device("cpu"), seed)
    return args, bench.make_rule_inputs(args, bench.RULES, seed)


def test_rule_inputs_are_each_sequences_history_and_masks():
    """The committed outputs and the prompt fill the context before the first window row;
    the counts hold the outputs (with repeats), the masks allow about 1/2 and 3/4."""
    args, inputs = rule_case_inputs(vocab=4000, num_rows=64)
    cu_rows, row_pos = args[1], args[2]
    context = row_pos[cu_rows[:-1].long()]
    num_seqs = len(context)
    generated = inputs["output_counts"].sum(dim=1)
    assert inputs["output_counts"].dtype == torch.int32 and inputs["prompt_mask"].dtype == torch.bool
    assert torch.equal(inputs["output_start"].long() + generated, context)
    assert (generated < bench.RULES.max_generated).all() and (generated > 0).any()
    assert (inputs["output_counts"].max(dim=1).values > 1).any()  # repeats
    assert (inputs["prompt_mask"].sum(dim=1) <= inputs["output_start"]).all()
    assert inputs["token_bitmask"].shape == (64, 125) and inputs["allowed_mask"].shape == (
        num_seqs, 125)
    every = torch.arange(4000)
    for words, share in ((inputs["token_bitmask"], 0.5), (inputs["allowed_mask"], 0.75)):
        bits = (words[:, every // 32] >> (every % 32).to(torch.int32)) & 1
        assert abs(bits.double().mean().item() - share) < 0.02
    assert inputs["bias_ids"].shape == (num_seqs, bench.RULES.bias_entries)
    assert inputs["stop_ids"].shape == (num_seqs, bench.RULES.stop_ids)
    assert (inputs["min_tokens"] == bench.RULES.min_tokens).all()
    assert inputs["temperature"] is args[3] and (args[3] == 0.7).all()


def test_allowed_reads_bit_token_mod_32_of_word_token_div_32():
    words = torch.tensor([[0b101, 0], [0, -2**31]], dtype=torch.int32)  # tokens 0, 2; 63
    token = torch.tensor([2, 63])
    assert bench.allowed(words, token).tolist() == [True, True]
    assert bench.allowed(words, torch.tensor([1, 62])).tolist() == [False, False]


@pytest.mark.parametrize("rule_set", list(bench.RULE_SETS))
def test_each_rule_set_passes_its_groups_and_none_for_the_others(rule_set):
    _, inputs = rule_case_inputs(vocab=100, num_rows=4)
    arguments = bench.rule_arguments(inputs, rule_set)
    assert set(arguments) == {name for group in bench.RULE_GROUPS.values() for name in group}
    given = {name for name, value in arguments.items() if value is not None}
    assert given == {name for group in bench.RULE_SETS[rule_set]
                     for name in bench.RULE_GROUPS[group]}
    assert all(arguments[name] is inputs[name] for name in given)


def test_rules_check_of_the_triton_launchers_compares_them_bit_for_bit():
    """Through Triton's interpreter (slow: the check only, no timing), two sequences."""
    args, inputs = rule_case_inputs(vocab=40, num_rows=5, seed=3)
    checks = bench.check_rules(args, inputs, bench.load_rule_launchers(with_triton=True))
    assert checks["process_logits_vs_torch"] == {
        "ok": True, "bit_equal": dict.fromkeys(bench.RULE_SETS, True)}
    assert checks["bans_respected"]["ok"] and checks["bans_respected"]["selected_rows"] > 0


def test_checks_fail_when_the_rules_are_not_applied():
    """A process launcher that leaves the logits as they are: it differs from the PyTorch
    implementation, and the tokens drawn then break the row bitmask."""
    args, inputs = rule_case_inputs(vocab=1000, num_rows=8)
    launchers = {**bench.load_rule_launchers(with_triton=False),
                 "process": lambda *args, **kwargs: None}
    checks = bench.check_rules(args, inputs, launchers)
    assert checks["process_logits_vs_torch"] == {
        "ok": False, "bit_equal": dict.fromkeys(bench.RULE_SETS, False)}
    assert not checks["bans_respected"]["ok"] and checks["bans_respected"]["selected_rows"] > 0


def test_added_cost_is_the_difference_of_the_medians_and_none_without_them():
    case = {"timings": {"plain": {"graph": {"median_us": 10.0}, "eager": {"error": "x"}},
                        "penalties_bias": {"graph": {"median_us": 12.5},
                                           "eager": {"median_us": 30.0}},
                        "bitmask": {"graph": {"error": "capture failed"}}}}
    bench.add_rules_derived(case)
    assert case["added_us"] == {"penalties_bias": {"graph": 2.5, "eager": None},
                                "bitmask": {"graph": None}, "all": {}}
    assert case["added_over_plain"]["penalties_bias"] == {"graph": 0.25, "eager": None}


@pytest.mark.parametrize("num_rows", [1, 5, 16, 64])
def test_inputs_are_decode_steps_of_up_to_16_mask_rows_per_sequence(num_rows):
    args = bench.make_inputs(bench.SMOKE, bench.PARAMS[1], num_rows, torch.device("cpu"), 0)
    logits, cu_rows, row_pos = args[:3]
    per_sequence = min(bench.SMOKE.rows_per_sequence, num_rows)
    assert logits.shape == (num_rows, bench.SMOKE.vocab)
    assert cu_rows.tolist() == [*range(0, num_rows, per_sequence), num_rows]
    for start, end in zip(cu_rows.tolist(), cu_rows.tolist()[1:]):
        assert row_pos[start:end].tolist() == list(range(row_pos[start], row_pos[start] + end
                                                         - start))
    assert all(a.shape == (len(cu_rows) - 1,) for a in args[3:])


def test_engine_sampler_selects_and_decodes_greedy_rows_like_the_contract():
    """fp32 logits, greedy: entropy, tokens of the selected rows and the selection (with the
    argmin fallback) equal select_tokens_torch; thresholds sit between adjusted entropies."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 300, generator=g) * torch.tensor([0.5, 3, 6]).repeat(3)[:, None]
    cu_rows, row_pos = [0, 4, 9], [10, 11, 12, 13, 50, 51, 52, 53, 54]
    base = batch(logits, cu_rows, row_pos, [0.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0],
                  [0.02, 0.1], [0, 0])
    entropy = select_tokens_torch(*base)[2]
    thresholds = [float(entropy[:4].sort().values[1:3].mean()), -math.inf]
    args = batch(logits, cu_rows, row_pos, [0.0, 0.0], [0, 0], [1.0, 1.0], thresholds,
                  [0.02, 0.1], [0, 0])
    token, selected, entropy = bench.engine_sampler(*args)
    torch_token, torch_selected, torch_entropy = select_tokens_torch(*args)
    torch.testing.assert_close(entropy, torch_entropy, **ENTROPY_TOLERANCE)
    assert selected.tolist() == torch_selected.tolist()
    assert 1 <= int(selected[:4].sum()) <= 3 and int(selected[4:].sum()) == 1
    assert token[selected].tolist() == torch_token[selected].tolist()


def test_engine_sampler_draws_sampled_rows_inside_top_k():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 200, generator=g) * 3
    args = batch(logits, [0, 8], list(range(8)), [1.0], [5], [0.95], [math.inf], [0.0], [0])
    token, selected, _ = bench.engine_sampler(*args)
    assert selected.all()
    top5 = logits.topk(5, dim=1).indices
    assert all(int(t) in top5[r].tolist() for r, t in enumerate(token))
