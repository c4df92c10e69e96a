"""dask loads of one store through the read-ahead, by its settings: GB/s and the engine reads.

Usage (GPU machine; a store of one variable ``field``, as ``route_table.py`` writes them)::

    python3 benchmarks/dask_windows.py /tmp/routes/zstd-tiles-64.zarr
    python3 benchmarks/dask_windows.py STORE --bytes 1,4 --wait 0,0.002 --rounds 2

Each setting (``read_ahead_bytes`` in GiB x ``read_ahead_wait`` in seconds x
``read_ahead_plan``, where the package has it, x the values of each ``--set NAME=V1,V2``)
loads the store with ``chunks={}`` and ``chunks="auto"`` (best of 3, the settings taken in
turns), beside an eager load, and prints the engine reads the last load made: their sizes,
chunks, routes and phases, largest first.
``--phases`` splits each best compute's time: before dask's first task asked for a block (its
graph work), while the blocks were read and handed out, and after the last one.
``--op mean`` times ``.mean()`` of the dask array instead of its load (against an eager
load's mean); ``--op sel`` a compute of its first four time steps (against the same
selection read eagerly).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import time
import warnings

import cupy
import xarray as xr
from read_throughput import PeakGPUMemory

import cupy_xarray

OPS = {
    "load": lambda a: a,
    "mean": lambda a: a.mean(),
    "sel": lambda a: a[:4],
}


#: (start, end) of each block a task asked the read-ahead for, where ``--phases`` times them
GETS: list[tuple[float, float]] = []


def time_gets() -> None:
    """Time every block a task asks the read-ahead for (``--phases``)."""
    from cupy_xarray.xarray import readahead

    get = readahead.ReadAhead.get

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return get(self, *args, **kwargs)
        finally:
            GETS.append((t0, time.perf_counter()))

    readahead.ReadAhead.get = timed


def phases_of(t0: float, t1: float, gets: list) -> str:
    """Where a compute's time went: before its first block was asked for (dask's graph
    work), from then until the last block was handed out, and after it (the tasks left, the
    result's assembly)."""
    if not gets:
        return ""
    first, last = min(g[0] for g in gets), max(g[1] for g in gets)
    return (
        f"; before the first block {(first - t0) * 1e3:.0f} ms, blocks {(last - first) * 1e3:.0f} ms,"
        f" after the last {(t1 - last) * 1e3:.0f} ms"
    )


def load(path: str, chunks, settings: dict, repeat: int = 3, op: str = "load") -> tuple:
    """Best seconds of ``repeat`` runs of ``op`` on ``field``, the reports of the last, the
    peak GPU memory of the best and where its time went (:func:`phases_of`)."""
    best, reports, peak, split = float("inf"), [], 0, ""
    with cupy_xarray.set_options(**settings):
        for _ in range(repeat):
            ds = xr.open_dataset(path, engine="kvikio", chunks=chunks)
            with PeakGPUMemory() as mem:
                GETS.clear()
                t0 = time.perf_counter()
                with cupy_xarray.record_reads() as reports:
                    if chunks is None:
                        out = OPS[op](ds["field"][:4].data if op == "sel" else ds["field"].data)
                    else:
                        out = OPS[op](ds["field"].data).compute()
                    cupy.cuda.Device().synchronize()
                t = time.perf_counter() - t0
            del out
            if t < best:
                best, peak, split = t, mem.used, phases_of(t0, t0 + t, GETS)
    return best, reports, peak, split


def learned() -> None:
    """Print what this process's reads taught the route model (``engine/observed.py``)."""
    from cupy_xarray.engine import observed

    for (_, kind), p in observed._paces.items():
        print(f"    pace {kind}: gpu_k {p.gpu_k:.2f} ({p.gpu_seen}) pool {p.pool / 1e9:.1f} GB/s"
              f" ({p.pool_seen}) shared {p.pool_shared / 1e9:.1f} ({p.pool_shared_seen})"
              f" io {p.io / 1e9:.1f} ({p.io_seen})")  # fmt: skip
    factors = sorted(observed._outcomes.items(), key=lambda kv: (kv[0][3], kv[0][2]))
    shown = (f"{k[2]}@{2 ** (2 * k[3]) >> 20}MiB {v[0]:.2f} ({v[1]}, {v[2]} since)" for k, v in factors)
    print("    factors:", ", ".join(shown))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--bytes", default="1,4", help="read_ahead_bytes, GiB")
    ap.add_argument("--wait", default="0,0.002", help="read_ahead_wait, seconds")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--plan", default="1,0", help="read_ahead_plan, where the package has it")
    ap.add_argument("--op", default="load", choices=sorted(OPS))
    ap.add_argument("--trace", action="store_true", help="print the paces and route factors learned")
    ap.add_argument("--phases", action="store_true", help="time the blocks' asks: where the time went")
    ap.add_argument(
        "--set", action="append", default=[], metavar="NAME=V1,V2",
        help="a setting's values to compare as well (repeatable; skipped where the package lacks it)",
    )  # fmt: skip
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.phases:
        time_gets()
    field = xr.open_dataset(args.store, engine="kvikio", chunks={})["field"]
    nbytes = field[:4].nbytes if args.op == "sel" else field.nbytes
    load(args.store, None, {}, repeat=1, op=args.op)  # (a process's first read sets things up)
    eager, _, peak, _ = load(args.store, None, {}, op=args.op)
    print(f"eager {args.op}: {nbytes / eager / 1e9:.2f} GB/s, peak GPU memory {peak / 2**30:.2f} GiB")
    plans = [bool(int(p)) for p in args.plan.split(",")]
    if not hasattr(cupy_xarray.Options, "read_ahead_plan"):
        plans = [None]
    extra = {}
    for item in args.set:
        name, _, values = item.partition("=")
        if hasattr(cupy_xarray.Options, name):
            extra[name] = [ast.literal_eval(v) for v in values.split(",")]
    variants = [dict(zip(extra, vals)) for vals in itertools.product(*extra.values())]
    for rnd in range(args.rounds):
        for chunks in ({}, "auto"):
            sizes = (float(b) for b in args.bytes.split(","))
            for gib, wait, plan, more in itertools.product(
                sizes, (float(w) for w in args.wait.split(",")), plans, variants
            ):
                settings = {"read_ahead_bytes": int(gib * 2**30), "read_ahead_wait": wait, **more}
                if plan is not None:
                    settings["read_ahead_plan"] = plan
                t, reports, peak, split = load(args.store, chunks, settings, op=args.op)
                reads = list({id(r): r for r in reports}.values())
                label = f"round {rnd} {args.op} chunks={chunks!r} {gib:g} GiB wait={wait:g} plan={plan}"
                label += "".join(f" {k}={v}" for k, v in more.items())
                speed = f"{nbytes / t / 1e9:.2f} GB/s ({eager / t:.2f}x eager), peak {peak / 2**30:.2f} GiB"
                print(f"{label}: {speed}, {len(reads)} engine reads{split}")
                for r in sorted(reads, key=lambda r: -r.nbytes)[:2]:
                    phases = {k: round(v * 1e3) for k, v in r.phases.items() if v > 0.002}
                    where = str(r.decisions[0]).split(":", 2)[-1][:140] if r.decisions else ""
                    print(f"    {r.nbytes >> 20:6d} MiB {r.chunks:5d} chunks {r.seconds * 1e3:6.0f} ms"
                          f" gathered {r.gathered} {phases}{where}")  # fmt: skip
                if args.trace:
                    learned()


if __name__ == "__main__":
    main()
