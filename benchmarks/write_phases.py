"""Where a GPU write's time goes: ``ds.cupy.to_zarr`` beside its stages alone, one run.

Usage (GPU machine): ``python benchmarks/write_phases.py --size-gib 4``

A float32 ``(T, 2048, 2048)`` field of smooth data in 4 MiB tiles ``(4, 512, 512)``, zstd-1
(and LZ4 with ``--codec lz4``). Stages alone, best of three:

- nvCOMP alone: every tile already contiguous in device memory, compressed by the writer's
  C-API encoder in one call, in calls of 128 to 1,024 tiles, and in calls of the smallest
  batch size from two threads on two streams (do two calls run side by side?);
- files alone: the same number of files of the compressed size written by the writer's
  threads (temporary names renamed into place) into a fresh directory, from host memory and
  copied out of device memory as the writer's are; with ``--copies``, a batch's chunks
  copied to the host one by one (1 to 16 threads) or packed and copied at once, and files
  created, written, renamed alone;
- the engine's whole write into a fresh directory at several batch sizes
  (the ``write_gpu_batch_chunks`` option), with its report: time waiting for the encoder and for
  files, device memory its batches held; with given batch plans (``--plans``), batches
  queued at once (``--depths``, ``write_in_flight``), the output packed or not
  (``--pack``, ``write_pack_output``), file threads (``--file-threads``); with nvCOMP and
  CPU threads sharing each batch (``--shares``: CPU threads' share of the chunks,
  ``write_cpu_share_*``); and with CPU threads compressing instead of nvCOMP;
- with ``--trace``, one write batch by batch (queued, encoded, handed to the file threads)
  and where its file threads' time went.

Directories are deleted outside the timed part (a write with ``mode="w"`` over an existing
store also pays the deletion).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import shutil
import time
from pathlib import Path

import numpy as np
from read_throughput import PeakGPUMemory, smooth_field

TILE = (4, 512, 512)


FIRST: list[float] = []  # each best()'s first run


def runs(fn, before=None, repeat: int = 3) -> list[float]:
    """Seconds of ``repeat`` runs of ``fn`` after one that warms up (its seconds go to
    :data:`FIRST`); ``before`` runs ahead of each, untimed."""
    import cupy

    times = []
    for _ in range(repeat + 1):
        if before is not None:
            before()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    FIRST.append(times[0])
    return times[1:]


def best(fn, before=None, repeat: int = 3) -> float:
    return min(runs(fn, before, repeat))


def main() -> None:
    import cupy
    import xarray as xr
    import zarr
    from zarr.codecs import numcodecs as zn

    from cupy_xarray import record_writes
    from cupy_xarray.options import get_options
    from cupy_xarray.write import chunks, encoders
    from cupy_xarray.write.nvcomp import batched_encoder

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/wphases")
    ap.add_argument("--codec", default="zstd", choices=["zstd", "lz4"])
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--shares", default="0,0.1,0.2,0.3")
    ap.add_argument(
        "--plans",
        default="",
        help="batch plans to time, ';' between plans: chunks per batch, ',' between batches "
        "('256x4' for four of 256), or 'auto' for the writer's own; each at every --depths",
    )
    ap.add_argument("--depths", default="2", help="batches queued on the GPU at once (write_in_flight)")
    ap.add_argument("--pack", default="1", help="write_pack_output of the plans' writes: 1, 0 or 1,0")
    ap.add_argument("--trace", action="store_true", help="when each batch of a write was queued, written")
    ap.add_argument("--file-threads", default="", help="the engine's write with these file threads too")
    ap.add_argument(
        "--copies", action="store_true", help="time device-to-host copies and file creation alone"
    )
    args = ap.parse_args()
    t = max(4, int(args.size_gib * 2**30 / (2048 * 2048 * 4)) // 4 * 4)
    field = cupy.asarray(smooth_field((t, 2048, 2048)))
    gb = field.nbytes / 1e9
    n = field.size * 4 // (4 * 512 * 512 * 4)
    tile_bytes = int(np.prod(TILE)) * 4
    tiles = cupy.ascontiguousarray(
        field.reshape(t // 4, 4, 4, 512, 4, 512).transpose(0, 2, 4, 1, 3, 5)
    ).reshape(n, tile_bytes // 4)
    rows = tiles.view(cupy.uint8)
    algo = {"zstd": "Zstd", "lz4": "LZ4"}[args.codec]
    enc = batched_encoder(algo)
    threads = get_options().host_decode_threads()
    print(f"{gb:.2f} GB float32 in {n} tiles of 4 MiB, {args.codec}, {threads} threads")
    out: dict = {}

    def nvcomp_alone(per):
        def run():
            stream = cupy.cuda.get_current_stream()
            jobs = [enc.compress(rows[s : s + per], tile_bytes, stream) for s in range(0, n, per)]
            stream.synchronize()
            out["sizes"] = np.concatenate([j.sizes.get() for j in jobs])
            out["jobs"] = jobs

        return run

    for per in (n, *(int(b) for b in args.batches.split(",") if int(b) < n)):
        s = best(nvcomp_alone(per))
        print(f"  nvCOMP alone, calls of {per:<5} {s * 1e3:8.1f} ms  {gb / s:6.2f} GB/s", flush=True)
    per = min(int(b) for b in args.batches.split(","))

    def two_threads():
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        starts = list(range(0, n, per))

        def side(j):
            with streams[j]:
                jobs = [enc.compress(rows[s : s + per], tile_bytes, streams[j]) for s in starts[j::2]]
                streams[j].synchronize()
                return jobs

        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(side, range(2)))

    s = best(two_threads)
    print(f"  nvCOMP alone, calls of {per} from 2 threads {s * 1e3:8.1f} ms  {gb / s:6.2f} GB/s", flush=True)
    sizes = out["sizes"].astype(np.int64)
    print(f"  compressed {sizes.sum() / 2**20:.0f} MiB, ratio {field.nbytes / sizes.sum():.2f}")

    root = Path(args.dir)
    if args.copies:
        _copies(out["jobs"][0], out["sizes"][:per], root / "copies")
    blob = np.random.default_rng(0).integers(0, 255, int(sizes.max()), dtype=np.uint8)

    def fresh(path):
        return lambda: (shutil.rmtree(path, ignore_errors=True), path.mkdir(parents=True))

    def files_alone(threads):
        def run():
            with cf.ThreadPoolExecutor(threads) as pool:
                files = chunks.ChunkFiles(root / "files", pool, crc32c=False)
                for i, m in enumerate(sizes.tolist()):
                    files.put(f"c/{i // 16}/{i // 4 % 4}/{i % 4}", blob[:m])
                files.wait()

        return run

    for threads in (8, 16, 32):
        s = best(files_alone(threads), fresh(root / "files"))
        print(f"  files alone, {threads:>2} threads       {s * 1e3:8.1f} ms  {gb / s:6.2f} GB/s", flush=True)
    # the same files copied out of device memory by the threads, as the writer's are
    job = out["jobs"][0]
    slot = job.out.strides[0]
    from_device = [encoders.DeviceChunk(job.out, k * slot, int(m)) for k, m in enumerate(out["sizes"][:per])]

    def device_files(threads):
        def run():
            with cf.ThreadPoolExecutor(threads) as pool:
                files = chunks.ChunkFiles(root / "files", pool, crc32c=False)
                for i in range(n):
                    files.put(f"c/{i // 16}/{i // 4 % 4}/{i % 4}", from_device[i % per])
                files.wait()

        return run

    for threads in (8, 16):
        s = best(device_files(threads), fresh(root / "files"))
        print(f"  files from device, {threads:>2} thr  {s * 1e3:8.1f} ms  {gb / s:6.2f} GB/s", flush=True)

    ds = xr.Dataset({"field": (("t", "y", "x"), field)})
    codec = zarr.codecs.ZstdCodec(level=1) if args.codec == "zstd" else zn.LZ4()
    encoding = {"field": {"chunks": TILE, "compressors": codec}}
    target = root / "engine.zarr"

    def engine(label: str) -> None:
        """The engine's write of ``ds`` as the settings stand, best of three, with its last report."""
        with PeakGPUMemory() as mem, record_writes() as reports:
            s = best(lambda: ds.cupy.to_zarr(target, encoding=encoding), lambda: shutil.rmtree(target, True))
        r = reports[-1]
        stored = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        print(
            f"  engine, {label:<30} {s * 1e3:7.1f} ms {gb / s:6.2f} GB/s  ({r.encoder}; first run "
            f"{FIRST[-1] * 1e3:.0f} ms; last: {r.batches} batches, encoder wait {r.encode_wait_s * 1e3:.0f} "
            f"ms, file wait {r.file_wait_s * 1e3:.0f} ms, chunks {r.seconds * 1e3:.0f} ms of it; batches "
            f"held {r.device_bytes / 2**30:.2f} GiB, stored {stored / 2**20:.0f} MiB, peak GPU "
            f"{mem.used / field.nbytes:.2f}x data)",
            flush=True,
        )

    from cupy_xarray import set_options

    share = get_options().write_cpu_share(algo)
    for size in [int(b) for b in args.batches.split(",")]:
        with set_options(write_gpu_batch_chunks=size):
            engine(f"batches of {size} (CPU share {share})")
    own_plan = chunks._plan
    for text in [t for t in args.plans.split(";") if t]:
        plan = None if text == "auto" else _parse_plan(text)
        if plan is not None and sum(plan) != n:
            print(f"  plan {text}: {sum(plan)} chunks, not {n}: skipped")
            continue
        chunks._plan = own_plan if plan is None else (lambda total, cap, row, plan=plan: list(plan))
        for depth, pack in [(int(d), int(p)) for d in args.depths.split(",") for p in args.pack.split(",")]:
            with set_options(write_in_flight=depth, write_pack_output=bool(pack)):
                engine(f"plan {text} depth {depth} pack {pack}")
    chunks._plan = own_plan
    if args.trace:
        _trace(ds, target, encoding, chunks, encoders)
    for threads in [int(x) for x in args.file_threads.split(",") if x]:
        with set_options(decode_threads=threads):
            engine(f"{threads} file threads")
    for share in [float(x) for x in args.shares.split(",") if x]:
        with set_options(write_gpu_batch_chunks=per, write_cpu_share_zstd=share, write_cpu_share_lz4=share):
            engine(f"CPU share {share}, batches of {per}")
    # the same write with the chunks compressed by CPU threads (a batch copied to the host at a time)
    gpu_supports = encoders.GPUEncoder.supports
    encoders.GPUEncoder.supports = lambda self, recipe, chunk_bytes=0: not recipe.compressed
    try:
        engine("CPU threads encode")
    finally:
        encoders.GPUEncoder.supports = gpu_supports
    shutil.rmtree(root, ignore_errors=True)


def _copies(job, sizes, root: Path) -> None:
    """A batch's compressed chunks to the host: one copy a chunk (from 1 and 8 threads, each
    synchronized), the batch made contiguous on the GPU then one copy (into page-locked and
    into pageable memory); and creating, writing, renaming files alone."""
    import os

    import cupy
    import cupyx

    sizes = [int(s) for s in sizes]
    slot = job.out.strides[0]
    total = sum(sizes)
    big = max(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rt = cupy.cuda.runtime

    def per_chunk(threads):
        def one(part):
            stream = cupy.cuda.Stream()  # blocking, as the file threads' streams are
            host = cupyx.empty_pinned((big,), np.uint8)
            t = time.perf_counter()
            for k in part:
                rt.memcpyAsync(
                    host.ctypes.data, job.out.data.ptr + k * slot, sizes[k], rt.memcpyDeviceToHost, stream.ptr
                )
                stream.synchronize()
            return time.perf_counter() - t

        with cf.ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            each = list(pool.map(one, [range(j, len(sizes), threads) for j in range(threads)]))
            return time.perf_counter() - t, sum(each)

    for threads in (1, 8, 16):
        per_chunk(threads)
        wall, busy = min(per_chunk(threads) for _ in range(3))
        print(
            f"  copies, a chunk each, {threads:>2} threads: {wall * 1e3:7.1f} ms "
            f"({total / wall / 1e9:5.1f} GB/s), "
            f"{busy / len(sizes) * 1e3:.3f} thread-ms a chunk",
            flush=True,
        )
    dense = cupy.empty((total,), cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)

    def compact():
        for k, (o, m) in enumerate(zip(offsets.tolist(), sizes)):
            rt.memcpyAsync(
                dense.data.ptr + o, job.out.data.ptr + k * slot, m, rt.memcpyDeviceToDevice, stream.ptr
            )
        stream.synchronize()

    pinned = cupyx.empty_pinned((total,), np.uint8)
    pageable = np.ones(total, np.uint8)
    for name, fn in [
        ("made contiguous on the GPU", compact),
        ("one copy into page-locked memory", lambda: dense.get(stream=stream, out=pinned)),
        ("one copy into pageable memory", lambda: dense.get(stream=stream, out=pageable)),
    ]:
        s = best(fn)
        print(f"  {name:<34} {s * 1e3:7.2f} ms ({total / s / 1e9:5.1f} GB/s)", flush=True)
    t = time.perf_counter()
    fresh = cupyx.empty_pinned((total,), np.uint8)
    print(f"  page-locked block of {total / 2**20:.0f} MiB made in {(time.perf_counter() - t) * 1e3:.0f} ms")
    del fresh
    blob = pinned[:big]
    for threads in (1, 8):
        for what in ("create+close", "create+write+close", "create+write+close+rename"):
            shutil.rmtree(root, ignore_errors=True)
            for d in range(64):
                (root / str(d)).mkdir(parents=True)

            def files(part, what=what):
                for k in part:
                    path = root / str(k % 64) / f"f{k}"
                    tmp = root / str(k % 64) / f".f{k}.partial"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                    if "write" in what:
                        os.write(fd, blob[: sizes[k % len(sizes)]])
                    os.close(fd)
                    if "rename" in what:
                        os.replace(tmp, path)

            with cf.ThreadPoolExecutor(threads) as pool:
                t = time.perf_counter()
                list(pool.map(files, [range(j, 1024, threads) for j in range(threads)]))
                s = time.perf_counter() - t
            print(f"  1024 files, {what:<26} {threads} threads: {s * 1e3:7.1f} ms", flush=True)
    shutil.rmtree(root, ignore_errors=True)


def _parse_plan(text: str) -> list[int]:
    plan: list[int] = []
    for part in text.split(","):
        size, _, times = part.partition("x")
        plan += [int(size)] * int(times or 1)
    return plan


def _trace(ds, target, encoding, chunks, encoders) -> None:
    """One write with the writer's own plan, each batch's moments in ms from its start: queued
    (gathered and handed to nvCOMP), taken (the host begins to wait for it), encoded, its
    files handed to the threads (after those of the batch before were written)."""
    import threading

    import cupy

    marks: list[tuple] = []
    start, finish = encoders.GPUEncoder.start, chunks._finish
    put, to_host = chunks.ChunkFiles._put, encoders.DeviceChunk.to_host
    write_all, rename = chunks._write_all, chunks._rename
    t0 = [0.0]
    spent: dict[str, list[float]] = {}
    lock = threading.Lock()

    def clocked(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent.setdefault(name, []).append(time.perf_counter() - t)

        return run

    def timed_start(self, recipe, buf, nbytes, empty):
        pending = start(self, recipe, buf, nbytes, empty)
        marks.append(("queued", buf.shape[0], time.perf_counter() - t0[0]))
        return pending

    def timed_finish(batch, pending, *rest):
        t = time.perf_counter() - t0[0]
        pending.result = _timed(pending.result, marks, "encoded", len(batch), t0[0])
        finish(batch, pending, *rest)
        marks.append(("handed", len(batch), time.perf_counter() - t0[0], t))

    encoders.GPUEncoder.start, chunks._finish = timed_start, timed_finish
    chunks.ChunkFiles._put = clocked("file (all of it)", put)
    encoders.DeviceChunk.to_host = clocked("copy to pinned host memory", to_host)
    chunks._write_all = clocked("os.write", write_all)
    chunks._rename = clocked("rename", rename)
    try:
        for _ in range(2):  # the second write is the one shown
            shutil.rmtree(target, ignore_errors=True)
            marks.clear()
            spent.clear()
            cupy.cuda.Device().synchronize()
            t0[0] = time.perf_counter()
            ds.cupy.to_zarr(target, encoding=encoding)
            total = time.perf_counter() - t0[0]
    finally:
        encoders.GPUEncoder.start, chunks._finish = start, finish
        chunks.ChunkFiles._put, encoders.DeviceChunk.to_host = put, to_host
        chunks._write_all, chunks._rename = write_all, rename
    print(f"  trace of one write ({total * 1e3:.0f} ms), ms from its start:")
    for m in marks:
        extra = f" (taken at {m[3] * 1e3:.0f})" if len(m) > 3 else ""
        print(f"    {m[0]:<8} {m[1]:>5} chunks at {m[2] * 1e3:7.1f}{extra}")
    for name, times in spent.items():
        t = np.array(times) * 1e3
        print(
            f"    {name:<28} {len(t):>5} times, {t.sum():8.1f} thread-ms, mean {t.mean():.3f} ms, "
            f"median {np.median(t):.3f}, max {t.max():.2f}"
        )


def _timed(result, marks, what, count, t0):
    def run():
        out = result()
        marks.append((what, count, time.perf_counter() - t0))
        return out

    return run


if __name__ == "__main__":
    main()
