"""Writing GPU data to Zarr: the engine's ``ds.cupy.to_zarr`` beside the other ways, one run.

Usage (GPU machine)::

    python benchmarks/write_patterns.py --dir /tmp/wbench --size-gib 4

A float32 ``(T, 2048, 2048)`` Dataset of smooth data in GPU memory (cupy), written in 4 MiB
tiles ``(4, 512, 512)``, uncompressed, zstd-1, Blosc LZ4 + shuffle, numcodecs LZ4, Blosc zstd
(level 5, zarr's default) + shuffle, and
the same tiles in 64 MiB shards ``(16, 1024, 1024)`` (uncompressed and zstd-1), by:

- ``engine``: ``ds.cupy.to_zarr(path, encoding=...)``;
- ``as_numpy().to_zarr``: a host copy written by xarray and zarr-python;
- ``zarr GPU mode``: ``zarr.config.enable_gpu()`` and ``array[:] = cupy_array``;
- ``raw kvikio write``: the same number of 4 MiB files written from GPU memory by kvikio with
  the same threads (the ceiling of an uncompressed write).

Prints GB/s (bytes of the array per second), the ratio to ``as_numpy().to_zarr`` and to zarr's
GPU mode, peak GPU memory beside the data, and the stored size beside zarr-python's at the same
codec and level. Writes go to the page cache (files deleted between runs).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
from read_throughput import PeakGPUMemory, smooth_field

TILE = (4, 512, 512)
SHARD = (16, 1024, 1024)


def codecs() -> dict:
    """Each compared layout's encoding of the field."""
    import zarr
    from zarr.codecs import numcodecs as zn

    zstd = zarr.codecs.ZstdCodec(level=1)
    return {
        "uncompressed": {"chunks": TILE, "compressors": None},
        "zstd-1": {"chunks": TILE, "compressors": zstd},
        "blosc-lz4": {
            "chunks": TILE,
            "compressors": zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
        },
        "lz4": {"chunks": TILE, "compressors": zn.LZ4()},
        "blosc-zstd": {
            "chunks": TILE,
            "compressors": zarr.codecs.BloscCodec(cname="zstd", shuffle="shuffle"),
        },
        "uncompressed-sharded": {"chunks": TILE, "shards": SHARD, "compressors": None},
        "zstd-1-sharded": {"chunks": TILE, "shards": SHARD, "compressors": zstd},
    }


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def paths(gds, host, out: Path, threads: int) -> dict:
    import cupy
    import kvikio
    import zarr

    def engine(enc):
        return lambda p: gds.cupy.to_zarr(p, mode="w", encoding=enc)

    def via_numpy(enc):
        return lambda p: gds.cupy.as_numpy().to_zarr(p, mode="w", encoding=enc)

    def zarr_gpu(enc):
        def write(p):
            with zarr.config.enable_gpu():
                arr = zarr.create_array(p, shape=gds.field.shape, dtype="f4", **enc["field"])
                arr[:] = gds.field.data

        return write

    flat = cupy.ascontiguousarray(gds.field.data).reshape(-1).view(cupy.uint8)
    tile_bytes = int(np.prod(TILE)) * 4

    def raw(p):
        p.mkdir(parents=True, exist_ok=True)
        futures = []
        files = []
        for i in range(flat.size // tile_bytes):
            f = kvikio.CuFile(p / str(i), "w")
            files.append(f)
            futures.append(f.pwrite(flat[i * tile_bytes : (i + 1) * tile_bytes]))
        for fut in futures:
            fut.get()
        for f in files:
            f.close()

    return {
        "engine": engine,
        "as_numpy().to_zarr": via_numpy,
        "zarr GPU mode": zarr_gpu,
        "raw kvikio write": raw,
    }


def main() -> None:
    import cupy
    import kvikio.defaults
    import xarray as xr

    from cupy_xarray import record_writes

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/wbench")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--codecs", default=",".join(codecs()))
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--paths", default="engine,as_numpy().to_zarr,zarr GPU mode,raw kvikio write")
    args = ap.parse_args()
    try:
        kvikio.defaults.set({"num_threads": args.threads})
    except Exception:  # noqa: BLE001 - older kvikio
        kvikio.defaults.num_threads_reset(args.threads)
    t = max(4, int(args.size_gib * 2**30 / (2048 * 2048 * 4)) // 4 * 4)
    host = xr.Dataset({"field": (("t", "y", "x"), smooth_field((t, 2048, 2048)))})
    gds = host.cupy.as_cupy()
    nbytes = host.field.nbytes
    out = Path(args.dir)
    print(f"{nbytes / 2**30:.2f} GiB float32, tiles {TILE}, {args.threads} threads")
    rows = []
    for name in args.codecs.split(","):
        enc = {"field": codecs()[name]}
        figures = {}
        for label, make in paths(gds, host, out, args.threads).items():
            if label not in args.paths.split(",") or (label == "raw kvikio write" and name != "uncompressed"):
                continue
            write = make(enc) if label != "raw kvikio write" else make
            target = out / f"{name}-{label.replace(' ', '_').replace('()', '')}.zarr"
            best, peak, size, encoder = float("inf"), 0, 0, ""
            for i in range(args.repeat + 1):
                shutil.rmtree(target, ignore_errors=True)
                cupy.get_default_memory_pool().free_all_blocks()
                with PeakGPUMemory() as mem, record_writes() as reports:
                    t0 = time.perf_counter()
                    try:
                        write(target)
                    except Exception as exc:  # noqa: BLE001 - a path that cannot write this codec
                        print(f"  {name:>13} {label:<20} failed: {type(exc).__name__}: {str(exc)[:120]}")
                        best = float("nan")
                        break
                    cupy.cuda.Device().synchronize()
                    dt = time.perf_counter() - t0
                if i:  # the first run warms up (kernels, pools, nvCOMP)
                    best = min(best, dt)
                peak = max(peak, mem.peak - mem.base)
                size = stored_bytes(target)
                encoder = reports[-1].encoder if label == "engine" and reports else ""
            figures[label] = (best, peak, size)
            gbs = nbytes / best / 1e9 if best == best else float("nan")
            print(
                f"  {name:>13} {label:<20} {gbs:7.2f} GB/s  peak {peak / nbytes:5.2f}x  "
                f"stored {size / 2**20:8.1f} MiB {encoder}",
                flush=True,
            )
        rows.append((name, figures))
        shutil.rmtree(out, ignore_errors=True)
    print(
        "\n| codec | path | GB/s | × as_numpy().to_zarr | × zarr GPU mode | stored ÷ zarr-python's "
        "| peak GPU ÷ data |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, figures in rows:
        base = figures.get("as_numpy().to_zarr", (float("nan"), 0, 0))
        zgpu = figures.get("zarr GPU mode", (float("nan"), 0, 0))
        for label, (best, peak, size) in figures.items():
            ratio = size / base[2] if base[2] else float("nan")
            print(
                f"| {name} | {label} | {nbytes / best / 1e9:.2f} | {base[0] / best:.2f} | "
                f"{zgpu[0] / best:.2f} | {ratio:.3f} | {peak / nbytes:.2f} |"
            )


if __name__ == "__main__":
    main()
