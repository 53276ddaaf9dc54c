"""``bench/vllm_serve.py --replot``: the plot of a result JSON, drawn where matplotlib is
(the bench runs in .venv-vllm, which has none; its other tests are in
tests/vllm_plugin/test_bench_vllm_serve.py)."""

import json

from bench import vllm_serve as vs
from tests.plot_checks import assert_png, needs_matplotlib


def tiny_report() -> dict:
    runs = []
    for server in vs.SERVERS:
        for c in (1, 4):
            counters = {} if server == "ar" else {
                "denoising_steps": 10 * c, "committed_tokens": 16 * c,
                "canvas_positions": (160 if server == "wedlm-fixed" else 100) * c}
            runs.append({"server": server, "concurrency": c, "repeat": 0, "num_prompts": c,
                         "wall_s": 1.0, "counters": counters, "texts_sha256": "t",
                         "client": {"output_throughput": 10.0 * c, "median_ttft_ms": 5.0,
                                    "median_tpot_ms": 2.0}})
    cases = vs.build_cases(runs)
    return {"date": "2026-12-01 00:00:00 UTC", "command": "python -m bench.vllm_serve",
            "device": {"type": "cpu"}, "machine": {}, "versions": {}, "plot": "no plot yet",
            "settings": {"model": "tiny", "dtype": "float32", "window": 8,
                         "max_model_len": 256, "max_num_seqs": 4,
                         "max_num_batched_tokens": 512, "block_size": 32, "input_len": 32,
                         "output_len": 16, "seed": 0},
            "cases": cases, "summary": vs.summarise(cases),
            "consistency": vs.check_consistency(runs, 8)}


@needs_matplotlib
def test_replot_draws_the_json_and_records_the_plot(tmp_path):
    path = tmp_path / "vllm_serve.json"
    path.write_text(json.dumps(tiny_report()))
    assert not vs.has_plot(path)
    assert vs.replot(path) == tmp_path / "vllm_serve.png"
    assert_png(tmp_path / "vllm_serve.png", size=(1430, 440))
    assert json.loads(path.read_text())["plot"] == "vllm_serve.png" and vs.has_plot(path)
    assert "![vllm_serve.png (CPU measurement)](vllm_serve.png)" in (
        tmp_path / "vllm_serve.md").read_text()
