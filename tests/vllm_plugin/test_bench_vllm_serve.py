"""``bench/vllm_serve.py`` without a server: the commands its dry run prints, the Qwen3
checkpoint it writes, the /metrics counters it reads, the cases, ratios and Markdown it
makes of a run, and the check that fails when the fixed and live WeDLM runs decode
differently (a full server bench is too slow for the suite: ``make bench-vllm``)."""

import json
import shlex
import subprocess

import pytest

from bench import vllm_serve as vs
from bench.common import CPU_LABEL, NO_MATPLOTLIB
from tests.plot_checks import hide_matplotlib

from .conftest import TINY

W = 8


def dry_run(capsys, monkeypatch, *argv) -> tuple[list[list[str]], list[list[str]], str]:
    """The server and client command lines of ``--dry-run`` (as argv lists) and the whole
    output; starting a process or a client fails the test."""
    popen = subprocess.Popen

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started something")

    def query_only(argv, *args, **kwargs):  # the GPU's name for the results folder
        if argv[0] != "nvidia-smi":
            refuse()
        return popen(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", query_only)
    monkeypatch.setattr(vs, "run_client", refuse)
    assert vs.main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    servers = [shlex.split(line) for line in lines if line.startswith("env ")]
    clients = [shlex.split(line) for line in lines if " bench serve " in line]
    assert len(lines) == len(servers) + len(clients)
    return servers, clients, out


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def engine_args(argv: list[str]) -> list[str]:
    """A server's argv without its port and the WeDLM-only options."""
    drop = {"--port", "--hf-overrides", "--additional-config"}
    kept, skip = [], False
    for word in argv[argv.index("serve") + 1:]:
        if skip:
            skip = False
            continue
        if word in drop:
            skip = True
            continue
        kept.append(word)
    return kept


def test_the_dry_run_prints_three_servers_of_one_engine_setting_and_their_clients(
        capsys, monkeypatch):
    servers, clients, out = dry_run(capsys, monkeypatch, "--quick")
    assert len(servers) == 3 and len(clients) == 3 * (1 + 3)  # a warm-up and c = 1, 4, 16
    ar, fixed, live = servers
    for argv in servers:
        assert "TRITON_INTERPRET=1" in argv and "VLLM_USE_V2_MODEL_RUNNER=1" in argv
        assert argv[argv.index("python"):][1:4] == ["-m", "wedlm_kernels.integrations.vllm",
                                                    "serve"]
        assert option(argv, "--dtype") == "float32" and "--enforce-eager" in argv
    assert "--hf-overrides" not in ar and "--additional-config" not in ar
    for argv, canvas in ((fixed, "fixed"), (live, "live")):
        assert json.loads(option(argv, "--hf-overrides")) == {
            "architectures": ["WeDLMForCausalLM"]}
        assert json.loads(option(argv, "--additional-config")) == {
            "wedlm": {"window": W, "canvas": canvas}}
    assert engine_args(ar) == engine_args(fixed) == engine_args(live)
    assert option(ar, "--max-num-seqs") == "16" and option(ar, "--block-size") == "32"
    ports = [option(argv, "--port") for argv in servers]
    assert len(set(ports)) == 3
    measured = {}
    for index, port in enumerate(ports):
        mine = clients[4 * index: 4 * index + 4]
        assert all(option(c, "--base-url") == f"http://127.0.0.1:{port}" for c in mine)
        for client in mine:
            assert "--ignore-eos" in client and option(client, "--temperature") == "0"
            assert option(client, "--seed") == "0"
            assert option(client, "--dataset-name") == "random"
            assert option(client, "--random-range-ratio") == "0"
            assert option(client, "--model") == option(servers[index], "serve")
        measured[port] = [(option(c, "--max-concurrency"), option(c, "--num-prompts"),
                           option(c, "--random-output-len")) for c in mine[1:]]
    assert [m[0] for m in measured[ports[0]]] == ["1", "4", "16"]
    assert measured[ports[0]] == measured[ports[1]] == measured[ports[2]]
    assert "bench/results/cpu/vllm_serve.json" in out


def test_the_gpu_dry_run_takes_a_checkpoint_bf16_window_16_and_no_interpreter(
        capsys, monkeypatch, tmp_path):
    model = vs.write_checkpoint(tmp_path / "ckpt")
    servers, clients, out = dry_run(capsys, monkeypatch, "--device", "gpu", "--model",
                                    str(model), "--repeats", "2")
    assert len(servers) == 3 and len(clients) == 3 * (1 + 2 * 3)
    for argv in servers:
        assert option(argv, "serve") == str(model) and option(argv, "--dtype") == "bfloat16"
        assert "TRITON_INTERPRET=1" not in argv and "TRITON_INTERPRET" in argv  # env -u
        assert "--enforce-eager" not in argv and "--no-async-scheduling" in argv
    assert json.loads(option(servers[2], "--additional-config"))["wedlm"]["window"] == 16
    assert "bench/results/cpu" not in out
    with pytest.raises(SystemExit):
        vs.parse_args(["--device", "gpu"])  # no --model


def test_the_checkpoint_is_the_tiny_model_as_qwen3_with_its_mask_token(tmp_path):
    path = vs.write_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    shipped = json.loads((TINY / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["mask_token_id"] == shipped["mask_token_id"] == 257
    assert "training" not in config
    assert {k: v for k, v in config.items() if k not in ("model_type", "architectures")} == {
        k: v for k, v in shipped.items() if k not in ("model_type", "architectures", "training")}
    assert (path / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
    assert json.loads((path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    from vllm.tokenizers import get_tokenizer

    assert get_tokenizer(str(path)).encode("ab", add_special_tokens=False) == [97, 98]
    assert vs.ar_architecture(config) is None
    wedlm = {"model_type": "wedlm", "architectures": ["WeDLMForCausalLM"]}
    assert vs.ar_architecture({**wedlm, "qk_norm": True}) == "Qwen3ForCausalLM"
    assert vs.ar_architecture(wedlm) == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="not a Qwen3"):
        vs.ar_architecture({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_the_metrics_counters_are_summed_over_engines():
    text = "\n".join([
        "# HELP vllm:diffusion_num_denoising_steps_total Number of denoising steps.",
        "# TYPE vllm:diffusion_num_denoising_steps_total counter",
        'vllm:diffusion_num_denoising_steps_total{engine="0",model_name="m"} 12.0',
        'vllm:diffusion_num_denoising_steps_total{engine="1",model_name="m"} 3.0',
        'vllm:diffusion_num_denoising_steps_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:diffusion_num_canvas_positions_total{engine="0",model_name="m"} 150.0',
        'vllm:diffusion_num_committed_tokens_total{engine="0",model_name="m"} 20.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 21.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 0.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 99.0',
    ])
    assert vs.parse_metrics(text) == {"denoising_steps": 15.0, "canvas_positions": 150.0,
                                      "committed_tokens": 20.0, "generation_tokens": 21.0,
                                      "preemptions": 0.0}
    assert vs.parse_metrics("# nothing\n") == {}


# ------------------------------------------------------------- a synthetic run of 3 repeats

TOK_S = {"ar": (90.0, 100.0, 130.0), "wedlm-fixed": (150.0, 120.0, 155.0),
         "wedlm-live": (200.0, 260.0, 180.0)}  # medians 100, 150, 200


def synthetic_runs() -> list[dict]:
    runs = []
    for server in vs.SERVERS:
        for repeat in range(3):
            for c in (1, 4, 16):
                steps, committed = 50 * c, 80 * c
                rows = 2 * W * steps if server == "wedlm-fixed" else 500 * c
                counters = ({} if server == "ar" else {
                    "denoising_steps": steps, "committed_tokens": committed,
                    "canvas_positions": rows, "generation_tokens": committed,
                    "preemptions": 0})
                runs.append({
                    "server": server, "concurrency": c, "repeat": repeat,
                    "num_prompts": 2 * c, "wall_s": 1.0 + repeat,
                    "client": {"output_throughput": TOK_S[server][repeat] * c,
                               "median_ttft_ms": 10.0 * (repeat + 1),
                               "median_tpot_ms": 5.0 + repeat, "total_output_tokens": 64 * c,
                               "completed": 2 * c, "failed": 0},
                    "counters": counters, "texts_sha256": f"t{c}" if server != "ar" else "x",
                })
    return runs


def synthetic_report(runs: list[dict]) -> dict:
    cases = vs.build_cases(runs)
    return {
        "benchmark": "bench.vllm_serve", "date": "2026-12-01 00:00:00 UTC",
        "command": "python -m bench.vllm_serve", "quick": False, "complete": True,
        "plot": "vllm_serve.png", "label": CPU_LABEL,
        "device": {"type": "cpu", "name": "CPU (x86_64)", "label": CPU_LABEL},
        "machine": {"platform": "Linux", "cpu_count": 2, "note": vs.SHARED_NOTE},
        "versions": {"vllm": "0.32.0", "torch": "2.x", "triton": "3.x", "python": "3.11",
                     "transformers": "5.x"},
        "settings": {"model": "tiny", "dtype": "float32", "window": W, "max_model_len": 256,
                     "max_num_seqs": 16, "max_num_batched_tokens": 512, "block_size": 32,
                     "input_len": 32, "output_len": 64, "seed": 0, "enforce_eager": True},
        "cases": cases, "summary": vs.summarise(cases),
        "consistency": vs.check_consistency(runs, W),
        "servers": [{"name": s, "command": f"env python -m x serve {s}", "startup_s": 20.0}
                    for s in vs.SERVERS],
        "wall_seconds": 300.0,
    }


def test_the_cases_and_the_summary_take_medians_and_the_fixed_live_rows_from_the_live_run():
    runs = synthetic_runs()
    cases = vs.build_cases(runs)
    assert [(c["server"], c["concurrency"]) for c in cases] == [
        (s, c) for s in vs.SERVERS for c in (1, 4, 16)]
    fixed = vs.case_of(cases, "wedlm-fixed", 4)
    assert fixed["output_tok_per_s"] == 600.0 and fixed["repeats"] == 3
    assert fixed["median_ttft_ms"] == 20.0 and fixed["median_tpot_ms"] == 6.0
    assert fixed["rows_fed"] == 2 * W * 200 and fixed["live_rows"] == 2000
    assert fixed["rows_fed_over_live_rows"] == pytest.approx(3200 / 2000)
    assert fixed["tokens_per_forward"] == pytest.approx(320 / 200)
    assert fixed["rows_fed_per_token"] == pytest.approx(3200 / 320)
    live = vs.case_of(cases, "wedlm-live", 16)
    assert live["rows_fed"] == live["live_rows"] == 8000 and live["rows_fed_over_live_rows"] == 1
    ar = vs.case_of(cases, "ar", 1)
    assert ar["tokens_per_forward"] == 1.0 and ar["rows_fed_per_token"] == 1.0
    assert ar["rows_fed"] is None and ar["live_rows"] is None
    summary = vs.summarise(cases)
    assert summary["concurrency"] == [1, 4, 16]
    for c in ("1", "4", "16"):
        assert summary["wedlm_live_over_ar_output_tok_per_s"][c] == pytest.approx(2.0)
        assert summary["wedlm_live_over_fixed_output_tok_per_s"][c] == pytest.approx(4 / 3)
        assert summary["wedlm_fixed_over_ar_output_tok_per_s"][c] == pytest.approx(1.5)
        assert summary["rows_fed_over_live_rows"]["wedlm-fixed"][c] == pytest.approx(1.6)
        assert summary["rows_fed_over_live_rows"]["wedlm-live"][c] == 1.0
        assert summary["wedlm_tokens_per_forward"][c] == pytest.approx(1.6)
    assert summary["statistic"] == "median of 3 runs per point"


def test_the_markdown_shows_every_case_the_ratios_and_the_cpu_label(tmp_path):
    report = synthetic_report(synthetic_runs())
    path = tmp_path / "vllm_serve.md"
    vs.write_markdown(report, path)
    text = path.read_text()
    assert text.startswith("# WeDLM vs AR decoding on a vLLM server (CPU measurement)")
    assert CPU_LABEL in text and vs.SHARED_NOTE in text
    assert ("| wedlm-fixed | 4 | 8 | 600.0 | 480.0–620.0 | 20.0 | 6.00 | 1.60 | 3200 | 2000 "
            "| 1.60 |") in text
    assert ("| wedlm-live | 16 | 32 | 3200.0 | 2880.0–4160.0 | 20.0 | 6.00 | 1.60 | 8000 "
            "| 8000 | 1.00 |") in text
    assert ("| ar | 1 | 2 | 100.0 | 90.0–130.0 | 20.0 | 6.00 | 1 (by definition) "
            "| 1 / token (def.) | 1 / token (def.) | 1.00 |") in text
    assert "| 16 | 2.00× | 1.33× | 1.50× | 1.60 | 1.00 | 1.60 |" in text
    assert "median of 3 runs per point" in text
    assert "exactly 2W rows per denoising step at every point" in text
    assert "![vllm_serve.png (CPU measurement)](vllm_serve.png)" in text


def test_without_matplotlib_the_outputs_record_why_there_is_no_plot(tmp_path, monkeypatch):
    hide_matplotlib(monkeypatch)
    report = synthetic_report(synthetic_runs())
    vs.write_outputs(report, tmp_path)
    saved = json.loads((tmp_path / "vllm_serve.json").read_text())
    assert saved["plot"].startswith(NO_MATPLOTLIB) and "--replot" in saved["plot"]
    assert saved["summary"] == json.loads(json.dumps(report["summary"]))
    assert f"Plot: {saved['plot']}" in (tmp_path / "vllm_serve.md").read_text()
    assert not (tmp_path / "vllm_serve.png").exists()
    assert vs.replot(tmp_path / "vllm_serve.json") == NO_MATPLOTLIB
    assert json.loads((tmp_path / "vllm_serve.json").read_text()) == saved


def mismatch(runs: list[dict], what: str) -> list[dict]:
    """``runs`` with the fixed (or live) run of c=4, repeat 2 changed in ``what``."""
    runs = json.loads(json.dumps(runs))
    server = "wedlm-live" if what == "rows" else "wedlm-fixed"
    (run,) = [r for r in runs
              if (r["server"], r["concurrency"], r["repeat"]) == (server, 4, 1)]
    if what == "texts":
        run["texts_sha256"] = "other"
    elif what == "rows":  # the live server fed the fixed canvas
        run["counters"]["canvas_positions"] = 2 * W * run["counters"]["denoising_steps"]
    elif what == "preemptions":
        run["counters"]["preemptions"] = 1
    elif what == "missing":
        runs.remove(run)
    else:
        run["counters"][what] += 1
    return runs


@pytest.mark.parametrize("what, message", [
    ("committed_tokens", "committed_tokens differ"),
    ("denoising_steps", "denoising_steps differ"),
    ("texts", "generated texts differ"),
    ("rows", "live canvas was not in effect"),
    ("preemptions", "preempted"),
    ("missing", "a WeDLM run is missing"),
])
def test_the_live_rows_check_fails_loudly_when_the_two_wedlm_runs_differ(what, message):
    runs = synthetic_runs()
    checked = vs.check_consistency(runs, W)
    assert checked["ok"] and len(checked["points"]) == 9
    assert all(p["fixed_rows_per_step_is_2w"] and p["texts_equal"] for p in checked["points"])
    with pytest.raises(vs.ConsistencyError, match=message) as raised:
        vs.check_consistency(mismatch(runs, what), W)
    assert "c=4 repeat 2" in str(raised.value)


def test_the_data_parallel_bench_serves_one_engine_then_two_with_the_same_clients(
        capsys, monkeypatch):
    from bench import vllm_data_parallel as dp

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a server"))
    assert dp.main(["--dry-run", "--repeats", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line and not line.startswith("#")]
    servers = [shlex.split(line) for line in lines if line.startswith("env ")]
    clients = [shlex.split(line) for line in lines if " bench serve " in line]
    assert len(servers) == 2 and len(clients) == 2 * (1 + 2)  # a warm-up and two repeats
    one, two = servers
    assert "--data-parallel-size" not in one
    assert two[two.index("--data-parallel-size") + 1] == "2"
    # the same engine settings otherwise (ports aside), and the live canvas
    strip = {one[one.index("--port") + 1], two[two.index("--port") + 1], "2",
             "--data-parallel-size"}
    assert [w for w in one if w not in strip] == [w for w in two if w not in strip]
    assert json.loads(one[one.index("--additional-config") + 1])["wedlm"]["canvas"] == "live"


def test_the_data_parallel_summary_is_the_ratio_of_medians_labelled_cpu():
    from bench import vllm_data_parallel as dp

    runs = [{"server": name, "client": {"output_throughput": value}}
            for name, values in (("dp1", [10, 30, 20]), ("dp2", [35, 25, 45]))
            for value in values]
    summary = dp.summarise(runs)
    assert summary["dp1_output_tok_per_s"] == 20 and summary["dp2_output_tok_per_s"] == 35
    assert summary["dp2_over_dp1_output_tok_per_s"] == pytest.approx(1.75)
    assert summary["label"].startswith("CPU")
