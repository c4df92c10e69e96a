"""Every example notebook runs top to bottom (on the CPU in CI, where it says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "examples").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "stream"
    )
    assert "device used:" in text  # each notebook says which device it ran on


# -- what the notebooks teach and need ---------------------------------------------------------

#: the modules a notebook may import beyond the standard library: the package's own
#: dependencies and those of the ``notebooks`` extra; on a GPU, cupy and (for one worker per GPU)
#: dask_cuda, which the first cell then names
BASE = {"cupy_xarray", "numpy", "xarray", "zarr", "numcodecs", "pandas"}
NOTEBOOKS_EXTRA = {"matplotlib", "dask", "distributed", "fsspec", "aiohttp"}
GPU_ONLY = {"cupy", "dask_cuda"}
#: the package's modules a notebook may import: its public ones
PUBLIC = {"cupy_xarray", "cupy_xarray.sample"}


def _imports(nb) -> set[str]:
    import ast

    found = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_imports_what_its_first_cell_says_to_install(path):
    import sys

    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source
    third_party = {m for m in _imports(nb) if m.split(".")[0] not in sys.stdlib_module_names}
    tops = {m.split(".")[0] for m in third_party}
    assert tops <= BASE | NOTEBOOKS_EXTRA | GPU_ONLY, tops - BASE - NOTEBOOKS_EXTRA - GPU_ONLY
    if tops & NOTEBOOKS_EXTRA:
        assert "notebooks]" in first, "the first cell must name the notebooks extra"
    for module in tops & GPU_ONLY - {"cupy"}:
        assert module.replace("_", "-") in first, f"the first cell must say {module} is needed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_public_api_only(path):
    import re

    nb = nbformat.read(path, as_version=4)
    own = {m for m in _imports(nb) if m.split(".")[0] == "cupy_xarray"}
    assert own <= PUBLIC, own - PUBLIC
    for cell in nb.cells:
        if cell.cell_type == "code":
            private = re.findall(r"\.\_[A-Za-z]\w*", cell.source)
            assert not private, f"private attributes in a notebook: {private}"
