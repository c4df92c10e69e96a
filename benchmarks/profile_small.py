"""Where small reads spend their time: a host profile of many small selections in one
thread, and the phase times (threads' seconds included) of one eager read, per store.

Usage (GPU machine, on stores written by ``read_patterns.py``)::

    python benchmarks/profile_small.py /tmp/bench/zstd-tiles.zarr /tmp/bench/uncompressed-tiles.zarr
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
    import numpy as np
    import xarray as xr

    from cupy_xarray.engine import reader

    ap = argparse.ArgumentParser()
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    for path in args.stores:
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
        t0 = time.perf_counter()
        _ = xr.open_dataset(path, engine="kvikio")["field"].data
        cupy.cuda.Device().synchronize()
        print(f"eager read {time.perf_counter() - t0:.3f} s; phases (s):",
              {k: round(v, 4) for k, v in reader.last_read_stats.items()})  # fmt: skip
        print("decisions:", [str(d) for d in reader.last_read_decisions])


if __name__ == "__main__":
    main()
