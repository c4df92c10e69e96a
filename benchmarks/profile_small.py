"""Where small reads spend their time: a host profile of many small selections in one
thread, the phase times (threads' seconds included) of one eager read, and with ``--dask``
a host profile of a dask ``chunks={}`` read (one task per stored chunk), per store.

Usage (GPU machine, on stores written by ``read_patterns.py``, or written here with
``--write``)::

    python benchmarks/profile_small.py /tmp/bench/zstd-tiles.zarr /tmp/bench/uncompressed-tiles.zarr
    python benchmarks/profile_small.py --write /tmp/bench --stores "zstd tiles 1MiB,zstd tiles" --dask

``--raw`` adds the same chunk files read without the engine (and with ``--dask``, by dask
tasks without the engine: what dask's scheduler allows a ``chunks={}`` read).

``--threads N`` adds whole stored chunks read at random by one thread and by ``N`` plain
threads, without dask: the bare read into pinned memory and copy to the GPU, ``read_arrays``
and xarray's indexing, with the threads' seconds per chunk spent in the engine's steps (where
they grow with the threads, the threads wait on each other).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from typing import Any

os.environ.setdefault("CUPY_XARRAY_PROFILE", "1")  # read at import: phases timed exactly


def main() -> None:
    import cupy
    import dask
    import numpy as np
    import xarray as xr

    from cupy_xarray import record_reads

    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--write", default=None, help="write read_patterns.py's --stores here and profile them")
    ap.add_argument("--stores", default="zstd tiles 1MiB,zstd tiles")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dask", action="store_true", help="also profile a chunks={} read")
    ap.add_argument("--raw", action="store_true", help="also time the chunk files read without the engine")
    ap.add_argument("--threads", type=int, default=0, help="also read whole chunks in 1 and N threads")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    paths = list(args.paths)
    if args.write:
        from read_patterns import pattern_store

        for name in args.stores.split(","):
            paths.append(str(pattern_store(args.write, name, args.size_gib)))
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
        with record_reads() as reports:
            _ = xr.open_dataset(path, engine="kvikio")["field"].data
        cupy.cuda.Device().synchronize()
        prof.disable()
        print(f"eager read {time.perf_counter() - t0:.3f} s (profiled); phases (s):",
              {k: round(v, 4) for k, v in reports[-1].phases.items()})  # fmt: skip
        print("decisions:", [str(d) for d in reports[-1].decisions])
        if args.raw:
            raw_reads(path, field.nbytes)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
        if args.threads:
            threaded_chunks(path, args.threads)
        if args.dask:
            lazy = xr.open_dataset(path, engine="kvikio", chunks={})["field"].data
            lazy.compute()
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            with dask.config.set(scheduler="synchronous"), record_reads() as reports:  # reports: this thread
                lazy.compute()
            cupy.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
            per = dt / lazy.npartitions * 1e3
            print(f"dask chunks={{}}: {dt:.3f} s, {lazy.npartitions} tasks, {per:.2f} ms per task, "
                  f"{lazy.nbytes / dt / 1e9:.2f} GB/s; phases of the last task (s):",
                  {k: round(v, 4) for k, v in reports[-1].phases.items()})  # fmt: skip
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
            if args.raw:
                dask_raw_reads(path, field.nbytes)


def threaded_chunks(path: str, threads: int, per_thread: int = 64) -> None:
    """Whole stored chunks at random, ``per_thread`` per thread, in one thread and in
    ``threads`` plain threads (no dask): per chunk, the wall time, GB/s, and the threads'
    seconds in the engine's steps."""
    import collections
    import threading

    import cupy
    import cupyx
    import numpy as np
    import xarray as xr
    from read_throughput import in_threads

    from cupy_xarray import set_options
    from cupy_xarray.engine import host, read_arrays, reader
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.xarray.backend import KvikioBackendArray
    from cupy_xarray.xarray.cf import find_backend_array

    ds = xr.open_dataset(path, engine="kvikio")
    spec = find_backend_array(ds["field"].variable._data, KvikioBackendArray).spec
    grid = [range(-(-n // c)) for n, c in zip(spec.shape, spec.chunks)]
    whole = [
        tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, spec.chunks, spec.shape))
        for idx in np.ndindex(*[len(g) for g in grid])
    ]
    files, codec, chunk_bytes = chunk_files(path)
    dev = resolve_device("gpu")
    spent: dict[str, float] = collections.defaultdict(float)
    lock = threading.Lock()
    local = threading.local()

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t0

        return wrapper

    def bare(i: int):
        if getattr(local, "pinned", None) is None:
            local.pinned = cupyx.empty_pinned((chunk_bytes,), dtype=np.uint8)
            local.stream = cupy.cuda.Stream()
        fd = os.open(files[i % len(files)], os.O_RDONLY)
        try:
            os.preadv(fd, [local.pinned], 0)
        finally:
            os.close(fd)
        block = cupy.empty(chunk_bytes, dtype=cupy.uint8)
        block.data.copy_from_host_async(local.pinned.ctypes.data, chunk_bytes, local.stream)
        local.stream.synchronize()
        return block

    ways = {} if codec is not None else {"bare pread + copy": bare}  # the bare read decodes nothing
    ways["read_arrays"] = lambda i: read_arrays([(spec, whole[i % len(whole)])], dev)[0]
    ways["xarray indexing"] = lambda i: ds["field"][whole[i % len(whole)]].data
    steps = [(reader, "locate"), (reader, "execute"), (host, "_direct_job"), (host, "pread_into")]
    saved = [(m, name, getattr(m, name)) for m, name in steps]
    for m, name, fn in saved:
        setattr(m, name, timed(name, fn))
    free = set_options(profile=False)  # free-running (the worker threads: the defaults)
    try:
        for label, fn in ways.items():
            for n in (1, threads):

                def work(k: int, n=n, fn=fn) -> None:
                    for i in np.random.default_rng(k).integers(len(whole), size=per_thread):
                        fn(int(i))

                work(99)  # warm
                spent.clear()
                t0 = time.perf_counter()
                in_threads(work, n)
                cupy.cuda.Device().synchronize()
                dt = time.perf_counter() - t0
                count = n * per_thread
                steps_us = {k: round(v / count * 1e6) for k, v in spent.items()}
                rate = count * chunk_bytes / dt / 1e9
                print(f"{label}, {n} thread(s): {dt / count * 1e6:.0f} us per chunk, {rate:.2f} GB/s; "
                      f"thread-us per chunk {steps_us}")  # fmt: skip
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        free.__exit__(None, None, None)


def raw_reads(path: str, nbytes: int, threads: int = 16) -> None:
    """The store's chunk files read without the engine, the best of three: compressed ones
    by ``threads`` CPU threads (``os.pread``, numcodecs' decoder into the thread's buffer,
    nothing sent to the GPU), uncompressed ones by ``kvikio.CuFile.pread`` into one GPU
    buffer, every file in flight at once on kvikio's ``threads`` threads."""
    files, codec, chunk_bytes = chunk_files(path)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        if codec is not None:
            _decode_files(files, codec, chunk_bytes, threads)
        else:
            _kvikio_files(files, threads)
        best = min(best, time.perf_counter() - t0)
    how = f"numcodecs on {threads} CPU threads (no GPU copy)" if codec else f"kvikio, {threads} threads"
    print(f"raw: {len(files)} chunk files, {how}: {nbytes / best / 1e9:.2f} GB/s")


def dask_raw_reads(path: str, nbytes: int, threads: int = 16) -> None:
    """What dask's threaded scheduler allows a ``chunks={}`` read without the engine: one
    ``dask.delayed`` task per chunk file that reads it (``os.preadv`` into the thread's pinned
    buffer, numcodecs' decoder where compressed) and copies it into a new cupy array, the
    blocks concatenated as ``.compute()`` does; the best of three, beside the same work on a
    plain pool of ``threads`` threads."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import cupy
    import cupyx
    import dask
    import dask.array as da
    import numpy as np

    files, codec, chunk_bytes = chunk_files(path)
    local = threading.local()

    def one(f: str):
        if getattr(local, "pinned", None) is None:
            local.pinned = cupyx.empty_pinned((chunk_bytes,), dtype=np.uint8)
            local.stream = cupy.cuda.Stream()
        fd = os.open(f, os.O_RDONLY)
        try:
            if codec is None:
                os.preadv(fd, [local.pinned], 0)
            else:
                codec.decode(os.pread(fd, os.fstat(fd).st_size, 0), out=local.pinned)
        finally:
            os.close(fd)
        with local.stream:
            block = cupy.empty(chunk_bytes, dtype=cupy.uint8)
            block.data.copy_from_host_async(local.pinned.ctypes.data, chunk_bytes, local.stream)
        local.stream.synchronize()
        return block

    def graph():
        meta_ = cupy.empty(0, dtype=cupy.uint8)
        parts = [da.from_delayed(dask.delayed(one)(f), (chunk_bytes,), np.uint8, meta=meta_) for f in files]
        with dask.config.set(scheduler="threads", num_workers=threads):
            da.concatenate(parts).compute()

    pool = ThreadPoolExecutor(threads)
    paths = (("dask tasks", graph), (f"a pool of {threads} threads", lambda: list(pool.map(one, files))))
    for label, fn in paths:
        best = float("inf")
        for _ in range(4):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        print(f"without the engine, a chunk per task on {label}: {len(files)} chunks, "
              f"{nbytes / best / 1e9:.2f} GB/s, {best / len(files) * 1e6:.0f} us per chunk")  # fmt: skip
    pool.shutdown()


def _kvikio_files(files: list[str], threads: int) -> None:
    import cupy
    import kvikio
    import kvikio.defaults  # a submodule: not imported by ``import kvikio``
    import numpy as np

    sizes = [os.path.getsize(f) for f in files]
    out = cupy.empty(sum(sizes), dtype=cupy.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    with kvikio.defaults.set({"num_threads": threads}):
        handles = [kvikio.CuFile(f, "r") for f in files]
        futures = [h.pread(out[o : o + n]) for h, o, n in zip(handles, offs, sizes)]
        for fut in futures:
            fut.get()
        for h in handles:
            h.close()


def chunk_files(path: str) -> tuple[list[str], Any, int]:
    """The chunk files of a store's ``field`` array (sorted), the numcodecs codec of its
    compressor (None where uncompressed) and a chunk's decoded bytes, from its ``zarr.json``."""
    import glob
    import json

    import numcodecs
    import numpy as np

    meta = json.load(open(os.path.join(path, "field", "zarr.json")))
    pattern = os.path.join(path, "field", "c", "**")
    files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    codecs = [c for c in meta["codecs"] if c["name"] not in ("bytes", "transpose")]
    codec = None
    if codecs:
        name = codecs[0]["name"].removeprefix("numcodecs.")  # zarr 3 names numcodecs' own codecs so
        codec = numcodecs.get_codec({"id": name, **codecs[0].get("configuration", {})})
    shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
    return files, codec, int(np.prod(shape)) * np.dtype(meta["data_type"]).itemsize


def _decode_files(files: list[str], codec: Any, chunk_bytes: int, threads: int) -> None:
    import threading

    import numpy as np
    from read_throughput import in_threads

    pending = list(files)
    lock = threading.Lock()

    def work():
        out = np.empty(chunk_bytes, dtype=np.uint8)
        while True:
            with lock:
                if not pending:
                    return
                f = pending.pop()
            fd = os.open(f, os.O_RDONLY)
            try:
                data = os.pread(fd, os.fstat(fd).st_size, 0)
            finally:
                os.close(fd)
            codec.decode(data, out=out)

    in_threads(lambda _k: work(), threads)


if __name__ == "__main__":
    main()
