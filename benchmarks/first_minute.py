"""What a fresh process spends before its first result: import, first read, first reduction.

Each measurement runs in a new Python process, first with empty kernel caches (``cold``: cupy's
``CUPY_CACHE_DIR`` and the engine's decode-rate cache in a new folder) and then again with the
caches that run left behind (``warm``), which is what a user sees from the second process on.

With ``--store PATH`` (a store of one variable ``field``, as ``read_patterns.py`` writes
them) it measures instead a fresh process's first reads of that store against the same
reads once warm: a one-chunk selection right after ``open_dataset``, and a full load.

Usage (GPU machine)::

    python benchmarks/first_minute.py [--runs 3] [--profile] [--json docs/benchmarks-first-minute.json]
    python benchmarks/first_minute.py --store /tmp/bench/zstd-tiles.zarr
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
t = {}
t0 = time.perf_counter()
import xarray as xr
t["import xarray"] = time.perf_counter() - t0
t0 = time.perf_counter()
import cupy_xarray
from cupy_xarray.sample import sample_path
t["import cupy_xarray"] = time.perf_counter() - t0
device = sys.argv[1]
profile = sys.argv[2] == "1"
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
ds = xr.open_dataset(sample_path(), engine="kvikio", device=device)
t["open_dataset"] = time.perf_counter() - t0
t0 = time.perf_counter()
air = ds.air.load()
t["first load"] = time.perf_counter() - t0
t0 = time.perf_counter()
anomaly = air - air.mean("time")
float(anomaly.std().data)
t["first reduction"] = time.perf_counter() - t0
if profile:
    prof.disable()
    import io, pstats
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
    sys.stderr.write(s.getvalue())
t0 = time.perf_counter()
air = xr.open_dataset(sample_path(), engine="kvikio", device=device).air.load()
t["second open + load"] = time.perf_counter() - t0
t0 = time.perf_counter()
anomaly = air - air.mean("time")
float(anomaly.std().data)
t["second reduction"] = time.perf_counter() - t0
print(json.dumps(t))
"""


STORE_CHILD = r"""
import json, os, sys, time
t = {}
prof = None
if os.environ.get("FIRST_READ_PROFILE"):  # --profile: where the first open and read wait
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
import xarray as xr
import cupy_xarray
t["imports"] = time.perf_counter() - t0
path, what = sys.argv[1], sys.argv[2]


def sync():
    try:
        import cupy
        cupy.cuda.Device().synchronize()
    except Exception:
        pass


for k in ("first", "second"):
    t0 = time.perf_counter()
    ds = xr.open_dataset(path, engine="kvikio")
    t[f"{k} open"] = time.perf_counter() - t0
    field = ds["field"]
    t0 = time.perf_counter()
    if what == "one chunk":
        ct, cy, cx = field.encoding["chunks"]
        _ = field[:ct, :cy, :cx].data
    else:
        _ = field.data
    sync()
    t[f"{k} {what}"] = time.perf_counter() - t0
    del _
    if prof is not None and k == "first":
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
        prof = None
print(json.dumps(t))
"""


def store_child(path: str, what: str, cache: str, profile: bool = False) -> dict[str, float]:
    env = dict(os.environ, CUPY_CACHE_DIR=os.path.join(cache, "cupy"))
    if profile:
        env["FIRST_READ_PROFILE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", STORE_CHILD, path, what], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr}")
    if profile:
        print(out.stderr[-12000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def store_main(args) -> None:
    """First reads of ``args.store`` in fresh processes (kernel caches warm: a second run)."""
    rows: dict[str, list[dict[str, float]]] = {"one chunk": [], "full load": []}
    with tempfile.TemporaryDirectory() as cache:
        store_child(args.store, "one chunk", cache)  # fills cupy's kernel cache
        if args.profile:
            store_child(args.store, "one chunk", cache, profile=True)
        for _ in range(args.runs):
            for what in rows:
                rows[what].append(store_child(args.store, what, cache))
    print(f"fresh process, {args.store}: median of {args.runs} runs, seconds")
    for what, runs in rows.items():
        for key in runs[0]:
            print(f"| {what} | {key} | {sorted(r[key] for r in runs)[len(runs) // 2]:.4f} |")
        first = sorted(r[f"first {what}"] for r in runs)[len(runs) // 2]
        second = sorted(r[f"second {what}"] for r in runs)[len(runs) // 2]
        print(f"{what}: first / warm = {first / second:.2f}x ({first * 1e3:.1f} ms / {second * 1e3:.1f} ms)")
    if args.json:
        from read_throughput import run_meta

        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "store": args.store, "rows": rows}, f, indent=1)


def run_child(device: str, cache: str, profile: bool) -> dict[str, float]:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = os.path.join(cache, "cupy")
    env["CUPY_XARRAY_CACHE"] = os.path.join(cache, "cupy-xarray")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, device, "1" if profile else "0"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr}")
    if profile:
        print(out.stderr[-6000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the first read of a cold run")
    ap.add_argument("--json", default="")
    ap.add_argument("--store", default="", help="first reads of this store instead (see above)")
    args = ap.parse_args()
    if args.store:
        store_main(args)
        return

    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            rows["cold"].append(run_child(args.device, cache, args.profile and i == 0))
            rows["warm"].append(run_child(args.device, cache, args.profile and i == 0))
    phases = list(rows["cold"][0])
    print(f"fresh process on {args.device}: median of {args.runs} runs, seconds")
    print("| phase | cold caches | warm caches |\n| --- | ---: | ---: |")
    for p in phases:
        cold = sorted(r[p] for r in rows["cold"])[args.runs // 2]
        warm = sorted(r[p] for r in rows["warm"])[args.runs // 2]
        print(f"| {p} | {cold:.3f} | {warm:.3f} |")
    if args.json:
        from read_throughput import run_meta

        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
