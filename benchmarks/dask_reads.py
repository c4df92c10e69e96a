"""Dask reads of engine stores with the ``read_ahead`` setting off and on, in turns.

For each store of ``route_table.py`` (float32 ``(T, 2048, 2048)`` of smooth data in 4 MiB
tiles): the eager default read (the reference), then, round after round, each ``read_ahead``
mode in turn: ``chunks={}`` loaded, ``chunks={}`` reduced (``.mean()``) and ``chunks="auto"``
loaded, best of two each (on a GPU after a warm-up run). Prints GB/s of decoded bytes, the
ratio to the eager read and the peak device memory over the output, per round (the rounds
show the run's spread).

Usage (GPU machine)::

    python benchmarks/dask_reads.py --size-gib 1 [--modes off,auto] [--rounds 2] [--json out.json]

``--device cpu`` runs the same reads into NumPy (``--modes off,on``: ``"auto"`` reads ahead on
a GPU only).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from route_table import store, timed

READS = (("chunks={}", {}, "load"), ("chunks={} .mean()", {}, "mean"), ("chunks='auto'", "auto", "load"))


def _timed(fn, device: str, repeat: int = 2) -> tuple[float, int]:
    """Best seconds of ``repeat`` runs of ``fn`` and, on a GPU, its peak device memory above
    the start (there: ``route_table.timed``, after a warm-up run)."""
    if device == "gpu":
        t, peak, _ = timed(fn, repeat)
        return t, peak
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, 0


def main() -> None:
    import xarray as xr

    import cupy_xarray

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-routes")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--stores", default="zstd tiles,blosc-zstd tiles,blosc-lz4 tiles,uncompressed tiles")
    ap.add_argument("--modes", default="off,auto", help="read_ahead settings compared, in turns")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    modes = args.modes.split(",")
    result: dict = {"size_gib": args.size_gib, "device": args.device, "stores": {}}
    for name in args.stores.split(","):
        path = store(Path(args.dir), name, args.size_gib)

        def open_(chunks, mode=None, path=path):
            with cupy_xarray.set_options(**({"read_ahead": mode} if mode else {})):
                kw = {"engine": "kvikio", "device": args.device, "consolidated": False}
                return xr.open_dataset(path, chunks=chunks, **kw)

        nbytes = open_(None)["field"].nbytes
        eager_s, eager_peak = _timed(lambda: open_(None)["field"].load(), args.device)
        rows = {"eager": {"GBps": nbytes / 1e9 / eager_s, "peak_x": eager_peak / nbytes}}
        gbs = nbytes / 1e9 / eager_s
        print(f"{name}: eager default {gbs:.2f} GB/s, peak {eager_peak / nbytes:.2f}x", flush=True)
        for _ in range(args.rounds):
            for mode in modes:
                for label, chunks, op in READS:

                    def fn(chunks=chunks, op=op, mode=mode):
                        data = open_(chunks, mode)["field"].data
                        (data.mean() if op == "mean" else data).compute()

                    t, peak = _timed(fn, args.device)
                    empty = {"GBps": [], "x_eager": [], "peak_x": []}
                    row = rows.setdefault(f"{label} read_ahead={mode}", empty)
                    row["GBps"].append(nbytes / 1e9 / t)
                    row["x_eager"].append(eager_s / t)
                    row["peak_x"].append(peak / nbytes)
        print("| read | GB/s by round | x eager | peak over output |\n| --- | --- | --- | --- |")
        for label, row in rows.items():
            if label == "eager":
                continue
            cells = [", ".join(f"{x:.2f}" for x in row[k]) for k in ("GBps", "x_eager", "peak_x")]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        result["stores"][name] = rows
    if args.json:
        from read_throughput import run_meta

        try:
            result["meta"] = run_meta()
        except ImportError:  # no cupy: a CPU run
            result["meta"] = {}
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
