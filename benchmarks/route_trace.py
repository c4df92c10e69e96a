"""Each read of a store, one after another, with the route the default chose, why, and the
pace it left behind (``engine/observed.py``): how the default learns on this machine.

    python benchmarks/route_trace.py --dir /tmp/bench --stores "zstd tiles" --size-gib 1 --reads 5

Stores are those of ``route_table.py`` (written there if missing). ``--order`` gives the
``decode=`` of each read, e.g. ``auto,auto,gpu,cpu,auto,auto``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    import cupy
    import xarray as xr
    from route_table import store

    from cupy_xarray import record_reads
    from cupy_xarray.engine import observed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/cupy-xarray-routes")
    ap.add_argument("--stores", default="zstd tiles")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--order", default="auto,auto,auto,gpu,cpu,auto,auto")
    args = ap.parse_args()
    for name in args.stores.split(","):
        path = store(Path(args.dir), name, args.size_gib)
        for i, decode in enumerate(args.order.split(",")):
            cupy.get_default_memory_pool().free_all_blocks()
            with record_reads() as reports:
                t0 = time.perf_counter()
                out = xr.open_dataset(path, engine="kvikio", decode=decode)["field"].data
                cupy.cuda.Device().synchronize()
                dt = time.perf_counter() - t0
            r = reports[-1]
            phases = {k: round(v * 1e3, 1) for k, v in r.phases.items() if v >= 0.0005}
            print(
                f"{name} #{i} decode={decode}: {out.nbytes / dt / 1e9:.2f} GB/s ({dt * 1e3:.0f} ms) {phases}"
            )
            for d in r.decisions:
                print(f"    {d}")
            paces = {"/".join(k): v for k, v in observed._paces.items()}
            print(
                "    paces:",
                {
                    k: (
                        round(v.gpu_k, 2),
                        round(v.pool / 1e9, 1),
                        round(v.pool_shared / 1e9, 1),
                        round(v.io / 1e9, 1),
                    )
                    for k, v in paces.items()
                },
                "(gpu_k, pool alone GB/s, pool beside batches, io)",
            )
            print(
                "    route factors:",
                {"/".join(map(str, k)): round(v[0], 2) for k, v in observed._outcomes.items()},
            )
            del out


if __name__ == "__main__":
    main()
