"""Small reads on one GPU: one-chunk latency, random (1, 256, 256) selections in 1 and 16
threads, and the eager load, for uncompressed 4 MiB tiles and zstd 1 MiB tiles.

A quick check of the per-call costs (``read_patterns.py`` measures every path beside its
peers). Usage (GPU machine)::

    python benchmarks/small_reads.py [--dir /tmp/small] [--gib 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    import cupy
    import numpy as np
    import xarray as xr
    import zarr
    from read_throughput import in_threads, smooth_field

    import cupy_xarray  # noqa: F401

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-small")
    ap.add_argument("--gib", type=float, default=0.25)
    args = ap.parse_args()
    side = 2048
    t_len = max(8, int(args.gib * 2**30 / (side * side * 4)) // 4 * 4)
    stores = {
        "uncompressed tiles": ((4, 512, 512), None),
        "zstd tiles 1MiB": ((1, 512, 512), zarr.codecs.ZstdCodec(level=1)),
    }
    for name, (chunks, comp) in stores.items():
        path = Path(args.dir) / (name.replace(" ", "-") + ".zarr")
        if not (path / "zarr.json").exists():
            data = smooth_field((t_len, side, side))
            enc = {"field": {"chunks": chunks, "compressors": comp}}
            xr.Dataset({"field": (("t", "y", "x"), data)}).to_zarr(
                path, mode="w", zarr_format=3, encoding=enc
            )
        field = xr.open_dataset(path, engine="kvikio", consolidated=False)["field"]
        rng = np.random.default_rng(0)
        picks = [
            (int(rng.integers(t_len)), int(rng.integers(side - 256)), int(rng.integers(side - 256)))
            for _ in range(300)
        ]

        def run(ps, field=field):
            for t, y, x in ps:
                _ = field[t, y : y + 256, x : x + 256].data
            cupy.cuda.Device().synchronize()

        run(picks[:20])
        t0 = time.perf_counter()
        run(picks)
        one = len(picks) / (time.perf_counter() - t0)
        many = 16 * len(picks) / in_threads(lambda _k, picks=picks: run(picks), 16)
        lat = []
        for i in range(30):
            t0 = time.perf_counter()
            _ = field[i % t_len, :512, :512].data
            cupy.cuda.Device().synchronize()
            lat.append(time.perf_counter() - t0)
        _ = field.data
        t0 = time.perf_counter()
        full = xr.open_dataset(path, engine="kvikio", consolidated=False)["field"].data
        cupy.cuda.Device().synchronize()
        gbps = full.nbytes / (time.perf_counter() - t0) / 1e9
        print(
            f"{name}: one chunk {statistics.median(lat) * 1e3:.2f} ms; selections/s 1 thread {one:.0f}, "
            f"16 threads {many:.0f} ({many / one:.1f}x); eager {gbps:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
