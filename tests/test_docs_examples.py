"""Every Python example of the README and the user pages runs as written.

Each page's ``python`` blocks run in order, in one namespace, in an empty folder, as a reader
would run them: the pages open the sample store that comes with the package, or make the
stores they open. Where there is no GPU they run under the switch the pages show,
``CUPY_XARRAY_DEVICE=cpu``. A block that needs the network says so just before it
(``<!-- example: needs network -->``) and is counted, not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from pathlib import Path

import pytest
import xarray as xr
from conftest import HAS_GPU

ROOT = Path(__file__).parent.parent
PAGES = ["README.md"] + [
    f"docs/{p}.md"
    for p in (
        "index",
        "getting-started",
        "engine",
        "accessor",
        "writing",
        "remote",
        "troubleshooting",
        "performance",
    )
]
NEEDS = re.compile(r"<!-- example: needs (\S+) -->")


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, what it needs: None, "network" or a module) of every ``python`` block of
    a page (blocks inside list items included, their indent removed)."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            indent = len(lines[i]) - len(lines[i].lstrip())
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            needs = NEEDS.fullmatch(before.strip())
            code = "\n".join(line[indent:] for line in lines[start:j])
            out.append((start + 1, code, needs.group(1) if needs else None))
            i = j
        i += 1
    return out


def test_the_pages_have_examples():
    counted = {p: len(blocks(ROOT / p)) for p in PAGES}
    assert counted["README.md"] >= 2 and sum(counted.values()) >= 12, counted


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(ROOT / p)])
def test_the_examples_of_a_page_run_as_written(page, tmp_path, monkeypatch, capsys):
    import cupy_xarray

    assert not any(tmp_path.iterdir())  # an empty folder, as a reader's: the pages make their stores
    monkeypatch.chdir(tmp_path)
    switch = contextlib.nullcontext() if HAS_GPU else cupy_xarray.set_options(device="cpu")
    namespace: dict = {"__name__": "__main__"}
    ran = skipped = 0
    with switch:
        for line, code, needs in blocks(ROOT / page):
            if needs == "network" or (needs and importlib.util.find_spec(needs) is None):
                skipped += 1
                continue
            try:
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{page}, the example at line {line}: {type(exc).__name__}: {exc}")
            ran += 1
    print(f"{page}: {ran} examples ran, {skipped} need the network or a GPU machine's module")
    assert ran or skipped


def test_the_pages_show_the_switch_they_run_under():
    for page in ("README.md", "docs/getting-started.md"):
        assert "CUPY_XARRAY_DEVICE=cpu" in (ROOT / page).read_text(), page


def test_the_switch_sends_reads_for_the_gpu_to_the_cpu(monkeypatch):
    """``device="gpu"`` (every reader's default) reads into NumPy under the switch, from the
    environment or from ``set_options``; ``device="cpu"`` is unchanged; a bad value is named."""
    import numpy as np

    import cupy_xarray
    from cupy_xarray.options import get_options
    from cupy_xarray.sample import sample_path

    with cupy_xarray.set_options(device="cpu"):
        ds = xr.open_dataset(sample_path(), engine="kvikio")
        assert isinstance(ds.air.values, np.ndarray) and not ds.air.load().cupy.is_cupy
        assert not cupy_xarray.read_zarr_gds(sample_path()).air.cupy.is_cupy
    assert get_options().device == "gpu"
    with pytest.raises(ValueError, match="device must be 'gpu' or 'cpu'"):
        cupy_xarray.set_options(device="tpu")
    code = "import cupy_xarray; print(cupy_xarray.get_options().device)"
    import subprocess
    import sys

    env = dict(os.environ, CUPY_XARRAY_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cpu"


@pytest.mark.skipif(HAS_GPU, reason="a machine without a GPU")
def test_without_a_gpu_the_error_names_the_cpu_switch():
    from cupy_xarray.sample import sample_path

    with pytest.raises(Exception) as info:
        xr.open_dataset(sample_path(), engine="kvikio").load()
    text = str(info.value)
    assert "device='cpu'" in text and "CUPY_XARRAY_DEVICE=cpu" in text, text


def test_no_page_names_a_commit_or_a_benchmark_command():
    """User pages speak to users: commits and benchmark command lines belong to the
    contributors' pages (benchmarks.md, contributing.md)."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert not re.search(r"\bcommit [0-9a-f]{7,}\b|\b[0-9a-f]{7}\b\)", text), page
        assert "benchmarks/" not in text and "python benchmarks" not in text, page


def test_a_mistyped_setting_names_the_one_meant():
    import cupy_xarray

    with pytest.raises(ValueError, match=r"unknown option\(s\) 'decod' \(did you mean 'decode'\?\)") as info:
        cupy_xarray.set_options(decod="cpu")
    assert "remote_backoff_max" not in str(info.value)  # not every field of Options
    with pytest.raises(ValueError, match=r"'zzz'; the options are the fields"):
        cupy_xarray.set_options(zzz=1)
