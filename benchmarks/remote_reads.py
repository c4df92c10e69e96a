"""Stores behind an HTTP server on loopback: the engine beside zarr's GPU mode and the CPU
readers over the same server, against the server's own ceiling.

Usage (on a GPU machine; obstore is an optional peer)::

    python benchmarks/remote_reads.py --dir /tmp/remote --size-gib 1 --json out.json

The stores (float32 ``(T, 2048, 2048)`` of smooth data, written by zarr-python the ordinary
way: 4 MiB tiles uncompressed, zstd-1 and Blosc lz4; 1 MiB zstd tiles; 16 MiB zstd slabs;
a sharded store of 1 MiB zstd tiles in 64 MiB shards) are served by ``tests/loopback.py``'s
HTTP server in its own process. For each store, in one run:

- the ceiling: every chunk object fetched with parallel GETs through fsspec's HTTP client
  (the client zarr uses), nothing decoded; and the same bytes through the engine's fetcher
  (threads, ``http.client``), into new NumPy arrays and into page-locked memory from cupy's
  pinned pool (where the engine lands bytes bound for the GPU as they are); the highest of
  the three is the ceiling;
- eager loads: ``engine="kvikio"`` (GPU, ``decode="auto"``, and ``decode="gpu"``: every
  stream to nvCOMP), also with the engine fetching through fsspec's client; zarr's GPU mode over
  ``FsspecStore``; zarr on the CPU + ``cupy.asarray`` over fsspec and over obstore;
- dask: ``chunks={}`` and 256 MiB chunks, ``.compute()``;
- latency of a one-chunk selection, engine and zarr's GPU mode.

It prints GB/s of decoded bytes (the ceiling: of stored bytes, and the decoded bytes they
hold), ratios to the ceiling and to zarr's GPU mode, peak GPU memory over the output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from read_patterns import best_of, median_latency, write_store
from read_throughput import run_meta

SIDE = 2048
HERE = Path(__file__).resolve().parent


def store_specs(t: int) -> dict[str, dict]:
    import zarr

    zstd = zarr.codecs.ZstdCodec(level=1)
    tiles = (4, 512, 512)
    return {
        "uncompressed tiles": dict(chunks=tiles, compressors=None),
        "zstd tiles": dict(chunks=tiles, compressors=zstd),
        "zstd tiles 1MiB": dict(chunks=(1, 512, 512), compressors=zstd),
        "zstd slabs 16MiB": dict(chunks=(1, SIDE, SIDE), compressors=zstd),
        "blosc-lz4 tiles": dict(
            chunks=tiles, compressors=zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
        ),
        "zstd 1MiB in shards": dict(chunks=(1, 512, 512), shards=(4, 2048, 2048), compressors=zstd),
    }


@contextlib.contextmanager
def http_server(root: Path):
    """The loopback HTTP server in its own process; yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE.parent / "tests" / "loopback.py"), str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def ceiling_paths(url: str, keys: list[str]) -> dict:
    """Fetch every chunk object with no decoding: fsspec's client, and the engine's fetcher."""
    import fsspec
    from zarr.storage import FsspecStore

    from cupy_xarray.engine.remote import RemoteSource, Request
    from cupy_xarray.options import get_options

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    urls = [f"{url}/field/{k}" for k in keys]
    source = RemoteSource(FsspecStore.from_url(url, read_only=True), "field", "field")

    def fsspec_cat():
        return fs.cat(urls, batch_size=256)

    def engine_fetch():
        return source.fetch([Request(k) for k in keys], get_options())

    def engine_fetch_pinned():
        return source.fetch([Request(k) for k in keys], get_options(), pinned=True)

    return {
        "ceiling: fsspec GETs": fsspec_cat,
        "ceiling: engine fetch": engine_fetch,
        "ceiling: engine fetch, pinned": engine_fetch_pinned,
    }


def eager_paths(url: str) -> dict:
    import cupy
    import xarray as xr
    import zarr
    from zarr.storage import FsspecStore

    def engine():
        return xr.open_dataset(url, engine="kvikio")["field"].data

    def engine_aiohttp():
        from cupy_xarray.engine import remote

        remote.THREADED_HTTP = False  # the store's own client (fsspec, aiohttp)
        try:
            return xr.open_dataset(url, engine="kvikio")["field"].data
        finally:
            remote.THREADED_HTTP = True

    def engine_gpu_decode():
        return xr.open_dataset(url, engine="kvikio", decode="gpu")["field"].data

    def engine_cpu():
        return xr.open_dataset(url, engine="kvikio", device="cpu")["field"].data

    def zarr_gpu():
        with zarr.config.enable_gpu():
            return zarr.open_array(FsspecStore.from_url(f"{url}/field", read_only=True), mode="r")[:]

    def fsspec_cpu():
        store = FsspecStore.from_url(f"{url}/field", read_only=True)
        return cupy.asarray(zarr.open_array(store, mode="r")[:])

    paths = {"engine (GPU)": engine, "engine (GPU), decode=gpu": engine_gpu_decode,
             "engine (GPU), fsspec client": engine_aiohttp, "engine device=cpu": engine_cpu,
             "zarr GPU mode": zarr_gpu, "zarr CPU (fsspec) + asarray": fsspec_cpu}  # fmt: skip
    try:
        import obstore
        from zarr.storage import ObjectStore

        def obstore_cpu():
            store = ObjectStore(
                obstore.store.HTTPStore.from_url(f"{url}/field", client_options={"allow_http": True}),
                read_only=True,
            )
            return cupy.asarray(zarr.open_array(store, mode="r")[:])

        paths["zarr CPU (obstore) + asarray"] = obstore_cpu
    except ImportError:
        pass
    return paths


def dask_paths(url: str, chunk_t: int) -> dict:
    import xarray as xr

    def own():
        return xr.open_dataset(url, engine="kvikio", chunks={})["field"].data.compute()

    def big():
        ds = xr.open_dataset(url, engine="kvikio", chunks={"t": chunk_t, "y": -1, "x": -1})
        return ds["field"].data.compute()

    return {"dask chunks={}": own, "dask 256MiB": big}


def measure(name: str, path: Path, url: str, args) -> dict:
    import cupy
    import xarray as xr
    import zarr

    arr = zarr.open_array(path / "field", mode="r")
    nbytes = arr.nbytes
    files = [f for f in (path / "field").rglob("*") if f.is_file() and f.name != "zarr.json"]
    stored = sum(f.stat().st_size for f in files)
    keys = [str(f.relative_to(path / "field")) for f in files]
    row = {"store": name, "GiB": nbytes / 2**30, "ratio": nbytes / stored, "chunks": arr.chunks, "paths": {}}
    gb = nbytes / 1e9

    def record(label, fn, repeat):
        try:
            t, peak = best_of(fn, repeat)
            row["paths"][label] = {"GBps": gb / t, "stored_GBps": stored / 1e9 / t, "peak_x": peak / nbytes}
            print(f"  {name:>20} {label:<30} {gb / t:7.2f} GB/s ({stored / 1e9 / t:5.2f} stored)  "
                  f"peak {peak / nbytes:5.2f}x", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a peer that cannot read this store
            row["paths"][label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  {name:>20} {label:<30} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)

    for label, fn in ceiling_paths(url, keys).items():
        record(label, fn, args.repeat)
    for label, fn in eager_paths(url).items():
        record(label, fn, args.repeat if label.startswith("engine") else 1)
    chunk_t = max(1, 256 * 2**20 // (SIDE * SIDE * 4))
    for label, fn in dask_paths(url, chunk_t).items():
        record(label, fn, 1)

    ct, cy, cx = arr.chunks
    ds = xr.open_dataset(url, engine="kvikio")
    rng = np.random.default_rng(0)
    t_len = arr.shape[0]
    starts = [(int(rng.integers(t_len // ct)) * ct, int(rng.integers(SIDE // cy)) * cy,
               int(rng.integers(SIDE // cx)) * cx) for _ in range(16)]  # fmt: skip

    def one(i=0):
        s = starts[i]
        return ds["field"][s[0] : s[0] + ct, s[1] : s[1] + cy, s[2] : s[2] + cx].data

    def zarr_one(i=0):
        from zarr.storage import FsspecStore

        with zarr.config.enable_gpu():
            z = zarr.open_array(FsspecStore.from_url(f"{url}/field", read_only=True), mode="r")
            s = starts[i]
            return z[s[0] : s[0] + ct, s[1] : s[1] + cy, s[2] : s[2] + cx]

    lat = {}
    for label, fn in [("engine one chunk", one), ("zarr GPU one chunk", zarr_one)]:
        try:
            lat[label] = median_latency(fn) * 1e3
        except Exception as exc:  # noqa: BLE001
            lat[label] = float("nan")
            print(f"  {name:>20} {label} failed: {exc}")
    row["latency_ms"] = lat
    print(f"  {name:>20} latency ms: " + ", ".join(f"{k} {v:.2f}" for k, v in lat.items()), flush=True)
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def table(results: list[dict]) -> None:
    print("\n| store | ceiling GB/s (decoded) | engine GPU | / ceiling | zarr GPU mode | engine / zarr GPU | "
          "fsspec + asarray | obstore + asarray | dask {} / eager | dask 256 MiB / eager | peak | "
          "one chunk ms, engine / zarr GPU |")  # fmt: skip
    print("|" + " --- |" * 12)
    for r in results:
        p = r["paths"]

        def g(label, p=p):
            return p.get(label, {}).get("GBps", float("nan"))

        ceil = max(g(k) for k in p if k.startswith("ceiling"))
        eng = g("engine (GPU)")
        lat = r.get("latency_ms", {})
        nan = float("nan")
        print(
            f"| {r['store']} | {ceil:.2f} | {eng:.2f} | {eng / ceil:.2f} | {g('zarr GPU mode'):.2f} | "
            f"{eng / g('zarr GPU mode'):.2f} | {g('zarr CPU (fsspec) + asarray'):.2f} | "
            f"{g('zarr CPU (obstore) + asarray'):.2f} | {g('dask chunks={}') / eng:.2f} | "
            f"{g('dask 256MiB') / eng:.2f} | {p.get('engine (GPU)', {}).get('peak_x', float('nan')):.2f} | "
            f"{lat.get('engine one chunk', nan):.1f} / {lat.get('zarr GPU one chunk', nan):.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/remote-bench"))
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stores", default="", help="comma-separated store names (default all)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    t = max(4, int(args.size_gib * 2**30 // (SIDE * SIDE * 4)) // 4 * 4)
    specs = store_specs(t)
    if args.stores:
        specs = {k: v for k, v in specs.items() if k in args.stores.split(",")}
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, spec in specs.items():
        write_store(args.dir / name.replace(" ", "_"), dict(spec, t=t))
    results = []
    with http_server(args.dir) as base:
        print(f"serving {args.dir} at {base}; {os.cpu_count()} CPU cores", flush=True)
        for name in specs:
            path = args.dir / name.replace(" ", "_")
            results.append(measure(name, path, f"{base}/{path.name}", args))
            if args.json:  # after every store: a run cut short keeps what it measured
                args.json.write_text(json.dumps({"meta": run_meta(), "rows": results}, indent=1, default=str))
    table(results)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
