"""What to expect on the CPU: ``engine="kvikio", device="cpu"`` beside ``engine="zarr"`` and
tensorstore, on the same stores, in one run.

Usage (any machine)::

    python benchmarks/cpu_reads.py --dir /tmp/cpu-bench --size-gib 1 --json docs/cpu-reads.json

Stores: float32 ``(T, 2048, 2048)`` of smooth data in 4 MiB tiles ``(4, 512, 512)``, written by
xarray: uncompressed, zstd level 1 and Blosc LZ4 + shuffle. For each: an eager load, dask with
the store's own chunks (``chunks={}``) and the median time of a one-chunk selection (open
included). Prints GB/s of decoded bytes, the ratio to ``engine="zarr"``, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

SIDE = 2048


def stores(t: int) -> dict[str, dict]:
    import zarr

    blosc = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    return {
        "uncompressed tiles": {"compressors": None},
        "zstd-1 tiles": {"compressors": zarr.codecs.ZstdCodec(level=1)},
        "blosc-lz4 tiles": {"compressors": blosc},
    }


def write(path: Path, t: int, compressors) -> None:
    import warnings

    import xarray as xr

    warnings.filterwarnings("ignore", category=UserWarning)  # zarr's notes on writing v3 stores

    if (path / "zarr.json").exists():
        return
    y = np.linspace(0, 3, SIDE, dtype="f4")[:, None]
    x = np.linspace(0, 5, SIDE, dtype="f4")[None, :]
    for t0 in range(0, t, 8):
        tt = np.arange(t0, t0 + 8, dtype="f4")[:, None, None]
        field = (np.round((np.sin(y + tt / 7) * np.cos(x) * 20 + 280) * 64) / 64).astype("f4")
        ds = xr.Dataset({"field": (("t", "y", "x"), field)})
        if t0 == 0:
            enc = {"field": {"chunks": (4, 512, 512), "compressors": compressors}}
            ds.to_zarr(path, mode="w", encoding=enc, zarr_format=3)
        else:
            ds.to_zarr(path, append_dim="t")


def best(fn, repeat: int) -> float:
    fn()  # warm: page cache, imports, threads
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(path: Path, repeat: int) -> dict:
    import xarray as xr

    nbytes = xr.open_dataset(path, engine="zarr")["field"].nbytes
    paths = {
        "engine, device='cpu'": lambda: xr.open_dataset(path, engine="kvikio", device="cpu")["field"].values,
        "engine, dask chunks={}": lambda: (
            xr.open_dataset(path, engine="kvikio", device="cpu", chunks={})["field"].values
        ),
        "engine='zarr'": lambda: xr.open_dataset(path, engine="zarr")["field"].values,
    }
    try:
        import tensorstore as ts

        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "field")}}
        paths["tensorstore"] = lambda: ts.open(spec).result().read().result()
    except ImportError:
        pass
    row = {}
    for label, fn in paths.items():
        seconds = best(fn, repeat)
        row[label] = {"GBps": nbytes / seconds / 1e9}

    def one(engine):
        kw = {"device": "cpu"} if engine == "kvikio" else {}

        def read():
            return xr.open_dataset(path, engine=engine, **kw)["field"][4:8, 512:1024, 0:512].values

        return read

    for engine in ("kvikio", "zarr"):
        read = one(engine)
        read()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        row[f"one chunk, engine={engine!r} (ms)"] = statistics.median(times) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-cpu-bench")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import xarray as xr
    import zarr

    t = max(8, int(args.size_gib * 2**30 / (SIDE * SIDE * 4)) // 8 * 8)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    machine = f"{os.cpu_count()} CPU cores, zarr {zarr.__version__}, xarray {xr.__version__}"
    print(f"CPU reads, {t * SIDE * SIDE * 4 / 2**30:.2f} GiB per store, {machine}")
    rows = {}
    for name, spec in stores(t).items():
        path = root / (name.replace(" ", "-") + ".zarr")
        write(path, t, spec["compressors"])
        rows[name] = row = measure(path, args.repeat)
        zarr_gbps = row["engine='zarr'"]["GBps"]
        for label, r in row.items():
            if isinstance(r, dict):
                print(
                    f"  {name:>18}  {label:<24} {r['GBps']:6.2f} GB/s  "
                    f"{r['GBps'] / zarr_gbps:5.2f}x engine='zarr'"
                )
            else:
                print(f"  {name:>18}  {label:<24} {r:6.2f}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "GiB": t * SIDE * SIDE * 4 / 2**30}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
