"""The backend switch of DESIGN.md section 2."""

import os
import subprocess
import sys

import pytest

import wedlm_kernels as wk
from wedlm_kernels import _library


def _import_with(backend: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WEDLM_KERNELS_BACKEND=backend)
    env.pop("TRITON_INTERPRET", None)
    code = (
        "import os, wedlm_kernels as wk\n"
        "print(wk.BACKEND, os.environ.get('TRITON_INTERPRET'))\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_unknown_backend_is_rejected_at_import_with_the_variable_name():
    result = _import_with("cuda-please")
    assert result.returncode != 0
    assert "WEDLM_KERNELS_BACKEND" in result.stderr


@pytest.mark.parametrize("backend", ["auto", "torch", "interpret", " Torch "])
def test_backend_is_read_once_at_import(backend):
    result = _import_with(backend)
    assert result.returncode == 0, result.stderr
    name, interpret = result.stdout.split()
    assert name == backend.strip().lower()
    assert (interpret == "1") == (name == "interpret")


@pytest.mark.parametrize("name", sorted(_library.OPS))
def test_ops_without_a_kernel_run_the_pytorch_implementation(name):
    module, _ = _library.OPS[name]
    if _library.triton_launcher(name) is not None:
        pytest.skip("op has a Triton kernel")
    for device_type in ("cpu", "cuda"):
        assert _library.kernel_for(name, device_type) is getattr(module, f"{name}_torch")


def test_cpu_tensors_use_pytorch_unless_interpreting():
    for name in _library.OPS:
        module, _ = _library.OPS[name]
        if wk.BACKEND != "interpret":
            assert _library.kernel_for(name, "cpu") is getattr(module, f"{name}_torch")
