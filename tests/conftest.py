"""Shared pytest configuration.

Hypothesis draws fresh random sizes and seeds on every run (no fixed seed): a failure prints
the example and the seed to reproduce it. The profile keeps the CPU suite inside the CI
budget; set HYPOTHESIS_PROFILE=thorough for a longer local run.
"""

import os

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter: the kernel tests call the
# launchers directly on CPU tensors. This must be set before triton is first imported (it is
# read when a kernel is decorated; importing torch does not import triton). The backend
# switch stays at its default ("auto": CPU tensors use the PyTorch implementations), so the
# rest of the suite is unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
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
