"""Where does an engine read spend its time? Phase timings for a few chunkings and batch sizes.

Usage (GPU machine): ``python benchmarks/profile_read.py --dir /tmp/prof``
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("CUPY_XARRAY_PROFILE", "1")


def main() -> None:
    import cupy
    import xarray as xr
    from read_throughput import smooth_field

    from cupy_xarray import record_reads, set_options
    from cupy_xarray.engine import describe, read_arrays
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.xarray.backend import KvikioBackendArray
    from cupy_xarray.xarray.cf import find_backend_array

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-prof")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--only", default="", help="comma-separated store labels")
    ap.add_argument("--batches", default="256,1024,4096", help="batch sizes in MiB")
    ap.add_argument("--no-nvcomp", action="store_true", help="skip the nvCOMP-alone timings")
    ap.add_argument("--threads", default="16", help="comma-separated I/O thread counts")
    ap.add_argument("--cprofile", action="store_true", help="host profile (top functions) of one read")
    ap.add_argument(
        "--concurrent",
        type=int,
        default=0,
        help="also read the store in N parts, in turn and in N threads",
    )
    ap.add_argument(
        "--nvcomp-cupy-pool", action="store_true", help="give nvCOMP cupy's memory pool for its device memory"
    )
    args = ap.parse_args()
    if args.nvcomp_cupy_pool:
        from nvidia import nvcomp

        nvcomp.set_device_allocator(lambda nbytes, stream: cupy.cuda.alloc(nbytes))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    import zarr
    from zarr.codecs import numcodecs as zn

    n = int(args.gib * 256)
    data = smooth_field((n, 1024, 1024))
    for label, chunks, comp in [
        ("zstd-4MiB", (1, 1024, 1024), zarr.codecs.ZstdCodec(level=1)),
        ("zstd-1MiB", (1, 256, 1024), zarr.codecs.ZstdCodec(level=1)),
        ("lz4-4MiB", (1, 1024, 1024), zn.LZ4()),
        ("lz4-1MiB", (1, 256, 1024), zn.LZ4()),
        ("none-32MiB", (8, 1024, 1024), None),
        ("blosc-lz4-4MiB", (1, 1024, 1024), zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")),
        # tiles: a chunk is not one run of the output (decoded into scratch, then scattered)
        ("blosc-lz4-tiles", (4, 512, 512), zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")),
        (
            "blosc-zstd-4MiB",
            (1, 1024, 1024),
            zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"),
        ),
    ]:
        if args.only and label not in args.only.split(","):
            continue
        path = root / f"{label}.zarr"
        if not path.exists():
            xr.Dataset({"f": (("t", "y", "x"), data)}).to_zarr(
                path, zarr_format=3, encoding={"f": {"chunks": chunks, "compressors": comp}}
            )
        ds = xr.open_dataset(path, engine="kvikio")
        spec = find_backend_array(ds.f.variable._data, KvikioBackendArray).spec
        print(describe(spec, resolve_device("gpu")), flush=True)
        if label.startswith("blosc"):
            head = next(p for p in sorted((path / "f" / "c").rglob("*")) if p.is_file()).read_bytes()[:16]
            print(
                f"  blosc header: flags {head[2]:#x} typesize {head[3]} nbytes "
                f"{int.from_bytes(head[4:8], 'little')} blocksize {int.from_bytes(head[8:12], 'little')}"
            )
        for threads, batch in (
            (int(t), int(b) * 2**20) for t in args.threads.split(",") for b in args.batches.split(",")
        ):
            dev = resolve_device("gpu", threads)
            read_arrays([(spec, (slice(None),))], dev, batch_bytes=batch)  # warm
            times = []
            for exact in (False, False, True):  # free-running twice, then synchronized per phase
                mempool = cupy.get_default_memory_pool()
                mempool.free_all_blocks()
                t0 = time.perf_counter()
                with set_options(profile=exact), record_reads() as reports:
                    (out,) = read_arrays([(spec, (slice(None),))], dev, batch_bytes=batch)
                cupy.cuda.Device().synchronize()
                times.append(time.perf_counter() - t0)
                pool_bytes = mempool.total_bytes()
                del out
            dt = min(times[:2])
            stats = {k: round(v * 1e3, 1) for k, v in reports[-1].phases.items()}  # synchronized run
            if args.cprofile:
                import cProfile
                import pstats

                set_options(profile=False)  # free-running from here on, in this thread
                prof = cProfile.Profile()
                prof.enable()
                (out,) = read_arrays([(spec, (slice(None),))], dev, batch_bytes=batch)
                cupy.cuda.Device().synchronize()
                prof.disable()
                del out
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            print(
                f"{label} threads {threads} batch {batch >> 20} MiB: {data.nbytes / dt / 1e9:6.2f} GB/s "
                f"({dt * 1e3:.0f} ms; cupy pool {pool_bytes / 2**30:.2f} GiB) "
                f"phases ms (synchronized) {stats}",
                flush=True,
            )
        if args.concurrent > 1:
            _concurrent(spec, args.concurrent, data.nbytes, label)
    if args.no_nvcomp:
        return
    # nvCOMP alone on the zstd chunks, already in GPU memory
    from nvidia import nvcomp

    for label in ("zstd-4MiB", "zstd-1MiB"):
        if not (root / f"{label}.zarr").exists():
            continue
        import numpy as np

        files = sorted((root / f"{label}.zarr" / "f" / "c").rglob("*"))
        bufs = [cupy.asarray(np.frombuffer(p.read_bytes(), np.uint8)) for p in files if p.is_file()]
        policies = {"default": {}}
        if hasattr(nvcomp, "ExecutionPolicy"):
            policies["latency"] = {"execution_policy": nvcomp.ExecutionPolicy.LATENCY}
        for (policy, extra), k in (
            (p, k)
            for p in policies.items()
            for k in sorted({len(bufs), min(len(bufs), 128), min(len(bufs), 256), min(len(bufs), 512)})
        ):
            codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, **extra)
            batch = nvcomp.as_arrays(bufs[:k])
            out = codec.decode(batch)
            _ = out[0]
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            out = codec.decode(batch)
            _ = out[0]
            cupy.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
            nbytes = sum(int(cupy.asarray(o).nbytes) for o in out)
            print(f"nvCOMP alone {label} x{k} ({policy} policy): {nbytes / dt / 1e9:6.2f} GB/s", flush=True)


def _concurrent(spec, parts: int, nbytes: int, label: str) -> None:
    """Parts of a store read one after another, then each in its own thread (as dask's threads
    do on one GPU): does the device overlap the reads?"""
    import cupy
    from read_throughput import in_threads

    from cupy_xarray import set_options
    from cupy_xarray.engine import read_arrays
    from cupy_xarray.engine.devices import resolve_device

    set_options(profile=False)  # free-running from here on, in this thread
    n = spec.shape[0]
    sels = [(slice(k * n // parts, (k + 1) * n // parts),) for k in range(parts)]
    dev = resolve_device("gpu")

    def one(sel, outs):
        outs.append(read_arrays([(spec, sel)], dev)[0])

    for how in ("one after another", f"{parts} threads", "one after another", f"{parts} threads"):
        outs: list = []
        cupy.get_default_memory_pool().free_all_blocks()
        t0 = time.perf_counter()
        if how == "one after another":
            for sel in sels:
                one(sel, outs)
        else:
            in_threads(lambda k, outs=outs: one(sels[k], outs), len(sels))
        cupy.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        assert len(outs) == parts
        print(f"{label} in {parts} parts, {how}: {nbytes / dt / 1e9:6.2f} GB/s", flush=True)
        del outs


if __name__ == "__main__":
    main()
