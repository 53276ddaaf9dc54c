"""pytest-benchmark benchmarks: host time of one eager call of every public op, and of
``select_tokens(..., sampling="greedy")`` under each select kernel setting (see
bench/host_time.py, which runs them and writes the results).

    pytest bench/test_host_time.py --benchmark-only --benchmark-json=FILE
    pytest bench/test_host_time.py --benchmark-disable   # each call once: cannot fail on time
"""

import functools
import os

import pytest
import torch

from bench.host_time import ROUNDS, SELECT_KERNELS, WARMUP_ROUNDS, decode_inputs, public_ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ENTRIES = ["public", "torch.ops", "launcher"]


@functools.cache
def _inputs(device: str) -> dict[str, tuple]:
    return decode_inputs(torch.device(device), small=device == "cpu")


def _entry_point(op: str, entry: str, device: str):
    import wedlm_kernels as wk
    from wedlm_kernels.ops import _library

    if entry == "public":
        return getattr(wk, op)
    if entry == "torch.ops":
        return getattr(torch.ops.wedlm, op)
    launcher = _library.triton_launcher(op)
    if device != "cuda" or launcher is None:
        pytest.skip("the Triton launcher alone is timed on CUDA tensors only")
    return launcher


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("op", public_ops())
@pytest.mark.parametrize("device", DEVICES)
def test_host_time_of_one_eager_call(benchmark, device, op, entry):
    call = functools.partial(_entry_point(op, entry, device), *_inputs(device)[op])
    setup = torch.cuda.synchronize if device == "cuda" else None
    benchmark.extra_info.update(device=device, op=op, entry=entry)
    benchmark.pedantic(call, setup=setup, rounds=int(os.environ.get("HOST_TIME_ROUNDS", ROUNDS)),
                       warmup_rounds=WARMUP_ROUNDS, iterations=1)


@pytest.mark.parametrize("kernel", SELECT_KERNELS)
@pytest.mark.parametrize("device", DEVICES)
def test_select_tokens_host_time_per_select_kernel(benchmark, monkeypatch, device, kernel):
    """The public ``select_tokens`` call with ``sampling="greedy"`` under each
    ``WEDLM_KERNELS_SELECT_KERNEL`` setting (read at import: set here on ``_backend``, where
    the launcher reads it on every call). On CPU tensors the PyTorch implementation runs
    whatever the setting."""
    import wedlm_kernels as wk
    from wedlm_kernels import _backend

    monkeypatch.setattr(_backend, "SELECT_KERNEL", kernel)
    call = functools.partial(wk.select_tokens, *_inputs(device)["select_tokens"], "greedy")
    setup = torch.cuda.synchronize if device == "cuda" else None
    benchmark.extra_info.update(device=device, op="select_tokens", entry="public",
                                sampling="greedy", select_kernel=kernel)
    benchmark.pedantic(call, setup=setup, rounds=int(os.environ.get("HOST_TIME_ROUNDS", ROUNDS)),
                       warmup_rounds=WARMUP_ROUNDS, iterations=1)
