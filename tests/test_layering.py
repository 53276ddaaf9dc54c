"""Who may import whom: shipped code (wedlm_kernels, model_min, reference) imports neither
the benchmarks nor the tests, and the benchmarks do not import the tests."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "wedlm_kernels": {"bench", "tests", "model_min", "reference"},
    "model_min": {"bench", "tests", "reference"},
    "reference": {"bench", "tests", "model_min"},
    "bench": {"tests"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in a Python file (function-level included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_the_layers_below_them(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offending = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
                 for path in files}
    assert not {path: names for path, names in offending.items() if names}
