"""`python -m model_min demo` (model_min/demo.py) on the shipped tiny model: the numbers it
reports are consistent with direct Generator calls, and the command prints, errors and
writes JSON as documented. Nothing here depends on the model's output quality."""

import io
import json

import pytest

from model_min import Generator, SamplingParams, load_model, load_tokenizer
from model_min.__main__ import main
from model_min.demo import DEMO_MODEL_DIR, RUNS, Progress, run_demo

PROMPTS = ["count: 41 42 43 ", "the old king sees "]
MAX_NEW, WINDOW, THRESHOLD = 10, 4, 0.4
MODE_NAMES = [label for label, *_ in RUNS]


@pytest.fixture(scope="module")
def generator() -> Generator:
    model = load_model(DEMO_MODEL_DIR, device="cpu")
    return Generator(model, window=WINDOW, max_batch=1, tokenizer=load_tokenizer(DEMO_MODEL_DIR))


@pytest.fixture(scope="module")
def demo_data(generator) -> list[dict]:
    return run_demo(generator, PROMPTS, max_new_tokens=MAX_NEW, threshold=THRESHOLD)


def test_runner_reports_all_four_modes_with_consistent_numbers(demo_data):
    assert [item["prompt"] for item in demo_data] == PROMPTS
    for item in demo_data:
        assert list(item["modes"]) == MODE_NAMES == ["streaming", "one-per-step", "blockwise", "ar"]
        for run in item["modes"].values():
            assert 0 < run["tokens"] <= MAX_NEW and run["tokens"] == len(run["token_ids"])
            assert run["forwards"] > 0 and run["wall_ms"] > 0
            assert run["tokens_per_forward"] == pytest.approx(run["tokens"] / run["forwards"])
            assert 0 < run["p_cache"] <= 1
        ar = item["modes"]["ar"]
        assert ar["p_cache"] == 1 and ar["tokens_per_forward"] == 1
        assert item["text"] == item["modes"]["streaming"]["text"]


def test_equal_flag_matches_direct_generator_calls(generator, demo_data):
    stop_ids = generator.model.config.eos_token_ids
    for item in demo_data:
        [streaming] = generator.generate([item["prompt"]], SamplingParams(
            max_new_tokens=MAX_NEW, threshold=THRESHOLD, stop_token_ids=stop_ids))
        [one_per_step] = generator.generate([item["prompt"]], SamplingParams(
            max_new_tokens=MAX_NEW, threshold=None, stop_token_ids=stop_ids))
        assert item["modes"]["streaming"]["token_ids"] == streaming.token_ids
        assert item["modes"]["one-per-step"]["token_ids"] == one_per_step.token_ids
        expected = streaming.token_ids == one_per_step.token_ids
        assert item["streaming_equals_one_per_step"] is expected


def demo_args(*extra: str) -> list[str]:
    return ["demo", "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--window", "4", *extra]


def test_demo_command_prints_a_table_of_every_mode_and_progress_only_on_stderr(capsys):
    assert main(demo_args()) == 0
    out, err = capsys.readouterr()
    table_rows = [line for line in out.splitlines() if line.startswith("| ")]
    for name in MODE_NAMES:
        assert any(row.split("|")[1].strip() == name for row in table_rows), name
    assert "streaming == one token per step: " in out
    assert "[1/4]" in err and "[4/4]" in err and "ar" in err
    assert "[1/4]" not in out


def test_no_progress_leaves_stderr_empty(capsys):
    assert main(demo_args("--no-progress")) == 0
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal_rewrites_one_line():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(2, stream)
    progress("count: 1 2 3 ", "streaming")
    progress("count: 1 2 3 ", "ar")
    progress.clear()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") == 4
    assert "[1/2] count: 1 2 3 ... streaming" in text and "[2/2]" in text


def test_missing_model_directory_exits_1_naming_it(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["demo", "--model", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert str(missing) in err and out == ""


def test_json_option_writes_the_per_prompt_numbers(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(demo_args("--json", str(path), "--no-progress")) == 0
    report = json.loads(path.read_text())
    [item] = report["prompts"]
    assert item["prompt"] == PROMPTS[0]
    assert set(item["modes"]) == set(MODE_NAMES)
    for run in item["modes"].values():
        assert {"forwards", "tokens", "tokens_per_forward", "p_cache", "wall_ms"} <= set(run)
    assert report["settings"]["max_new_tokens"] == 8 and report["device"]["type"] == "cpu"
    streaming = item["modes"]["streaming"]
    assert f"{streaming['p_cache']:.3f}" in capsys.readouterr().out
