"""The check that lm-eval measures the decoder (bench/eval_served.py --smoke): lm-eval's
``local-completions`` against the plugin's OpenAI server, on four items of the local
``wedlm_patterns`` task, one WeDLM setting, greedy and seeded. The served answers (lm-eval's
logged samples) equal model_min's offline answers for the same settings, and the server's
tokens per forward (``/metrics``) model_min's, over every item; the run stops otherwise.
lm-eval runs from its own venv (``make .venv-eval/.installed``, which ``make test-vllm``
builds)."""

import json

import pytest

from bench import eval_served


@pytest.mark.slow
def test_lm_eval_on_the_served_model_scores_model_mins_answers(tmp_path):
    if not eval_served.DEFAULT_LM_EVAL.exists():
        pytest.fail(f"{eval_served.DEFAULT_LM_EVAL} is missing: make .venv-eval/.installed")
    assert eval_served.main(["--smoke", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "eval_served_smoke.json").read_text())
    assert report["device"]["type"] == "cpu" and report["machine"]["cpu_count"] >= 1
    runs = report["runs"]
    assert [run["condition"] for run in runs] == ["greedy", "T=0.1 seed 1"]
    for run in runs:
        answers = run["tasks"]["wedlm_patterns"]["answers"]
        assert len(answers) == 4 and all(isinstance(a["answer"], str) for a in answers)
        # every item compared; the committed tokens and forwards are model_min's
        assert run["check"]["items_compared"] == 4
        assert run["counters"]["committed_tokens"] == run["check"]["model_min_tokens"] > 0
        assert run["counters"]["denoising_steps"] == run["check"]["model_min_forwards"]
        assert run["tokens_per_forward"] > 1  # the patterns decode several tokens a forward
        assert 0 <= run["tasks"]["wedlm_patterns"]["metrics"]["exact,none"] <= 1
    # the table reports the task's metric, as the greedy run scored it
    row = report["rows"][0]
    greedy = runs[0]["tasks"]["wedlm_patterns"]["metrics"]["exact,none"]
    assert row["metric"] == "exact,none" and row["greedy"]["value"] == greedy
    assert report["summary"]["wedlm_patterns"][row["setting"]]["greedy"] == greedy
