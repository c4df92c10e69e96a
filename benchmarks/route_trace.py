"""Each read of a store, one after another, with the route the default chose, why, and the
pace it left behind (``engine/observed.py``): how the default learns on this machine.

    python benchmarks/route_trace.py --dir /tmp/bench --stores "zstd tiles" --size-gib 1 --reads 5
    python benchmarks/route_trace.py --dir /tmp/bench --era5 "batch,series" --order auto,auto,cpu,auto

Stores are those of ``route_table.py`` (written there if missing); ``--era5`` traces the
ERA5-like reads of ``route_table.py`` instead (32 steps of one variable, one point's series
of one variable: each a read of its own). ``--order`` gives the ``decode=`` of each read,
e.g. ``auto,auto,gpu,cpu,auto,auto``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def trace(label: str, decode: str, read) -> None:
    """Time ``read()`` (returns a GPU array) and print its report, the paces and the factors."""
    import cupy

    from cupy_xarray import record_reads
    from cupy_xarray.engine import observed

    cupy.get_default_memory_pool().free_all_blocks()
    with record_reads() as reports:
        t0 = time.perf_counter()
        out = read()
        cupy.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
    r = reports[-1]
    phases = {k: round(v * 1e3, 1) for k, v in r.phases.items() if v >= 0.0005}
    print(f"{label} decode={decode}: {r.nbytes / dt / 1e9:.2f} GB/s ({dt * 1e3:.1f} ms) {phases}")
    for d in r.decisions:
        print(f"    {d}")
    paces = {"/".join(k): v for k, v in observed._paces.items()}
    print(
        "    paces:",
        {
            k: (round(v.gpu_k, 2), *(round(x / 1e9, 1) for x in (v.pool, v.pool_shared, v.io)))
            for k, v in paces.items()
        },
        "(gpu_k, pool alone GB/s, pool beside batches, io)",
    )
    print(
        "    route factors:",
        {"/".join(map(str, k)): round(v[0], 2) for k, v in observed._outcomes.items()},
    )
    del out


def main() -> None:
    import numpy as np
    import xarray as xr
    from read_patterns import era5_store
    from route_table import store

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/cupy-xarray-routes")
    ap.add_argument("--stores", default="zstd tiles")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--era5", default="", help="ERA5-like reads to trace: batch,series")
    ap.add_argument("--era5-steps", type=int, default=128)
    ap.add_argument("--order", default="auto,auto,auto,gpu,cpu,auto,auto")
    args = ap.parse_args()
    order = args.order.split(",")
    if args.era5:
        path = era5_store(Path(args.dir), args.era5_steps)
        opened = {d: xr.open_dataset(path, engine="kvikio", decode=d) for d in set(order)}
        rng = np.random.default_rng(1)
        for kind in args.era5.split(","):
            for i, decode in enumerate(order):
                var = opened[decode]["t2m"]
                if kind == "batch":
                    s = int(rng.integers(0, args.era5_steps - 32))
                    sel = var.isel(time=slice(s, s + 32))
                else:
                    sel = var.isel(lat=int(rng.integers(721)), lon=int(rng.integers(1440)))
                trace(f"era5 {kind} #{i}", decode, lambda sel=sel: sel.data)
        return
    for name in args.stores.split(","):
        path = store(Path(args.dir), name, args.size_gib)
        for i, decode in enumerate(order):
            trace(
                f"{name} #{i}",
                decode,
                lambda path=path, decode=decode: (
                    xr.open_dataset(path, engine="kvikio", decode=decode)["field"].data
                ),
            )


if __name__ == "__main__":
    main()
