"""Where the host route of a GPU read spends its time: CPU threads read, decode and place each
chunk (``decode="cpu"``, and the default's CPU share). Beside the read, on the same chunks: the
reads alone, the decodes alone, the default read, and the read with each way of placing a
tile (2-D copies, a scratch chunk and the scatter kernel) and with more threads.

Usage (GPU machine)::

    python benchmarks/host_route.py --dir /tmp/pat --size-gib 4 --stores "lz4 tiles,zstd tiles"
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import time
from pathlib import Path

os.environ.setdefault("CUPY_XARRAY_PROFILE", "1")


def profile_store(name: str, path: Path, threads: int) -> None:
    """Print each path's GB/s and the read's phases, best of 3 after a warm-up."""
    import cupy
    import numcodecs
    import numpy as np
    import xarray as xr
    import zarr

    from cupy_xarray import record_reads, set_options

    arr = zarr.open_array(path / "field", mode="r")
    gb = arr.nbytes / 1e9
    files = sorted(f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json")
    pool = cf.ThreadPoolExecutor(threads)
    blobs = [np.fromfile(f, np.uint8) for f in files]
    expected = int(np.prod(arr.chunks)) * arr.dtype.itemsize
    outs = [np.empty(expected, np.uint8) for _ in blobs]
    numcodec = {"lz4": numcodecs.LZ4(), "zstd": numcodecs.Zstd()}.get(name.split()[0])

    def reads_alone():
        return list(pool.map(lambda f: np.fromfile(f, np.uint8), files))

    def decodes_alone():
        return list(pool.map(lambda i: numcodec.decode(blobs[i], out=outs[i]), range(len(blobs))))

    def read(decode="cpu", **opts):
        def fn():
            with set_options(**opts):
                ds = xr.open_dataset(path, engine="kvikio", decode=decode, threads=threads)
                return ds["field"].data

        return fn

    paths = {f"reads alone ({threads} threads)": reads_alone}
    if numcodec is not None:
        paths["decodes alone (numcodecs)"] = decodes_alone
    paths |= {
        "default read": read("auto"),
        "decode=cpu read": read(),
        "decode=cpu, tiles scattered": read(box_min_row=1 << 40),
        "decode=cpu, 32 threads": read(decode_threads=32),
    }
    print(f"{name}: {gb:.2f} GB, ratio {arr.nbytes / sum(len(b) for b in blobs):.2f}")
    for label, fn in paths.items():
        fn()
        best, phases = float("inf"), {}
        for _ in range(3):
            cupy.get_default_memory_pool().free_all_blocks()
            with record_reads() as reports:
                t0 = time.perf_counter()
                out = fn()
                cupy.cuda.Device().synchronize()
                dt = time.perf_counter() - t0
            del out
            if dt < best:
                best, phases = dt, (dict(reports[-1].phases) if reports else {})
        shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items() if v > 0.002)
        print(f"  {label:<30} {gb / best:6.2f} GB/s  {best * 1e3:7.1f} ms  [{shown}]", flush=True)


def main() -> None:
    from read_patterns import pattern_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/pat")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--stores", default="lz4 tiles,zstd tiles")
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    for name in args.stores.split(","):
        path = pattern_store(args.dir, name, args.size_gib)
        profile_store(name, path, args.threads)


if __name__ == "__main__":
    main()
