"""Structured outputs (vLLM's ``structured_outputs`` and the OpenAI server's
``response_format`` and tool calls) decoded in parallel windows: vLLM's structured-output
manager and its xgrammar backend decide, ``wedlm_kernels.grammar``'s window rule applies
(docs/vllm.md, "Structured outputs"). Every output parses and validates; each request
decodes model_min's tokens in model_min's forwards, with model_min's grammar compiled by
the same vLLM backend; forced tokens (a schema's keys and punctuation) commit several
tokens a forward."""

import json
import re
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import StructuredOutputOptions
from vllm.v1.structured_output.utils import choice_as_grammar

import model_min
from wedlm_kernels.integrations.vllm._register import SCHEDULER, _structured_refusal

from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

EOS = 256  # the tiny model's (a byte-level vocabulary: token = byte)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "mood": {"enum": ["happy", "sad", "calm"]}},
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}( ok)?"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] | "x" [0-9]'
CASES = {
    "json": (StructuredOutputOptions.JSON, json.dumps(SCHEMA), {"json": SCHEMA}),
    "regex": (StructuredOutputOptions.REGEX, REGEX, {"regex": REGEX}),
    # (vLLM's xgrammar backend serves a choice as this grammar)
    "choice": (StructuredOutputOptions.GRAMMAR, choice_as_grammar(CHOICES),
               {"choice": CHOICES}),
    "grammar": (StructuredOutputOptions.GRAMMAR, EBNF, {"grammar": EBNF}),
}


def backend_of(engine):
    """The engine's grammar backend (the engine core runs in this process; the backend
    exists once the engine has served a structured request)."""
    core = engine.llm_engine.engine_core.engine_core
    return core.scheduler.structured_output_manager.backend


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def valid(case: str, output: str) -> bool:
    if case == "json":
        value = json.loads(output)
        return (set(value) == {"name", "age", "mood"} and isinstance(value["age"], int)
                and 0 <= value["age"] <= 120 and value["mood"] in ("happy", "sad", "calm")
                and isinstance(value["name"], str) and len(value["name"]) <= 8)
    if case == "regex":
        return re.fullmatch(REGEX, output) is not None
    if case == "choice":
        return output in CHOICES
    return re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9])){0,2}\)", output) is not None


def both(engine, case: str, seed: int | None, max_tokens: int = 64):
    """The request as vLLM and as model_min take it (eos ends both)."""
    kind, spec, fields = CASES[case]
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {"temperature": 0}
    served = SamplingParams(max_tokens=max_tokens, **sampling,
                            structured_outputs=StructuredOutputsParams(**fields))
    wanted = model_min.SamplingParams(
        max_new_tokens=max_tokens, stop_token_ids=(EOS,), **sampling,
        grammar=lambda: backend_of(engine).compile_grammar(kind, spec, stop_token_ids={EOS}))
    return served, wanted


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_grammar_decodes_valid_outputs_and_model_mins_tokens(engine, reference, case,
                                                                   seed):
    served, wanted = both(engine, case, seed)
    got = vllm_generate(engine, PROMPTS, served)
    assert got == reference_generate(reference, PROMPTS, wanted)
    for tokens, forwards, _ in got:
        assert tokens[-1] == EOS and valid(case, text(tokens[:-1])), text(tokens)
        assert forwards < len(tokens)  # the forced tokens commit beside a sampled one



@pytest.mark.parametrize("version, scheduler, reasoning, why", [
    ("0.32.0", SCHEDULER, None, None),
    ("0.32.0+cu130", SCHEDULER, None, None),
    ("0.33.0", SCHEDULER, None, "written for vLLM"),
    ("0.32.0", "my.Scheduler", None, "plugin's scheduler"),
    ("0.32.0", SCHEDULER, "qwen3", "reasoning parser"),
])
def test_an_engine_that_cannot_serve_them_says_why(monkeypatch, version, scheduler,
                                                   reasoning, why):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler),
        structured_outputs_config=SimpleNamespace(reasoning_parser=reasoning,
                                                  enable_in_reasoning=False))
    refusal = _structured_refusal(config)
    assert refusal is None if why is None else why in refusal


def test_a_refusing_engine_refuses_the_request_by_name(engine, monkeypatch):
    from vllm.exceptions import VLLMValidationError

    hf_config = engine.llm_engine.vllm_config.model_config.hf_config
    monkeypatch.setattr(hf_config, "wedlm_structured_refusal", "no grammar today",
                        raising=False)
    served, _ = both(engine, "regex", None)
    with pytest.raises(VLLMValidationError, match="no grammar today") as failure:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], served, use_tqdm=False)
    assert failure.value.parameter == "structured_outputs"
