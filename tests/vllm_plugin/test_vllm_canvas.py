"""The rows each decode step feeds a request: the live canvas (the default: the W + p' rows
its window holds, sized from the previous step's output through live_canvas's patch) and
the fixed canvas (2W rows), each decoding as model_min does."""

import pytest
import vllm
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import live_canvas, row_stats
from wedlm_kernels.integrations.vllm._register import SCHEDULER
from wedlm_kernels.integrations.vllm.scheduler import WeDLMScheduler

from .conftest import WINDOW
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

# The workloads of test_vllm_decoding: greedy, seeded, block-wise, mixed settings.
WORKLOADS = {
    "greedy": [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4,
    "seeded": [SamplingParams(max_tokens=24, temperature=0.9, top_k=12, top_p=0.95,
                              seed=seed, ignore_eos=True) for seed in (11, 12, 13, 14)],
    "blockwise": [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                 extra_args={"wedlm_mode": "blockwise"})] * 4,
    "mixed": [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, extra_args=extra)
              for extra in ({"wedlm_mode": "blockwise", "wedlm_window": 4},
                            {"wedlm_window": 5, "wedlm_distance_penalty": 0.1},
                            {"wedlm_entropy_threshold": None},
                            {"wedlm_mode": "blockwise", "wedlm_entropy_threshold": 1.5})],
}


def rows_of(engine, params) -> tuple[int, int]:
    """(rows fed, live rows) of decoding PROMPTS with ``params``."""
    before = row_stats(engine)
    vllm_generate(engine, PROMPTS, params)
    after = row_stats(engine)
    return (after["rows_fed"] - before["rows_fed"], after["live_rows"] - before["live_rows"])


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_live_canvas_feeds_only_live_rows(engine, workload):
    # (the tokens of these workloads equal model_min's: test_vllm_decoding)
    fed, live = rows_of(engine, WORKLOADS[workload])
    assert 0 < live == fed, (workload, fed, live)


def test_a_synchronous_engine_runs_the_plugins_diffusion_scheduler(engine):
    # the plugin's scheduler_cls: vLLM's DiffusionScheduler with the structured-output
    # windows under synchronous scheduling (test_vllm_async.py has the asynchronous one)
    config = engine.llm_engine.vllm_config.scheduler_config
    assert not config.async_scheduling and config.scheduler_cls == SCHEDULER
    assert type(engine.llm_engine.engine_core.engine_core.scheduler) is WeDLMScheduler


def test_the_fixed_canvas_feeds_2w_rows_per_request_and_decodes_the_same(engines, reference):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    fixed = {"wedlm": {"window": WINDOW, "canvas": "fixed"}}
    with engines.own(additional_config=fixed) as engine:
        before = row_stats(engine)
        got = vllm_generate(engine, PROMPTS, params)
        after = row_stats(engine)
    fed = after["rows_fed"] - before["rows_fed"]
    live = after["live_rows"] - before["live_rows"]
    forwards = sum(f for _, f, _ in got)
    assert fed == 2 * WINDOW * forwards and live == sum(r for _, _, r in got) < fed
    assert got == reference_generate(reference, PROMPTS,
                                     model_min.SamplingParams(max_new_tokens=40))


def test_the_live_canvas_is_refused_on_another_vllm_release():
    with pytest.raises(live_canvas.LiveCanvasError, match=r'"canvas": "fixed"'):
        live_canvas.check_version("0.33.0")
    live_canvas.check_version(vllm.__version__)  # the release under test is patched
    live_canvas.check_version(vllm.__version__ + "+cu130")  # and a local build of it


def test_the_patch_refuses_a_method_it_was_not_written_for(monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    def take_draft_token_ids(self):
        return self.something_else()

    monkeypatch.setattr(GPUModelRunner, "take_draft_token_ids", take_draft_token_ids)
    with pytest.raises(live_canvas.LiveCanvasError, match="not the method"):
        live_canvas.install()


def test_an_unknown_canvas_setting_stops_the_engine_naming_it(engines):
    with pytest.raises(Exception, match=r'additional_config\["wedlm"\]\["canvas"\]'):
        with engines.own(additional_config={"wedlm": {"window": WINDOW, "canvas": "2w"}}):
            pass

