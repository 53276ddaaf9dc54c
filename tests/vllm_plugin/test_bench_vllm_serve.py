"""``bench/vllm_serve.py`` without a server: the commands its dry run prints (four servers,
three workloads), the Qwen3 checkpoint and the prompt files it writes, the /metrics counters
it reads, the cases, ratios and Markdown it makes of a run, and the check that fails when the
fixed and live WeDLM runs decode differently (a full server bench is too slow for the suite:
``make bench-vllm``)."""

import json
import shlex
import subprocess

import pytest

from bench import vllm_serve as vs
from bench.common import CPU_LABEL, NO_MATPLOTLIB
from tests.plot_checks import hide_matplotlib

from .conftest import TINY

W = 16


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


def workload_of(client: list[str]) -> str:
    """The workload a client command sends, from its dataset."""
    if option(client, "--dataset-name") == "random":
        return "random"
    return option(client, "--dataset-path").removeprefix("$DATASETS/").removesuffix(".json")


def by_server(servers, clients) -> dict[str, list[list[str]]]:
    """Each server's client commands (warm-ups first), by the port they are sent to."""
    names = {option(argv, "--port"): name for argv, name in zip(servers, vs.SERVERS)}
    found: dict[str, list[list[str]]] = {name: [] for name in names.values()}
    for client in clients:
        found[names[option(client, "--base-url").rsplit(":", 1)[1]]].append(client)
    return found


def without_port(client: list[str]) -> list[str]:
    return [w for w in client if not w.startswith("http://")]


def test_the_dry_run_prints_four_servers_of_one_engine_setting_and_their_workloads(
        capsys, monkeypatch):
    servers, clients, out = dry_run(capsys, monkeypatch, "--quick")
    assert len(servers) == 4
    ar, fixed, live, adaptive = servers
    for argv in servers:
        assert "TRITON_INTERPRET=1" in argv and "VLLM_USE_V2_MODEL_RUNNER=1" in argv
        assert argv[argv.index("python"):][1:4] == ["-m", "wedlm_kernels.integrations.vllm",
                                                    "serve"]
        assert option(argv, "--dtype") == "float32" and "--enforce-eager" in argv
    assert "--hf-overrides" not in ar and "--additional-config" not in ar
    for argv, wedlm in ((fixed, {"window": W, "canvas": "fixed"}),
                        (live, {"window": W, "canvas": "live"}),
                        (adaptive, {"window": W, "canvas": "live",
                                    "window_policy": "adaptive"})):
        assert json.loads(option(argv, "--hf-overrides")) == {
            "architectures": ["WeDLMForCausalLM"]}
        assert json.loads(option(argv, "--additional-config")) == {"wedlm": wedlm}
    assert engine_args(ar) == engine_args(fixed) == engine_args(live) == engine_args(adaptive)
    assert option(ar, "--max-num-seqs") == "4" and option(ar, "--block-size") == "32"
    assert len({option(argv, "--port") for argv in servers}) == 4
    sent = by_server(servers, clients)
    # a warm-up per workload, then each workload at c = 1 and 4 (--quick)
    everything = [(w, c) for w in vs.WORKLOADS for c in ("1", "4")]
    for name, expected in (("ar", everything), ("wedlm-fixed", everything[:2]),
                           ("wedlm-live", everything), ("wedlm-adaptive", everything)):
        workloads = sorted({w for w, _ in expected}, key=vs.WORKLOADS.index)
        warmups, points = sent[name][:len(workloads)], sent[name][len(workloads):]
        assert [workload_of(c) for c in warmups] == workloads
        assert [(workload_of(c), option(c, "--max-concurrency")) for c in points] == expected
    # every server that runs a point gets the same client command but for its port
    for index, client in enumerate(sent["wedlm-live"]):
        assert without_port(client) == without_port(sent["ar"][index]) == without_port(
            sent["wedlm-adaptive"][index])
    for client in clients:
        assert "--ignore-eos" in client and option(client, "--seed") == "0"
        assert option(client, "--model") == option(servers[0], "serve")
        workload = workload_of(client)
        if workload == "random":
            assert option(client, "--random-range-ratio") == "0"
            assert option(client, "--temperature") == "0" and "--extra-body" not in client
            continue
        assert option(client, "--dataset-name") == "sharegpt"
        assert "--disable-shuffle" in client and "--no-oversample" in client
        if workload == "low_entropy":
            assert option(client, "--temperature") == "0" and "--extra-body" not in client
        else:
            assert option(client, "--temperature") == "1"
            assert json.loads(option(client, "--extra-body")) == {"seed": 0}
    assert [option(c, "--sharegpt-output-len") for c in sent["ar"][3:] if
            workload_of(c) != "random"] == ["32"] * 4
    assert "# DATASETS: a temporary directory" in out
    assert "bench/results/cpu/vllm_serve.json" in out


def test_a_subset_of_workloads_leaves_out_the_fixed_canvas_without_the_random_one(
        capsys, monkeypatch):
    servers, clients, _ = dry_run(capsys, monkeypatch, "--workloads", "low_entropy",
                                  "--concurrency", "2", "--repeats", "2")
    assert [json.loads(option(argv, "--additional-config"))["wedlm"].get("window_policy")
            for argv in servers[1:]] == [None, "adaptive"]
    assert len(servers) == 3 and "--additional-config" not in servers[0]
    assert len(clients) == 3 * (1 + 2)  # a warm-up and two repeats
    assert {workload_of(c) for c in clients} == {"low_entropy"}


def test_the_gpu_dry_run_takes_a_checkpoint_bf16_window_16_and_no_interpreter(
        capsys, monkeypatch, tmp_path):
    model = vs.write_checkpoint(tmp_path / "ckpt")
    servers, clients, out = dry_run(capsys, monkeypatch, "--device", "gpu", "--model",
                                    str(model), "--repeats", "2")
    # per server: a warm-up per workload, then 2 repeats x its workloads x 3 concurrencies
    assert len(servers) == 4 and len(clients) == 3 * (3 + 2 * 3 * 3) + (1 + 2 * 3)
    for argv in servers:
        assert option(argv, "serve") == str(model) and option(argv, "--dtype") == "bfloat16"
        assert "TRITON_INTERPRET=1" not in argv and "TRITON_INTERPRET" in argv  # env -u
        assert "--enforce-eager" not in argv and "--no-async-scheduling" in argv
    assert json.loads(option(servers[2], "--additional-config"))["wedlm"]["window"] == 16
    assert "bench/results/cpu" not in out
    with pytest.raises(SystemExit):
        vs.parse_args(["--device", "gpu"])  # no --model


def test_the_workload_prompts_are_seeded_pattern_items_and_random_words():
    items = {json.loads(line)["prompt"] for line in vs.PATTERN_ITEMS.read_text().splitlines()}
    assert len(items) == 112  # 120 items, some of the same prompt
    low = vs.workload_prompts("low_entropy", 130, seed=0)
    assert set(low[:112]) == items and low[112:] == low[:18]  # each once, then again
    assert low == vs.workload_prompts("low_entropy", 130, seed=0)
    assert low[:8] != vs.workload_prompts("low_entropy", 8, seed=1)
    from bench.window_policy import WORDS

    high = vs.workload_prompts("high_entropy", 32, seed=0)
    assert all(p.endswith(" ") and len(p.split()) == 6 and set(p.split()) <= set(WORDS)
               for p in high)
    assert high == vs.workload_prompts("high_entropy", 32, seed=0) and len(set(high)) == 32
    assert vs.workload_prompts("random", 32, seed=0) == ()
    with pytest.raises(ValueError, match="unknown workload"):
        vs.workload_prompts("medium_entropy", 4, seed=0)


def test_vllms_client_reads_a_workload_file_as_exactly_its_prompts_in_order(tmp_path):
    """The client's own dataset code (``vllm bench serve``'s get_samples) on the arguments
    of a point: the file's first prompts, as written, each with the point's output length."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = str(vs.write_checkpoint(tmp_path / "ckpt"))
    args = vs.parse_args(["--device", "cpu", "--workloads", "low_entropy", "high_entropy"])
    profile = vs.make_profile(args)
    workloads = vs.make_workloads(profile, str(tmp_path))
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    for workload in workloads:
        vs.write_dataset(workload)
        assert len(workload.prompts) == profile.most_prompts() == 32
        argv = vs.client_argv(18100, model, profile, 4, 8, profile.output_len, workload)
        samples = get_samples(parser.parse_args(argv), get_tokenizer(model))
        assert [s.prompt for s in samples] == list(workload.prompts[:8])
        assert {s.expected_output_len for s in samples} == {64}
        assert [s.prompt_len for s in samples] == [len(p) for p in workload.prompts[:8]]
    definition = workloads[1].definition(profile)
    assert definition["temperature"] == 1.0 and definition["sampling_seed"] == 0
    assert definition["prompt_list"] == list(workloads[1].prompts)
    assert definition["servers"] == ["ar", "wedlm-live", "wedlm-adaptive"]
    assert profile.longest_prompt == max([profile.input_len, *(len(p) for w in workloads
                                                                for p in w.prompts)])


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

MEDIAN_TOK_S = {  # (workload, server): the median of its repeats at c = 1
    ("random", "ar"): 100.0, ("random", "wedlm-fixed"): 150.0, ("random", "wedlm-live"): 200.0,
    ("random", "wedlm-adaptive"): 220.0,
    ("low_entropy", "ar"): 100.0, ("low_entropy", "wedlm-live"): 300.0,
    ("low_entropy", "wedlm-adaptive"): 285.0,
    ("high_entropy", "ar"): 100.0, ("high_entropy", "wedlm-live"): 80.0,
    ("high_entropy", "wedlm-adaptive"): 95.0,
}
SPREAD = (0.9, 1.0, 1.3)  # repeat r runs at SPREAD[r] x the median


def synthetic_runs(workloads=vs.WORKLOADS) -> list[dict]:
    """3 repeats of every (workload, server, c): the fixed canvas feeds 2W rows a step, the
    live one 500 rows per c, the adaptive window 400 rows in 60 steps per c (1.33 tokens per
    forward against the fixed window's 1.6)."""
    runs = []
    for workload in workloads:
        for server in vs.WORKLOAD_SERVERS[workload]:
            for repeat in range(3):
                for c in (1, 4, 16):
                    steps, committed = (60 if server == "wedlm-adaptive" else 50) * c, 80 * c
                    rows = {"wedlm-fixed": 2 * W * steps, "wedlm-live": 500 * c}.get(
                        server, 400 * c)
                    counters = ({} if server == "ar" else {
                        "denoising_steps": steps, "committed_tokens": committed,
                        "canvas_positions": rows, "generation_tokens": committed,
                        "preemptions": 0})
                    tok_s = MEDIAN_TOK_S[(workload, server)] * SPREAD[repeat] * c
                    runs.append({
                        "server": server, "workload": workload, "concurrency": c,
                        "repeat": repeat, "num_prompts": 2 * c, "wall_s": 1.0 + repeat,
                        "client": {"output_throughput": tok_s,
                                   "median_ttft_ms": 10.0 * (repeat + 1),
                                   "median_tpot_ms": 5.0 + repeat,
                                   "total_output_tokens": 64 * c, "completed": 2 * c,
                                   "failed": 0},
                        "counters": counters,
                        "texts_sha256": "x" if server == "ar" else f"{workload} t{c}",
                    })
    return runs


def synthetic_report(runs: list[dict], workloads=vs.WORKLOADS) -> dict:
    cases = vs.build_cases(runs)
    profile = vs.make_profile(vs.parse_args(["--device", "cpu", "--workloads", *workloads]))
    return {
        "benchmark": "bench.vllm_serve", "date": "2026-12-01 00:00:00 UTC",
        "command": "python -m bench.vllm_serve", "quick": False, "complete": True,
        "plot": "vllm_serve.png", "label": CPU_LABEL,
        "device": {"type": "cpu", "name": "CPU (x86_64)", "label": CPU_LABEL},
        "machine": {"platform": "Linux", "cpu_count": 2, "note": vs.SHARED_NOTE},
        "versions": {"vllm": "0.32.0", "torch": "2.x", "triton": "3.x", "python": "3.11",
                     "transformers": "5.x"},
        "settings": {"model": "tiny", "dtype": "float32", "window": W, "max_model_len": 256,
                     "max_num_seqs": 16, "max_num_batched_tokens": 568, "block_size": 32,
                     "input_len": 32, "output_len": 64, "seed": 0, "enforce_eager": True,
                     "workloads": list(workloads)},
        "workloads": {w.name: w.definition(profile)
                      for w in vs.make_workloads(profile, "/tmp/datasets")},
        "cases": cases, "summary": vs.summarise(cases),
        "consistency": vs.check_consistency(runs, W),
        "servers": [{"name": s, "command": f"env python -m x serve {s}", "startup_s": 20.0}
                    for s in vs.SERVERS],
        "wall_seconds": 300.0,
    }


def test_the_cases_take_medians_per_workload_and_the_fixed_live_rows_from_the_live_run():
    runs = synthetic_runs()
    cases = vs.build_cases(runs)
    assert [(c["workload"], c["server"], c["concurrency"]) for c in cases] == [
        (w, s, c) for w in vs.WORKLOADS for s in vs.WORKLOAD_SERVERS[w] for c in (1, 4, 16)]
    assert cases[0]["name"] == "ar random c=1"
    fixed = vs.case_of(cases, "wedlm-fixed", 4)
    assert fixed["output_tok_per_s"] == 600.0 and fixed["repeats"] == 3
    assert fixed["median_ttft_ms"] == 20.0 and fixed["median_tpot_ms"] == 6.0
    assert fixed["rows_fed"] == 2 * W * 200 and fixed["live_rows"] == 2000
    assert fixed["rows_fed_over_live_rows"] == pytest.approx(6400 / 2000)
    assert fixed["tokens_per_forward"] == pytest.approx(320 / 200)
    assert fixed["rows_fed_per_token"] == pytest.approx(6400 / 320)
    live = vs.case_of(cases, "wedlm-live", 16)
    assert live["rows_fed"] == live["live_rows"] == 8000 and live["rows_fed_over_live_rows"] == 1
    adaptive = vs.case_of(cases, "wedlm-adaptive", 4, "high_entropy")
    assert adaptive["output_tok_per_s"] == 380.0 and adaptive["workload"] == "high_entropy"
    assert adaptive["rows_fed"] == adaptive["live_rows"] == 1600  # its own: the live canvas
    assert adaptive["tokens_per_forward"] == pytest.approx(80 / 60)
    assert adaptive["rows_fed_per_token"] == pytest.approx(400 / 80)
    ar = vs.case_of(cases, "ar", 1, "low_entropy")
    assert ar["tokens_per_forward"] == 1.0 and ar["rows_fed_per_token"] == 1.0
    assert ar["rows_fed"] is None and ar["live_rows"] is None
    assert vs.case_of(cases, "wedlm-fixed", 1, "low_entropy") is None


def test_the_summary_keeps_the_random_ratios_and_adds_the_adaptive_ones_with_their_goals():
    summary = vs.summarise(vs.build_cases(synthetic_runs()))
    assert summary["concurrency"] == [1, 4, 16]
    assert summary["workloads"] == list(vs.WORKLOADS)
    for c in ("1", "4", "16"):  # the random workload, as before
        assert summary["wedlm_live_over_ar_output_tok_per_s"][c] == pytest.approx(2.0)
        assert summary["wedlm_live_over_fixed_output_tok_per_s"][c] == pytest.approx(4 / 3)
        assert summary["wedlm_fixed_over_ar_output_tok_per_s"][c] == pytest.approx(1.5)
        assert summary["rows_fed_over_live_rows"]["wedlm-fixed"][c] == pytest.approx(3.2)
        assert summary["rows_fed_over_live_rows"]["wedlm-live"][c] == 1.0
        assert summary["wedlm_tokens_per_forward"][c] == pytest.approx(1.6)
        over_ar = summary["adaptive_over_ar_output_tok_per_s"]
        assert [over_ar[w][c] for w in vs.WORKLOADS] == pytest.approx([2.2, 2.85, 0.95])
        over_fixed = summary["adaptive_over_fixed_window_output_tok_per_s"]
        assert [over_fixed[w][c] for w in vs.WORKLOADS] == pytest.approx([1.1, 0.95, 95 / 80])
        per_forward = summary["tokens_per_forward_by_workload"]["low_entropy"]
        assert per_forward["wedlm-live"][c] == pytest.approx(1.6)
        assert per_forward["wedlm-adaptive"][c] == pytest.approx(4 / 3)
        per_token = summary["rows_fed_per_token_by_workload"]["high_entropy"]
        assert per_token["wedlm-adaptive"][c] == pytest.approx(5.0)
    assert summary["adaptive_over_ar_min"] == pytest.approx(0.95)
    assert summary["adaptive_over_ar_max"] == pytest.approx(2.85)
    assert summary["adaptive_over_fixed_low_entropy_min"] == pytest.approx(0.95)
    assert summary["adaptive_over_fixed_high_entropy_min"] == pytest.approx(95 / 80)
    assert summary["goals"] == {
        "adaptive_over_ar_min": {"goal": ">= 1.0", "met": False},
        "adaptive_over_fixed_low_entropy_min": {"goal": ">= 0.95", "met": True}}
    assert summary["statistic"] == "median of 3 runs per point"


def test_without_the_entropy_workloads_the_adaptive_keys_are_empty_not_wrong():
    summary = vs.summarise(vs.build_cases(synthetic_runs(["random"])))
    assert summary["workloads"] == ["random"]
    assert summary["adaptive_over_ar_min"] == pytest.approx(2.2)
    assert summary["adaptive_over_fixed_low_entropy_min"] is None
    assert summary["adaptive_over_fixed_high_entropy_min"] is None
    assert summary["goals"]["adaptive_over_fixed_low_entropy_min"]["met"] is None


def test_the_markdown_shows_each_workload_its_cases_the_ratios_and_the_cpu_label(tmp_path):
    report = synthetic_report(synthetic_runs())
    path = tmp_path / "vllm_serve.md"
    vs.write_markdown(report, path)
    text = path.read_text()
    assert text.startswith("# WeDLM vs AR decoding on a vLLM server (CPU measurement)")
    assert CPU_LABEL in text and vs.SHARED_NOTE in text
    sections = text.split("\n## ")
    titles = [section.splitlines()[0] for section in sections[1:]]
    assert titles == ["Workload `random`", "Workload `low_entropy`", "Workload `high_entropy`",
                      "Summary", "Checks", "Servers"]
    random, low, high = sections[1:4]
    assert ("| wedlm-fixed | 4 | 8 | 600.0 | 540.0–780.0 | 20.0 | 6.00 | 1.60 | 6400 | 2000 "
            "| 3.20 |") in random
    assert ("| wedlm-live | 16 | 32 | 3200.0 | 2880.0–4160.0 | 20.0 | 6.00 | 1.60 | 8000 "
            "| 8000 | 1.00 |") in random
    assert ("| ar | 1 | 2 | 100.0 | 90.0–130.0 | 20.0 | 6.00 | 1 (by definition) "
            "| 1 / token (def.) | 1 / token (def.) | 1.00 |") in low
    assert ("| wedlm-adaptive | 4 | 8 | 380.0 | 342.0–494.0 | 20.0 | 6.00 | 1.33 | 1600 "
            "| 1600 | 1.00 |") in high
    assert "wedlm-fixed" not in low and "wedlm-fixed" not in high
    assert "Prompts: the client's random dataset" in random and ", 32 tokens each" in random
    assert "Prompts: the pattern task's distinct prompts" in low and "temperature 0;" in low
    assert "temperature 1 with request seed 0" in high
    summary = sections[4]
    assert "| 16 | 2.00× | 1.33× | 1.50× | 3.20 | 1.00 | 1.60 |" in summary
    assert "`adaptive_over_ar_min` 0.95× (goal >= 1.0: not met)" in summary
    assert "`adaptive_over_fixed_low_entropy_min` 0.95× (goal >= 0.95: met)" in summary
    assert "| low_entropy | 4 | 2.85× | 0.95× | 1.60 | 1.33 | 6.25 | 5.00 |" in summary
    assert "median of 3 runs per point" in text
    assert "At all 9 points of the random workload" in text
    assert "exactly 2W rows per denoising step at every point" in text
    assert "![vllm_serve.png (CPU measurement)](vllm_serve.png)" in text


def test_a_result_from_before_the_workloads_renders_as_its_random_workload(tmp_path):
    """The committed results of three servers and one workload (no ``workload`` in its
    runs and cases, no ``workloads`` entry, the summary's random keys only) still render."""
    runs = [{k: v for k, v in run.items() if k != "workload"}
            for run in synthetic_runs(["random"]) if run["server"] != "wedlm-adaptive"]
    report = synthetic_report(runs, ["random"])
    del report["workloads"]
    for case in report["cases"]:
        del case["workload"]
    keep = ("concurrency", "wedlm_live_over_ar_output_tok_per_s",
            "wedlm_live_over_fixed_output_tok_per_s", "wedlm_fixed_over_ar_output_tok_per_s",
            "rows_fed_over_live_rows", "wedlm_tokens_per_forward", "ar_tokens_per_forward",
            "statistic")
    report["summary"] = {k: v for k, v in report["summary"].items() if k in keep}
    path = tmp_path / "vllm_serve.md"
    vs.write_markdown(report, path)
    text = path.read_text()
    assert text.count("## Workload ") == 1 and "## Workload `random`" in text
    assert "Prompts: the client's random dataset (random token ids, input_len of them), 32 " in text
    assert "| 16 | 2.00× | 1.33× | 1.50× | 3.20 | 1.00 | 1.60 |" in text
    assert "adaptive" not in text.split("## Summary")[1].split("## Checks")[0]
    assert vs.case_of(report["cases"], "wedlm-live", 4)["output_tok_per_s"] == 800.0


def test_without_the_random_workload_there_is_no_canvas_check_to_fail(tmp_path):
    runs = synthetic_runs(["low_entropy", "high_entropy"])
    assert vs.check_consistency(runs, W) == {"ok": True, "points": []}
    report = synthetic_report(runs, ["low_entropy", "high_entropy"])
    vs.write_markdown(report, tmp_path / "vllm_serve.md")
    text = (tmp_path / "vllm_serve.md").read_text()
    assert "None: the random workload, the one the fixed canvas runs" in text
    assert "## Workload `random`" not in text and "Workload `random`:" not in text


def test_without_matplotlib_the_outputs_record_why_there_is_no_plot(tmp_path, monkeypatch):
    hide_matplotlib(monkeypatch)
    report = synthetic_report(synthetic_runs())
    vs.write_outputs(report, tmp_path)
    saved = json.loads((tmp_path / "vllm_serve.json").read_text())
    assert saved["plot"].startswith(NO_MATPLOTLIB) and "--replot" in saved["plot"]
    assert saved["summary"] == json.loads(json.dumps(report["summary"]))
    assert saved["workloads"]["low_entropy"]["prompt_list"][:1] == [
        vs.workload_prompts("low_entropy", 1, seed=0)[0]]
    assert f"Plot: {saved['plot']}" in (tmp_path / "vllm_serve.md").read_text()
    assert not (tmp_path / "vllm_serve.png").exists()
    assert vs.replot(tmp_path / "vllm_serve.json") == NO_MATPLOTLIB
    assert json.loads((tmp_path / "vllm_serve.json").read_text()) == saved


def mismatch(runs: list[dict], what: str) -> list[dict]:
    """``runs`` with the fixed (or live) run of the random workload at c=4, repeat 2
    changed in ``what``."""
    runs = json.loads(json.dumps(runs))
    server = "wedlm-live" if what == "rows" else "wedlm-fixed"
    (run,) = [r for r in runs if (r["workload"], r["server"], r["concurrency"], r["repeat"])
              == ("random", server, 4, 1)]
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


def test_the_live_rows_check_reads_the_random_workload_only():
    """The other workloads have no fixed-canvas run to compare with: a live run of theirs
    that decodes differently is no mismatch."""
    runs = synthetic_runs()
    for run in runs:
        if run["workload"] != "random" and run["server"] == "wedlm-live":
            run["texts_sha256"], run["counters"]["denoising_steps"] = "other", 1
    assert len(vs.check_consistency(runs, W)["points"]) == 9


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
