"""Data parallelism through ``serve``: ``--data-parallel-size 2`` behind one API server
(vLLM's internal load balancing) and two servers of one rank each
(``--data-parallel-rank 0`` and ``1``, the external mode, a client spreading the requests),
on the tiny WeDLM checkpoint. For a dense model vLLM runs each rank as an engine of its own
(no collective between them, no dummy batches on an idle rank). Every request decodes
model_min's tokens, greedy and seeded, with requests arriving together, streams closed
early (aborted on their rank) and a cache small enough that each rank preempts; each rank
reports its own diffusion counters on ``/metrics`` (``engine`` label), which sum to
model_min's forwards, rows and tokens.

Three engines in all (about 40 s each to start on two cores; docs/vllm.md, "Serving past
one machine").
"""

import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import model_min

from .conftest import WINDOW
from .test_vllm_decoding import PROMPTS
from .test_vllm_server import (
    counters_by_engine,
    free_port,
    running_server,
    running_servers,
    serve_command,
)

pytestmark = pytest.mark.distributed

MAX_MODEL_LEN, MAX_NUM_SEQS, BLOCK_SIZE = 128, 4, 32
# 5 blocks of 32 positions per rank (max_model_len and the canvas): four requests of 2 to 4
# blocks do not fit at once
CACHE_BLOCKS = 5
OPTIONS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--block-size", str(BLOCK_SIZE), "--served-model-name", "tiny-wedlm",
           "--additional-config", json.dumps({"wedlm": {"window": WINDOW}}),
           "--num-gpu-blocks-override", str(CACHE_BLOCKS))
COUNTERS = ("vllm:diffusion_num_denoising_steps_total",
            "vllm:diffusion_num_canvas_positions_total",
            "vllm:diffusion_num_committed_tokens_total", "vllm:num_preemptions_total")


def workload(count: int) -> list[tuple[list[int], dict]]:
    """``count`` (prompt ids, completion fields): greedy and seeded in turn, prompts of 3
    to 55 tokens and 40 to 60 new tokens (2 to 3 cache blocks each)."""
    bases = [PROMPTS[1], PROMPTS[3], PROMPTS[0], list(b"Once upon a time")]
    return [((bases[i % 4] * 3)[: 3 + (i * 13) % 53],
             {"max_tokens": 40 + (i % 3) * 10, "temperature": 0.8 if i % 2 else 0.0,
              "top_k": 20, "seed": 300 + i}) for i in range(count)]


def model_min_results(reference, requests) -> list[model_min.Result]:
    model, _ = reference
    generator = model_min.Generator(model, window=WINDOW)
    return [generator.generate([prompt], model_min.SamplingParams(
        max_new_tokens=fields["max_tokens"], temperature=fields["temperature"],
        top_k=fields["top_k"], seed=fields["seed"]))[0] for prompt, fields in requests]


def complete(address: str, prompt: list[int], fields: dict) -> list[int]:
    """The committed token ids of one completion (``return_token_ids``)."""
    body = {"model": "tiny-wedlm", "prompt": prompt, "ignore_eos": True,
            "return_token_ids": True, **fields}
    request = urllib.request.Request(f"{address}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def abandon_stream(address: str, prompt: list[int]) -> None:
    """Start a long streaming completion and close it after its first chunk (vLLM aborts
    the request on its rank)."""
    body = {"model": "tiny-wedlm", "prompt": prompt, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"{address}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        response.readline()


def settled(read, want_total: dict[str, float], timeout_s: float = 10.0):
    """``read()`` once the frontend has counted every step (its sums match
    ``want_total``) or the timeout passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = read()
        totals = {name: sum(c.get(name, 0.0) for c in counts.values()) for name in want_total}
        if totals == want_total or time.monotonic() > deadline:
            return counts, totals
        time.sleep(0.2)


def serve_and_check(addresses: list[str], reference, count: int) -> dict:
    """Send ``count`` requests from eight clients at once, spread over ``addresses`` in
    turn; check each against model_min, and every server's counters against model_min's
    sums; returns the counters by (address, engine)."""
    requests = workload(count)
    want = model_min_results(reference, requests)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda item: complete(addresses[item[0] % len(addresses)],
                                                  *item[1]), enumerate(requests)))
    for index, (tokens, result) in enumerate(zip(got, want)):
        assert tokens == result.token_ids, f"request {index}"

    def read():
        return {(address, engine): values for address in addresses
                for engine, values in counters_by_engine(address, COUNTERS.__contains__).items()}

    want_total = {COUNTERS[0]: sum(r.forwards for r in want),
                  COUNTERS[2]: sum(len(r.token_ids) for r in want)}
    counts, totals = settled(read, want_total)
    assert totals == want_total  # the ranks' counts, summed, are model_min's
    return counts


@pytest.fixture(scope="module")
def internal_server(wedlm_checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("dp-internal") / "vllm-serve.log"
    command = serve_command(wedlm_checkpoint, port, *OPTIONS, "--data-parallel-size", "2")
    with running_server(command, port, log) as address:
        yield address


def test_dp2_internal_balancing_decodes_model_min_on_both_ranks(internal_server, reference):
    counts = serve_and_check([internal_server], reference, count=16)
    engines = {engine: values for (_, engine), values in counts.items()}
    assert sorted(engines) == ["0", "1"]
    for engine, values in engines.items():  # each rank decoded, and preempted, its share
        assert values[COUNTERS[0]] > 0 and values[COUNTERS[2]] > 0, engine
        assert values[COUNTERS[3]] > 0, f"rank {engine} preempted nothing"


def test_dp2_internal_balancing_survives_aborts_between_requests(internal_server, reference):
    # four streams closed after their first chunk, while eight requests decode
    requests = workload(8)
    want = model_min_results(reference, requests)
    with ThreadPoolExecutor(8) as pool:
        aborted = [pool.submit(abandon_stream, internal_server, PROMPTS[i % 4])
                   for i in range(4)]
        got = list(pool.map(lambda item: complete(internal_server, *item), requests))
        for future in aborted:
            future.result()
    assert got == [result.token_ids for result in want]
    # and the server decodes as before afterwards
    assert complete(internal_server, *requests[0]) == want[0].token_ids


def test_dp2_external_balancing_is_two_independent_servers(wedlm_checkpoint, reference,
                                                          tmp_path):
    # vLLM's external mode for a dense model: independent servers, no --data-parallel-*
    # arguments (it refuses them, test below); a client spreads the requests
    ports = [free_port(), free_port()]
    servers = [(serve_command(wedlm_checkpoint, port, *OPTIONS), port,
                tmp_path / f"rank{rank}.log") for rank, port in enumerate(ports)]
    with running_servers(servers) as addresses:
        counts = serve_and_check(addresses, reference, count=12)
    for address in addresses:  # each server reports its own counts
        mine = [values for (where, _), values in counts.items() if where == address]
        assert len(mine) == 1 and mine[0][COUNTERS[0]] > 0, address


def test_vllm_refuses_data_parallel_rank_for_a_dense_model(wedlm_checkpoint, tmp_path):
    command = serve_command(wedlm_checkpoint, free_port(), *OPTIONS,
                            "--data-parallel-size", "2", "--data-parallel-rank", "1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    assert result.returncode != 0
    assert "Non-MoE models do not support external data parallel mode" in result.stderr
