"""The mutation list of ``tests/mutations.py`` stays applicable and broad, and its harness
tells a killed mutation from a surviving one. (Running every mutation, ``make mutation``,
takes about three minutes on two cores; ``.ci/run`` runs it after the suite.)"""

import ast
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.mutations import (
    MUTATIONS,
    ROOT,
    VLLM_MUTATIONS,
    Mutation,
    PytestServer,
    make_copy,
    repository_files,
    run_mutation,
)

HAS_VLLM = find_spec("vllm") is not None

OP_FILES = {
    "reorder_window": "wedlm_kernels/ops/reorder.py",
    "rope_kv_append": "wedlm_kernels/ops/rope.py",
    "paged_attention": "wedlm_kernels/ops/attention.py",
    "select_tokens": "wedlm_kernels/ops/select.py",
    "commit_window": "wedlm_kernels/ops/commit.py",
    "silu_mul": "wedlm_kernels/ops/silu_mul.py",
    "process_logits": "wedlm_kernels/ops/logits.py",
}


def _in_triton_kernel(path: str, old: str) -> bool:
    """Whether the text ``old`` of ``path`` lies inside a ``@triton.jit`` function."""
    source = (ROOT / path).read_text()
    line = source[: source.index(old)].count("\n") + 1
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= node.end_lineno:
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) == "triton.jit":
                    return True
    return False


@pytest.mark.parametrize("mutation", MUTATIONS + VLLM_MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_applies_exactly_once_and_changes_the_source(mutation):
    source = (ROOT / mutation.path).read_text()
    mutated = mutation.apply(source)  # raises unless each edit's text occurs exactly once
    assert mutated != source
    assert all(old != new for old, new in mutation.edits)


def _collected_items(files: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *files], cwd=ROOT, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_mutation_names_are_unique_and_their_tests_exist():
    names = [mutation.name for mutation in MUTATIONS + VLLM_MUTATIONS]
    assert len(names) == len(set(names))
    for mutation in MUTATIONS + VLLM_MUTATIONS:
        assert mutation.tests and mutation.bug, mutation.name
        for test in mutation.tests:
            assert (ROOT / test.split("::")[0]).is_file(), (mutation.name, test)
    # a keyword (an expression of substrings joined by and, or, not, as `pytest -k` reads
    # it) selects at least one test (the vLLM plugin's tests are collected only where vLLM
    # is installed)
    narrowed = [m for m in MUTATIONS + (VLLM_MUTATIONS if HAS_VLLM else []) if m.keyword]
    items = _collected_items(sorted({test for m in narrowed for test in m.tests}))
    for mutation in narrowed:
        assert any(
            item.split("::")[0] in mutation.tests
            and _selects(mutation.keyword, item.split("::")[-1])
            for item in items
        ), mutation.name


def _selects(keyword: str, name: str) -> bool:
    """Whether ``pytest -k keyword`` selects a test of this name (its parametrised id
    included): each word is a case-insensitive substring of the name."""
    words = re.findall(r"\(|\)|[^\s()]+", keyword)
    python = " ".join(word if word in ("(", ")", "and", "or", "not")
                      else str(word.lower() in name.lower()) for word in words)
    return eval(python)  # noqa: S307 - True, False, and, or, not and parentheses only


def test_a_keyword_expression_selects_as_pytest_k_does():
    name = "test_each_filter_path[top-p alone, NaN in the row]"
    assert _selects("filter_path and NaN", name) and _selects("nan", name)
    assert not _selects("filter_path and flat", name)
    assert _selects("flat or (filter_path and not draws)", name)
    assert _selects("exactly[4]", "test_mass_above_equals_top_p_exactly[4]")


def test_mutations_span_every_op_in_both_paths_the_reference_decoder_and_model_min():
    assert len(MUTATIONS) >= 25
    kinds = {(m.path, _in_triton_kernel(m.path, old)) for m in MUTATIONS for old, _ in m.edits}
    for op, path in OP_FILES.items():
        assert (path, False) in kinds, f"{op}: no mutation of the PyTorch implementation"
        assert (path, True) in kinds, f"{op}: no mutation of a Triton kernel"
    paths = {m.path for m in MUTATIONS}
    assert "reference/decoder.py" in paths
    assert "model_min/generator.py" in paths


def test_outside_a_git_checkout_the_copy_skips_environments_and_caches(tmp_path: Path):
    for name in ("pkg/a.py", ".venv/lib/x.py", "pkg/__pycache__/a.pyc", "w.egg-info/PKG-INFO",
                 "tests/.hypothesis/db", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert sorted(repository_files(tmp_path)) == ["README.md", "pkg/a.py"]


def test_the_harness_tells_killed_survived_and_not_run_apart(tmp_path: Path):
    copy = make_copy(tmp_path / "copy")
    # the pytest server starts before any mutation is written: each forked run must still
    # import the copy as it is then
    with PytestServer(copy) as server:
        planted = next(m for m in MUTATIONS if m.name == "select-torch-threshold-not-strict")
        killed = run_mutation(planted, server)
        assert killed.status == "killed", killed
        assert killed.failing == [
            "tests/test_select_tokens.py::test_rows_exactly_at_their_threshold_are_not_selected"]
        harmless = Mutation(
            "comment-only", planted.path,
            (("# Adjusted entropy: penalty", "# The adjusted entropy: penalty"),),
            planted.tests, "changes a comment", keyword=planted.keyword,
        )
        survived = run_mutation(harmless, server)
        assert survived.status == "SURVIVED", survived
        unexpected = Mutation("killed-by-something-else", planted.path, planted.edits,
                              planted.tests, planted.bug, keyword=planted.keyword,
                              expect="NoProgressError")
        assert run_mutation(unexpected, server).status == "ERROR"
        selects_nothing = Mutation("selects-nothing", planted.path, planted.edits, planted.tests,
                                   "no test runs", keyword="no_test_is_named_like_this")
        assert run_mutation(selects_nothing, server).status == "ERROR"
    assert (copy / planted.path).read_text() == (ROOT / planted.path).read_text()


def test_interpreted_kernel_tests_pass_in_the_harness(tmp_path: Path, monkeypatch):
    """The pytest server imports Triton before any test does: a harmless change to a kernel
    file must survive its interpreted kernel tests (a server without Triton's interpreter on
    failed every kernel test at once, and counted each kernel mutation as killed). Run as
    from a shell, where TRITON_INTERPRET is not set (this process's conftest set it)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    copy = make_copy(tmp_path / "copy")
    planted = next(m for m in MUTATIONS if m.name == "attention-kernel-no-rescale")
    harmless = Mutation(
        "comment-only", planted.path,
        (("# ---------------------------------------------------------------------------- launcher",
          "# ---------------------------------------------------------------------------- launch"),),
        planted.tests, "changes a comment",
        keyword="test_launcher_returns_a_fresh_contiguous_output_and_leaves_inputs_unchanged",
    )
    with PytestServer(copy) as server:
        assert run_mutation(harmless, server).status == "SURVIVED"

