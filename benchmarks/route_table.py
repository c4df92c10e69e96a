"""The default read beside ``decode="gpu"`` and ``decode="cpu"``, on every read pattern.

Usage (GPU machine)::

    python benchmarks/route_table.py --dir /tmp/bench --json out.json            # about 3 min
    python benchmarks/route_table.py --dir /tmp/bench --size-gib 4 --json out.json  # the record
    python benchmarks/route_table.py --compare before.json after.json           # side by side

For each store (float32 ``(T, 2048, 2048)`` in 4 MiB tiles, written by zarr-python:
uncompressed, zstd-1, zarr v3's default zstd, Blosc zstd and Blosc LZ4 with shuffle, numcodecs
LZ4) it times an eager ``open_dataset(...).load()`` with ``decode="auto"`` (the default),
``"gpu"`` and ``"cpu"``, best of ``--repeat`` after a warm-up (the decode choices taken in
turns), and prints GB/s of decoded bytes, the default's ratio to the better of the two others,
the default read's split (chunks to nvCOMP / to CPU threads) and its phases, and peak GPU
memory over the output. Then, on the zstd-1 store: dask ``chunks={}`` and ``chunks="auto"``
against the eager default; on an ERA5-like store (four variables, 721 x 1440 zstd chunks): a
batch of 32 consecutive steps of every variable and one point's series of every variable; and
in fresh processes the first one-chunk read after open and the first full load against warm
ones. ``--paths`` picks the decode choices measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

STORES = (
    "uncompressed tiles",
    "zstd tiles",
    "zstd3 tiles",
    "blosc-zstd tiles",
    "blosc-lz4 tiles",
    "lz4 tiles",
)
DECODES = ("auto", "gpu", "cpu")


def specs() -> dict:
    import zarr
    from zarr.codecs import numcodecs as zn

    tiles = (4, 512, 512)
    return {
        "uncompressed tiles": dict(chunks=tiles, compressors=None),
        "zstd tiles": dict(chunks=tiles, compressors=zarr.codecs.ZstdCodec(level=1)),
        "zstd3 tiles": dict(chunks=tiles, compressors=zarr.codecs.ZstdCodec()),  # v3's default
        "blosc-zstd tiles": dict(
            chunks=tiles, compressors=zarr.codecs.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")
        ),
        "blosc-lz4 tiles": dict(
            chunks=tiles, compressors=zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
        ),
        "lz4 tiles": dict(chunks=tiles, compressors=zn.LZ4()),
    }


def store(root: Path, name: str, size_gib: float) -> Path:
    import xarray as xr
    from read_throughput import smooth_field

    t = max(8, int(size_gib * 2**30 / (2048 * 2048 * 4)) // 4 * 4)
    path = root / f"{name.replace(' ', '-')}-{t}.zarr"
    if not (path / "zarr.json").exists():
        data = smooth_field((t, 2048, 2048))
        xr.Dataset({"field": (("t", "y", "x"), data)}).to_zarr(
            path, mode="w", zarr_format=3, consolidated=False, encoding={"field": specs()[name]}
        )
    return path


def sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def timed(fn, repeat: int) -> tuple[float, int, object]:
    """Best seconds of ``repeat`` runs after a warm-up, peak GPU memory of the last, and the
    last run's read report (``None`` where it made no read)."""

    out = fn()
    sync()
    del out
    best, peak, report = float("inf"), 0, None
    for _ in range(repeat):
        t, used, last = _once(fn)
        if t < best:
            best, peak, report = t, used, last
    return best, peak, report


def _once(fn) -> tuple[float, int, object]:
    """Seconds of one run of ``fn``, its peak GPU memory and its last read report."""
    import cupy
    from read_throughput import PeakGPUMemory

    from cupy_xarray import record_reads

    cupy.get_default_memory_pool().free_all_blocks()
    with record_reads() as reports, PeakGPUMemory() as mem:
        t0 = time.perf_counter()
        out = fn()
        sync()
        t = time.perf_counter() - t0
        del out
    return t, mem.used, reports[-1] if reports else None


def interleaved(fns: dict, repeat: int) -> dict:
    """Best of ``repeat`` runs of each of ``fns`` after a warm-up of each, the runs taken in
    turns (a, b, c, a, b, c, ...) so that what else the machine does falls on all alike."""
    for fn in fns.values():
        out = fn()
        sync()
        del out
    best = {name: (float("inf"), 0, None) for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            got = _once(fn)
            if got[0] < best[name][0]:
                best[name] = got
    return best


def describe(report) -> dict:
    if report is None:
        return {}
    split = [(d.gpu, d.host) for d in report.decisions]
    gpu, host = sum(s[0] for s in split), sum(s[1] for s in split)
    phases = {k: round(v * 1e3, 1) for k, v in report.phases.items() if v >= 0.0005}
    return {"nvcomp": gpu, "cpu": host, "batches": report.batches, "phases_ms": phases}


def line(label: str, gbps: float, extra: str = "") -> None:
    print(f"  {label:<44} {gbps:7.2f} GB/s {extra}", flush=True)


def eager(root: Path, args) -> list[dict]:
    import xarray as xr

    rows = []
    for name in args.stores.split(","):
        path = store(root, name, args.size_gib)
        row = {"store": name, "paths": {}}

        def fn(decode, path=path):
            ds = xr.open_dataset(path, engine="kvikio", decode=decode)
            return ds["field"].data

        decodes = args.paths.split(",")
        runs = interleaved({d: functools.partial(fn, d) for d in decodes}, args.repeat)
        for decode in decodes:
            t, peak, rep = runs[decode]
            nbytes = rep.nbytes if rep is not None else 0
            row["nbytes"] = nbytes or row.get("nbytes", 0)
            gb = row["nbytes"] / 1e9
            d = describe(rep)
            row["paths"][decode] = {
                "GBps": gb / t,
                "ms": t * 1e3,
                "peak_x": peak / max(row["nbytes"], 1),
                **d,
            }
            line(f"{name} decode={decode}", gb / t, f"peak {peak / max(row['nbytes'], 1):.2f}x  {d}")
        ratio(row)
        rows.append(row)
    return rows


def ratio(row: dict) -> None:
    p = row["paths"]
    others = [p[k]["GBps"] for k in ("gpu", "cpu") if k in p]
    if "auto" in p and others:
        row["default_vs_best"] = p["auto"]["GBps"] / max(others)
        print(f"  {row['store']:<44} default / better of gpu, cpu: {row['default_vs_best']:.2f}", flush=True)


def dask_reads(root: Path, args) -> dict:
    import xarray as xr

    import cupy_xarray
    from cupy_xarray.options import Options

    path = store(root, "zstd tiles", args.size_gib)
    out = {}
    runs = [("chunks={}", {}, {}), ("chunks='auto'", "auto", {})]
    if hasattr(Options, "read_ahead"):  # the same with read-ahead (:mod:`cupy_xarray.xarray.readahead`)
        ahead = {"read_ahead": "auto"}
        runs += [("chunks={} read ahead", {}, ahead), ("chunks='auto' read ahead", "auto", ahead)]
    for label, chunks, settings in runs:

        def fn(chunks=chunks, settings=settings):
            with cupy_xarray.set_options(**settings):
                ds = xr.open_dataset(path, engine="kvikio", chunks=chunks)
            return ds["field"].data.compute()

        nbytes = xr.open_dataset(path, engine="kvikio", chunks={})["field"].nbytes
        t, peak, _ = timed(fn, max(1, args.repeat - 1))
        out[label] = {"GBps": nbytes / 1e9 / t, "ms": t * 1e3}
        line(f"zstd tiles dask {label}", nbytes / 1e9 / t)
    return out


def era5(root: Path, args) -> dict:
    import xarray as xr
    from read_patterns import ERA5_VARS, era5_store

    path = era5_store(root, args.era5_steps)
    steps = args.era5_steps
    rng = np.random.default_rng(0)
    out: dict = {}
    decodes = args.paths.split(",")
    opened = {d: xr.open_dataset(path, engine="kvikio", decode=d) for d in decodes}
    starts = [int(s) for s in rng.integers(0, steps - 32, size=8)]
    points = [(int(rng.integers(721)), int(rng.integers(1440))) for _ in range(8)]

    def batch(ds, i):
        return [ds[v].isel(time=slice(starts[i], starts[i] + 32)).data for v in ERA5_VARS]

    def series(ds, i):
        return [ds[v].isel(lat=points[i][0], lon=points[i][1]).data for v in ERA5_VARS]

    for label, fn, nbytes in (
        ("32 steps x 4 vars", batch, 32 * 721 * 1440 * 4 * len(ERA5_VARS)),
        (f"point series ({steps} steps x 4 vars)", series, steps * 721 * 1440 * 4 * len(ERA5_VARS)),
    ):
        for d in decodes:
            fn(opened[d], 0)
            sync()
        times: dict = {d: [] for d in decodes}
        for i in range(8):
            for d in decodes:  # in turns: what else the machine does falls on each alike
                t0 = time.perf_counter()
                fn(opened[d], i)
                sync()
                times[d].append(time.perf_counter() - t0)
        for d in decodes:
            t = statistics.median(times[d])
            out.setdefault(label, {})[d] = {"GBps": nbytes / 1e9 / t, "ms": t * 1e3}
            line(f"era5 {label} decode={d}", nbytes / 1e9 / t, f"{t * 1e3:.1f} ms (chunk bytes)")
    for label, row in out.items():
        others = [row[k]["ms"] for k in ("gpu", "cpu") if k in row]
        if "auto" in row and others:
            row["default_vs_best"] = min(others) / row["auto"]["ms"]
            print(f"  era5 {label:<39} default / better: {row['default_vs_best']:.2f}", flush=True)
    return out


def first_reads(root: Path, args) -> dict:
    import tempfile

    from first_minute import store_child

    path = str(store(root, "zstd tiles", args.size_gib))
    out: dict = {}
    with tempfile.TemporaryDirectory() as cache:
        store_child(path, "one chunk", cache)  # cupy's kernel cache, as from a user's second process on
        for what in ("one chunk", "full load"):
            runs = [store_child(path, what, cache) for _ in range(args.fresh_runs)]
            first = statistics.median(r[f"first {what}"] for r in runs)
            warm = statistics.median(r[f"second {what}"] for r in runs)
            out[what] = {
                "first_s": first,
                "warm_s": warm,
                "open_s": statistics.median(r["first open"] for r in runs),
            }
            print(f"  fresh process {what:<30} first {first * 1e3:7.1f} ms, warm {warm * 1e3:7.1f} ms "
                  f"({first / warm:.2f}x)", flush=True)  # fmt: skip
    return out


def compare(paths: list[str]) -> None:
    """Default reads of several runs side by side (GB/s; ms where a latency)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    print("| read | " + " | ".join(Path(p).stem for p in paths) + " |")
    print("| --- |" + " ---: |" * len(paths))
    keys: list[tuple[str, str]] = []
    for r in runs:
        for row in r.get("eager", []):
            for d in row["paths"]:
                if (row["store"], d) not in keys:
                    keys.append((row["store"], d))
    for store_name, d in keys:
        cells = []
        for r in runs:
            row = next((x for x in r.get("eager", []) if x["store"] == store_name), None)
            v = row and row["paths"].get(d)
            cells.append(f"{v['GBps']:.2f}" if v else "")
        print(f"| {store_name} decode={d} | " + " | ".join(cells) + " |")
    for store_name in dict.fromkeys(k[0] for k in keys):
        cells = []
        for r in runs:
            row = next((x for x in r.get("eager", []) if x["store"] == store_name), None)
            cells.append(f"{row['default_vs_best']:.2f}" if row and "default_vs_best" in row else "")
        print(f"| {store_name} default / better | " + " | ".join(cells) + " |")
    for section, unit in (("dask", "GBps"), ("era5", "ms"), ("first", "first_s")):
        labels = list(dict.fromkeys(k for r in runs for k in r.get(section, {})))
        for label in labels:
            cells = []
            for r in runs:
                v = r.get(section, {}).get(label)
                if v is None:
                    cells.append("")
                elif section == "era5":
                    cells.append(" / ".join(f"{d} {v[d]['ms']:.1f}" for d in DECODES if d in v) + " ms")
                elif section == "first":
                    cells.append(f"{v['first_s'] * 1e3:.0f} ms (warm {v['warm_s'] * 1e3:.0f})")
                else:
                    cells.append(f"{v[unit]:.2f}")
            print(f"| {section} {label} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-routes")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--paths", default=",".join(DECODES), help="decode choices measured")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--era5-steps", type=int, default=128)
    ap.add_argument("--fresh-runs", type=int, default=2)
    ap.add_argument("--skip", default="", help="sections to leave out: dask,era5,first")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", nargs="+", default=None, help="print runs' JSON side by side")
    ap.add_argument("--set", action="append", default=[], help="an engine setting, name=value")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from read_throughput import run_meta

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    import cupy

    _ = float(cupy.arange(1024, dtype=cupy.float32).mean())
    result: dict = {"meta": run_meta(), "size_gib": args.size_gib, "settings": args.set}
    skip = set(args.skip.split(","))
    import cupy_xarray
    from cupy_xarray.options import _convert

    settings = {}
    for item in args.set:
        name, value = item.split("=", 1)
        settings[name] = _convert(name, value, "--set")
    with cupy_xarray.set_options(**settings):
        run(root, args, result, skip)


def run(root: Path, args, result: dict, skip: set) -> None:
    def save() -> None:
        try:
            from cupy_xarray.engine import observed

            result["paces"] = {"/".join(k): v.__dict__ for k, v in observed._paces.items()}
        except ImportError:  # an engine without them
            pass
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    result["eager"] = eager(root, args)
    save()
    if "dask" not in skip:
        result["dask"] = dask_reads(root, args)
        eager_default = next(r for r in result["eager"] if r["store"] == "zstd tiles")["paths"]["auto"][
            "GBps"
        ]
        for v in result["dask"].values():
            v["x_eager"] = v["GBps"] / eager_default
        save()
    if "era5" not in skip:
        result["era5"] = era5(root, args)
        save()
    if "first" not in skip:
        result["first"] = first_reads(root, args)
        save()


if __name__ == "__main__":
    main()
