"""Read throughput of every path into GPU memory, one store at a time, in one run.

Usage (on a GPU machine)::

    python benchmarks/read_throughput.py --dir /tmp/bench --size-gib 4 --json out.json

For each store (uncompressed, zstd and lz4 with 4 MiB and 1 MiB chunks, zstd with content
checksums, gzip, zlib, Blosc lz4 + shuffle, Blosc zstd + bitshuffle, sharded zstd) it
measures, on the same data:
``engine="kvikio"`` full load (``decode="auto"``, and ``decode="gpu"``: every chunk to nvCOMP),
``read_zarr_gds``, zarr's GPU mode with ``LocalStore``,
kvikio's ``GDSStore`` with zarr's GPU mode, CPU zarr + ``cupy.asarray``, and the raw
ceiling (``kvikio.CuFile.read`` of one file of the same size, same thread count, into a
buffer allocated beforehand, and again with the allocation timed as every other path's is).
It prints GB/s of decoded bytes, ratios against each baseline, and peak GPU memory; for
stores whose chunks carry checksums, the time of the GPU pass that verifies them beside the
time of the whole read.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np


def smooth_field(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A smooth float32 field (compressible like real geophysical data, not noise)."""
    t, y, x = shape
    rng = np.random.default_rng(seed)
    yy = np.linspace(0, 4 * np.pi, y, dtype=np.float32)[:, None]
    xx = np.linspace(0, 8 * np.pi, x, dtype=np.float32)[None, :]
    base = (np.sin(yy) * np.cos(xx) * 20 + 280).astype(np.float32)
    out = np.empty(shape, np.float32)
    for i in range(t):
        out[i] = base + np.float32(np.sin(i / 10.0) * 5)
        out[i, :, ::97] += rng.standard_normal((y, len(range(0, x, 97)))).astype(np.float32)
    # quantize to 1/64 K, as packed real data is
    return np.round(out * 64) / 64


def write_stores(root: Path, size_gib: float, which: list[str]) -> dict[str, Path]:
    import xarray as xr
    import zarr
    from zarr.codecs import numcodecs as zn

    n = max(8, int(size_gib * 2**30 / (1024 * 1024 * 4)))
    stores = {}
    specs = {
        "uncompressed": dict(t=n, chunks=(8, 1024, 1024), compressors=None),
        "zstd": dict(t=n, chunks=(1, 1024, 1024), compressors=zarr.codecs.ZstdCodec(level=1)),
        "zstd-1MiB": dict(t=n, chunks=(1, 256, 1024), compressors=zarr.codecs.ZstdCodec(level=1)),
        "zstd-checksum": dict(
            t=n, chunks=(1, 1024, 1024), compressors=zarr.codecs.ZstdCodec(level=1, checksum=True)
        ),
        "gzip": dict(t=max(8, n // 4), chunks=(1, 1024, 1024), compressors=zarr.codecs.GzipCodec(level=1)),
        "zlib": dict(t=max(8, n // 4), chunks=(1, 1024, 1024), compressors=zn.Zlib(level=1)),
        "lz4": dict(t=max(8, n // 4), chunks=(1, 1024, 1024), compressors=zn.LZ4()),
        "lz4-1MiB": dict(t=max(8, n // 4), chunks=(1, 256, 1024), compressors=zn.LZ4()),
        "blosc-lz4": dict(
            t=max(8, n // 4),
            chunks=(1, 1024, 1024),
            compressors=zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
        ),
        "blosc-zstd": dict(
            t=max(8, n // 4),
            chunks=(1, 1024, 1024),
            compressors=zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"),
        ),
        "sharded-zstd": dict(
            t=n, chunks=(1, 1024, 1024), shards=(16, 1024, 1024), compressors=zarr.codecs.ZstdCodec(level=1)
        ),
    }
    for name in which:
        s = specs[name]
        path = root / f"{name}.zarr"
        stores[name] = path
        if (path / "zarr.json").exists():
            continue
        data = smooth_field((s["t"], 1024, 1024))
        enc = {"field": {k: s[k] for k in ("chunks", "compressors", "shards") if k in s}}
        xr.Dataset({"field": (("t", "y", "x"), data)}).to_zarr(
            path, mode="w", zarr_format=3, consolidated=True, encoding=enc
        )
    return stores


class PeakGPUMemory:
    """Samples device memory in use (all allocators: cupy, nvCOMP, kvikio) every ~1 ms."""

    def __enter__(self):
        import cupy

        self._rt = cupy.cuda.runtime
        cupy.get_default_memory_pool().free_all_blocks()
        free, total = self._rt.memGetInfo()
        self.base = total - free
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            free, total = self._rt.memGetInfo()
            self.peak = max(self.peak, total - free)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def used(self) -> int:
        return self.peak - self.base


def in_threads(work, count: int) -> float:
    """Run ``work(k)`` for k in ``range(count)``, each in its own thread, all at once; the
    seconds until the last one is done."""
    pool = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def timed(fn, repeat: int):
    """Best time of ``repeat`` runs after a warm-up, and the peak GPU memory of one more run.

    The memory sampler polls the device from a Python thread; it runs apart from the timed
    runs, whose host work it would otherwise slow down.
    """
    import cupy

    fn()  # warm the page cache and the allocators
    cupy.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(repeat):
        cupy.get_default_memory_pool().free_all_blocks()  # every run allocates, as a first read does
        t0 = time.perf_counter()
        out = fn()
        cupy.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
        del out
    with PeakGPUMemory() as mem:
        out = fn()
        cupy.cuda.Device().synchronize()
        del out
    return best, mem.used


def paths_for(path: Path, threads: int):
    import cupy
    import xarray as xr
    import zarr

    import cupy_xarray

    def kvikio_engine():
        return xr.open_dataset(path, engine="kvikio", threads=threads)["field"].data

    def kvikio_engine_gpu_decode():
        return xr.open_dataset(path, engine="kvikio", threads=threads, decode="gpu")["field"].data

    def loader():
        return cupy_xarray.read_zarr_gds(path, threads=threads)["field"].data

    def zarr_gpu():
        with zarr.config.enable_gpu():
            return zarr.open_array(path / "field", mode="r")[:]

    def gds_store():
        from kvikio.zarr import GDSStore

        with zarr.config.enable_gpu():
            return zarr.open_array(GDSStore(path / "field"), mode="r")[:]

    def cpu_zarr():
        return cupy.asarray(zarr.open_array(path / "field", mode="r")[:])

    return {
        "kvikio engine": kvikio_engine,
        "engine decode=gpu": kvikio_engine_gpu_decode,
        "read_zarr_gds": loader,
        "zarr GPU mode": zarr_gpu,
        "GDSStore+GPU": gds_store,
        "CPU zarr+asarray": cpu_zarr,
    }


def raw_ceiling(root: Path, nbytes: int, threads: int, repeat: int) -> tuple[float, float]:
    import cupy
    import kvikio
    import kvikio.defaults

    f = root / f"raw-{nbytes}.bin"
    if not f.exists() or f.stat().st_size != nbytes:
        with open(f, "wb") as fh:
            chunk = os.urandom(64 * 2**20)
            for _ in range(nbytes // len(chunk)):
                fh.write(chunk)
            fh.write(chunk[: nbytes % len(chunk)])
    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    with kvikio.defaults.set("num_threads", threads):

        def read():
            with kvikio.CuFile(f, "r") as fh:
                fh.read(buf)

        def alloc_and_read():  # as the other paths do: allocate the output, then read
            out = cupy.empty(nbytes, dtype=cupy.uint8)
            with kvikio.CuFile(f, "r") as fh:
                fh.read(out)
            return out

        t, _ = timed(read, repeat)
        t_alloc, _ = timed(alloc_and_read, repeat)
    return nbytes / t / 1e9, nbytes / t_alloc / 1e9


#: the checksum each store's chunks carry (verified by the engine after decoding on the GPU)
CHECKSUMS = {"zstd-checksum": "xxh64", "gzip": "crc32", "zlib": "adler32"}


def verify_cost(path: Path, kind: str, threads: int, repeat: int) -> tuple[float, float]:
    """Seconds of the engine's GPU checksum pass over the decoded chunks of a full load (one
    kernel launch per batch, as in a read), and of a ``decode="gpu"`` load itself (the reads
    that run that pass: ``decode="auto"`` leaves zstd frames without a crc32c to libzstd,
    which checks them on the CPU)."""
    import cupy
    import xarray as xr

    from cupy_xarray.runtime import checksums

    load = lambda: xr.open_dataset(path, engine="kvikio", threads=threads, decode="gpu")["field"].data  # noqa: E731
    t_read, _ = timed(load, repeat)
    out = load()
    chunk = out[0].nbytes  # chunks are (1, y, x): one run of the output each
    ptrs = np.uint64(out.data.ptr) + np.arange(out.shape[0], dtype=np.uint64) * np.uint64(chunk)
    lens = np.full(out.shape[0], chunk, dtype=np.int64)
    t_verify, _ = timed(lambda: checksums.compute(kind, ptrs, lens), repeat)
    cupy.cuda.Device().synchronize()
    return t_verify, t_read


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-bench")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--stores", default="uncompressed,zstd,lz4,blosc-lz4,blosc-zstd,sharded-zstd")
    ap.add_argument("--paths", default="all")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also time a cold-cache engine read")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import zarr

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stores = write_stores(root, args.size_gib, args.stores.split(","))
    print(f"stores ready in {time.time() - t0:.0f} s under {root}", flush=True)
    results = []
    for name, path in stores.items():
        arr = zarr.open_array(path / "field", mode="r")
        nbytes = arr.nbytes
        stored = sum(f.stat().st_size for f in (path / "field").rglob("*") if f.is_file())
        ratio = nbytes / stored
        row = {"store": name, "GiB": nbytes / 2**30, "ratio": ratio, "chunks": arr.chunks, "paths": {}}
        ceiling, ceiling_alloc = raw_ceiling(root, nbytes, args.threads, args.repeat)
        row["paths"]["raw kvikio read"] = {"GBps": ceiling, "peak_GiB": nbytes / 2**30}
        row["paths"]["raw read + cupy.empty"] = {"GBps": ceiling_alloc, "peak_GiB": nbytes / 2**30}
        print(f"  {name:>13} raw read {ceiling:.2f} GB/s, allocation included {ceiling_alloc:.2f} GB/s")
        for label, fn in paths_for(path, args.threads).items():
            if args.paths != "all" and label not in args.paths.split(","):
                continue
            slow = label in ("CPU zarr+asarray", "GDSStore+GPU", "zarr GPU mode")
            t, peak = timed(fn, 1 if slow else args.repeat)
            row["paths"][label] = {"GBps": nbytes / t / 1e9, "peak_GiB": peak / 2**30}
            print(
                f"  {name:>13} {label:<18} {nbytes / t / 1e9:7.2f} GB/s  peak {peak / 2**30:6.2f} GiB",
                flush=True,
            )
        if name in CHECKSUMS:
            t_verify, t_read = verify_cost(path, CHECKSUMS[name], args.threads, args.repeat)
            row["verify"] = {"kind": CHECKSUMS[name], "seconds": t_verify, "read_seconds": t_read}
            print(
                f"  {name:>13} verifying {CHECKSUMS[name]} on the GPU: {t_verify * 1e3:.1f} ms, "
                f"{100 * t_verify / t_read:.1f} % of the engine's decode=gpu read "
                f"({nbytes / t_verify / 1e9:.0f} GB/s)",
                flush=True,
            )
        if args.cold and drop_caches():
            import xarray as xr

            t1 = time.perf_counter()
            _ = xr.open_dataset(path, engine="kvikio", threads=args.threads)["field"].data
            import cupy

            cupy.cuda.Device().synchronize()
            tc = time.perf_counter() - t1
            drop_caches()
            f = root / f"raw-{nbytes}.bin"
            t2 = time.perf_counter()
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 * 2**20):
                    pass
            disk = nbytes / (time.perf_counter() - t2) / 1e9
            row["cold"] = {"engine_GBps": nbytes / tc / 1e9, "disk_GBps": disk, "disk_x_ratio": disk * ratio}
            print(
                f"  {name:>13} cold engine {nbytes / tc / 1e9:.2f} GB/s; disk {disk:.2f} GB/s "
                f"x ratio {ratio:.2f} = {disk * ratio:.2f}",
                flush=True,
            )
        results.append(row)

    print(
        "\n| store | path | GB/s | × zarr GPU | × GDSStore | × CPU+asarray | × raw | × raw+alloc | peak GiB |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in results:
        p = row["paths"]

        def ratio_to(label, v, p=p):
            return f"{v / p[label]['GBps']:.2f}" if label in p else "-"

        for label, r in p.items():
            v = r["GBps"]
            print(
                f"| {row['store']} ({row['GiB']:.1f} GiB, ratio {row['ratio']:.2f}) | {label} | "
                f"{v:.2f} | {ratio_to('zarr GPU mode', v)} | {ratio_to('GDSStore+GPU', v)} | "
                f"{ratio_to('CPU zarr+asarray', v)} | {ratio_to('raw kvikio read', v)} | "
                f"{ratio_to('raw read + cupy.empty', v)} | "
                f"{r['peak_GiB']:.2f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": run_meta(), "rows": results}, indent=1, default=str))


def run_meta() -> dict:
    """What the docs print under a table of this run: command, commit, date, hardware, software."""
    import platform
    import subprocess
    import sys

    import cupy
    import zarr

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    try:
        from nvidia import nvcomp

        nvcomp_version = getattr(nvcomp, "__version__", "installed")
    except ImportError:
        nvcomp_version = "not installed"
    return {
        "command": "python3 " + " ".join(sys.argv),
        # (CUPY_XARRAY_BENCH_COMMIT: the commit of a copy of the tree that has no history)
        "commit": os.environ.get("CUPY_XARRAY_BENCH_COMMIT")
        or git("rev-parse", "--short", "HEAD") + (" (with changes)" if git("status", "--porcelain") else ""),
        "date": time.strftime("%Y-%m-%d"),
        "hardware": f"{name}, {os.cpu_count()} CPU cores, {platform.machine()}",
        "software": f"zarr {zarr.__version__}, cupy {cupy.__version__}, nvCOMP {nvcomp_version}",
    }


if __name__ == "__main__":
    main()
