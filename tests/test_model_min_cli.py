"""`python -m model_min` on tiny checkpoints: once as a subprocess from the checkout, the
other cases in-process through ``model_min.__main__.main`` (same code, no interpreter start)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tiny_models import VOCAB_SIZE, build_tiny_model, save_checkpoint
from model_min import Generator, SamplingParams, load_model
from model_min.__main__ import main
from model_min.demo import DEMO_MODEL_DIR

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


def test_generate_with_the_adaptive_window_decodes_as_the_generator_does(checkpoint):
    args = ["--window", "8", "--window-policy", "adaptive", "--temperature", "1",
            "--max-new-tokens", "16", "--seed", "9"]
    completed = run_cli("generate", "--model", str(checkpoint), "--prompt-ids", "3,1,4",
                        "--prompt-ids", "2,7", "--device", "cpu", "--no-progress", *args)
    assert completed.returncode == 0, completed.stderr
    expected = Generator(load_model(checkpoint), window=8, max_batch=2,
                         window_policy="adaptive").generate(
        [[3, 1, 4], [2, 7]], SamplingParams(max_new_tokens=16, temperature=1.0, seed=9))
    for result in expected:
        assert " ".join(map(str, result.token_ids)) in completed.stdout


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


# ------------------------------------------------------------------ what a user looks for


def _run(capsys, *argv):
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generate_help_explains_every_option_with_its_default(capsys):
    status, out, _ = _run(capsys, "generate", "--help")
    assert status == 0
    for option, default in [("--window", "16"), ("--window-policy", "fixed"),
                            ("--threshold", "0.4"), ("--penalty", "0.02"),
                            ("--max-new-tokens", "128"), ("--poll-every", "1")]:
        assert option in out
        help_entry = out.split(f"\n  {option} ", 1)[1].split("\n  --")[0]  # its help lines
        assert f"(default: {default})" in help_entry, option
    assert "tiny_wedlm" in out  # the default --model


def test_version_names_the_library_and_torch(capsys):
    import wedlm_kernels

    status, out, _ = _run(capsys, "--version")
    assert status == 0 and wedlm_kernels.__version__ in out and torch.__version__ in out


def test_default_model_is_the_shipped_demo_model(capsys):
    status, out, _ = _run(capsys, "generate", "--prompt", "count: 7 ", "--max-new-tokens", "8",
                          "--no-progress")
    assert status == 0, out
    assert out.startswith("8 9 10"), out


def test_several_prompts_in_one_call_each_get_their_text_and_summary(capsys):
    status, out, _ = _run(capsys, "generate", "--prompt", "count: 3 ", "--prompt",
                          "letters: c ", "--max-new-tokens", "10", "--seed", "1")
    assert status == 0, out
    lines = out.strip().splitlines()
    assert lines[0].startswith("[0] 4 5 6") and lines[2].startswith("[1] d e f"), out
    assert SUMMARY.search(lines[1]) and SUMMARY.search(lines[3])
    status, out, _ = _run(capsys, "generate", "--prompt-ids", "40,41", "--prompt-ids", "50",
                          "--max-new-tokens", "3")
    assert status == 0 and out.startswith("[0] ") and "\n[1] " in out


def test_committed_tokens_are_printed_after_every_step(capsys, monkeypatch):
    """--poll-every 1 (the default) hands the commits of every step to the printer; with
    --poll-every 4 they come in bursts of four steps."""
    from model_min import generator as generator_module

    original = generator_module.Generator.generate

    def prints_with(*options):
        calls = []

        def counting(self, prompts, params=None, mode="streaming", on_tokens=None):
            def record(index, tokens):
                calls.append(len(tokens))
                on_tokens(index, tokens)
            return original(self, prompts, params, mode, record)

        monkeypatch.setattr(generator_module.Generator, "generate", counting)
        status, out, _ = _run(capsys, "generate", "--prompt", "months: january, ",
                              "--threshold", "none", "--max-new-tokens", "12", *options)
        assert status == 0, out
        assert sum(calls) == 12
        return len(calls)

    assert prints_with() >= 11  # one token per step: a print per step
    assert prints_with("--poll-every", "4") <= 4


def test_a_long_prefill_prints_a_progress_line_on_stderr(capsys):
    prompt = ",".join(["40"] * 300)
    status, _, err = _run(capsys, "generate", "--prompt-ids", prompt, "--max-new-tokens", "2",
                          "--window", "4")
    assert status == 0
    assert "prefill: 300 prompt tokens" in err and "prefill: done" in err
    status, _, err = _run(capsys, "generate", "--prompt-ids", prompt, "--max-new-tokens", "2",
                          "--window", "4", "--no-progress")
    assert "prefill" not in err


# ------------------------------------------------------------- bad input at the CLI


@pytest.mark.parametrize("argv, option", [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--window", "0"], "--window"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--prompt-ids", "1,two"], "--prompt-ids"),
    (["--threshold", "low"], "--threshold"),
])
def test_cli_usage_errors_exit_2_naming_the_option(capsys, argv, option):
    base = ["generate"] + ([] if "--prompt-ids" in argv else ["--prompt-ids", "4,5"])
    status, _, err = _run(capsys, *base, *argv)
    assert status == 2 and f"argument {option}" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cli_cuda_without_cuda_is_a_usage_error(capsys):
    status, _, err = _run(capsys, "generate", "--prompt-ids", "4,5", "--device", "cuda")
    assert status == 2 and "argument --device: 'cuda': no CUDA device" in err


def test_cli_errors_in_the_checkpoint_exit_1_with_the_file_and_key(capsys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": None}))
    status, _, err = _run(capsys, "generate", "--model", str(model), "--prompt-ids", "4,5")
    assert status == 1 and "config.json" in err and "num_attention_heads" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_stop_id_outside_the_vocabulary_exits_1(capsys):
    status, _, err = _run(capsys, "generate", "--prompt-ids", "4,5", "--stop-ids", "9999")
    assert status == 1 and "stop_token_ids has token ids outside the vocabulary [0, 264): [9999]" in err
