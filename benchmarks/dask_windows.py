"""dask loads of one store through the read-ahead, by its settings: GB/s and the engine reads.

Usage (GPU machine; a store of one variable ``field``, as ``route_table.py`` writes them)::

    python3 benchmarks/dask_windows.py /tmp/routes/zstd-tiles-64.zarr
    python3 benchmarks/dask_windows.py STORE --bytes 1,4 --wait 0,0.002 --rounds 2

Each setting (``read_ahead_bytes`` in GiB x ``read_ahead_wait`` in seconds) loads the store
with ``chunks={}`` and ``chunks="auto"`` (best of 3, the settings taken in turns), beside an
eager load, and prints the engine reads the last load made: their sizes, chunks, routes and
phases, largest first.
"""

from __future__ import annotations

import argparse
import time
import warnings

import cupy
import xarray as xr

import cupy_xarray


def load(path: str, chunks, settings: dict, repeat: int = 3) -> tuple[float, list]:
    """Best seconds of ``repeat`` loads of ``field``, and the reports of the last."""
    best, reports = float("inf"), []
    with cupy_xarray.set_options(**settings):
        for _ in range(repeat):
            ds = xr.open_dataset(path, engine="kvikio", chunks=chunks)
            t0 = time.perf_counter()
            with cupy_xarray.record_reads() as reports:
                data = ds["field"].data
                if chunks is not None:
                    data = data.compute()
                cupy.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
    return best, reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--bytes", default="1,4", help="read_ahead_bytes, GiB")
    ap.add_argument("--wait", default="0,0.002", help="read_ahead_wait, seconds")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    nbytes = xr.open_dataset(args.store, engine="kvikio", chunks={})["field"].nbytes
    eager, _ = load(args.store, None, {})
    print(f"eager: {nbytes / eager / 1e9:.2f} GB/s")
    for rnd in range(args.rounds):
        for chunks in ({}, "auto"):
            for gib in (float(b) for b in args.bytes.split(",")):
                for wait in (float(w) for w in args.wait.split(",")):
                    settings = {"read_ahead_bytes": int(gib * 2**30), "read_ahead_wait": wait}
                    t, reports = load(args.store, chunks, settings)
                    reads = list({id(r): r for r in reports}.values())
                    label = f"round {rnd} chunks={chunks!r} read_ahead_bytes={gib:g} GiB wait={wait:g}"
                    speed = f"{nbytes / t / 1e9:.2f} GB/s ({eager / t:.2f}x eager)"
                    print(f"{label}: {speed}, {len(reads)} engine reads")
                    for r in sorted(reads, key=lambda r: -r.nbytes)[:4]:
                        phases = {k: round(v * 1e3) for k, v in r.phases.items() if v > 0.002}
                        where = str(r.decisions[0]).split(":", 2)[-1][:60] if r.decisions else ""
                        print(f"    {r.nbytes >> 20:6d} MiB {r.chunks:5d} chunks {r.seconds * 1e3:6.0f} ms"
                              f" gathered {r.gathered} {phases}{where}")  # fmt: skip


if __name__ == "__main__":
    main()
