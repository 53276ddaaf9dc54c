"""The backend switch (docs/testing.md, "Backends")."""

import os
import subprocess
import sys

import pytest

from wedlm_kernels.ops import _library


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


# backend -> the implementation each op runs for (CPU tensors, CUDA tensors)
EXPECTED_IMPLEMENTATIONS = {
    "auto": ("torch", "triton"),
    "torch": ("torch", "torch"),
    "interpret": ("triton", "triton"),
}


@pytest.mark.parametrize("backend", sorted(EXPECTED_IMPLEMENTATIONS))
def test_every_op_runs_the_implementation_its_backend_names(backend):
    """Each op has a Triton launcher and a PyTorch implementation; the backend decides which
    one serves CPU and CUDA tensors (read in a fresh process: the switch is read at import)."""
    env = dict(os.environ, WEDLM_KERNELS_BACKEND=backend)
    env.pop("TRITON_INTERPRET", None)
    code = (
        "from wedlm_kernels.ops import _library\n"
        "for name, (module, _) in sorted(_library.OPS.items()):\n"
        "    launcher = _library.triton_launcher(name)\n"
        "    assert launcher is not None, name\n"
        "    kinds = {launcher: 'triton', getattr(module, name + '_torch'): 'torch'}\n"
        "    print(name, kinds[_library.kernel_for(name, 'cpu')],"
        " kinds[_library.kernel_for(name, 'cuda')])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    table = {line.split()[0]: tuple(line.split()[1:]) for line in result.stdout.splitlines()}
    assert table == {name: EXPECTED_IMPLEMENTATIONS[backend] for name in _library.OPS}
