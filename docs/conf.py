"""Sphinx configuration: MyST Markdown pages, MyST-NB notebooks, the .cupy accessor's API."""

from __future__ import annotations

import json
import os
import shutil
import statistics
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
exclude_patterns = ["_build", "_generated", "**.ipynb_checkpoints"]
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


_META = ("command", "commit", "date", "hardware", "software")
_BASELINES = ("zarr GPU mode", "GDSStore+GPU", "CPU zarr+asarray", "raw kvikio read", "raw read + cupy.empty")


def _benchmark_run(path: Path) -> tuple[list, dict]:
    """The rows and the run's facts of a ``benchmarks/read_throughput.py --json`` file; a file
    without them fails the build, so that no table is shown without its command and commit."""
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run benchmarks/read_throughput.py --json {path.name}")
    doc = json.loads(path.read_text())
    meta = doc.get("meta", {}) if isinstance(doc, dict) else {}
    missing = [k for k in _META if not meta.get(k)]
    if missing or not doc.get("rows"):
        raise RuntimeError(f"{path} lacks {missing or 'rows'}: write it with the benchmark's --json")
    _check_commit(path, meta["commit"])
    return doc["rows"], meta


def _check_commit(path: Path, commit: str) -> None:
    """A run must name a commit of this repository's history (where git and the history are
    at hand): a table of figures from a tree that no longer exists fails the build."""
    import subprocess

    name = commit.split()[0]
    try:
        found = subprocess.run(
            ["git", "-C", str(HERE), "cat-file", "-e", f"{name}^{{commit}}"], capture_output=True, check=False
        )
        inside = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--is-inside-work-tree"], capture_output=True, check=False
        )
    except OSError:  # no git: nothing to check against
        return
    if inside.returncode == 0 and found.returncode != 0:
        raise RuntimeError(f"{path.name} was measured at commit {name!r}, which this repository lacks")


def _benchmark_table(path: Path) -> str:
    """A Markdown table of one run (GB/s, ratios to every baseline measured, peak memory), with
    the command, commit, date and hardware under it."""
    rows, meta = _benchmark_run(path)
    bases = [b for b in _BASELINES if any(b in r["paths"] for r in rows)]
    head = ["store", "path", "GB/s", *(f"× {b}" for b in bases), "peak GiB"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for r in rows:
        store = f"{r['store']} ({r['GiB']:.2f} GiB, ratio {r['ratio']:.2f})"
        for name, v in r["paths"].items():
            ratios = [f"{v['GBps'] / r['paths'][b]['GBps']:.2f}" if b in r["paths"] else "-" for b in bases]
            lines.append(
                f"| {store} | {name} | {v['GBps']:.2f} | " + " | ".join(ratios) + f" | {v['peak_GiB']:.2f} |"
            )
        if "verify" in r:
            t = r["verify"]
            lines.append(
                f"| {store} | GPU {t['kind']} check of the decoded chunks | "
                f"{r['GiB'] * 2**30 / t['seconds'] / 1e9:.0f} | " + " | ".join("-" for _ in bases) + " | - |"
            )
    return "\n".join(lines + _run_facts(meta))


def _run_facts(meta: dict) -> list[str]:
    return [
        "",
        f"Measured on {meta['date']}, {meta['hardware']}; {meta['software']}; commit `{meta['commit']}`:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
    ]


def _paths_rows(rows: list, heads: list[str], cells) -> list[str]:
    """A table of store | ratio | read | GB/s | ``heads``, a row per read path of every store;
    ``cells(paths, name, path)`` gives one path's cells under ``heads``."""
    lines = [
        "| store | ratio | read | GB/s | " + " | ".join(heads) + " |",
        "| --- | ---: | --- | ---: |" + " ---: |" * len(heads),
    ]
    for r in rows:
        for name, v in r["paths"].items():
            head = f"| {r['store']} | {r['ratio']:.2f} | {name} |"
            if "error" in v:
                lines.append(f"{head} fails: {v['error'][:60]} |" + " |" * len(heads))
                continue
            lines.append(f"{head} {v['GBps']:.2f} | " + " | ".join(cells(r["paths"], name, v)) + " |")
    return lines


def _patterns_tables(path: Path) -> str:
    """Tables of a ``benchmarks/read_patterns.py --json`` run: GB/s per store and read path
    with ratios and peak memory, then latencies, threads and the scheduler's choices."""
    rows, meta = _benchmark_run(path)

    def cells(p: dict, name: str, v: dict) -> list[str]:
        ratios = []
        for label in ("zarr GPU mode", "engine auto", "raw kvikio read"):
            base = p.get(label, {}).get("GBps")
            ratios.append(f"{v['GBps'] / base:.2f}" if base else "-")
        peak = "-" if name == "raw kvikio read" else f"{v['peak_x']:.2f}"  # its buffer: allocated before
        return [*ratios, peak]

    lines = _paths_rows(rows, ["× zarr GPU", "× engine eager", "× raw read", "peak / output"], cells)
    lines += [
        "",
        "| store | one chunk: engine / zarr GPU (ms) | 1 %: engine / zarr GPU (ms) "
        '| small selections per s: 1 thread / 16 threads | scheduler (decode="auto") |',
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lat, th = r["latency_ms"], r.get("threads", {})
        threads = f"{th['one']:.0f} / {th['sixteen']:.0f} ({th['x']:.1f}×)" if "x" in th else "-"
        choice = "; ".join(d.split(": ", 1)[1] for d in r.get("decisions", [])) or "nothing to decode"
        lines.append(
            f"| {r['store']} | {lat['engine one chunk']:.2f} / {lat['zarr GPU one chunk']:.2f} "
            f"| {lat['engine 1%']:.2f} / {lat['zarr GPU 1%']:.2f} | {threads} | {choice} |"
        )
    return "\n".join(lines + _run_facts(meta))


def _first_minute_table(path: Path) -> str:
    """The phases of a fresh process (``benchmarks/first_minute.py --json``): medians, cold
    and warm caches."""
    runs, meta = _benchmark_run(path)
    lines = ["| phase | cold caches (s) | warm caches (s) |", "| --- | ---: | ---: |"]
    for phase in runs["cold"][0]:
        med = [statistics.median(r[phase] for r in runs[k]) for k in ("cold", "warm")]
        lines.append(f"| {phase} | {med[0]:.3f} | {med[1]:.3f} |")
    lines += ["", f"Medians of {len(runs['cold'])} fresh processes each."]
    return "\n".join(lines + _run_facts(meta))


def _remote_table(path: Path) -> str:
    """The table of a ``benchmarks/remote_reads.py --json`` run: GB/s per store and read path,
    against the ceiling (the fastest of the fetch-only paths) and zarr's GPU mode."""
    rows, meta = _benchmark_run(path)

    def cells(p: dict, name: str, v: dict) -> list[str]:
        def gbps(label: str) -> float:
            return p.get(label, {}).get("GBps", 0.0)

        ceiling = max(gbps(k) for k in p if k.startswith("ceiling"))
        zarr_gpu = gbps("zarr GPU mode")
        peak = "-" if name.startswith("ceiling") or "cpu" in name else f"{v['peak_x']:.2f}"
        x_zarr = f"{v['GBps'] / zarr_gpu:.2f}" if zarr_gpu else "-"
        return [f"{v['GBps'] / ceiling:.2f}", x_zarr, peak]

    lines = _paths_rows(rows, ["× ceiling", "× zarr GPU", "peak / output"], cells)
    lines += ["", "| store | one chunk: engine / zarr GPU (ms) |", "| --- | ---: |"]
    for r in rows:
        lat = r["latency_ms"]
        lines.append(f"| {r['store']} | {lat['engine one chunk']:.2f} / {lat['zarr GPU one chunk']:.2f} |")
    return "\n".join(lines + _run_facts(meta))


def _write_benchmark_tables() -> None:
    """docs/_generated/<name>.md for every docs/benchmarks*.json (included by benchmarks.md)."""
    out = HERE / "_generated"
    out.mkdir(exist_ok=True)
    for path in sorted(HERE.glob("benchmarks*.json")):
        if path.stem.startswith("benchmarks-patterns"):
            table = _patterns_tables(path)
        elif path.stem == "benchmarks-first-minute":
            table = _first_minute_table(path)
        elif path.stem == "benchmarks-remote":
            table = _remote_table(path)
        else:
            table = _benchmark_table(path)
        (out / f"{path.stem}.md").write_text(table)


def _bar_plot(rows: list, paths: list[str], labels: list[str], title: str, name: str) -> None:
    """docs/_static/<name>: grouped bars of GB/s, one group per store, one bar per read path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 4.8))
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        values = [r["paths"].get(path, {}).get("GBps", 0) for r in rows]
        ax.bar([k + i * width for k in range(len(rows))], values, width, label=path)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GB/s decoded into GPU memory")
    ax.set_title(title)
    # the bars drawn set the axis, not the paths left out of the plot
    top = max((r["paths"].get(p, {}).get("GBps", 0) for r in rows for p in paths), default=1.0)
    ax.set_ylim(0, (top or 1.0) * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    (HERE / "_static").mkdir(exist_ok=True)
    fig.savefig(HERE / "_static" / name, dpi=110)
    plt.close(fig)


def _plot_benchmarks() -> None:
    """benchmarks.png: GB/s per read path and slab store, from benchmarks.json."""
    rows, meta = _benchmark_run(HERE / "benchmarks.json")
    labels = [f"{r['store']}\n({r['GiB']:.0f} GiB, ratio {r['ratio']:.2f})" for r in rows]
    gpu = meta["hardware"].split(",")[0]
    title = f"Full loads of slab stores, {gpu}, {meta['date']}"
    _bar_plot(rows, list(rows[0]["paths"]), labels, title, "benchmarks.png")


def _plot_patterns() -> None:
    """read-patterns.png: GB/s by codec and chunk layout, the engine beside zarr's GPU mode and
    the CPU peers, from benchmarks-patterns.json."""
    rows, meta = _benchmark_run(HERE / "benchmarks-patterns.json")
    paths = ["engine auto", "engine decode=gpu", "zarr GPU mode", "zarrs + asarray", "tensorstore + asarray",
             "dask chunks={}", "dask 256MiB"]  # fmt: skip
    title = f"Full loads by codec and chunk layout, {meta['hardware'].split(',')[0]}, {meta['date']}"
    labels = [r["store"].replace(" ", "\n", 1) for r in rows]
    _bar_plot(rows, paths, labels, title, "read-patterns.png")


_copy_notebooks()
_write_benchmark_tables()
_plot_benchmarks()
_plot_patterns()
