"""Structured outputs (vLLM's ``structured_outputs`` and the OpenAI server's
``response_format`` and tool calls) decoded in parallel windows: vLLM's structured-output
manager and its xgrammar backend decide, ``wedlm_kernels.requests.grammar``'s window rule applies
(docs/vllm.md, "Structured outputs"). Every output parses and validates; each request
decodes model_min's tokens in model_min's forwards, with model_min's grammar compiled by
the same vLLM backend; forced tokens (a schema's keys and punctuation) commit several
tokens a forward."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import StructuredOutputOptions
from vllm.v1.structured_output.utils import choice_as_grammar

import model_min
from wedlm_kernels.integrations.vllm import request_stats
from wedlm_kernels.integrations.vllm._register import SCHEDULER, _structured_refusal

from .conftest import WINDOW
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


def assert_valid(case: str, outputs) -> None:
    """Every output (token ids first) ends on eos, and its text is one ``case`` accepts."""
    for tokens, *_ in outputs:
        assert tokens[-1] == EOS and valid(case, text(tokens[:-1])), text(tokens)


def decode_and_check(engine, reference, case: str, seed: int | None) -> list:
    """The request of ``case`` for every prompt of PROMPTS on ``engine``: model_min's tokens,
    forwards and rows, every output valid; returns the outputs."""
    served, wanted = both(engine, case, seed)
    got = vllm_generate(engine, PROMPTS, served)
    assert got == reference_generate(reference, PROMPTS, wanted)
    assert_valid(case, got)
    return got


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_grammar_decodes_valid_outputs_and_model_mins_tokens(engine, reference, case,
                                                                   seed):
    got = decode_and_check(engine, reference, case, seed)
    # forced tokens and validated drafts commit beside the sampled ones (a rejected draft
    # costs a forward: one request may take a forward a token)
    assert sum(forwards for _, forwards, _ in got) < sum(len(tokens) for tokens, _, _ in got)



def test_a_grammar_that_accepts_the_free_text_decodes_it_as_free_decoding_does(engine,
                                                                                reference):
    """[0-9a-z ]{24} after counting and letters: the served text is free decoding's, in
    model_min's tokens, forwards and rows, and in free decoding's forwards or one more."""
    prompts = [list(b"count: 1 2 3 4 5 "), list(b"letters: a b c d e ")]
    regex = "[0-9a-z ]{24}"
    free = vllm_generate(engine, prompts, SamplingParams(max_tokens=24, temperature=0))
    served = SamplingParams(max_tokens=24, temperature=0,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    got = vllm_generate(engine, prompts, served)
    wanted = model_min.SamplingParams(
        max_new_tokens=24, stop_token_ids=(EOS,), grammar=lambda: backend_of(
            engine).compile_grammar(StructuredOutputOptions.REGEX, regex,
                                    stop_token_ids={EOS}))
    assert got == reference_generate(reference, prompts, wanted)
    for (tokens, forwards, _), (free_tokens, free_forwards, _) in zip(got, free):
        assert re.fullmatch(regex, text(free_tokens))  # the premise
        assert tokens == free_tokens and free_forwards <= forwards <= free_forwards + 1


STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<p>", "content": {"type": "regex", "pattern": REGEX},
    "end": "</p>"}}


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_a_structural_tag_decodes_valid_outputs_and_model_mins_tokens(engine, reference,
                                                                      seed):
    """``structural_tag`` (what tool-calling formats send): a tag around a regex, every
    output the tag and a match, in model_min's tokens, forwards and rows."""
    spec = json.dumps(STRUCTURAL_TAG)
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {"temperature": 0}
    served = SamplingParams(max_tokens=40, **sampling,
                            structured_outputs=StructuredOutputsParams(structural_tag=spec))
    got = vllm_generate(engine, PROMPTS, served)
    wanted = model_min.SamplingParams(
        max_new_tokens=40, stop_token_ids=(EOS,), **sampling, grammar=lambda: backend_of(
            engine).compile_grammar(StructuredOutputOptions.STRUCTURAL_TAG, spec,
                                    stop_token_ids={EOS}))
    assert got == reference_generate(reference, PROMPTS, wanted)
    for tokens, _, _ in got:
        assert tokens[-1] == EOS and re.fullmatch(
            f"<p>{REGEX}</p>", text(tokens[:-1])), text(tokens)


def test_structured_requests_resume_their_window_after_preemption_as_alone(engines,
                                                                          reference):
    """Structured requests in a cache too small for them all (64-token texts under a regex,
    and JSON): vLLM preempts and resumes them (a resumed window is held one step and walked
    again); each decodes, valid, the tokens and forwards it decodes alone in model_min."""
    count, long_regex = 10, "[0-9a-z ]{64}"
    prompts = [(PROMPTS[i % 4] * 40)[: 60 + (i * 13) % 50] for i in range(count)]
    seeds = [None if i % 2 else 40 + i for i in range(count)]

    def request(i, engine):
        if i % 3 == 2:
            return both(engine, "json", seeds[i])
        sampling = {"temperature": 0.8, "seed": seeds[i]} if seeds[i] else {"temperature": 0}
        return (SamplingParams(max_tokens=64, **sampling,
                               structured_outputs=StructuredOutputsParams(regex=long_regex)),
                model_min.SamplingParams(
                    max_new_tokens=64, stop_token_ids=(EOS,), **sampling,
                    grammar=lambda: backend_of(engine).compile_grammar(
                        StructuredOutputOptions.REGEX, long_regex, stop_token_ids={EOS})))

    with engines.own(num_gpu_blocks_override=10) as llm:
        requests = [request(i, llm) for i in range(count)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [served for served, _ in requests], use_tqdm=False)
        stats = request_stats(llm, [o.request_id for o in outputs])
        restarts = [stats[o.request_id]["restarts"] for o in outputs]
        assert sum(map(len, restarts)) >= 4, f"{restarts}: the test needs a smaller cache"
        for i, output in enumerate(outputs):
            tokens = list(output.outputs[0].token_ids)
            if i % 3 == 2:
                assert tokens[-1] == EOS and valid("json", text(tokens[:-1])), text(tokens)
            else:
                assert re.fullmatch(long_regex, text(tokens)), text(tokens)
            alone = reference_generate(reference, [prompts[i]], requests[i][1])[0]
            assert (tokens, stats[output.request_id]["forwards"]) == alone[:2]


@pytest.mark.parametrize("max_tokens", [8, 9, 30])
def test_rejected_drafts_are_never_committed_and_decode_as_in_model_min(engine, reference,
                                                                         max_tokens):
    """After "count: 1 2 3 4 5 " the tiny model drafts "6 7 8 9 10 ..." in one step; the
    choice takes "6 7 8 " and wants X: the drafts from 9 on are rejected at the next walk
    (with 8 or 9 tokens, free decoding's early finish would have committed them). Every
    output is a prefix of a choice (a whole one when it fits), in model_min's tokens,
    forwards and rows."""
    choices = ["6 7 8 X", "6 7 8 XY", "5 5"]
    prompts = [list(b"count: 1 2 3 4 5 "), list(b"count: 1 2 3 4 5 ")]
    served = SamplingParams(max_tokens=max_tokens, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    wanted = model_min.SamplingParams(
        max_new_tokens=max_tokens, stop_token_ids=(EOS,), grammar=lambda: backend_of(
            engine).compile_grammar(StructuredOutputOptions.GRAMMAR,
                                    choice_as_grammar(choices), stop_token_ids={EOS}))
    got = vllm_generate(engine, prompts, served)
    assert got == reference_generate(reference, prompts, wanted)
    for tokens, _, _ in got:
        body = text(tokens[:-1] if tokens[-1] == EOS else tokens)
        assert any(choice.startswith(body) for choice in choices), body
        assert max_tokens < 9 or (body in choices and tokens[-1] == EOS)


@pytest.mark.parametrize("version, scheduler, reasoning, stages, vocab, why", [
    ("0.32.0", SCHEDULER, None, 1, 264, None),
    ("0.32.0+cu130", SCHEDULER, None, 1, 264, None),
    ("0.33.0", SCHEDULER, None, 1, 264, "written for vLLM"),
    ("0.32.0", "my.Scheduler", None, 1, 264, "plugin's scheduler"),
    ("0.32.0", SCHEDULER, "qwen3", 1, 264, "reasoning parser"),
    ("0.32.0", SCHEDULER, None, 2, 264, None),  # pipeline parallelism serves them
    ("0.32.0", SCHEDULER, None, 1, 128, None),
    ("0.32.0", SCHEDULER, None, 1, 127, "cannot hold"),  # a mask row's metadata words
])
def test_an_engine_that_cannot_serve_them_says_why(monkeypatch, version, scheduler,
                                                   reasoning, stages, vocab, why):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=stages),
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
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


def test_a_json_schema_response_format_without_a_schema_is_refused_naming_it():
    """vLLM's OpenAI request models turn such a response format into a constraint of
    nothing ("none are specified", naming no field); the plugin refuses it naming
    response_format (test_vllm_server.py sends it over HTTP)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    from wedlm_kernels.integrations.vllm import register

    register()
    for model, fields in ((ChatCompletionRequest, {"messages": [{"role": "user",
                                                                 "content": "hi"}]}),
                          (CompletionRequest, {"prompt": "hi"})):
        for json_schema, refused in (({"name": "x"}, True),
                                     ({"name": "x", "schema": {"type": "integer"}}, False)):
            request = model.model_validate({"model": "m", **fields, "response_format": {
                "type": "json_schema", "json_schema": json_schema}})
            if not refused:
                assert request.extract_structured_outputs().json == {"type": "integer"}
                continue
            with pytest.raises(VLLMValidationError, match="json_schema.schema") as failure:
                request.extract_structured_outputs()
            assert failure.value.parameter == "response_format"


@pytest.mark.parametrize("fields", [
    {"choice": []}, {"regex": "("}, {"regex": ""}, {"json": {"type": "nonsense"}},
    {"grammar": "root ::= "}, {"json": "{not json"}, {"regex": "a+"},
    {"json": {"type": "object", "properties": {"x": {"type": "string", "pattern": "["}}}},
], ids=lambda fields: json.dumps(fields)[:40])
def test_an_odd_grammar_is_refused_or_served_and_the_engine_keeps_serving(engine, fields):
    """Grammars vLLM's backend cannot compile or that accept nothing but the end: refused
    with an error naming them, or served (to the end or to max_tokens); never a stopped
    engine (the next request decodes model_min's tokens)."""
    from vllm.exceptions import VLLMValidationError

    served = SamplingParams(max_tokens=12, temperature=0,
                            structured_outputs=StructuredOutputsParams(**fields))
    try:
        [output] = engine.generate([{"prompt_token_ids": PROMPTS[0]}], served,
                                   use_tqdm=False)
    except (VLLMValidationError, ValueError) as error:
        assert error.args  # refused before the engine took it
    else:
        tokens = list(output.outputs[0].token_ids)
        assert len(tokens) <= 12
        if "regex" in fields and fields["regex"] == "a+":
            assert set(tokens) <= {ord("a"), EOS}
    plain, _ = both(engine, "regex", None)
    assert all(t[-1] == EOS for t, _, _ in vllm_generate(engine, PROMPTS[:1], plain))


# Grammars that allow nothing (xgrammar compiles each): a regex of an empty class, a JSON
# string of such a pattern (its opening quote is forced first), an EBNF of no character
UNSATISFIABLE = {
    "regex": (StructuredOutputOptions.REGEX, r"[^\s\S]", {"regex": r"[^\s\S]"}),
    "json": (StructuredOutputOptions.JSON, json.dumps({"type": "string",
                                                       "pattern": r"[^\s\S]"}),
             {"json": {"type": "string", "pattern": r"[^\s\S]"}}),
    "grammar": (StructuredOutputOptions.GRAMMAR, "root ::= [^\\x00-\\U0010FFFF]",
                {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}),
}


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_a_grammar_that_allows_nothing_ends_its_request_alone_as_model_min_does(
        engine, reference, seed):
    """Caught at the walk that finds the grammar's first mask empty (the JSON string's
    after the quote it forces): finish_reason "error" and a stop_reason naming
    structured_outputs, model_min's tokens, forwards and rows (its request ends with
    "error" too); the requests beside it decode model_min's tokens, and so does the engine
    afterwards."""
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {"temperature": 0}
    cases = [CASES["json"], *UNSATISFIABLE.values(), CASES["regex"]]
    served = [SamplingParams(max_tokens=64, **sampling,
                             structured_outputs=StructuredOutputsParams(**fields))
              for _, _, fields in cases]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], served,
                              use_tqdm=False)
    stats = request_stats(engine, [o.request_id for o in outputs])
    backend = backend_of(engine)
    model, _ = reference
    generator = model_min.Generator(model, window=WINDOW, max_batch=len(prompts))
    results = generator.generate(prompts, [model_min.SamplingParams(
        max_new_tokens=64, stop_token_ids=(EOS,), **sampling,
        grammar=lambda kind=kind, spec=spec: backend.compile_grammar(
            kind, spec, stop_token_ids={EOS})) for kind, spec, _ in cases])
    for output, result in zip(outputs, results):
        got = output.outputs[0]
        record = stats[output.request_id]
        assert (list(got.token_ids), record["forwards"], record["rows"]) == (
            result.token_ids, result.forwards, result.rows)
        assert (got.finish_reason == "error") == (result.finish_reason == "error")
    ended = [output.outputs[0] for output in outputs[1:4]]
    assert [list(o.token_ids) for o in ended] == [[], [ord('"')], []]
    assert all(o.finish_reason == "error" and o.stop_reason.startswith(
        "structured_outputs: the request's grammar") for o in ended)
    assert_valid("json", [(list(outputs[0].outputs[0].token_ids),)])
    assert_valid("regex", [(list(outputs[4].outputs[0].token_ids),)])
    plain, _ = both(engine, "regex", None)
    assert all(t[-1] == EOS for t, _, _ in vllm_generate(engine, PROMPTS[:1], plain))


def test_a_grammar_that_fails_in_the_walk_ends_its_request_alone(engine, reference,
                                                                 monkeypatch):
    """The grammar backend raises in the first walk of the step (as a broken grammar
    would): that request ends with an error naming structured_outputs and the exception;
    the request beside it decodes model_min's tokens."""
    from wedlm_kernels.integrations.vllm import structured

    walk, calls = structured.plan_window, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the matcher broke")
        return walk(*args, **kwargs)

    monkeypatch.setattr(structured, "plan_window", fails_once)
    served, wanted = both(engine, "regex", None)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], served,
                              use_tqdm=False)
    failed = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "error"]
    assert len(failed) == 1 and list(failed[0].token_ids) == []
    assert failed[0].stop_reason == ("structured_outputs: the request's grammar failed "
                                     "(RuntimeError: the matcher broke)")
    [other] = [i for i, o in enumerate(outputs) if o.outputs[0].finish_reason != "error"]
    assert list(outputs[other].outputs[0].token_ids) == reference_generate(
        reference, PROMPTS[other:other + 1], wanted)[0][0]


def test_a_step_fed_another_window_than_the_one_walked_commits_nothing(engine, reference,
                                                                       monkeypatch):
    """Every third window report is lost on its way to the scheduler (as when a report does
    not arrive before a step under asynchronous scheduling): the scheduler walks an older
    window, the worker sees the key differ and holds the request that step, and the request
    still decodes model_min's tokens."""
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    take = scheduler._take_reports
    calls = []

    def lossy(draft_token_ids):
        calls.append(1)
        if len(calls) % 3 == 0:
            return {req_id for req_id in draft_token_ids.req_ids
                    if req_id in scheduler.requests
                    and scheduler.requests[req_id].use_structured_output}
        return take(draft_token_ids)

    monkeypatch.setattr(scheduler, "_take_reports", lossy)
    served, wanted = both(engine, "json", None)
    got = vllm_generate(engine, PROMPTS, served)
    assert [t for t, _, _ in got] == [t for t, _, _ in reference_generate(reference, PROMPTS,
                                                                          wanted)]
    assert all(valid("json", text(t[:-1])) for t, _, _ in got)


# ------------------------------------------------------------ a Qwen3-0.6B-shaped model

VOCAB_06B, EOS_06B, MASK_06B = 151936, 151643, 151665


def write_06b_shaped(path: Path) -> Path:
    """A random WeDLM checkpoint at Qwen3-0.6B's widths (hidden 1024, 16 query and 8 KV
    heads of 128, MLP 3072, vocabulary 151936, tied embeddings) with 2 of its 28 layers
    (the test's CPU time; the grammar path does not depend on depth), and a byte-level BPE
    tokenizer of about 151k tokens (bytes, every pair and many triples of printable
    characters): noise over a vocabulary of Qwen's size, whose raw outputs parse as nothing,
    so only the grammar makes them valid."""
    from safetensors.torch import save_file

    from .conftest import TINY

    path.mkdir(parents=True, exist_ok=True)
    # the byte-level characters of the 256 bytes, as the tiny model's tokenizer has them
    tiny = json.loads((TINY / "tokenizer.json").read_text())["model"]["vocab"]
    byte_char = {byte: text for text, byte in tiny.items() if byte < 256}
    vocab = {byte_char[b]: b for b in range(256)}
    printable = [byte_char[b] for b in range(32, 127)]
    merges = []
    for first in printable:
        for second in printable:
            vocab[first + second] = len(vocab)
            merges.append(f"{first} {second}")
    for first in printable:
        for second in printable:
            for third in printable:
                if len(vocab) >= EOS_06B:
                    break
                vocab[first + second + third] = len(vocab)
                merges.append(f"{first + second} {third}")
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, text in ((EOS_06B, "<|endoftext|>"), (MASK_06B, "<|mask|>"))]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": 512}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_06B}))
    hidden, heads, kv_heads, head_dim, mlp, layers = 1024, 16, 8, 128, 3072, 2
    (path / "config.json").write_text(json.dumps({
        "architectures": ["WeDLMForCausalLM"], "model_type": "wedlm", "qk_norm": True,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": mlp,
        "vocab_size": VOCAB_06B, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": EOS_06B,
        "bos_token_id": EOS_06B, "mask_token_id": MASK_06B}))
    generator = torch.Generator().manual_seed(0)

    def linear(rows, columns):
        return torch.randn(rows, columns, generator=generator) / columns ** 0.5

    def norm(size):
        return 1.0 + 0.25 * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": torch.randn(VOCAB_06B, hidden,
                                                         generator=generator),
               "model.norm.weight": norm(hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        weights.update({
            prefix + "input_layernorm.weight": norm(hidden),
            prefix + "post_attention_layernorm.weight": norm(hidden),
            prefix + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            prefix + "self_attn.q_norm.weight": norm(head_dim),
            prefix + "self_attn.k_norm.weight": norm(head_dim),
            prefix + "mlp.gate_proj.weight": linear(mlp, hidden),
            prefix + "mlp.up_proj.weight": linear(mlp, hidden),
            prefix + "mlp.down_proj.weight": linear(hidden, mlp),
        })
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.mark.slow
def test_a_qwen3_06b_shaped_random_model_decodes_valid_json_only_through_the_grammar(
        engines, tmp_path):
    """Noise through a grammar: valid JSON, model_min's tokens and forwards, and no more
    forwards than without drafts."""
    checkpoint = write_06b_shaped(tmp_path / "qwen3-0.6b-shaped")
    model = model_min.load_model(checkpoint)
    schema = json.dumps(SCHEMA)
    prompts = [list(range(1000, 1012)), [5, 77, 300, 151000]]
    samplings = [{"temperature": 0}, {"temperature": 0.8, "seed": 3}]  # one of each
    with engines.own(checkpoint, max_model_len=512, max_num_batched_tokens=128) as llm:
        free = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        for output in free:  # noise: not JSON
            with pytest.raises(ValueError):
                json.loads(output.outputs[0].text)
        got = vllm_generate(llm, prompts, [SamplingParams(
            max_tokens=120, **sampling, structured_outputs=StructuredOutputsParams(json=SCHEMA))
            for sampling in samplings])
        backend = backend_of(llm)
        generator = model_min.Generator(model, window=WINDOW, max_batch=len(prompts))
        want = generator.generate(prompts, [model_min.SamplingParams(
            max_new_tokens=120, stop_token_ids=(EOS_06B,), **sampling,
            grammar=lambda: backend.compile_grammar(
                StructuredOutputOptions.JSON, schema, stop_token_ids={EOS_06B}))
            for sampling in samplings])
        assert [(tokens, forwards) for tokens, forwards, _ in got] == [
            (r.token_ids, r.forwards) for r in want]
        for result in want:
            assert result.token_ids[-1] == EOS_06B
            body = llm.get_tokenizer().decode(result.token_ids[:-1])
            assert valid("json", body), body
        # the worst case of drafts (noise: the grammar overrules nearly every first choice)
        # is no slower than decoding without them (the greedy request: a forward of this
        # vocabulary is seconds on a CPU)
        [undrafted] = model_min.Generator(model, window=WINDOW, max_batch=1,
                                          grammar_drafts=False).generate(prompts[:1], [
            model_min.SamplingParams(
                max_new_tokens=120, stop_token_ids=(EOS_06B,), **samplings[0],
                grammar=lambda: backend.compile_grammar(
                    StructuredOutputOptions.JSON, schema, stop_token_ids={EOS_06B}))])
        assert want[0].forwards <= undrafted.forwards
