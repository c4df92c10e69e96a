"""Readers beside a zarr-python writer: the engine's reads and zarr-python's, counted.

Usage::

    python tools/live_reads.py /tmp/live.zarr           # unsharded chunks
    python tools/live_reads.py /tmp/live.zarr shards    # sharded

A writer thread rewrites one time step after another (zarr-python writes each chunk to a
temporary file and renames it over the old one); four threads read the whole array through
``engine="kvikio"`` (``device="cpu"``) and two through zarr-python, 150 reads each. Prints the
reads, the errors and the torn reads (a chunk equal to none of the versions written) per reader.
"""

import sys
import threading

import numpy as np
import xarray as xr
import zarr

import cupy_xarray  # noqa

root = sys.argv[1]
shards = len(sys.argv) > 2
shape, chunks = (16, 128, 128), (1, 128, 128)
enc = {"chunks": chunks, "compressors": zarr.codecs.ZstdCodec(level=1)}
if shards:
    enc["shards"] = (4, 128, 128)
rng = np.random.default_rng(0)
versions = [
    np.full(shape, k, "float32") + (rng.standard_normal(shape).astype("float32") if k % 2 else 0)
    for k in range(4)
]
xr.Dataset({"v": (("t", "y", "x"), versions[0])}).to_zarr(
    root, mode="w", zarr_format=3, consolidated=False, encoding={"v": enc}
)
stop = threading.Event()


def write():
    a = zarr.open_array(root + "/v", mode="r+")
    k = 0
    while not stop.is_set():
        k += 1
        t = k % shape[0]
        a[t] = versions[k % 4][t]


counts = {"engine": [0, 0, 0], "zarr": [0, 0, 0]}  # reads, errors, torn
lock = threading.Lock()


def whole(got):
    return all(any(np.array_equal(got[t], v[t]) for v in versions) for t in range(shape[0]))


def read(kind, n):
    for _ in range(n):
        try:
            if kind == "engine":
                got = xr.open_dataset(root, engine="kvikio", device="cpu", consolidated=False).v.values
            else:
                got = zarr.open_array(root + "/v", mode="r")[...]
            torn = not whole(got)
            err = 0
        except Exception as e:
            torn, err = False, 1
            if err and counts[kind][1] < 2:
                print(kind, type(e).__name__, str(e)[:160])
        with lock:
            c = counts[kind]
            c[0] += 1
            c[1] += err
            c[2] += torn


w = threading.Thread(target=write)
w.start()
ts = [threading.Thread(target=read, args=(k, 150)) for k in ("engine",) * 4 + ("zarr",) * 2]
[t.start() for t in ts]
[t.join() for t in ts]
stop.set()
w.join()
print(
    "sharded" if shards else "unsharded",
    {k: dict(reads=v[0], errors=v[1], torn=v[2]) for k, v in counts.items()},
)
