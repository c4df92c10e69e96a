"""A seeded campaign of hostile local stores: links out of the root, special files, files far
larger than their chunks, damaged shard indexes, each read every way a user reads.

Each case writes a small store (v2 or v3, uncompressed, zstd or gzip, sharded or not), makes
one hostile change, and reads it with one of read_zarr_gds, a lazy load, dask or DataTree.
Outcomes:

``refused``
    one of the package's own errors (``UnsafeStoreError``, ``ChunkError``, ``StoreError``).
``same``
    the values zarr-python reads from the store before the change (a harmless change: a
    link that stays inside the root).
``leak`` / ``silent`` / ``bare`` / ``slow``
    failures: the file outside the root was read, values unlike the store's own where the
    change should have been refused, an exception that is not the package's, a read over
    ``--limit`` seconds.

    python tests/hostile.py --cases 1000
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

CHANGES = (
    "link-chunk-out",
    "link-chunk-in",
    "link-dir-out",
    "link-array-out",
    "link-meta-out",
    "fifo-chunk",
    "fifo-meta",
    "sparse-chunk",
    "half-index",
)
READS = ("eager", "lazy", "dask", "tree")


def _write(path: str, rng: random.Random) -> dict:
    import xarray as xr
    import zarr

    fmt = rng.choice([2, 3])
    sharded = fmt == 3 and rng.random() < 0.4
    comp = rng.choice(["none", "zstd", "gzip"])
    enc: dict = {"chunks": (4, 4)}
    if fmt == 3:
        enc["compressors"] = {
            "none": None,
            "zstd": zarr.codecs.ZstdCodec(),
            "gzip": zarr.codecs.GzipCodec(),
        }[comp]
        if sharded:
            enc["shards"] = (8, 8)
    else:
        import numcodecs

        enc["compressors"] = {"none": None, "zstd": numcodecs.Zstd(), "gzip": numcodecs.GZip()}[comp]
    data = np.arange(16 * 8, dtype="float32").reshape(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xr.Dataset({"a": (("x", "y"), data)}).to_zarr(
            path, zarr_format=fmt, encoding={"a": enc}, consolidated=True
        )
    return {"fmt": fmt, "sharded": sharded, "comp": comp}


def _chunk_files(array_dir: str) -> list[str]:
    out = []
    for top, _, files in os.walk(array_dir):
        out += [os.path.join(top, f) for f in files if not f.startswith((".z", "zarr.json"))]
    return sorted(out)


def _change(kind: str, store: str, outside: str, rng: random.Random, layout: dict) -> bool:
    """Make the change; False where it does not apply to this layout."""
    arr = os.path.join(store, "a")
    files = _chunk_files(arr)
    if not files:
        return False
    victim = rng.choice(files)
    if kind == "link-chunk-out":
        os.unlink(victim)
        os.symlink(outside, victim)
    elif kind == "link-chunk-in":
        other = rng.choice(files)
        copy = os.path.join(store, "copy-of-chunk")
        shutil.copy(other if other != victim else victim, copy)
        shutil.copy(victim, copy)  # the same bytes, reached through a link inside the root
        os.unlink(victim)
        os.symlink(copy, victim)
    elif kind == "link-dir-out":
        d = os.path.dirname(victim)
        if d == arr:
            return False
        away = outside + "-dir"
        shutil.move(d, away)
        os.symlink(away, d)
    elif kind == "link-array-out":
        away = outside + "-array"
        shutil.move(arr, away)
        os.symlink(away, arr)
    elif kind == "link-meta-out":
        meta = os.path.join(arr, "zarr.json" if layout["fmt"] == 3 else ".zarray")
        shutil.copy(meta, outside + "-meta")
        os.unlink(meta)
        os.symlink(outside + "-meta", meta)
    elif kind == "fifo-chunk":
        os.unlink(victim)
        os.mkfifo(victim)
    elif kind == "fifo-meta":
        meta = os.path.join(arr, "zarr.json" if layout["fmt"] == 3 else ".zarray")
        os.unlink(meta)
        os.mkfifo(meta)
    elif kind == "sparse-chunk":
        with open(victim, "r+b") as f:
            f.truncate(2**31)
    elif kind == "half-index":
        if not layout["sharded"]:
            return False
        raw = bytearray(open(victim, "rb").read())
        n = 4 * 16 + 4  # 2 x 2 inner chunks, (offset, length) each, then the crc32c
        index = np.frombuffer(bytes(raw[-n:-4]), "<u8").copy()
        index[rng.randrange(8)] = np.uint64(2**64 - 1)
        import google_crc32c

        body = index.tobytes()
        raw[-n:] = body + google_crc32c.value(body).to_bytes(4, "little")
        open(victim, "wb").write(bytes(raw))
    return True


def _read(how: str, store: str) -> np.ndarray:
    import xarray as xr

    import cupy_xarray

    if how == "eager":
        return cupy_xarray.read_zarr_gds(store, device="cpu").a.values
    if how == "lazy":
        return xr.open_dataset(store, engine="kvikio", device="cpu").a.values
    if how == "dask":
        return xr.open_dataset(store, engine="kvikio", device="cpu", chunks={}).a.compute().values
    return xr.open_datatree(store, engine="kvikio", device="cpu").load()["a"].values


def run_case(index: int, seed: int, root: str, limit: float) -> dict:
    from cupy_xarray.errors import CupyXarrayError

    rng = random.Random(seed * 1_000_003 + index)
    kind, how = rng.choice(CHANGES), rng.choice(READS)
    case = os.path.join(root, f"case{index}")
    os.makedirs(case)
    store, outside = os.path.join(case, "s.zarr"), os.path.join(case, "outside")
    with open(outside, "wb") as f:
        f.write(b"\x00secret" * 4096)
    old = time.time() - 86400
    os.utime(outside, (old, old + 3600))
    layout = _write(store, rng)
    import zarr

    pristine = zarr.open_array(os.path.join(store, "a"), mode="r")[...]
    shards = " sharded" if layout["sharded"] else ""
    label = f"#{index} {kind} {how} v{layout['fmt']} {layout['comp']}{shards}"
    if not _change(kind, store, outside, rng, layout):
        shutil.rmtree(case, ignore_errors=True)
        return {"index": index, "case": label, "outcome": "skipped"}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _read(how, store)
        outcome = "same" if np.array_equal(got, pristine) else "silent"
        if outcome == "same" and kind not in ("link-chunk-in",):
            outcome = "silent"  # read where it should have been refused
        detail = ""
    except CupyXarrayError as exc:
        outcome, detail = "refused", f"{type(exc).__name__}: {exc}"[:200]
    except Exception as exc:  # noqa: BLE001 - a failure of the campaign
        outcome, detail = "bare", f"{type(exc).__name__}: {exc}"[:200]
    seconds = time.perf_counter() - t0
    for name in (outside, outside + "-dir", outside + "-array", outside + "-meta"):
        if name == outside and os.stat(name).st_atime != old:
            outcome, detail = "leak", "the file outside the root was read"
    if seconds > limit:
        outcome = "slow"
    shutil.rmtree(case, ignore_errors=True)
    return {"index": index, "case": label, "outcome": outcome, "detail": detail, "seconds": round(seconds, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=10.0)
    args = ap.parse_args()
    from tally import Tally

    root = tempfile.mkdtemp(prefix="hostile-")
    tally = Tally(ok=("refused", "same", "skipped"))
    try:
        for i in range(args.cases):
            r = run_case(i, args.seed, root, args.limit)
            tally.add(r["case"], r["outcome"], r.get("detail", ""), r.get("seconds", 0.0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tally.finish(args.cases)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
