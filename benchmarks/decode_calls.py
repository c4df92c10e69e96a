"""nvCOMP's batched decode of a store's frames, cut into calls: one call, calls one after
another, and calls in flight at once (each from its own thread, on its own CUDA stream).

    python3 decode_calls.py --dir /tmp/pat --size-gib 4 --stores "zstd tiles,lz4 tiles"
    python3 decode_calls.py --dir /tmp/pat --era5 128   # one call of n frames against CPU threads

The frames are already in device memory, decoded in this process (run it as a process of its
own: on the stores of ``read_patterns.py``, valid frames). Prints GB/s of decoded bytes, best
of ``--repeat``, and the cost of a decoder-process arena (allocate, export, free).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from read_patterns import pattern_store

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/cupy-xarray-calls")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--stores", default="zstd tiles")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cuts", default="1,2,4", help="calls the frames are cut into")
    ap.add_argument("--era5", type=int, default=0, help="steps of an ERA5-like store: its frames instead")
    args = ap.parse_args()
    if args.era5:
        era5_floor(Path(args.dir), args.era5, args.repeat)
        return
    for name in args.stores.split(","):
        path = pattern_store(args.dir, name, args.size_gib)
        measure(path, name, args.repeat, [int(c) for c in args.cuts.split(",")])


def on_device(codec, framed, expected: int):
    """The bare streams of ``framed`` (stored streams in host memory) on the device, an output
    of ``expected`` bytes for each, and the four arrays nvCOMP's batched call takes: source
    addresses and lengths, output addresses and capacities."""
    import cupy

    srcs = [cupy.asarray(codec.deframe(f)) for f in framed]
    outs = cupy.empty((len(srcs), expected), np.uint8)
    src_ptrs = np.array([s.data.ptr for s in srcs], np.uint64)
    src_lens = np.array([len(s) for s in srcs], np.uint64)
    dst_ptrs = np.array([outs[i].data.ptr for i in range(len(srcs))], np.uint64)
    caps = np.full(len(srcs), expected, np.uint64)
    return srcs, outs, (src_ptrs, src_lens, dst_ptrs, caps)


def era5_floor(root: Path, steps: int, repeat: int) -> None:
    """One nvCOMP call on the first n frames of an ERA5-like store (``read_patterns.py``:
    four variables, a 721 x 1440 zstd chunk per step) against 16 CPU threads decoding the
    same frames (libzstd through the engine's decoder): the least an nvCOMP call costs, beside
    what CPU threads take for a whole batch."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy
    from read_patterns import ERA5_VARS, era5_store

    from cupy_xarray.engine.decoders.registry import stream
    from cupy_xarray.runtime.nvcomp import batched_decoder

    path = era5_store(root, steps)
    codec, decoder = stream("zstd"), batched_decoder("Zstd")
    files = sorted(
        f for v in ERA5_VARS for f in (path / v).rglob("*") if f.is_file() and f.name != "zarr.json"
    )
    raw = [np.fromfile(f, np.uint8) for f in files]
    expected = 721 * 1440 * 4
    srcs, outs, (src_ptrs, src_lens, dst_ptrs, caps) = on_device(codec, raw, expected)
    n = len(srcs)
    host = np.empty((n, expected), np.uint8)
    print(f"ERA5-like: {n} frames of {expected / 2**20:.2f} MiB, ratio {n * expected / src_lens.sum():.2f}")
    with ThreadPoolExecutor(16) as pool:
        for k in (1, 4, 16, 32, 64, 128, 256, 512):
            if k > n:
                break
            gpu = cpu = float("inf")
            for _ in range(repeat + 1):
                with cupy.cuda.Stream(non_blocking=True):
                    t0 = time.perf_counter()
                    _, statuses = decoder.decode(src_ptrs[:k], src_lens[:k], dst_ptrs[:k], caps[:k])
                    gpu = min(gpu, time.perf_counter() - t0)
                if (statuses != 0).any():
                    raise RuntimeError("a frame did not decode")
                t0 = time.perf_counter()
                list(pool.map(lambda i: codec.decode_host(raw[i], expected, host[i]), range(k)))
                cpu = min(cpu, time.perf_counter() - t0)
            gb = k * expected / 1e9
            print(f"  {k:4d} frames: nvCOMP, one call {gpu * 1e3:6.1f} ms ({gb / gpu:5.2f} GB/s) | "
                  f"16 CPU threads {cpu * 1e3:6.1f} ms ({gb / cpu:5.2f} GB/s)")  # fmt: skip


def measure(path: Path, name: str, repeat: int, cuts: list[int]) -> None:
    """Time nvCOMP's calls on the store's frames, and an arena of their size."""
    import cupy
    import zarr
    from read_patterns import STREAM_KINDS

    from cupy_xarray.engine.decoders.registry import stream
    from cupy_xarray.engine.sandbox.arena import make_arena
    from cupy_xarray.runtime.nvcomp import batched_decoder

    kind = STREAM_KINDS[name.split()[0]]
    codec = stream(kind)
    decoder = batched_decoder(codec.nvcomp)
    arr = zarr.open_array(path / "field", mode="r")
    expected = int(np.prod(arr.chunks)) * arr.dtype.itemsize
    files = sorted(f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json")
    framed = (np.fromfile(f, np.uint8) for f in files)
    srcs, outs, (src_ptrs, src_lens, dst_ptrs, caps) = on_device(codec, framed, expected)
    n = len(srcs)
    gb = n * expected / 1e9

    def call(sl: slice) -> None:
        sizes, statuses = decoder.decode(src_ptrs[sl], src_lens[sl], dst_ptrs[sl], caps[sl])
        if (statuses != 0).any() or (sizes != expected).any():
            raise RuntimeError("a frame did not decode")

    def serial(k: int) -> None:
        with cupy.cuda.Stream(non_blocking=True):
            for part in np.array_split(np.arange(n), k):
                call(slice(int(part[0]), int(part[-1]) + 1))

    def parallel(k: int) -> None:
        errors: list = []

        def one(part):
            try:
                with cupy.cuda.Stream(non_blocking=True):
                    call(slice(int(part[0]), int(part[-1]) + 1))
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(p,)) for p in np.array_split(np.arange(n), k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    cases = {}
    for k in cuts:
        cases[f"{k} call(s) of {-(-n // k)}, one after another"] = lambda k=k: serial(k)
        if k > 1:
            cases[f"{k} calls of {-(-n // k)} in flight at once"] = lambda k=k: parallel(k)
    print(f"{name}: {n} frames of {expected / 2**20:.0f} MiB, {src_lens.sum() / 2**30:.2f} GiB stored")
    for label, fn in cases.items():
        fn()  # warm-up (scratch memory, kernels)
        best = float("inf")
        for _ in range(repeat):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        print(f"  {label}: {gb / best:.2f} GB/s ({best * 1e3:.0f} ms)")
    through_process(kind, srcs, expected, repeat, cuts)
    nbytes = int(src_lens.sum() + caps.sum())
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        arena = make_arena(nbytes, True)
        arena.export()
        arena.close()
        cupy.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    print(f"  an arena of {nbytes / 2**30:.2f} GiB allocated, exported and freed: {best * 1e3:.1f} ms")
    del srcs, outs


def through_process(kind: str, srcs: list, expected: int, repeat: int, cuts: list[int]) -> None:
    """The same frames through the decoder process (decoded into its arena), in one batch and
    in batches in flight at once from threads, with the steps of each batch's round trip."""
    import cupy

    from cupy_xarray.engine.sandbox.client import decode_batch
    from cupy_xarray.options import get_options

    gb = len(srcs) * expected / 1e9
    for k in cuts:
        parts = [list(p) for p in np.array_split(np.arange(len(srcs)), k)]
        steps: list[dict] = []

        def one(part, steps=steps):
            seconds: dict = {}
            batch = [srcs[i] for i in part]
            outs, _ = decode_batch(
                kind, batch, [expected] * len(part), None, True, 1.0, None, seconds, options=get_options()
            )
            steps.append(seconds)

        def run(parts=parts):
            threads = [threading.Thread(target=one, args=(p,)) for p in parts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cupy.cuda.Device().synchronize()

        run()
        best, spent = float("inf"), {}
        for _ in range(repeat):
            steps.clear()
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            if dt < best:
                best, spent = dt, {key: max(s[key] for s in steps) * 1e3 for key in steps[0]}
        shown = ", ".join(f"{key} {v:.1f}" for key, v in spent.items())
        rate = f"{gb / best:.2f} GB/s ({best * 1e3:.0f} ms; ms: {shown})"
        print(f"  decoder process, {k} batch(es) in flight: {rate}")


if __name__ == "__main__":
    main()
