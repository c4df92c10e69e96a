"""Where small reads spend their time: a host profile of many small selections in one
thread, the phase times (threads' seconds included) of one eager read, and with ``--dask``
a host profile of a dask ``chunks={}`` read (one task per stored chunk), per store.

Usage (GPU machine, on stores written by ``read_patterns.py``, or written here with
``--write``)::

    python benchmarks/profile_small.py /tmp/bench/zstd-tiles.zarr /tmp/bench/uncompressed-tiles.zarr
    python benchmarks/profile_small.py --write /tmp/bench --stores "zstd tiles 1MiB,zstd tiles" --dask
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ["CUPY_XARRAY_PROFILE"] = "1"


def main() -> None:
    import cupy
    import dask
    import numpy as np
    import xarray as xr

    from cupy_xarray.engine import reader

    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--write", default=None, help="write read_patterns.py's --stores here and profile them")
    ap.add_argument("--stores", default="zstd tiles 1MiB,zstd tiles")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dask", action="store_true", help="also profile a chunks={} read")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    paths = list(args.paths)
    if args.write:
        from pathlib import Path

        from read_patterns import SIDE, store_specs, write_store

        t = max(8, int(args.size_gib * 2**30 / (SIDE * SIDE * 4)) // 4 * 4)  # as read_patterns.py
        specs = store_specs(t)
        for name in args.stores.split(","):
            path = Path(args.write) / (name.strip().replace(" ", "-") + ".zarr")
            write_store(path, specs[name.strip()])
            paths.append(str(path))
    for path in paths:
        ds = xr.open_dataset(path, engine="kvikio")
        field = ds["field"]
        t_len, side = field.shape[0], field.shape[1]
        rng = np.random.default_rng(0)
        picks = [
            (int(rng.integers(t_len)), int(rng.integers(side - 256)), int(rng.integers(side - 256)))
            for _ in range(args.count)
        ]

        def run(picks=picks, field=field):
            for t, y, x in picks:
                _ = field[t, y : y + 256, x : x + 256].data
            cupy.cuda.Device().synchronize()

        run()
        t0 = time.perf_counter()
        run()
        per = (time.perf_counter() - t0) / args.count
        print(f"\n== {path}: {per * 1e3:.2f} ms per (1, 256, 256) selection, one thread")
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        _ = field.data
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        _ = xr.open_dataset(path, engine="kvikio")["field"].data
        cupy.cuda.Device().synchronize()
        prof.disable()
        print(f"eager read {time.perf_counter() - t0:.3f} s (profiled); phases (s):",
              {k: round(v, 4) for k, v in reader.last_read_stats.items()})  # fmt: skip
        print("decisions:", [str(d) for d in reader.last_read_decisions])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
        if args.dask:
            lazy = xr.open_dataset(path, engine="kvikio", chunks={})["field"].data
            lazy.compute()
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            lazy.compute()
            cupy.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
            per = dt / lazy.npartitions * 1e3
            print(f"dask chunks={{}}: {dt:.3f} s, {lazy.npartitions} tasks, {per:.2f} ms per task, "
                  f"{lazy.nbytes / dt / 1e9:.2f} GB/s; phases of the last task (s):",
                  {k: round(v, 4) for k, v in reader.last_read_stats.items()})  # fmt: skip
            with dask.config.set(scheduler="synchronous"):  # every task on this thread: profiled
                lazy.compute()
                t0 = time.perf_counter()
                lazy.compute()
                dt = time.perf_counter() - t0
                print(f"one thread: {dt / lazy.npartitions * 1e3:.2f} ms per task")
                prof = cProfile.Profile()
                prof.enable()
                lazy.compute()
                prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
