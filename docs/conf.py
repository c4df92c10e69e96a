"""Sphinx configuration: MyST Markdown pages, MyST-NB notebooks, the .cupy accessor's API."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import sphinx_autosummary_accessors

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import cupy_xarray  # noqa: E402

project = "cupy-xarray"
author = "cupy-xarray developers"
copyright = "2026, cupy-xarray developers"
release = cupy_xarray.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx_autosummary_accessors",
]
templates_path = ["_templates", sphinx_autosummary_accessors.templates_path]
exclude_patterns = ["_build", "benchmarks.md", "**.ipynb_checkpoints"]
autosummary_generate = True
autodoc_typehints = "description"
napoleon_numpy_docstring = True
myst_enable_extensions = ["colon_fence", "deflist"]
# notebooks carry the outputs of their run on the H200; CI executes them separately
nb_execution_mode = "off"
html_theme = "alabaster"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "xarray": ("https://docs.xarray.dev/en/stable", None),
    "zarr": ("https://zarr.readthedocs.io/en/stable", None),
    "cupy": ("https://docs.cupy.dev/en/stable", None),
    "kvikio": ("https://docs.rapids.ai/api/kvikio/stable", None),
    "dask": ("https://docs.dask.org/en/stable", None),
    "numpy": ("https://numpy.org/doc/stable", None),
}
if os.environ.get("CUPY_XARRAY_DOCS_OFFLINE"):
    # machines without internet (CI) cannot fetch the inventories; links render as plain text
    intersphinx_mapping = {}
    suppress_warnings = ["ref.python"]


def _copy_notebooks() -> None:
    dest = HERE / "examples"
    dest.mkdir(exist_ok=True)
    for nb in sorted((HERE.parent / "examples").glob("*.ipynb")):
        shutil.copyfile(nb, dest / nb.name)


def _plot_benchmarks() -> None:
    """docs/_static/benchmarks.png: GB/s per read path and store, from benchmarks.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads((HERE / "benchmarks.json").read_text())
    paths = list(rows[0]["paths"])
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(paths)
    for i, name in enumerate(paths):
        values = [r["paths"].get(name, {}).get("GBps", 0) for r in rows]
        ax.bar([k + i * width for k in range(len(rows))], values, width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))])
    ax.set_xticklabels([f"{r['store']}\n({r['GiB']:.0f} GiB, ratio {r['ratio']:.2f})" for r in rows])
    ax.set_ylabel("GB/s decoded into GPU memory")
    ax.set_title("Read throughput on one H200 (warm page cache)")
    top = max(v.get("GBps", 0) for r in rows for v in r["paths"].values())
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    (HERE / "_static").mkdir(exist_ok=True)
    fig.savefig(HERE / "_static" / "benchmarks.png", dpi=110)
    plt.close(fig)


_copy_notebooks()
_plot_benchmarks()
