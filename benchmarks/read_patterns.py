"""The reads users make, on tiled and slab stores, beside zarr's GPU mode and the CPU peers.

Usage (on a GPU machine; zarrs and tensorstore are optional peers)::

    python benchmarks/read_patterns.py --dir /tmp/bench --size-gib 2 --json out.json

Stores: float32 ``(T, 2048, 2048)`` of smooth data, written by zarr-python the ordinary way:
4 MiB tiles ``(4, 512, 512)`` (a chunk is not one run of the output) uncompressed, zstd-1,
Blosc lz4 + shuffle, numcodecs LZ4 and gzip-1; 16 MiB slabs ``(1, 2048, 2048)`` uncompressed
and zstd-1; 1 MiB tiles ``(1, 512, 512)`` zstd-1. For each store, in one run:

- eager full loads: ``engine="kvikio"`` with ``decode="auto"``, ``"gpu"`` and ``"cpu"``;
  the engine's read alone (the array opened once, no ``xr.open_dataset`` in the time);
  zarr's GPU mode; the zarrs codec pipeline and tensorstore, each + ``cupy.asarray``; and
  the I/O ceiling: kvikio reading every chunk file at once into one GPU buffer (allocated
  beforehand, and by each read);
- dask: ``chunks={}`` (the store's own chunks) ``.compute()``, and 256 MiB chunks
  ``.compute()`` and ``.mean().compute()``;
- latency (median of 15): a one-chunk selection and a 1 % selection, engine and zarr's GPU
  mode;
- 16 threads each reading random ``(1, 256, 256)`` selections, against one thread.

It prints GB/s of decoded bytes, ratios to zarr's GPU mode and to the engine's eager read,
peak GPU memory over the output, the scheduler's decisions, and writes ``--json`` for the
docs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
from read_throughput import PeakGPUMemory, in_threads, run_meta, smooth_field

SIDE = 2048


def store_specs(t: int) -> dict[str, dict]:
    import zarr
    from zarr.codecs import numcodecs as zn

    zstd = zarr.codecs.ZstdCodec(level=1)
    tiles, slabs, small = (4, 512, 512), (1, SIDE, SIDE), (1, 512, 512)
    return {
        "uncompressed tiles": dict(t=t, chunks=tiles, compressors=None),
        "uncompressed slabs": dict(t=t, chunks=slabs, compressors=None),
        "zstd tiles": dict(t=t, chunks=tiles, compressors=zstd),
        "zstd slabs 16MiB": dict(t=t, chunks=slabs, compressors=zstd),
        "zstd tiles 1MiB": dict(t=t, chunks=small, compressors=zstd),
        "blosc-lz4 tiles": dict(
            t=t, chunks=tiles, compressors=zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
        ),
        "blosc-zstd tiles": dict(
            t=t, chunks=tiles, compressors=zarr.codecs.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")
        ),
        "lz4 tiles": dict(t=t, chunks=tiles, compressors=zn.LZ4()),
        "gzip tiles": dict(t=max(8, t // 4), chunks=tiles, compressors=zarr.codecs.GzipCodec(level=1)),
    }


def pattern_store(root: Path | str, name: str, size_gib: float) -> Path:
    """Store ``name`` of :func:`store_specs`, about ``size_gib`` of float32, under ``root``
    (written there if missing): the path every benchmark that reads these stores uses."""
    t = max(8, int(size_gib * 2**30 / (SIDE * SIDE * 4)) // 4 * 4)
    path = Path(root) / (name.strip().replace(" ", "-") + ".zarr")
    write_store(path, store_specs(t)[name.strip()])
    return path


def write_store(path: Path, spec: dict) -> None:
    import xarray as xr

    if (path / "zarr.json").exists():
        return
    data = smooth_field((spec["t"], SIDE, SIDE))
    enc = {"field": {k: v for k, v in spec.items() if k != "t"}}  # chunks, compressors, shards ...
    xr.Dataset({"field": (("t", "y", "x"), data)}).to_zarr(
        path, mode="w", zarr_format=3, consolidated=True, encoding=enc
    )


def sync():
    import cupy

    cupy.cuda.Device().synchronize()


def best_of(fn, repeat: int, cap_s: float = 20.0) -> tuple[float, float]:
    """Best seconds of ``repeat`` runs after a warm-up, and the peak GPU memory of one more
    (a warm-up slower than ``cap_s`` is the figure, with its memory: nothing is repeated)."""
    import cupy

    t0 = time.perf_counter()
    with PeakGPUMemory() as mem:
        out = fn()
        sync()
        del out
    if time.perf_counter() - t0 > cap_s:
        return time.perf_counter() - t0, mem.used
    best = float("inf")
    for _ in range(repeat):
        cupy.get_default_memory_pool().free_all_blocks()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        del out
    with PeakGPUMemory() as mem:
        out = fn()
        sync()
        del out
    return best, mem.used


def median_latency(fn, count: int = 15) -> float:
    fn()
    sync()
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        out = fn(i)
        sync()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def raw_read(path: Path, threads: int, allocate: bool = False):
    """kvikio reading every chunk file of the array with ``threads`` threads, all at once, into
    one GPU buffer allocated beforehand (``allocate``: by each read, as a reader that returns a
    new array must): the I/O ceiling for the store's bytes."""
    import cupy
    import kvikio
    import kvikio.defaults

    files = sorted(f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json")
    sizes = [f.stat().st_size for f in files]
    kept = None if allocate else cupy.empty(sum(sizes), np.uint8)

    def read():
        buf = cupy.empty(sum(sizes), np.uint8) if kept is None else kept
        if kvikio.defaults.get("num_threads") != threads:  # setting it rebuilds kvikio's pool
            kvikio.defaults.set("num_threads", threads)
        handles, futures, off = [], [], 0
        for f, n in zip(files, sizes):
            handles.append(kvikio.CuFile(f, "r"))
            futures.append(handles[-1].pread(buf[off : off + n], n))
            off += n
        for h, fut in zip(handles, futures):
            fut.get()
            h.close()
        return buf if allocate else None

    return read


#: the stream kind each store's chunks are (one stream per chunk), for the ceilings
STREAM_KINDS = {"zstd": "zstd", "lz4": "lz4", "gzip": "gzip"}


def ceilings(path: Path, name: str, threads: int) -> dict:
    """Two ceilings on the store's own chunks, decoded bytes per second: nvCOMP alone (every
    bare stream already in device memory, all in one batched call, in the decoder process, as
    the engine runs it: nvCOMP called in this process with these 1,024 valid frames hung for
    120 s and cost the CUDA context on an H200) and CPU threads alone (every chunk in host
    memory, decoded by ``threads`` threads into buffers made beforehand; Blosc: numcodecs'
    Blosc, one thread each)."""
    import concurrent.futures as cf

    import cupy
    import zarr

    from cupy_xarray.engine.decoders.registry import stream
    from cupy_xarray.engine.sandbox.client import decode_batch
    from cupy_xarray.options import get_options
    from cupy_xarray.runtime.nvcomp import batched_decoder

    arr = zarr.open_array(path / "field", mode="r")
    expected = int(np.prod(arr.chunks)) * arr.dtype.itemsize
    files = sorted(f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json")
    blobs = [np.fromfile(f, np.uint8) for f in files]
    outs = [np.empty(expected, np.uint8) for _ in blobs]
    kind = STREAM_KINDS.get(name.split()[0])
    pool = cf.ThreadPoolExecutor(threads)
    if kind is None:  # Blosc
        import numcodecs
        import numcodecs.blosc

        numcodecs.blosc.use_threads = False
        codec = numcodecs.Blosc()

        def one(i):
            codec.decode(blobs[i], out=outs[i])
    else:
        decoder = stream(kind)

        def one(i):
            decoder.decode_host(blobs[i], expected, outs[i])

    paths = {"CPU threads alone": lambda: list(pool.map(one, range(len(blobs))))}
    nv = batched_decoder(decoder.nvcomp) if kind is not None else None
    if nv is not None:
        srcs = [cupy.asarray(decoder.deframe(b)) for b in blobs]

        def nvcomp_alone():  # decoded into the arena (no copy out); checked sizes and statuses
            outs, _ = decode_batch(kind, srcs, [expected] * len(srcs), None, True, 1.0, options=get_options())
            cupy.cuda.Device().synchronize()

        paths["nvCOMP alone"] = nvcomp_alone
    return paths


def eager_paths(path: Path, threads: int, has_lz4: bool) -> dict:
    import cupy
    import xarray as xr
    import zarr

    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device

    def engine(decode):
        return lambda: xr.open_dataset(path, engine="kvikio", threads=threads, decode=decode)["field"].data

    spec = array_spec(zarr.open_array(path / "field", mode="r"), "field")
    gpu = resolve_device("gpu", threads)

    def engine_read():  # the read alone: the array opened once, as a loop over loads has it
        return read_arrays([(spec, (slice(None),) * 3)], gpu)[0]

    def zarr_gpu():
        with zarr.config.enable_gpu():
            return zarr.open_array(path / "field", mode="r")[:]

    def zarrs():
        with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}):
            return cupy.asarray(zarr.open_array(path / "field", mode="r")[:])

    def tensorstore():
        import tensorstore as ts

        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "field")}}
        return cupy.asarray(ts.open(spec, read=True).result().read().result())

    paths = {
        "raw kvikio read": raw_read(path, threads),
        "raw read + cupy.empty": raw_read(path, threads, allocate=True),
        "engine auto": engine("auto"),
        "engine read, no open": engine_read,
        "engine decode=gpu": engine("gpu"),
        "engine decode=cpu": engine("cpu"),
        "zarr GPU mode": zarr_gpu,
        "zarrs + asarray": zarrs,
    }
    if not has_lz4:
        paths["tensorstore + asarray"] = tensorstore
    return paths


def dask_paths(path: Path, threads: int, t_len: int, chunk_t: int) -> dict:
    import xarray as xr

    def own_chunks():
        return xr.open_dataset(path, engine="kvikio", threads=threads, chunks={})["field"].data.compute()

    def big_chunks():
        ds = xr.open_dataset(path, engine="kvikio", threads=threads, chunks={"t": chunk_t, "y": -1, "x": -1})
        return ds["field"].data.compute()

    def big_mean():
        ds = xr.open_dataset(path, engine="kvikio", threads=threads, chunks={"t": chunk_t, "y": -1, "x": -1})
        return ds["field"].mean().data.compute()

    def auto_chunks():
        return xr.open_dataset(path, engine="kvikio", threads=threads, chunks="auto")["field"].data.compute()

    def auto_mean():
        ds = xr.open_dataset(path, engine="kvikio", threads=threads, chunks="auto")
        return ds["field"].mean().data.compute()

    def own_mean():
        ds = xr.open_dataset(path, engine="kvikio", threads=threads, chunks={})
        return ds["field"].mean().data.compute()

    return {
        "dask chunks={}": own_chunks,
        "dask chunks={} .mean()": own_mean,
        "dask chunks='auto'": auto_chunks,
        "dask chunks='auto' .mean()": auto_mean,
        "dask 256MiB": big_chunks,
        "dask 256MiB .mean()": big_mean,
    }


ERA5_VARS = ("t2m", "u10", "v10", "msl")


def era5_store(root: Path, steps: int) -> Path:
    """An ERA5-like store: four float32 variables of ``steps`` hourly 721 x 1440 fields,
    a chunk per step and variable, zarr v3's default zstd."""
    import xarray as xr
    import zarr

    path = root / f"era5-{steps}.zarr"
    if (path / "zarr.json").exists():
        return path
    y = np.linspace(-np.pi / 2, np.pi / 2, 721, dtype="f4")[:, None]
    x = np.linspace(0, 2 * np.pi, 1440, dtype="f4")[None, :]
    first = True
    for t0 in range(0, steps, 16):
        n = min(16, steps - t0)
        t = np.arange(t0, t0 + n, dtype="f4")[:, None, None]
        data = {
            v: (
                ("time", "lat", "lon"),
                (np.round((np.sin(y * (k + 1) + t / 24) * np.cos(x + k) * 20 + 280) * 64) / 64).astype("f4"),
            )
            for k, v in enumerate(ERA5_VARS)
        }
        ds = xr.Dataset(data, coords={"time": np.arange(t0, t0 + n)})
        if first:
            enc = {v: {"chunks": (1, 721, 1440), "compressors": zarr.codecs.ZstdCodec()} for v in ERA5_VARS}
            ds.to_zarr(path, mode="w", encoding=enc, zarr_format=3)
            first = False
        else:
            ds.to_zarr(path, append_dim="time")
    return path


def era5_batches(root: Path, steps: int, threads: int, repeat: int) -> dict:
    """Batches of 32 steps of every variable (what a training loop reads), consecutive and
    random, engine beside zarr's GPU mode; GB/s and ms per batch."""
    import xarray as xr
    import zarr

    path = era5_store(root, steps)
    rng = np.random.default_rng(0)
    starts = [int(s) for s in rng.integers(0, steps - 32, size=repeat)]
    picks = [np.sort(rng.choice(steps, 32, replace=False)) for _ in range(repeat)]
    nbytes = 32 * 721 * 1440 * 4 * len(ERA5_VARS)
    ds = xr.open_dataset(path, engine="kvikio", threads=threads)

    def engine(sel):
        return lambda i: [a.data for a in ds[list(ERA5_VARS)].isel(time=sel(i)).data_vars.values()]

    def zarr_gpu(sel):
        def read(i):
            with zarr.config.enable_gpu():
                g = zarr.open_group(path, mode="r")
                return [g[v].get_orthogonal_selection((sel(i), slice(None), slice(None))) for v in ERA5_VARS]

        return read

    out = {}
    for label, sel in [
        ("consecutive", lambda i: slice(starts[i], starts[i] + 32)),
        ("random", lambda i: picks[i]),
    ]:
        for who, make in [("engine", engine), ("zarr GPU mode", zarr_gpu)]:
            fn = make(sel)
            fn(0)
            sync()
            times = []
            for i in range(repeat):
                t0 = time.perf_counter()
                fn(i)
                sync()
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            out[f"{who} {label}"] = {"GBps": nbytes / t / 1e9, "ms": t * 1e3}
            print(
                f"  era5 32 x 4 {who:>14} {label:<11} {nbytes / t / 1e9:6.2f} GB/s  {t * 1e3:7.1f} ms",
                flush=True,
            )
    return out


def threads_small(path: Path, threads: int, readers: int, per_reader: int) -> float:
    """Selections per second of ``readers`` threads, each reading random (1, 256, 256) windows."""
    import xarray as xr

    ds = xr.open_dataset(path, engine="kvikio", threads=threads)
    field = ds["field"]
    t_len = field.shape[0]

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(per_reader):
            t, y, x = int(rng.integers(t_len)), int(rng.integers(SIDE - 256)), int(rng.integers(SIDE - 256))
            _ = field[t, y : y + 256, x : x + 256].data
        sync()

    work(99)  # warm
    return readers * per_reader / in_threads(work, readers)


def measure(name: str, path: Path, args) -> dict:
    import cupy
    import xarray as xr
    import zarr

    from cupy_xarray import record_reads

    arr = zarr.open_array(path / "field", mode="r")
    nbytes = arr.nbytes
    stored = sum(f.stat().st_size for f in (path / "field").rglob("*") if f.is_file())
    row = {"store": name, "GiB": nbytes / 2**30, "ratio": nbytes / stored, "chunks": arr.chunks, "paths": {}}
    has_lz4 = name.startswith("lz4")
    gb = nbytes / 1e9

    def record(label, fn, repeat, scale=1.0):
        try:
            t, peak = best_of(fn, repeat)
            row["paths"][label] = {"GBps": gb * scale / t, "peak_x": peak / (nbytes * scale)}
            print(
                f"  {name:>19} {label:<22} {gb * scale / t:7.2f} GB/s  peak {peak / (nbytes * scale):5.2f}x",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - a peer that cannot read this store
            row["paths"][label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  {name:>19} {label:<22} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)

    for label, fn in eager_paths(path, args.threads, has_lz4).items():
        repeat = 1  # the slow peers: once after the warm-up
        if label in ("engine auto", "engine decode=gpu"):
            repeat = args.repeat
        elif label in ("raw kvikio read", "raw read + cupy.empty", "engine read, no open"):
            repeat = max(args.repeat, 5)  # a read and its ceiling: their ratio is a target
        with record_reads() as reports:
            record(label, fn, repeat)
        if label == "engine auto" and reports:
            row["decisions"] = [str(d) for d in reports[-1].decisions]
            print(f"  {name:>19} scheduler: {row['decisions']}", flush=True)
    if row["ratio"] > 1.05:
        for label, fn in ceilings(path, name, args.threads).items():
            record(label, fn, 3)
        cupy.get_default_memory_pool().free_all_blocks()
        got = row["paths"]
        tops = [got[k]["GBps"] for k in ("nvCOMP alone", "CPU threads alone") if "GBps" in got.get(k, {})]
        eng = got.get("engine auto", {}).get("GBps")
        if tops and eng:
            row["ceiling_x"] = {"larger": eng / max(tops), "sum": eng / sum(tops)}
            print(f"  {name:>19} engine auto: {eng / max(tops):.2f}x the larger ceiling, "
                  f"{eng / sum(tops):.2f}x their sum", flush=True)  # fmt: skip
    t_len = arr.shape[0]
    chunk_t = max(1, 256 * 2**20 // (SIDE * SIDE * 4))
    dask = dask_paths(path, args.threads, t_len, chunk_t)
    for label, fn in dask.items():
        if args.quick and label not in ("dask chunks={}", "dask chunks='auto'"):
            continue
        record(label, fn, 1)

    # latency of small selections, engine beside zarr's GPU mode
    ct, cy, cx = arr.chunks
    ds = xr.open_dataset(path, engine="kvikio", threads=args.threads)
    z = zarr.open_array(path / "field", mode="r")
    rng = np.random.default_rng(0)
    starts = [
        (
            int(rng.integers(t_len // ct)) * ct,
            int(rng.integers(SIDE // cy)) * cy,
            int(rng.integers(SIDE // cx)) * cx,
        )
        for _ in range(16)
    ]

    def one(i=0):
        s = starts[i]
        return ds["field"][s[0] : s[0] + ct, s[1] : s[1] + cy, s[2] : s[2] + cx].data

    pct = (slice(0, max(1, t_len // 4)), slice(0, 410), slice(0, 410))

    def one_pct(i=0):
        return ds["field"][pct].data

    def zarr_one(i=0):
        with zarr.config.enable_gpu():
            zg = zarr.open_array(path / "field", mode="r")
            s = starts[i]
            return zg[s[0] : s[0] + ct, s[1] : s[1] + cy, s[2] : s[2] + cx]

    def zarr_pct(i=0):
        with zarr.config.enable_gpu():
            return zarr.open_array(path / "field", mode="r")[pct]

    lat = {}
    for label, fn in [("engine one chunk", one), ("zarr GPU one chunk", zarr_one),
                      ("engine 1%", one_pct), ("zarr GPU 1%", zarr_pct)]:  # fmt: skip
        if args.quick and "1%" in label:
            lat[label] = float("nan")
            continue
        try:
            lat[label] = median_latency(fn)
        except Exception as exc:  # noqa: BLE001
            lat[label] = float("nan")
            print(f"  {name:>19} {label} failed: {exc}")
    del z
    row["latency_ms"] = {k: v * 1e3 for k, v in lat.items()}
    print(f"  {name:>19} latency ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in lat.items()), flush=True)
    try:
        if args.quick:
            raise RuntimeError("not measured (--quick)")
        one_thread = threads_small(path, args.threads, 1, 64)
        many = threads_small(path, args.threads, 16, 64)
        row["threads"] = {"one": one_thread, "sixteen": many, "x": many / one_thread}
        print(f"  {name:>19} small selections/s: 1 thread {one_thread:.0f}, 16 threads {many:.0f} "
              f"({many / one_thread:.1f}x)", flush=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        row["threads"] = {"error": str(exc)}
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def table(results: list[dict]) -> None:
    print("\n| store | ratio | path | GB/s | × zarr GPU | × engine eager | × raw | peak / output |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in results:
        p = row["paths"]
        zg = p.get("zarr GPU mode", {}).get("GBps")
        eng = p.get("engine auto", {}).get("GBps")
        raw = p.get("raw kvikio read", {}).get("GBps")
        for label, r in p.items():
            if "error" in r:
                print(f"| {row['store']} | {row['ratio']:.2f} | {label} | failed | | | | |")
                continue
            v = r["GBps"]
            ratios = " | ".join(f"{v / d:.2f}" if d else "" for d in (zg, eng, raw))
            print(
                f"| {row['store']} | {row['ratio']:.2f} | {label} | {v:.2f} | {ratios} | {r['peak_x']:.2f} |"
            )
    print("\n| store | one chunk, engine / zarr GPU (ms) | 1 %, engine / zarr GPU (ms) | 16 threads × one |")
    print("| --- | ---: | ---: | ---: |")
    for row in results:
        lat, th = row["latency_ms"], row.get("threads", {})
        print(
            f"| {row['store']} | {lat['engine one chunk']:.2f} / {lat['zarr GPU one chunk']:.2f} | "
            f"{lat['engine 1%']:.2f} / {lat['zarr GPU 1%']:.2f} | {th.get('x', float('nan')):.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-patterns")
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--stores", default="all")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="eager reads, ceilings, dask chunks={}, one chunk")
    ap.add_argument("--era5-steps", type=int, default=0, help="also the ERA5-like batches (0: not)")
    args = ap.parse_args()

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    import cupy

    _ = float(cupy.arange(1024, dtype=cupy.float32).mean())  # compile cupy's kernels before timing
    import dask.array as da
    import xarray as xr

    # and those of a dask mean through xarray (its first use compiles for seconds)
    small = xr.DataArray(da.from_array(cupy.ones((8, 64, 64), dtype=cupy.float32), chunks=(2, 64, 64)))
    _ = float(small.mean().data.compute())
    names = list(store_specs(8)) if args.stores == "all" else args.stores.split(",")
    results = []
    for name in names:
        t0 = time.time()
        path = pattern_store(root, name, args.size_gib)
        print(f"{name}: written in {time.time() - t0:.0f} s", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            results.append(measure(name, path, args))
        if args.json:  # after every store: a run cut short keeps what it measured
            Path(args.json).write_text(
                json.dumps({"meta": run_meta(), "rows": results}, indent=1, default=str)
            )
    era5 = era5_batches(root, args.era5_steps, args.threads, 8) if args.era5_steps else {}
    if args.json:
        Path(args.json).write_text(
            json.dumps({"meta": run_meta(), "rows": results, "era5": era5}, indent=1, default=str)
        )
    table(results)


if __name__ == "__main__":
    main()
