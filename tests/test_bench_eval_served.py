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
    # 16 streaming settings, one token per step, block-wise, AR; greedy and three seeds
    assert len(runs) == 19 * 4
    sent = [gen_kwargs(argv) for argv in runs]
    xargs = {tuple(sorted(kw["vllm_xargs"].items())) for kw in sent if "vllm_xargs" in kw}
    streaming = {(x["wedlm_entropy_threshold"], x["wedlm_distance_penalty"], x["wedlm_window"])
                 for x in map(dict, xargs) if x["wedlm_mode"] == "streaming"}
    assert {(t, p, w) for t in (0.2, 0.4, 0.6, 0.9) for p in (0.02, 0.10)
            for w in (8, 16)} <= streaming
    assert (0.0, 0.02, 16) in streaming  # one token per step
    assert any(dict(x)["wedlm_mode"] == "blockwise" for x in xargs)
    assert sum("vllm_xargs" not in kw for kw in sent) == 4  # AR: plain requests
    assert sorted({kw["temperature"] for kw in sent}) == [0.0, 0.1]
    seeds = {word.split("seed=")[1].split(",")[0] for argv in runs for word in argv
             if word.startswith("model=")}
    assert seeds == {"0", "1", "2", "3"}
    assert all("tokenizer_backend=None" in argv[argv.index("--model_args") + 1]
               and "--log_samples" in argv for argv in runs)


def test_quick_and_smoke_plan_fewer_runs(capsys):
    assert len(planned_runs(capsys, "--quick")) == 4 * 2
    smoke = planned_runs(capsys, "--smoke")
    assert len(smoke) == 2 and all(json.loads(argv[argv.index("--samples") + 1]) == {
        "wedlm_patterns": eval_served.SMOKE_ITEMS} for argv in smoke)


def fake_run(setting: str, seed, exact: float, wall: float, committed=0, steps=0) -> dict:
    return {"setting": setting, "condition": Condition(seed).name, "seed": seed,
            "wall_s": wall, "counters": {"committed_tokens": committed,
                                         "denoising_steps": steps},
            "tasks": {"t": {"metrics": {"exact": exact, "exact_stderr": 0.04,
                                        "exact_in_training": exact, "exact_unseen": None}}}}


def test_a_settings_figures_are_its_greedy_run_and_its_seeds_spread():
    settings = [Setting("W", "wedlm"), Setting("AR", "ar", threshold=None)]
    runs = [fake_run("W", None, 0.9, 10.0, 300, 100), fake_run("W", 1, 0.8, 12.0, 200, 100),
            fake_run("W", 2, 0.6, 12.0, 100, 100),
            fake_run("AR", None, 0.95, 40.0), fake_run("AR", 1, 0.9, 40.0),
            fake_run("AR", 2, 0.85, 60.0)]
    wedlm, ar = summarise(runs, settings, "t")
    assert wedlm["greedy"]["exact"] == 0.9 and wedlm["greedy"]["stderr"] == 0.04
    assert wedlm["sampled"]["mean"] == pytest.approx(0.7)
    assert (wedlm["sampled"]["min"], wedlm["sampled"]["max"]) == (0.6, 0.8)
    assert wedlm["sampled"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert wedlm["tokens_per_forward"] == pytest.approx(2.0)  # 600 tokens in 300 forwards
    assert wedlm["wall_vs_ar"] == pytest.approx((10 / 40 + 12 / 40 + 12 / 60) / 3)
    assert ar["tokens_per_forward"] == 1.0 and ar["wall_vs_ar"] == 1.0


@needs_matplotlib
def test_the_pareto_plot_is_drawn_from_the_json(tmp_path):
    settings = [Setting("W", "wedlm"), Setting("AR", "ar", threshold=None)]
    runs = [fake_run("W", None, 0.9, 10.0, 300, 100), fake_run("W", 1, 0.8, 12.0, 200, 100),
            fake_run("AR", None, 0.95, 40.0), fake_run("AR", 1, 0.9, 40.0)]
    report = {"date": "d", "label": "CPU", "device": "cpu", "command": "c", "wall_s": 1.0,
              "versions": {"lm_eval": "0.4.13"}, "plot": None, "checks_note": "n",
              "plan": {"tasks": ["t"], "items": 4, "seeds": [1]},
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
