"""Shared pytest configuration.

Hypothesis profiles:

- ``ci`` (the default): derandomized. Every run of a test draws the same examples (derived
  from the test itself), so a CI result can be reproduced exactly; the known edge cases are
  pinned by ``@example``s and by fixed tests. 100 examples per test (the interpreter-heavy
  kernel tests take most of the time): ``make test`` ran in 1169 s alone on two cores.
- ``random``: the same number of examples, drawn fresh on every run (a failure prints the
  example and a blob to reproduce it); for exploring locally.
- ``thorough``: many more fresh examples, for a long local run.
- ``mutation``: ``ci`` without shrinking a failing example (``tests/mutations.py`` only needs
  to know that a test fails, and shrinking interpreter examples takes minutes).

Select one with ``HYPOTHESIS_PROFILE=<name>``.
"""

import gc
import os
from importlib.util import find_spec

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter: the kernel tests call the
# launchers directly on CPU tensors. This must be set before triton is first imported (it is
# read when a kernel is decorated; importing torch does not import triton). The backend
# switch stays at its default ("auto": CPU tensors use the PyTorch implementations), so the
# rest of the suite is unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# tests/vllm_plugin needs a real vLLM (make test-vllm runs it in .venv-vllm)
collect_ignore = [] if find_spec("vllm") is not None else ["vllm_plugin"]

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("random", max_examples=100, **_COMMON)
settings.register_profile("thorough", max_examples=400, **_COMMON)
settings.register_profile("smoke", max_examples=10, derandomize=True, database=None, **_COMMON)
settings.register_profile("mutation", max_examples=100, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One intra-op thread: the test tensors are tiny, and on a busy 2-core machine OpenMP's
# spinning threads made small ops up to 100x slower than a single thread.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> str:
    """Where kernel tests run: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seeded_global_generators(request):
    """Tests that draw from torch's (or numpy's, or Python's) global generator draw the same
    numbers on every run: the generators are seeded from the test's id before each test."""
    import random
    import zlib

    import numpy as np

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def pytest_collection_finish(session):
    """Every test module is imported (torch, transformers, vLLM: a heap of millions of
    objects that live to the end): move them out of the collector's reach, so that each
    full collection (Python's own, and the ones vLLM and pytest call, about ten an engine)
    walks only what the tests allocate."""
    gc.freeze()
