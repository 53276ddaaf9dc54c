"""Kernels on tensors of more than 2^31 elements compute their offsets in int64: each check
of ``tests/int64_checks.py`` runs in its own process on the CPU (Triton's interpreter), so an
offset that wraps in int32 and crashes the process is a clean failure. The buffers are
reserved, not filled: the checks must stay within a few hundred MiB of real memory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.int64_checks import CHECKS

ROOT = Path(__file__).parents[1]
PEAK_MEMORY_LIMIT_MIB = 2048


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_offsets_past_2_31_elements_are_int64_on_the_interpreter(name):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("WEDLM_KERNELS_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "tests.int64_checks", name], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    report = f"exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    last_line = done.stdout.strip().splitlines()[-1]
    if last_line.startswith("skip"):
        pytest.skip(last_line)
    status, peak_mib = last_line.split()
    assert status == "ok", report
    assert float(peak_mib) < PEAK_MEMORY_LIMIT_MIB, f"peak memory {peak_mib} MiB: {report}"
