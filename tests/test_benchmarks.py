"""The benchmark scripts run on a GPU machine only; what they take from the package is checked
here, so that a renamed function fails in CI rather than on the GPU machine."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def _imports(path: Path) -> list[tuple[str, str]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupy_xarray"):
            names += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [(alias.name, "") for alias in node.names if alias.name.startswith("cupy_xarray")]
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_what_a_benchmark_imports_from_the_package_exists(path):
    for module, name in _imports(path):
        mod = importlib.import_module(module)
        if name:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), f"{module}.{name}"


def test_the_check_sees_the_imports():
    here = Path(__file__).parent.parent / "benchmarks" / "write_patterns.py"
    assert ("cupy_xarray", "record_writes") in _imports(here)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_a_benchmark_using_the_accessor_imports_the_package(path):
    # ``.cupy`` exists on xarray objects only once cupy_xarray is imported
    text = path.read_text()
    if ".cupy." in text.replace("import cupy.", ""):
        assert any(module.startswith("cupy_xarray") for module, _ in _imports(path)), path.name
