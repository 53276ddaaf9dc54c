"""`python -m model_min` on tiny checkpoints: once as a subprocess from the checkout, the
other cases in-process through ``model_min.__main__.main`` (same code, no interpreter start)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny_models import VOCAB_SIZE, build_tiny_model, save_checkpoint
from model_min import Generator, SamplingParams, load_model
from model_min.__main__ import main

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"tokens=(\d+) forwards=(\d+) tok/fwd=([\d.]+) p_cache=([\d.]+) tok/s=([\d.]+) "
    r"finish=(stop|length)"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # ids 296..299


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "model_min", *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120,
    )


def write_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json over the tiny vocabulary: "t0".."t295" and the Qwen
    special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"t{i}" for i in range(VOCAB_SIZE - len(SPECIAL))] + SPECIAL
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(build_tiny_model("qwen2"), tmp_path_factory.mktemp("cli"))


def test_generate_with_prompt_ids_prints_tokens_and_summary(checkpoint):
    args = ["--window", "4", "--threshold", "2.8", "--max-new-tokens", "12", "--seed", "5"]
    completed = run_cli("generate", "--model", str(checkpoint), "--prompt-ids", "3,1,4,1,5",
                        "--device", "cpu", *args)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.strip().splitlines()
    summary = SUMMARY.search(lines[-1])
    assert summary, completed.stdout
    [expected] = Generator(load_model(checkpoint), window=4).generate(
        [[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=12, threshold=2.8, seed=5))
    assert [int(t) for t in " ".join(lines[:-1]).split()] == expected.token_ids
    tokens, forwards = int(summary.group(1)), int(summary.group(2))
    assert (tokens, forwards) == (len(expected.token_ids), expected.forwards)
    assert float(summary.group(4)) == pytest.approx(expected.p_cache, abs=1e-3)


def test_generate_with_text_prompt_chat_template_and_tokenizer(checkpoint, tmp_path, capsys):
    directory = tmp_path / "with_tokenizer"
    directory.mkdir()
    for file in checkpoint.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    write_word_tokenizer(directory)
    status = main(["generate", "--model", str(directory), "--prompt", "t5 t7 t9", "--chat",
                   "--mode", "ar", "--max-new-tokens", "6", "--device", "cpu"])
    assert status == 0
    *text_lines, summary_line = capsys.readouterr().out.strip().splitlines()
    summary = SUMMARY.search(summary_line)
    assert summary and summary.group(2) == summary.group(1)  # AR: one token per forward
    words = " ".join(text_lines).split()
    assert words and all(re.fullmatch(r"t\d+", w) for w in words)


def test_generate_json_records_the_run_and_prompt_ids_need_no_tokenizers_package(
        checkpoint, tmp_path, capsys, monkeypatch):
    """With tokenizer.json present but the tokenizers package missing, --prompt-ids still
    decodes (ids in, ids out); --json writes what was printed, with the run's settings."""
    directory = tmp_path / "with_tokenizer"
    directory.mkdir()
    for file in checkpoint.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    write_word_tokenizer(directory)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    out = tmp_path / "run.json"
    argv = ["generate", "--model", str(directory), "--prompt-ids", "3,1,4", "--window", "4",
            "--max-new-tokens", "7", "--seed", "2", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    *token_lines, summary_line = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out.read_text())
    assert report["token_ids"] == [int(t) for t in " ".join(token_lines).split()]
    assert report["prompt_ids"] == [3, 1, 4] and report["text"] is None
    assert f"forwards={report['forwards']}" in summary_line
    assert report["settings"]["window"] == 4 and report["settings"]["seed"] == 2
    assert report["command"] == "python -m model_min " + " ".join(argv)
    assert report["device"]["type"] == "cpu" and report["versions"]["torch"]
    # a text prompt does need the package
    assert main(["generate", "--model", str(directory), "--prompt", "t5", "--device", "cpu"]) == 1
    assert "tokenizers" in capsys.readouterr().err


def test_missing_mask_token_id_is_a_clear_cli_error(checkpoint, tmp_path, capsys):
    directory = tmp_path / "no_mask"
    directory.mkdir()
    for file in checkpoint.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    del config["mask_token_id"]
    (directory / "config.json").write_text(json.dumps(config))
    arguments = ["generate", "--model", str(directory), "--prompt-ids", "1,2", "--device", "cpu",
                 "--max-new-tokens", "3"]
    assert main(arguments) == 1
    assert "--mask-token-id" in capsys.readouterr().err
    assert main([*arguments, "--mask-token-id", "299"]) == 0
    assert SUMMARY.search(capsys.readouterr().out)
