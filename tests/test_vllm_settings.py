"""WeDLM's vLLM settings and request check (wedlm_kernels.integrations.vllm.settings):
pure Python, so tested here too, without vLLM; the engine tests (tests/vllm_plugin) run
them against a real engine. And the integration stays a room above the ops: it imports
only the public API, and ``import wedlm_kernels`` does not import it or vLLM."""

import ast
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from wedlm_kernels.integrations.vllm.settings import (
    SettingsError,
    WeDLMSettings,
    check_request,
    checkpoint_eos_ids,
    engine_settings,
    request_settings,
    request_values,
    stop_ids_of,
    unsupported_parameters,
)
from wedlm_kernels.requests.params import MAX_STOP_TOKEN_IDS

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ROOT / "wedlm_kernels" / "integrations"
# the package's public submodules besides its top level
# the public rooms above the ops: request semantics and checkpoint reading (the ops
# themselves are reached through `wedlm_kernels`)
PUBLIC_MODULES = ("wedlm_kernels.requests", "wedlm_kernels.checkpoints")


def test_engine_defaults_are_the_reference_engines():
    settings = engine_settings({})
    assert settings == WeDLMSettings(window=16, entropy_threshold=0.4, distance_penalty=0.02,
                                     mode="streaming", canvas="live")
    assert settings.canvas_length == 32
    assert engine_settings(None) == settings


def test_engine_settings_come_from_additional_config():
    settings = engine_settings({"wedlm": {"window": 4, "entropy_threshold": None,
                                          "distance_penalty": 0, "mode": "blockwise",
                                          "canvas": "fixed"},
                                "other_plugin": {"x": 1}})
    assert settings.canvas == "fixed"
    assert (settings.window, settings.entropy_threshold, settings.mode) == (4, -math.inf,
                                                                           "blockwise")
    assert settings.canvas_length == 8
    assert isinstance(settings.distance_penalty, float)


@pytest.mark.parametrize("section, named", [
    ({"window": 0}, '["window"]'), ({"window": 2.0}, '["window"]'),
    ({"window": True}, '["window"]'), ({"entropy_threshold": float("nan")},
                                       '["entropy_threshold"]'),
    ({"entropy_threshold": "0.4"}, '["entropy_threshold"]'),
    ({"distance_penalty": float("inf")}, '["distance_penalty"]'),
    ({"distance_penalty": -0.1}, '["distance_penalty"]'), ({"window": 4097}, '["window"]'),
    ({"mode": "ar"}, '["mode"]'), ({"windw": 8}, "unknown keys ['windw']"),
    ({"canvas": "2w"}, '["canvas"]'), ({"canvas": True}, '["canvas"]'),
])
def test_bad_engine_settings_are_named(section, named):
    with pytest.raises(SettingsError, match=named.replace("[", r"\[").replace("]", r"\]")):
        engine_settings({"wedlm": section})


def test_the_wedlm_entry_must_be_an_object():
    with pytest.raises(SettingsError, match="must be an object"):
        engine_settings({"wedlm": [16]})


def test_request_settings_override_the_engines_within_its_window():
    engine = engine_settings({"wedlm": {"window": 8}})
    assert request_settings(engine, None) == engine
    settings = request_settings(engine, {"wedlm_window": 3, "wedlm_mode": "blockwise",
                                         "wedlm_entropy_threshold": 1,
                                         "wedlm_distance_penalty": 0.5, "unrelated": 1})
    assert settings == WeDLMSettings(3, 1.0, 0.5, "blockwise")
    assert request_settings(engine, {"wedlm_entropy_threshold": 0}).entropy_threshold == (
        -math.inf)  # one token per step, the form HTTP can send
    for bad in (9, 0, -1, "4", True, 2.0):
        with pytest.raises(SettingsError, match=r"extra_args\['wedlm_window'\]") as error:
            request_settings(engine, {"wedlm_window": bad})
        assert error.value.parameter == "extra_args['wedlm_window']"


def params(**fields):
    defaults = dict(n=1, logprobs=None, prompt_logprobs=None, presence_penalty=0.0,
                    frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0, min_tokens=0,
                    logit_bias=None, bad_words=None, allowed_token_ids=None,
                    structured_outputs=None, extra_args=None, logprob_token_ids=None,
                    eos_token_id=None, stop_token_ids=[])
    return SimpleNamespace(**{**defaults, **fields})


def sampling(**fields):
    """A vLLM SamplingParams as the request check sees it (after vLLM's own __post_init__)."""
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, seed=None, max_tokens=16,
                    stop_token_ids=[], extra_args=None)
    return SimpleNamespace(**{**defaults, **fields})


def test_request_values_are_what_the_device_stores():
    engine = engine_settings({"wedlm": {"window": 8}})
    values = request_values(engine, sampling(temperature=0.5, top_k=2**40, top_p=0.9, seed=-5,
                                             extra_args={"wedlm_entropy_threshold": 1e300}))
    assert (values.temperature, values.top_k, values.top_p, values.seed) == (0.5, 0, 0.9, -5)
    assert values.settings.entropy_threshold == math.inf and values.max_tokens == 16


@pytest.mark.parametrize("fields, name", [
    (dict(extra_args={"wedlm_distance_penalty": 1e300}), "extra_args['wedlm_distance_penalty']"),
    (dict(extra_args={"wedlm_distance_penalty": -1.0}), "extra_args['wedlm_distance_penalty']"),
    (dict(extra_args={"wedlm_window": True}), "extra_args['wedlm_window']"),
    (dict(seed=2**63), "seed"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(temperature=True), "temperature"), (dict(stop_token_ids=[264]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
])
def test_the_request_check_names_a_value_the_device_cannot_hold(fields, name):
    engine = engine_settings({"wedlm": {"window": 8}})
    with pytest.raises(SettingsError) as error:
        check_request(engine, sampling(**fields), vocab_size=264, max_model_len=256,
                      eos_ids=(256,))
    assert error.value.parameter == name


def test_the_checkpoints_eos_ids_are_not_counted_among_the_stop_ids():
    engine = engine_settings({})
    ids = [256, *range(MAX_STOP_TOKEN_IDS)]
    check_request(engine, sampling(stop_token_ids=ids), 264, 256, eos_ids=(256,))
    with pytest.raises(SettingsError, match="at most 24"):
        check_request(engine, sampling(stop_token_ids=ids), 264, 256, eos_ids=())
    with pytest.raises(SettingsError, match="max_tokens"):
        check_request(engine, sampling(max_tokens=2**31 - 256), 264, 256)
    assert checkpoint_eos_ids(256, [7, 256]) == (256, 7)
    assert checkpoint_eos_ids(None, None) == ()
    with pytest.raises(ValueError, match="eos_token_id"):
        checkpoint_eos_ids([2**63], None)


def test_supported_parameters_pass_the_check():
    assert unsupported_parameters(params()) == []
    assert unsupported_parameters(params(extra_args={"wedlm_mode": "blockwise",
                                                     "user_tag": 3})) == []


def test_the_logit_rules_and_n_are_served():
    served = dict(n=2, presence_penalty=0.1, frequency_penalty=-0.1, repetition_penalty=1.1,
                  min_p=0.05, min_tokens=1, logit_bias={1: 1.0}, allowed_token_ids=[1],
                  logprobs=5)
    for field, value in served.items():
        assert unsupported_parameters(params(**{field: value})) == [], field


@pytest.mark.parametrize("fields, name", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=17), "min_tokens"), (dict(logit_bias={264: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[264]), "allowed_token_ids"), (dict(n=0), "n"),
    # vLLM seeds child i of n with seed + i: the last one must be an int64 too
    (dict(n=3, seed=2**63 - 2), "seed"),
    # ... and none of them -1, which vLLM reads as no seed
    (dict(n=3, seed=-3), "seed"), (dict(n=2, seed=-2), "seed"),
    # at most 64 alternatives (and the vocabulary); -1 is the whole vocabulary of 264
    (dict(logprobs=65), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=-2), "logprobs"), (dict(logprobs=False), "logprobs"),
    # at most 128 named ids, in the vocabulary, as many as logprobs when both are set
    (dict(logprob_token_ids=list(range(129))), "logprob_token_ids"),
    (dict(logprob_token_ids=[264]), "logprob_token_ids"),
    (dict(logprob_token_ids=[3, True]), "logprob_token_ids"),
    (dict(logprobs=2, logprob_token_ids=[1, 2, 3]), "logprob_token_ids"),
])
def test_the_request_check_names_a_bad_rule_value(fields, name):
    engine = engine_settings({"wedlm": {"window": 8}})
    with pytest.raises(SettingsError) as error:
        check_request(engine, sampling(**params(**fields).__dict__ | {
            "temperature": 1.0, "seed": fields.get("seed"), "max_tokens": 16,
            "top_k": 0, "top_p": 1.0}), vocab_size=264, max_model_len=256)
    assert error.value.parameter == name
    for seed in (2**63 - 3, -4, -1, 0):  # the edges that leave every child a seed of its own
        check_request(engine, sampling(**params(n=3, seed=seed).__dict__ | {
            "temperature": 1.0, "seed": seed, "max_tokens": 16, "top_k": 0, "top_p": 1.0}),
            vocab_size=264, max_model_len=256)


@pytest.mark.parametrize("fields, name", [
    (dict(prompt_logprobs=0), "prompt_logprobs"),
    (dict(bad_words=["x"], structured_outputs=object()), "bad_words"),
    (dict(extra_args={"diffusion_max_steps": 4}), "extra_args['diffusion_max_steps']"),
    (dict(extra_args={"wedlm_threshold": 1}), "extra_args['wedlm_threshold']"),
    # the canvas is the engine's: a request cannot choose its rows
    (dict(extra_args={"wedlm_canvas": "fixed"}), "extra_args['wedlm_canvas']"),
])
def test_each_unsupported_parameter_is_named(fields, name):
    assert [found for found, _ in unsupported_parameters(params(**fields))] == [name]


def test_structured_outputs_are_served_not_refused():
    # (the engine may still refuse them, naming why: tests/vllm_plugin/test_vllm_structured.py)
    assert unsupported_parameters(params(structured_outputs=object())) == []


def test_stop_ids_are_eos_then_stop_token_ids_without_repeats():
    assert stop_ids_of(params(eos_token_id=7, stop_token_ids=[3, 7, 9])) == [7, 3, 9]
    assert stop_ids_of(params(eos_token_id=None, stop_token_ids=[5])) == [5]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_the_integration_uses_only_the_public_api():
    files = sorted(INTEGRATIONS.rglob("*.py"))
    assert files
    for path in files:
        private = {name for name in _imports(path)
                   if name.startswith("wedlm_kernels.") and not name.startswith(
                       ("wedlm_kernels.integrations", *PUBLIC_MODULES))}
        assert not private, (path, private)


def test_importing_the_package_imports_no_engine():
    code = ("import sys, wedlm_kernels, wedlm_kernels.integrations.vllm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' "
            "or m.startswith('wedlm_kernels.integrations.vllm.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"
