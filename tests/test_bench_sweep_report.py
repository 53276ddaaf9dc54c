"""``bench.sweep`` in a small ``--quick`` grid on a tiny random checkpoint, and
``bench.report`` on copies of the committed results plus that sweep."""

import json
import shutil
import statistics
from pathlib import Path

import pytest

from bench import common
from bench import report as bench_report
from bench.common import fmt_rate
from bench.sweep import main as sweep_main
from bench.tiny_models import build_tiny_model, save_checkpoint
from tests.plot_checks import assert_png, hide_matplotlib, needs_matplotlib

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PROMPTS = ["count: 41 42 43", "the quick fox", "days: monday, tuesday"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The report bench.sweep returns and the path of the JSON it wrote."""
    root = tmp_path_factory.mktemp("sweep")
    checkpoint = save_checkpoint(build_tiny_model("qwen3", seed=0), root / "tiny")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    report = sweep_main(["--model", str(checkpoint), "--quick", "--batch-sizes", "1", "4",
                         "--max-new-tokens", "8", "--prompts", str(prompts),
                         "--out-dir", str(root / "out")])
    return report, root / "out" / "sweep_tiny.json"


def expected_grid(params: dict) -> list[tuple]:
    points = []
    for batch in params["batch_sizes"]:
        points.append(("ar", batch, None, None, None))
        points += [(mode, batch, window, threshold, penalty)
                   for window in params["windows"] for threshold in params["thresholds"]
                   for penalty in params["penalties"] for mode in ("streaming", "blockwise")]
    return points


def test_sweep_json_holds_every_grid_point_once(sweep):
    report, path = sweep
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    params = report["params"]
    assert params["batch_sizes"] == [1, 4] and params["thresholds"] == [0.4, None]
    points = [(c["mode"], c["batch"], c["window"], c["threshold"], c["penalty"])
              for c in report["cases"]]
    assert points == expected_grid(params)
    assert report["prompts"] == PROMPTS
    assert "CPU" in report["label"] and report["device"]["type"] == "cpu"
    assert report["command"].startswith("python -m bench.sweep --model")
    markdown = path.with_suffix(".md").read_text()
    assert "CPU measurement" in markdown and report["date"] in markdown


def test_each_batch_is_the_prompt_list_cycled_and_every_request_is_counted(sweep):
    report, _ = sweep
    for case in report["cases"]:
        assert sum(case["finish_reasons"].values()) == case["batch"]
        assert case["forwards_per_request"] == pytest.approx(case["forwards"] / case["batch"])
        assert 0 < case["tokens"] <= case["batch"] * report["params"]["max_new_tokens"]


def test_tokens_per_forward_and_p_cache_are_quotients_of_the_counts(sweep):
    report, _ = sweep
    for case in report["cases"]:
        assert case["tokens_per_forward"] == pytest.approx(case["tokens"] / case["forwards"])
        assert case["p_cache"] == pytest.approx(case["tokens"] / case["rows"])
        if case["mode"] == "ar":
            assert case["p_cache"] == 1.0 and case["tokens_per_forward"] == 1.0
        else:
            # every token is fed as a mask at least once, and all but a finishing run are fed
            # again as filled tokens (docs/algorithm.md section 4), so rows exceed tokens
            assert case["p_cache"] < 1.0


def test_speedup_is_the_tokens_per_second_ratio_to_ar_at_the_same_batch(sweep):
    report, _ = sweep
    ar = {c["batch"]: c for c in report["cases"] if c["mode"] == "ar"}
    for case in report["cases"]:
        wall = case["wall_seconds"]
        assert len(wall["samples"]) == report["params"]["repeats"]
        assert wall["median"] == statistics.median(wall["samples"])
        assert case["tokens_per_second"] == pytest.approx(case["tokens"] / wall["median"])
        assert case["speedup_over_ar"] == pytest.approx(
            case["tokens_per_second"] / ar[case["batch"]]["tokens_per_second"])


def test_window_policy_rows_name_the_best_swept_window_and_the_auto_choice(tmp_path):
    """A random tiny model with flat logits over three windows and two batch sizes: each
    (mode, threshold, penalty, batch) group lists its fastest window and auto_window's."""
    from model_min import auto_window

    report = sweep_main(["--model", "random:tiny-flat", "--batch-sizes", "1", "12",
                         "--windows", "4", "8", "16", "--thresholds", "0.4", "--modes",
                         "streaming", "ar", "--max-new-tokens", "6", "--repeats", "1",
                         "--ignore-eos", "--out-dir", str(tmp_path)])
    assert report["model"]["weights"].startswith("random") and report["model"]["logits"] == "flat"
    policy = report["window_policy"]
    assert [(row["mode"], row["batch"]) for row in policy] == [("streaming", 1),
                                                                ("streaming", 12)]
    for row in policy:
        rates = {c["window"]: c["tokens_per_second"] for c in report["cases"]
                 if c["mode"] == "streaming" and c["batch"] == row["batch"]}
        assert row["best_tokens_per_second"] == max(rates.values())
        assert rates[row["best_window"]] == max(rates.values())
        assert row["auto_window"] == auto_window(row["batch"])
        assert row["auto_over_best"] == rates[row["auto_window"]] / max(rates.values())
    assert report["summary"]["auto_window_over_best_toks_min"] == min(
        row["auto_over_best"] for row in policy)
    assert "Window policy" in (tmp_path / "sweep_random-tiny-flat.md").read_text()


def test_random_model_names_are_checked():
    with pytest.raises(ValueError, match="random:SHAPE-LOGITS"):
        sweep_main(["--model", "random:qwen3-9b-flat", "--quick"])


def png_size(data: dict) -> tuple[int, int]:
    width, height = bench_report.sweep_plot_size(data)
    return round(width * bench_report.PLOT_DPI), round(height * bench_report.PLOT_DPI)


@needs_matplotlib
def test_sweep_writes_a_png_that_names_the_json_it_was_drawn_from(sweep):
    report, path = sweep
    png = path.with_suffix(".png")
    text = assert_png(png, size=png_size(report))
    assert text[bench_report.PLOT_DIGEST_KEY] == bench_report.sweep_plot_digest(report)
    assert bench_report.sweep_plot_is_current(report, png)
    changed = json.loads(json.dumps(report))
    changed["cases"][0]["p_cache"] /= 2
    assert not bench_report.sweep_plot_is_current(changed, png)
    assert "](sweep_tiny.png)" in path.with_suffix(".md").read_text()


@needs_matplotlib
def test_sweep_plot_has_a_panel_per_metric_and_window_and_a_series_per_mode(sweep):
    """The largest batch: per metric and window a line per windowed mode through its value
    at each threshold (printed beside each marker), and AR's value as a dashed line."""
    from matplotlib.figure import Figure

    report, _ = sweep
    figure = Figure()
    bench_report.draw_sweep(figure, report)
    params, largest = report["params"], max(report["params"]["batch_sizes"])
    thresholds = sorted(params["thresholds"], key=lambda t: (t is not None, t or 0.0))
    assert len(figure.axes) == len(bench_report.PLOT_METRICS) * len(params["windows"])
    axes = iter(figure.axes)
    for metric, label, digits in bench_report.PLOT_METRICS:
        for window in params["windows"]:
            axis = next(axes)
            assert axis.get_title() == f"{label}, W={window}"
            assert [t.get_text() for t in axis.get_xticklabels()] == [
                "none" if t is None else f"{t:g}" for t in thresholds]
            lines = {line.get_label(): line for line in axis.get_lines()}
            assert set(lines) == {"streaming", "blockwise", "ar (no threshold)"}
            shown = []
            for mode in ("streaming", "blockwise"):
                cases = {c["threshold"]: c[metric] for c in report["cases"]
                         if (c["mode"], c["batch"], c["window"]) == (mode, largest, window)}
                expected = [cases[t] for t in thresholds]
                assert list(lines[mode].get_ydata()) == expected
                assert list(lines[mode].get_xdata()) == list(range(len(thresholds)))
                shown += [f"{v:.{digits}f}" for v in expected]
            (ar,) = [c[metric] for c in report["cases"]
                     if c["mode"] == "ar" and c["batch"] == largest]
            assert lines["ar (no threshold)"].get_linestyle() == "--"
            assert list(lines["ar (no threshold)"].get_ydata()) == [ar, ar]
            shown.append(f"ar {ar:.{digits}f}")
            assert sorted(t.get_text() for t in axis.texts) == sorted(shown)
    assert f"batch {largest}" in figure.get_suptitle()
    assert "CPU measurement" in figure.get_suptitle()
    assert report["date"] in figure.get_suptitle()


def test_sweep_plot_without_matplotlib_is_the_reason_and_the_run_still_writes(
        sweep, tmp_path, monkeypatch):
    report, _ = sweep
    hide_matplotlib(monkeypatch)
    json_path = tmp_path / "sweep_tiny.json"
    from bench.sweep import write_outputs

    assert write_outputs(report, json_path) == common.NO_MATPLOTLIB
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(report))
    assert "](sweep_tiny.png)" in json_path.with_suffix(".md").read_text()
    assert not json_path.with_suffix(".png").exists()


def a_figure(data: dict) -> str:
    """One figure of a result file, formatted the way the report formats it."""
    if data.get("benchmark") == "bench.sweep":
        return f"{data['cases'][0]['tokens_per_forward']:.2f}"
    if data.get("benchmark") == "bench.decoder_cpu":
        return f"{data['cases'][0]['ratios']['reference_forward_over_generator_step']:.4g}"
    if data.get("benchmark") == "attention_cpu":
        return bench_report.num(data["tiny_prefill"]["sdpa_ms"])
    if data.get("benchmark") == "bench.vllm_serve":
        return f"| {bench_report.num(data['cases'][0]['output_tok_per_s'])} |"
    if data.get("benchmark") == "bench.vllm_data_parallel":
        return (f"| summary.dp2_over_dp1_output_tok_per_s | "
                f"{bench_report.num(data['summary']['dp2_over_dp1_output_tok_per_s'])} |")
    if str(data.get("name", "")).startswith("eval_served"):
        return f"| {bench_report.fmt(data['rows'][0]['greedy']['value'], 3)} ± "
    if data.get("benchmark") == "bench.structured_outputs":
        return f"| tokens_per_forward | {bench_report.cell(data['cases'][0]['tokens_per_forward'])} |"
    if data.get("benchmark") == "decode_step":
        return f"| step_ms | {bench_report.num(data['cases'][0]['step_ms'])} |"
    if data.get("benchmark") == "host_time":
        return bench_report.fmt(data["benchmarks"][0]["stats"]["median"] * 1e6, 1)
    if data.get("benchmark") == "compile_facts" and data.get("op") == "paged_attention":
        key = "partial_over_kv_max_fa2_last_program"
        return f"| summary.{key} | {bench_report.num(data['summary'][key])} |"
    if data.get("benchmark") == "compile_facts":
        key = "greedy_registers_one_launch_bf16"
        return f"| summary.{key} | {bench_report.num(data['summary'][key])} |"
    if data.get("benchmark") == "bench.window_policy":
        key = "adaptive_over_ar_min"
        return f"| summary.{key} | {bench_report.num(data['summary'][key])} |"
    if data.get("benchmark") == "vocabulary_passes":
        return f"| summary.greedy_passes | {bench_report.num(data['summary']['greedy_passes'])} |"
    if "copy_bandwidth" in data:
        return f"{fmt_rate(data['copy_bandwidth']['gb_per_s'])} GB/s"
    raise AssertionError(f"no figure known for {data.get('benchmark')}")


def first_timed_case(node):
    if isinstance(node, dict):
        if isinstance(node.get("timings"), dict):
            return node
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            found = first_timed_case(value)
            if found is not None:
                return found
    return None


@pytest.fixture
def results_copy(sweep, tmp_path):
    """A results folder: the committed result files plus the sweep's JSON."""
    results = tmp_path / "results"
    for path in RESULTS.glob("*/*"):
        if path.suffix in (".json", ".png", ".md"):
            (results / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, results / path.parent.name / path.name)
    (results / "cpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(sweep[1], results / "cpu" / "sweep_tiny.json")
    return results


@needs_matplotlib
def test_report_shows_each_file_with_its_date_command_and_figures(results_copy, tmp_path):
    out = tmp_path / "REPORT.md"
    assert bench_report.main(["--results", str(results_copy), "--out", str(out)]) == 0
    text = out.read_text()
    files = sorted(results_copy.glob("*/*.json"))
    assert {"decoder_cpu.json", "sweep_tiny.json"} <= {p.name for p in files}
    for path in files:
        data = json.loads(path.read_text())
        assert f"## {path.parent.name}/{path.name}" in text
        assert data["date"] in text and f"`{data['command']}`" in text
        assert a_figure(data) in text, path
        case = first_timed_case(data)
        if case is not None:  # an op benchmark: a median time and its speed-ups
            modes = next(iter(case["timings"].values()))
            mode, timing = next(iter(modes.items()))
            assert f"| {timing['median_us']:.1f} |" in text
            for by_mode in case.get("speedup", {}).values():
                if by_mode.get(mode) is not None:
                    assert f"| {by_mode[mode]:.2f}× |" in text
    if any(p.parent.name != "cpu" for p in files):
        assert "**GPU measurement**" in text
    assert "**CPU measurement**" in text
    sweep = json.loads((results_copy / "cpu" / "sweep_tiny.json").read_text())
    for case in sweep["cases"]:
        assert f"| {case['tokens_per_second']:.1f} | {case['speedup_over_ar']:.2f}× |" in text
    assert_png(results_copy / "cpu" / "sweep_tiny.png", size=png_size(sweep))
    assert "](results/cpu/sweep_tiny.png)" in text
    assert "svg" not in text
    for png in results_copy.glob("*/*.png"):
        assert f"](results/{png.parent.name}/{png.name})" in text


def test_unknown_shapes_fall_back_to_a_key_value_table(tmp_path):
    results = tmp_path / "results" / "somewhere"
    results.mkdir(parents=True)
    (results / "odd.json").write_text(json.dumps(
        {"benchmark": "odd", "date": "2001-02-03", "command": "python -m odd",
         "figures": {"latency_ms": 1.25, "sizes": [1, 2]}}))
    (results / "timed_badly.json").write_text(json.dumps(
        {"benchmark": "bad", "date": "2001-02-04", "cases": [{"timings": {"x": "oops"}}]}))
    (results / "a_list.json").write_text("[1, 2, 3]")
    (results / "broken.json").write_text("{not json")
    out = tmp_path / "REPORT.md"
    assert bench_report.main(["--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| figures.latency_ms | 1.25 |" in text and "| figures.sizes | [1, 2] |" in text
    assert "2001-02-03" in text and "`python -m odd`" in text
    assert "2001-02-04" in text and "layout not recognised" in text
    assert "## somewhere/a_list.json" in text and "## somewhere/broken.json" in text
    assert "JSONDecodeError" in text


@needs_matplotlib
def test_check_fails_when_the_report_or_a_plot_is_stale(results_copy, tmp_path, capsys):
    out = tmp_path / "REPORT.md"
    args = ["--results", str(results_copy), "--out", str(out)]
    assert bench_report.main(args + ["--check"]) == 1  # nothing written yet
    assert bench_report.main(args) == 0
    assert bench_report.main(args + ["--check"]) == 0
    fresh = out.read_text()
    out.write_text(fresh.replace("|", "!", 1))
    assert bench_report.main(args + ["--check"]) == 1
    out.write_text(fresh)
    png = results_copy / "cpu" / "sweep_tiny.png"
    drawn = png.read_bytes()
    # a whole PNG, but drawn from another result (the committed sweep's)
    shutil.copy(results_copy / "cpu" / "sweep_tiny_wedlm.png", png)
    capsys.readouterr()
    assert bench_report.main(args + ["--check"]) == 1
    assert capsys.readouterr().out.startswith(f"out of date: {png}\n")
    assert bench_report.main(args) == 0
    assert png.read_bytes() == drawn  # redrawn the same: the drawing is deterministic
    png.unlink()
    assert bench_report.main(args + ["--check"]) == 1
    assert bench_report.main(args) == 0 and png.exists()
    sweep = results_copy / "cpu" / "sweep_tiny.json"
    data = json.loads(sweep.read_text())
    data["cases"][0]["tokens_per_second"] *= 2
    sweep.write_text(json.dumps(data))
    assert bench_report.main(args + ["--check"]) == 1


@needs_matplotlib
def test_a_current_plot_is_not_redrawn_so_the_report_needs_no_matplotlib_then(
        results_copy, tmp_path, monkeypatch, capsys):
    out = tmp_path / "REPORT.md"
    args = ["--results", str(results_copy), "--out", str(out)]
    assert bench_report.main(args) == 0
    png = results_copy / "cpu" / "sweep_tiny.png"
    before = png.stat().st_mtime_ns
    hide_matplotlib(monkeypatch)
    out.unlink()
    capsys.readouterr()
    assert bench_report.main(args) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.exists() and png.stat().st_mtime_ns == before
    assert bench_report.main(args + ["--check"]) == 0


def test_report_without_matplotlib_writes_the_text_says_why_no_plot_and_exits_1(
        results_copy, tmp_path, monkeypatch, capsys):
    hide_matplotlib(monkeypatch)
    out = tmp_path / "REPORT.md"
    png = results_copy / "cpu" / "sweep_tiny.png"
    data = json.loads((results_copy / "cpu" / "sweep_tiny.json").read_text())
    assert bench_report.write_sweep_plot(data, png) == common.NO_MATPLOTLIB
    capsys.readouterr()
    assert bench_report.main(["--results", str(results_copy), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"{png} not written: matplotlib is not installed: no plot" in printed
    assert "## cpu/sweep_tiny.json" in out.read_text() and not png.exists()


@pytest.mark.parametrize("matplotlib", ["installed", "unimportable"])
def test_the_committed_report_is_up_to_date_with_the_committed_results(matplotlib,
                                                                        monkeypatch):
    """``--check`` reads the digest in the committed PNG: it needs no matplotlib."""
    if matplotlib == "unimportable":
        hide_matplotlib(monkeypatch)
    assert bench_report.main(["--check"]) == 0, "run `python -m bench.report`"
