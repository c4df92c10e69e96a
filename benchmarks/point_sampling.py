"""Random points from a large store: the engine beside ``engine="zarr"`` and zarr's GPU mode.

Usage (GPU machine; ``--device cpu`` measures the engine's CPU path alone)::

    python benchmarks/point_sampling.py --dir /tmp/bench --size-gib 4 --json out.json

A float32 ``(T, 2048, 2048)`` zstd-1 store in 4 MiB tiles (4, 512, 512). Each case draws N
random ``(t, y, x)`` points and reads them with xarray's vectorized indexing
(``ds.field.isel(t=DataArray, y=DataArray, x=DataArray)``), timed from ``open_dataset`` to the
values in memory, best of ``--repeat`` after a warm-up. It prints milliseconds, the chunks the
read decoded (from the read report) beside the chunks that hold a point, and checks every path's
values against zarr-python's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

TILES = (4, 512, 512)


def store(root: Path, size_gib: float) -> Path:
    import xarray as xr
    import zarr
    from read_throughput import smooth_field

    t = max(8, int(size_gib * 2**30 / (2048 * 2048 * 4)) // 4 * 4)
    path = root / f"points-zstd-{t}.zarr"
    if not (path / "zarr.json").exists():
        enc = {"field": dict(chunks=TILES, compressors=zarr.codecs.ZstdCodec(level=1))}
        xr.Dataset({"field": (("t", "y", "x"), smooth_field((t, 2048, 2048)))}).to_zarr(
            path, mode="w", zarr_format=3, consolidated=False, encoding=enc
        )
    return path


def points(shape: tuple[int, ...], n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {d: rng.integers(0, s, n) for d, s in zip(("t", "y", "x"), shape)}


def holding(idx: dict[str, np.ndarray]) -> int:
    keys = np.stack([idx[d] // c for d, c in zip(("t", "y", "x"), TILES)], axis=1)
    return len(np.unique(keys, axis=0))


def reader(path: Path, how: str, device: str):
    import xarray as xr

    def read(idx):
        import zarr

        if how == "zarr-gpu":
            with zarr.config.enable_gpu():
                ds = xr.open_dataset(path, engine="zarr", chunks=None, consolidated=False)
                out = ds.field.isel({d: xr.DataArray(v, dims="p") for d, v in idx.items()}).values
        else:
            kw = {"engine": "zarr"} if how == "zarr" else {"engine": "kvikio", "device": device}
            ds = xr.open_dataset(path, chunks=None, consolidated=False, **kw)
            out = ds.field.isel({d: xr.DataArray(v, dims="p") for d, v in idx.items()}).data
        return out.get() if hasattr(out, "get") else np.asarray(out)

    return read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-points")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--counts", default="10,1000,10000")
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from cupy_xarray import record_reads

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = store(root, args.size_gib)
    import zarr

    shape = zarr.open_array(path / "field").shape
    hows = ["engine", "zarr"] + (["zarr-gpu"] if args.device == "gpu" else [])
    rows = []
    print(f"store {path.name} {shape}, device={args.device}", flush=True)
    for n in (int(c) for c in args.counts.split(",")):
        idx = points(shape, n, seed=n)
        truth = zarr.open_array(path / "field").vindex[idx["t"], idx["y"], idx["x"]]
        row = {"points": n, "chunks_holding": holding(idx), "paths": {}}
        for how in hows:
            read = reader(path, how, args.device)
            try:
                np.testing.assert_array_equal(read(idx), truth)  # warm-up, and the values
            except Exception as e:  # zarr's GPU mode fails vectorized reads (coordinate selection)
                row["paths"][how] = {"error": f"{type(e).__name__}: {e}"[:200]}
                print(f"  {n:>6} points  {how:<9} fails: {row['paths'][how]['error']}", flush=True)
                continue
            best, chunks = float("inf"), None
            for _ in range(args.repeat):
                with record_reads() as reports:
                    t0 = time.perf_counter()
                    read(idx)
                    t = time.perf_counter() - t0
                if t < best:
                    best = t
                    chunks = sum(getattr(r, "chunks", 0) for r in reports) if reports else None
            row["paths"][how] = {"ms": best * 1e3, "chunks_decoded": chunks}
            print(
                f"  {n:>6} points ({row['chunks_holding']} chunks hold one)  {how:<9} "
                f"{best * 1e3:9.1f} ms  chunks decoded: {chunks if chunks is not None else '-'}",
                flush=True,
            )
        eng, z = row["paths"]["engine"]["ms"], row["paths"]["zarr"]["ms"]
        print(f"  {'':>6}   engine / zarr time: {eng / z:.2f}", flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"store": str(path), "shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
