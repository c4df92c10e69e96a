"""What it costs to get a large read's chunk files into device memory, step by step: the
plan's stat of every file, opening and checking them, kvikio's opens and reads, and reads on
CPU threads into page-locked memory copied to the device; then the engine's read of the store,
with its phases.

    python3 read_files.py --dir /tmp/pat --size-gib 4 --store "zstd tiles"

The store is ``read_patterns.py``'s (written there if missing); best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import time


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    import cupy
    import cupyx
    import kvikio
    from read_patterns import pattern_store

    from cupy_xarray.engine import io

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/cupy-xarray-patterns")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--store", default="zstd tiles")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="16,32")
    ap.add_argument("--cprofile", action="store_true", help="a host profile of two engine reads")
    args = ap.parse_args()
    path = pattern_store(args.dir, args.store, args.size_gib)
    files = sorted(str(p) for p in (path / "field").rglob("*") if p.is_file() and p.name != "zarr.json")
    sizes = [os.stat(f).st_size for f in files]
    slots, off = [], 0
    for s in sizes:
        slots.append(off)
        off += (s + 511) // 512 * 512
    total = sum(sizes)
    dev = cupy.empty(off, dtype=cupy.uint8)
    host = cupyx.empty_pinned(off, dtype=cupy.uint8)
    print(f"{args.store}: {len(files)} files, {total / 1e9:.3f} GB stored")

    def report(what: str, dt: float, nbytes: int = 0) -> None:
        per = dt / len(files) * 1e6
        rate = f", {nbytes / dt / 1e9:.1f} GB/s" if nbytes else ""
        print(f"  {what}: {dt * 1e3:.1f} ms ({per:.1f} us a file{rate})")

    report("lstat every file", best(lambda: [os.lstat(f) for f in files], args.repeat))

    def opens():
        for f in files:
            fd, _ = io.open_chunk(f, None, "field", f)
            os.close(fd)

    report("open + fstat + close (ours)", best(opens, args.repeat))

    def kv_opens(proc: bool):
        def run():
            for f in files:
                fd, _ = io.open_chunk(f, None, "field", f)
                h = kvikio.CuFile(f"/proc/self/fd/{fd}" if proc else f, "r")
                os.close(fd)
                h.close()

        return run

    report("ours + kvikio.CuFile(/proc/self/fd/N) + closes", best(kv_opens(True), args.repeat))
    report("ours + kvikio.CuFile(path) + closes", best(kv_opens(False), args.repeat))

    for threads in [int(t) for t in args.threads.split(",")]:
        reads(threads, files, sizes, slots, dev, host, args.repeat, report)

    # the read as the engine does it, for the whole picture
    import xarray as xr

    import cupy_xarray

    for exact in (False, True):
        with cupy_xarray.set_options(profile=exact), cupy_xarray.record_reads() as reports:
            t0 = time.perf_counter()
            out = xr.open_dataset(path, engine="kvikio")["field"].data
            cupy.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
        r = reports[-1]
        label = "exact phases" if exact else "free-running"
        phases = {k: round(v * 1e3, 1) for k, v in r.phases.items()}
        print(f"  engine read ({label}): {out.nbytes / dt / 1e9:.2f} GB/s", phases)
        del out
    if not args.cprofile:
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(2):
        prof.enable()
        out = xr.open_dataset(path, engine="kvikio")["field"].data
        cupy.cuda.Device().synchronize()
        prof.disable()
        del out
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("cupy_xarray", 60)


def reads(threads, files, sizes, slots, dev, host, repeat, report) -> None:
    """The files read by the engine's kvikio session, and by CPU threads into page-locked
    memory copied to the device (at once, or a group of files at a time)."""
    import cupy

    from cupy_xarray.engine import io
    from cupy_xarray.runtime import pools

    total = sum(sizes)
    where = list(zip(files, sizes, slots, strict=True))
    ops = [io.ReadOp(f, 0, s, dev[o : o + s], "field", f) for f, s, o in where]
    hops = [io.ReadOp(f, 0, s, host[o : o + s], "field", f) for f, s, o in where]
    pool = pools.kept_pool("probe", threads)

    def engine_kvikio():
        with io.KvikioIO().session(threads) as session:
            session.submit(ops).wait()
        cupy.cuda.runtime.deviceSynchronize()

    def submit_only():
        with io.KvikioIO().session(threads) as session:
            t0 = time.perf_counter()
            pending = session.submit(ops)
            dt = time.perf_counter() - t0
            pending.wait()
        return dt

    def posix_pinned():
        for fu in [pool.submit(io.pread_into, op) for op in hops]:
            fu.result()
        dev.set(host)
        cupy.cuda.runtime.deviceSynchronize()

    def posix_grouped():
        n = len(hops)
        step = max(1, n // (threads * 2))
        stream = cupy.cuda.Stream(non_blocking=True)

        def run(group):
            for op in group:
                io.pread_into(op)

        for fu, i in [(pool.submit(run, hops[i : i + step]), i) for i in range(0, n, step)]:
            fu.result()
            last = min(i + step, n) - 1
            a, b = slots[i], slots[last] + sizes[last]
            dev[a:b].set(host[a:b], stream=stream)
        stream.synchronize()

    report(f"engine's kvikio reads, {threads} threads (submit + wait)", best(engine_kvikio, repeat), total)
    print(f"    of which submitting: {min(submit_only() for _ in range(repeat)) * 1e3:.1f} ms")
    report(f"CPU threads to page-locked, one copy, {threads} threads", best(posix_pinned, repeat), total)
    report(f"the same, a copy per group of files, {threads} threads", best(posix_grouped, repeat), total)


if __name__ == "__main__":
    main()
