"""xarray's own Zarr backend tests, run through cupy-xarray: the conformance bar.

Runs the Zarr tests of the installed xarray version's source distribution
(``xarray/tests/test_backends.py`` and ``test_backends_datatree.py``, ``-k "zarr or Zarr"``,
under xarray's own pytest configuration: warnings from xarray are errors) once per route (see
``conformance_route.py``): unrouted (the baseline),
with reads through ``engine="kvikio"``, with writes through ``.cupy.to_zarr``, and with small
writes forced through the engine's writer too. Prints each route's counts beside the baseline and
every test that fails in a route but passes in the baseline; exits 1 if any of those is not one
of the documented divergences below.

Usage::

    python tools/conformance.py                      # every route, reads on the CPU
    python tools/conformance.py --device gpu         # reads on the GPU
    python tools/conformance.py --routes reads -- -x # a route, pytest arguments after --
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUTES = ("baseline", "reads", "writes", "engine-writes")

#: intended divergences: (route, test id pattern, reason). A test that fails in its route but
#: passes in the baseline is allowed only if it matches one of these.
DIVERGENCES: list[tuple[str, str, str]] = [
    (
        "reads",
        r"::test_zarr_fill_value_setting\[2-",
        "use_zarr_fill_value_as_mask=False is honoured for zarr v2 (the v2 fill_value is not made a "
        "_FillValue attribute), where xarray's zarr engine ignores the keyword and masks anyway",
    ),
    (
        "reads",
        r"::TestZarrDictStore::(test_async_load_multiple_variables|test_concurrent_load_multiple_objects"
        r"|test_indexing)\[",
        "the test asserts that zarr-python's AsyncArray.getitem is awaited: the engine reads the "
        "chunks itself (on its threads, off the event loop); the values load_async gives are "
        "tested by the package's own tests (tests/test_backend.py)",
    ),
]


def xarray_source(cache: Path) -> Path:
    """The installed xarray version's source distribution, unpacked under ``cache`` (fetched
    with pip once)."""
    import tarfile

    import xarray

    version = xarray.__version__
    root = cache / f"xarray-{version}"
    if (root / "xarray" / "tests" / "test_backends.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"xarray-{version}.tar.gz"
    if not archive.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", str(cache), f"xarray=={version}"],
            check=True,
        )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return root


def xarray_tests(source: Path) -> list[str]:
    return ["xarray/tests/test_backends.py", "xarray/tests/test_backends_datatree.py"]


def run_route(route: str, device: str, extra: list[str], source: Path, workdir: Path) -> tuple[dict, float]:
    """Run xarray's Zarr tests (in its unpacked ``source``, with its pytest configuration) under
    ``route``; each test's outcome and the seconds taken."""
    log = workdir / f"{route}.jsonl"
    log.unlink(missing_ok=True)
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "CUPY_XARRAY_ROUTE": route,
        "CUPY_XARRAY_ROUTE_DEVICE": device,
        "CUPY_XARRAY_ROUTE_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    cmd = [
        sys.executable, "-m", "pytest", "-p", "conformance_route", "-p", "no:cacheprovider",
        # xarray's own configuration (warnings from xarray are errors), less its mypy plugin's
        # option; the tests' files in a directory of their own
        "-q", "--no-header", "-rN", "-o", "addopts=--strict-markers", "-o", "log_cli_level=WARNING",
        f"--basetemp={workdir / route}", "-k", "zarr or Zarr", *xarray_tests(source), *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    results, routed = {}, None
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if "routed" in row:
                routed = row["routed"]
            else:
                results[row["test"]] = row
    if not results:
        print(out.stdout[-3000:], out.stderr[-3000:], sep="\n")
        sys.exit(f"route {route}: no test ran (pytest exited {out.returncode})")
    if route != "baseline" and not routed:
        # a route that sent nothing through cupy-xarray tested nothing of it
        sys.exit(f"route {route}: no call was routed through cupy-xarray ({len(results)} tests ran)")
    print(f"route {route}: {len(results)} tests, {routed or 0} calls routed through cupy-xarray", flush=True)
    return results, seconds


def allowed(route: str, test: str) -> str | None:
    for where, pattern, reason in DIVERGENCES:
        if where in (route, "*") and re.search(pattern, test):
            return reason
    return None


def short(test: str) -> str:
    return test.split("/tests/", 1)[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of " + ", ".join(ROUTES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="the reads route's device")
    parser.add_argument("--json", help="write the table and the failures to this file")
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "cupy-xarray-conformance"),
        help="where xarray's source distribution is fetched and unpacked",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)
    routes = [r for r in args.routes.split(",") if r]
    if "baseline" not in routes:
        routes.insert(0, "baseline")
    import xarray
    import zarr

    print(f"xarray {xarray.__version__}, zarr {zarr.__version__}, reads on the {args.device}")
    results, seconds = {}, {}
    source = xarray_source(Path(args.cache))
    with tempfile.TemporaryDirectory(prefix="cupy-xarray-conformance-") as tmp:
        for route in routes:
            results[route], seconds[route] = run_route(
                route, args.device, args.pytest_args, source, Path(tmp)
            )
    base = results["baseline"]
    table, unexplained, divergent = [], [], []
    for route in routes:
        counts: dict[str, int] = {}
        for row in results[route].values():
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        new = sorted(
            t for t, row in results[route].items()
            if row["outcome"] == "failed" and base.get(t, {}).get("outcome") != "failed"
        )  # fmt: skip
        ok = [(t, allowed(route, t)) for t in new]
        divergent += [(route, t, why) for t, why in ok if why]
        unexplained += [(route, t, results[route][t]["message"]) for t, why in ok if not why]
        table.append(
            (route, len(results[route]), counts.get("passed", 0), counts.get("failed", 0),
             counts.get("skipped", 0) + counts.get("xfailed", 0), len(new), sum(1 for _, w in ok if not w),
             seconds[route])
        )  # fmt: skip
    head = (
        "route",
        "tests",
        "passed",
        "failed",
        "skipped/xfail",
        "failed, not in baseline",
        "unexplained",
        "s",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table:
        print("| " + " | ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in row) + " |")
    grouped: dict[tuple[str, str], int] = {}
    for route, _test, why in divergent:
        grouped[(route, why)] = grouped.get((route, why), 0) + 1
    for (route, why), n in grouped.items():
        print(f"intended divergence ({route}, {n} tests): {why}")
    for route, test, message in unexplained:
        print(f"FAILED ({route}): {short(test)}: {message.splitlines()[0] if message else ''}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "xarray": xarray.__version__, "zarr": zarr.__version__, "device": args.device,
                    "table": [dict(zip(head, row)) for row in table],
                    "unexplained": [dict(route=r, test=t, message=m) for r, t, m in unexplained],
                },
                indent=1,
            )
        )  # fmt: skip
    print(
        "conformance: " + ("0 unexplained failures" if not unexplained else f"{len(unexplained)} unexplained")
    )
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
