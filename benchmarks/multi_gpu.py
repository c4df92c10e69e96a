"""A full-store reduction with dask over 1 GPU and over every GPU of the machine, in one run.

Usage (on a machine with two or more GPUs)::

    python benchmarks/multi_gpu.py --dir /tmp/bench --size-gib 8 --json multi.json

It writes (once) a zstd store of a smooth float32 field, opens it with
``engine="kvikio", chunks={"t": ...}`` and computes ``field.mean("t")`` and ``field.std()``
on a dask-cuda ``LocalCUDACluster`` with one worker per GPU: first restricted to GPU 0,
then on all GPUs. Prints GB/s of decoded bytes and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from read_throughput import write_stores  # noqa: E402


def run(store: Path, devices: str, tchunk: int, repeat: int, tpw: int) -> dict:
    import xarray as xr
    from dask_cuda import LocalCUDACluster
    from distributed import Client, wait

    with (
        LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=devices, dashboard_address=None, threads_per_worker=1
        ) as cluster,
        Client(cluster) as client,
    ):
        n = len(client.scheduler_info()["workers"])

        def once() -> float:
            ds = xr.open_dataset(store, engine="kvikio", chunks={"t": tchunk})
            t0 = time.perf_counter()
            mean, std = ds.field.mean("t"), ds.field.std()
            futures = client.compute([mean.data, std.data])
            wait(futures)
            result = [f.result() for f in futures]
            dt = time.perf_counter() - t0
            assert type(result[0]).__module__.startswith("cupy"), type(result[0])
            return dt

        once()  # warm: page cache, CUDA contexts, nvCOMP, kvikio threads on every worker
        times = [once() for _ in range(repeat)]
        nbytes = xr.open_dataset(store, engine="kvikio", chunks={}).field.nbytes
    best = min(times)
    return {"devices": devices, "workers": n, "seconds": best, "gbps": nbytes / best / 1e9, "bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-bench")
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--tchunk", type=int, default=128, help="time steps per dask task (4 MiB each)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads-per-worker", type=int, default=2, help="dask tasks in flight per GPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy

    ngpu = cupy.cuda.runtime.getDeviceCount()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    store = write_stores(root, args.size_gib, ["zstd"])["zstd"]
    all_gpus = ",".join(str(i) for i in range(ngpu))
    results = [run(store, "0", args.tchunk, args.repeat, args.threads_per_worker)]
    if ngpu > 1:
        results.append(run(store, all_gpus, args.tchunk, args.repeat, args.threads_per_worker))
    one = results[0]["gbps"]
    print(
        f"\nstore: {store} ({results[0]['bytes'] / 2**30:.1f} GiB decoded, zstd), dask chunks t={args.tchunk}"
    )
    print("| GPUs | workers | seconds | GB/s | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['devices']} | {r['workers']} | {r['seconds']:.2f} | {r['gbps']:.2f} "
            f"| {r['gbps'] / one:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
