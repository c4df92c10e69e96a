"""Where a large compressed read's time goes: each store read eagerly with ``decode="auto"``
and ``decode="gpu"`` alternately (twice each), free-running and with exact phases (the
``profile`` option synchronizes the GPU between phases), with the scheduler's decisions.

    python3 decode_phases.py --dir /tmp/phases --size-gib 4 --stores "zstd tiles,zstd tiles 1MiB"

Stores are those of ``read_patterns.py`` (written there if missing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    import cupy
    import xarray as xr
    from read_patterns import pattern_store

    import cupy_xarray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/cupy-xarray-phases")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--stores", default="zstd tiles")
    ap.add_argument("--decodes", default="auto,gpu")
    ap.add_argument("--no-sandbox", action="store_true", help="skip the decoder process alone")
    args = ap.parse_args()
    decodes = args.decodes.split(",")
    for name in args.stores.split(","):
        path = pattern_store(args.dir, name, args.size_gib)
        for decode in decodes * 2:
            for exact in (False, True):
                cupy.get_default_memory_pool().free_all_blocks()
                with cupy_xarray.set_options(profile=exact), cupy_xarray.record_reads() as reports:
                    t0 = time.perf_counter()
                    out = xr.open_dataset(path, engine="kvikio", decode=decode)["field"].data
                    cupy.cuda.Device().synchronize()
                    dt = time.perf_counter() - t0
                r = reports[-1]
                label = "exact phases" if exact else "free-running"
                rate = out.nbytes / dt / 1e9
                print(f"{name} decode={decode!r} {label}: {rate:.2f} GB/s, {r.batches} batch(es), "
                      f"staging {r.staging_bytes / 2**30:.2f} GiB")  # fmt: skip
                if exact:
                    print("   phases (ms):", {k: round(v * 1e3, 1) for k, v in r.phases.items()})
                    print("   decisions:", [str(d) for d in r.decisions])
                del out
        if not args.no_sandbox:
            sandbox_alone(path, name)


def sandbox_alone(path: Path, name: str) -> None:
    """The decoder process's round trip alone on the store's frames (already in device memory):
    arena, copies in and out, IPC, nvCOMP, answer; beside nvCOMP alone in this process."""
    import cupy
    import numpy as np
    import zarr
    from read_patterns import STREAM_KINDS

    from cupy_xarray.engine.decoders.registry import stream
    from cupy_xarray.engine.sandbox.client import decode_batch
    from cupy_xarray.options import get_options

    kind = STREAM_KINDS.get(name.split()[0])
    if kind is None:
        return
    arr = zarr.open_array(path / "field", mode="r")
    expected = int(np.prod(arr.chunks)) * arr.dtype.itemsize
    files = sorted(f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json")
    srcs = [cupy.asarray(stream(kind).deframe(np.fromfile(f, np.uint8))) for f in files]
    into = [cupy.empty(expected, np.uint8) for _ in srcs]
    for label, target in (("decoded into the arena", None), ("copied out", into)):
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            outs, _keep = decode_batch(
                kind, srcs, [expected] * len(srcs), target, True, 1.0, options=get_options()
            )
            cupy.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
            del outs, _keep
        gb = expected * len(srcs) / 1e9
        print(f"{name} decoder process alone, {label}: {gb / best:.2f} GB/s ({best * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
