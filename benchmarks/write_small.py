"""Small writes and dask writes of GPU data: the engine's ``ds.cupy.to_zarr`` beside
``as_numpy().to_zarr`` and zarr's GPU mode, one run.

Usage (GPU machine): ``python benchmarks/write_small.py``

- one chunk: a ``(1, 512, 512)`` float32 field (1 MiB) written whole, zstd-1 and uncompressed,
  median of ``--repeat`` writes into fresh directories (ms);
- an append of that chunk to a store of 64 of them (ms);
- dask: ``--size-gib`` of cupy blocks of 64 MiB, zarr chunks of 4 MiB tiles, zstd-1, computed
  by dask's threaded scheduler (GB/s), and the same data eager.

Writes go to the page cache; directories are deleted outside the timed part.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from read_throughput import PeakGPUMemory, smooth_field
from write_phases import runs


def main() -> None:
    import cupy
    import xarray as xr
    import zarr

    import cupy_xarray  # noqa: F401 - registers the .cupy accessor

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/wsmall")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="profile one warm one-chunk zstd write")
    args = ap.parse_args()
    out = Path(args.dir)
    target = out / "t.zarr"

    def fresh():
        shutil.rmtree(target, ignore_errors=True)

    one = xr.Dataset({"field": (("t", "y", "x"), cupy.asarray(smooth_field((1, 512, 512))))})
    for name, codec in [("zstd-1", zarr.codecs.ZstdCodec(level=1)), ("uncompressed", None)]:
        enc = {"field": {"chunks": (1, 512, 512), "compressors": codec}}

        def zarr_gpu(codec=codec):
            with zarr.config.enable_gpu():
                arr = zarr.create_array(
                    target, shape=(1, 512, 512), chunks=(1, 512, 512), dtype="f4", compressors=codec
                )
                arr[:] = one.field.data

        ways = {
            "engine": lambda enc=enc: one.cupy.to_zarr(target, encoding=enc),
            "as_numpy().to_zarr": lambda enc=enc: one.cupy.as_numpy().to_zarr(target, encoding=enc),
            "zarr GPU mode (array only)": zarr_gpu,
        }
        for label, fn in ways.items():
            ms = statistics.median(runs(fn, fresh, args.repeat)) * 1e3
            print(f"one 1 MiB chunk, {name:<12} {label:<28} {ms:7.2f} ms (median)", flush=True)
        if args.profile and codec is not None:
            import cProfile
            import pstats

            fresh()
            with cProfile.Profile() as prof:
                ways["engine"]()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)

    base = xr.Dataset({"field": (("t", "y", "x"), cupy.asarray(smooth_field((64, 512, 512))))})
    base = base.assign_coords(t=range(64))
    step = one.assign_coords(t=[64])
    enc = {"field": {"chunks": (1, 512, 512), "compressors": zarr.codecs.ZstdCodec(level=1)}}

    def store_of_64():
        fresh()
        base.cupy.to_zarr(target, encoding=enc)

    for label, fn in {
        "engine": lambda: step.cupy.to_zarr(target, append_dim="t"),
        "as_numpy().to_zarr": lambda: step.cupy.as_numpy().to_zarr(target, append_dim="t"),
    }.items():
        ms = statistics.median(runs(fn, store_of_64, min(args.repeat, 10))) * 1e3
        print(f"append of one 1 MiB chunk, zstd-1, {label:<20} {ms:7.2f} ms (median)", flush=True)

    t = max(16, int(args.size_gib * 2**30 / (2048 * 2048 * 4)) // 16 * 16)
    field = cupy.asarray(smooth_field((t, 2048, 2048)))
    eager = xr.Dataset({"field": (("t", "y", "x"), field)})
    lazy = eager.chunk({"t": 4})  # 64 MiB blocks of cupy arrays
    enc = {"field": {"chunks": (4, 512, 512), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    for label, fn in {
        "engine, dask blocks": lambda: lazy.cupy.to_zarr(target, encoding=enc),
        "engine, eager": lambda: eager.cupy.to_zarr(target, encoding=enc),
        "as_numpy().to_zarr, dask blocks": lambda: lazy.cupy.as_numpy().to_zarr(target, encoding=enc),
    }.items():
        with PeakGPUMemory() as mem:
            s = min(runs(fn, fresh, 2))
        print(
            f"{field.nbytes / 2**30:.1f} GiB zstd-1 tiles, {label:<34} {field.nbytes / s / 1e9:6.2f} GB/s  "
            f"peak GPU {mem.used / field.nbytes:.2f}x data",
            flush=True,
        )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
