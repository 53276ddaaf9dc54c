"""The Triton path behind the custom ops, through Triton's interpreter on the CPU.

The backend is read once at import, so these tests run pytest in a subprocess with
``WEDLM_KERNELS_BACKEND=interpret``: there every op that has a Triton kernel runs it for CPU
tensors, and the op-level checks (opcheck, torch.compile) and a slice of the decoder's
token-for-token tests must still pass.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wedlm_kernels.ops import _library

ROOT = Path(__file__).parents[1]
KERNEL_OPS = sorted(name for name in _library.OPS if _library.triton_launcher(name) is not None)

pytestmark = pytest.mark.skipif(not KERNEL_OPS, reason="no op has a Triton kernel yet")


def _run(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, WEDLM_KERNELS_BACKEND="interpret", TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def _outcomes(stdout: str) -> dict[str, int]:
    """The counts of pytest's summary line (``3 passed, 2 deselected in 1.2s``)."""
    summary = stdout.strip().splitlines()[-1]
    return {kind: int(count) for count, kind in re.findall(r"(\d+) (\w+)", summary)
            if kind not in ("warning", "warnings")}


def test_outcomes_parse_the_summary_line():
    assert _outcomes("..\n13 passed, 1 skipped, 7 deselected, 2 warnings in 3.10s\n") == {
        "passed": 13, "skipped": 1, "deselected": 7}


def test_interpret_backend_dispatches_cpu_tensors_to_the_triton_launchers():
    code = (
        "from wedlm_kernels.ops import _library\n"
        f"for name in {KERNEL_OPS!r}:\n"
        "    assert _library.kernel_for(name, 'cpu') is _library.triton_launcher(name), name\n"
        "print('ok')\n"
    )
    result = _run(["-c", code])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_opcheck_compile_and_decoder_pass_on_the_triton_path():
    selection = " or ".join(KERNEL_OPS)
    decoder = (
        "test_tokens_and_metrics_equal_the_reference_decoder and qwen3 and "
        "(greedy-streaming or sampling-blockwise)"
    )
    result = _run([
        "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/test_custom_ops.py", "-k", f"({selection}) and not traces",
    ])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # opcheck and torch.compile for every op with a kernel (and commit_window with a commit
    # limit, one test for both), nothing skipped
    assert _outcomes(result.stdout).get("passed") == 2 * len(KERNEL_OPS) + 1, (
        result.stdout[-2000:])
    assert "skipped" not in _outcomes(result.stdout), result.stdout[-2000:]
    result = _run([
        "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/test_model_min_generator.py", "tests/test_model_min_logits.py",
        "-k", f"({decoder}) or (test_window_logits_equal_hf and qwen3 and not sharded)",
    ])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    outcomes = _outcomes(result.stdout)
    # two decoder runs, and the window logits of qwen3 and qwen3-yarn against transformers
    assert outcomes.get("passed") == 4 and "skipped" not in outcomes, result.stdout[-2000:]
