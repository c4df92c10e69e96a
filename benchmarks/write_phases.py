"""Where a GPU write's time goes: the stages of ``ds.cupy.to_zarr`` for zstd, each alone.

Usage (GPU machine): ``python benchmarks/write_phases.py --size-gib 4``

On a float32 ``(T, 2048, 2048)`` field in 4 MiB tiles: the tiles made contiguous; nvCOMP's zstd
compression of all of them in one call and in calls of 256; the compressed bytes copied to the
host; the files written by 16 threads; and the whole engine write, best of three each.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import shutil
import time
from pathlib import Path

import numpy as np
from read_throughput import smooth_field

TILE = (4, 512, 512)


def best(fn, repeat: int = 3) -> float:
    import cupy

    fn()
    times = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    import cupy
    import xarray as xr
    import zarr
    from nvidia import nvcomp

    from cupy_xarray.write.encoders import _to_host

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/wphases")
    args = ap.parse_args()
    t = max(4, int(args.size_gib * 2**30 / (2048 * 2048 * 4)) // 4 * 4)
    field = cupy.asarray(smooth_field((t, 2048, 2048)))
    gb = field.nbytes / 1e9
    grid = [(i, j, k) for i in range(t // 4) for j in range(4) for k in range(4)]

    def tiles():
        return [
            cupy.ascontiguousarray(field[i * 4 : i * 4 + 4, j * 512 : j * 512 + 512, k * 512 : k * 512 + 512])
            .reshape(-1)
            .view(cupy.uint8)
            for i, j, k in grid
        ]

    raws = tiles()
    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
    out = {}

    def encode(per):
        def run():
            encoded = []
            for s in range(0, len(raws), per):
                encoded += codec.encode(nvcomp.as_arrays(raws[s : s + per]))
            cupy.cuda.Device().synchronize()
            out["encoded"] = encoded

        return run

    root = Path(args.dir)
    pool = cf.ThreadPoolExecutor(16)

    def to_host():
        out["host"] = _to_host([cupy.asarray(e).view(cupy.uint8).reshape(-1) for e in out["encoded"]])

    def write_files():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        list(pool.map(lambda a: (root / str(a[0])).write_bytes(memoryview(a[1])), enumerate(out["host"])))

    ds = xr.Dataset({"field": (("t", "y", "x"), field)})
    enc = {"field": {"chunks": TILE, "compressors": zarr.codecs.ZstdCodec(level=1)}}

    def engine():
        ds.cupy.to_zarr(root.with_suffix(".zarr"), mode="w", encoding=enc)

    stages = {
        "tiles made contiguous": tiles,
        "nvCOMP zstd, one call": encode(len(raws)),
        "nvCOMP zstd, calls of 256": encode(256),
        "copy to the host": to_host,
        "files written (16 threads)": write_files,
        "engine write, whole": engine,
    }
    print(f"{gb:.2f} GB float32 in {len(grid)} tiles of 4 MiB")
    for label, fn in stages.items():
        s = best(fn)
        print(f"  {label:<28} {s * 1e3:8.1f} ms  {gb / s:6.2f} GB/s", flush=True)
    stored = sum(len(h) for h in out["host"])
    print(f"  compressed: {stored / 2**20:.0f} MiB, ratio {field.nbytes / stored:.2f}")
    np.testing.assert_equal(len(out["host"]), len(grid))


if __name__ == "__main__":
    main()
