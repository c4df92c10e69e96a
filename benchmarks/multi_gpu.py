"""A full-store reduction with dask over 1 GPU and over every GPU of the machine, in one run.

Usage (on a machine with two or more GPUs)::

    python benchmarks/multi_gpu.py --dir /tmp/bench --size-gib 24 --json multi.json

It writes (once) a zstd store of a smooth float32 field (4 MiB chunks), opens it with
``engine="kvikio"`` and dask chunks of the store's own size (``chunks={}``) or of ``T`` time
steps, and on a dask-cuda ``LocalCUDACluster`` at dask's defaults, one worker per GPU (first
restricted to GPU 0, then on all GPUs), computes ``field.mean("t")`` and ``field.std()``, or
persists the whole array on the workers (a full ``.compute()`` that stays on the GPUs).
Prints the best and median of ``--repeat`` runs in GB/s of decoded bytes and the speed-up::

    python benchmarks/multi_gpu.py --dir /tmp/bench --size-gib 24 --configs 0x1,64x1,256x1
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


def _trace_reads() -> None:
    """On a worker: record every engine read's start, end and phases (see --trace)."""
    import threading
    import time as _time

    from cupy_xarray import record_reads
    from cupy_xarray.xarray import backend

    if getattr(backend, "_traced", None) is not None:
        backend._traced.clear()
        return
    backend._traced = traced = []
    inner = backend.read_arrays

    def read_arrays(*args, **kwargs):
        t0 = _time.perf_counter()
        with record_reads() as reports:
            out = inner(*args, **kwargs)
        phases = dict(reports[-1].phases) if reports else {}
        traced.append((t0, _time.perf_counter(), threading.get_ident(), phases))
        return out

    backend.read_arrays = read_arrays


def _traced_reads() -> list:
    from cupy_xarray.xarray import backend

    return list(getattr(backend, "_traced", []))


def _summarize(traces: dict, wall: float) -> str:
    lines = []
    for worker, reads in traces.items():
        if not reads:
            continue
        busy = sum(e - s for s, e, _, _ in reads)
        phases: dict[str, float] = {}
        for *_, st in reads:
            for k, v in st.items():
                phases[k] = phases.get(k, 0.0) + v
        mean = {k: round(1e3 * v / len(reads), 1) for k, v in phases.items()}
        lines.append(
            f"  {worker}: {len(reads)} reads, {1e3 * busy / len(reads):.0f} ms each, read time / wall "
            f"{busy / wall:.2f}; mean phases ms (racy across threads): {mean}"
        )
    return "\n".join(lines)


def _task_timeline(records: list, wall: float) -> str:
    """Per worker: tasks by kind, busy time per thread, and when its first and last tasks ran."""
    from dask.utils import key_split

    t0 = min(ss["start"] for r in records for ss in r["startstops"])
    lines = []
    for worker in sorted({r["worker"] for r in records}):
        mine = [r for r in records if r["worker"] == worker]
        kinds: dict[str, int] = {}
        busy: dict[int, float] = {}
        spans = []
        for r in mine:
            kinds[key_split(r["key"])] = kinds.get(key_split(r["key"]), 0) + 1
            for ss in r["startstops"]:
                if ss["action"] == "compute":
                    busy[r.get("thread", 0)] = busy.get(r.get("thread", 0), 0.0) + ss["stop"] - ss["start"]
                    spans.append((ss["start"] - t0, ss["stop"] - t0))
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        lines.append(
            f"  {worker}: {kinds}; compute busy per thread s {[round(b, 2) for b in busy.values()]}; "
            f"first start {first:.3f}, last stop {last:.3f} (wall {wall:.3f})"
        )
    return "\n".join(lines)


def run(
    store: Path,
    devices: str,
    tchunk: int,
    repeat: int,
    tpw: int,
    io_threads: int,
    trace: bool = False,
    saturation: float | None = None,
    op: str = "mean",
    device: str = "gpu",
) -> dict:
    import xarray as xr
    from distributed import Client, LocalCluster, wait

    # the workers inherit the environment: each one's engine reads with io_threads threads
    saved = os.environ.get("CUPY_XARRAY_THREADS")
    os.environ["CUPY_XARRAY_THREADS"] = str(io_threads)
    try:
        import dask

        # None: dask's own default (1.1: root tasks queued and handed out as threads free up;
        # with two dozen 1 GiB tasks one worker often got 13 and the other 11, seen with
        # --trace); inf assigns every read up front (see docs/benchmarks.md)
        settings = {} if saturation is None else {"distributed.scheduler.worker-saturation": saturation}
        with dask.config.set(settings):
            if device == "gpu":
                from dask_cuda import LocalCUDACluster

                cluster = LocalCUDACluster(
                    CUDA_VISIBLE_DEVICES=devices, dashboard_address=None, threads_per_worker=tpw
                )
            else:  # the same orchestration on CPU workers, one per "device" (a check of the script)
                n_workers = len(devices.split(","))
                cluster = LocalCluster(n_workers=n_workers, threads_per_worker=tpw, dashboard_address=None)
    finally:
        if saved is None:
            del os.environ["CUPY_XARRAY_THREADS"]
        else:
            os.environ["CUPY_XARRAY_THREADS"] = saved
    with cluster, Client(cluster) as client:
        n = len(client.scheduler_info()["workers"])
        import cupy_xarray

        cupy_xarray.warm_up(client, device)  # fresh workers: else the first one ready takes most reads
        array_module = "cupy" if device == "gpu" else "numpy"

        def once(steps: int | None = None) -> float:
            ds = xr.open_dataset(
                store, engine="kvikio", device=device, chunks={"t": tchunk} if tchunk else {}
            )
            if steps is not None:
                ds = ds.isel(t=slice(0, steps))
            t0 = time.perf_counter()
            if op == "persist":  # a full .compute() whose blocks stay on the workers' GPUs
                kept = ds.field.data.persist()
                wait(kept)
                dt = time.perf_counter() - t0
                assert type(kept._meta).__module__.startswith(array_module), type(kept._meta)
                del kept
                return dt
            mean, std = ds.field.mean("t"), ds.field.std()
            futures = client.compute([mean.data, std.data])
            wait(futures)
            result = [f.result() for f in futures]
            dt = time.perf_counter() - t0
            assert type(result[0]).__module__.startswith(array_module), type(result[0])
            return dt

        once()  # warm: page cache, CUDA contexts, nvCOMP, kvikio threads on every worker
        times = [once() for _ in range(repeat)]
        # the same computation over one dask chunk: what a computation costs besides its reads
        one_task = min(once(tchunk or 1) for _ in range(3))
        if trace:  # one more run, with every read timed on the workers
            from distributed import get_task_stream

            client.run(_trace_reads)
            client.run(_trace_reads)
            with get_task_stream(client) as ts:
                wall = once()
            print(
                f"trace, GPUs {devices}, {wall:.2f} s:\n{_summarize(client.run(_traced_reads), wall)}\n"
                f"{_task_timeline(ts.data, wall)}",
                flush=True,
            )
        nbytes = xr.open_dataset(store, engine="kvikio", device=device, chunks={}).field.nbytes
    best = min(times)
    median = sorted(times)[len(times) // 2]
    return {
        "median_seconds": median,
        "median_gbps": nbytes / median / 1e9,
        "devices": devices,
        "workers": n,
        "io_threads": io_threads,
        "seconds": best,
        "gbps": nbytes / best / 1e9,
        "bytes": nbytes,
        "worker_saturation": "dask default" if saturation is None else saturation,
        "op": op,
        "one_task_seconds": one_task,
        "times": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/cupy-xarray-bench")
    ap.add_argument("--size-gib", type=float, default=24.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--configs",
        default="256x2",
        help="comma-separated TxN: T time steps (4 MiB each) per dask chunk (0: the store's own chunks, "
        "chunks={}), N tasks in flight per GPU (dask threads per worker); e.g. 0x1,64x1,256x1",
    )
    ap.add_argument(
        "--io-threads",
        default="auto",
        help="I/O threads per worker (CUPY_XARRAY_THREADS); auto: the host's cores split between the workers",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        help="run on this many CPU workers (device='cpu') instead of the GPUs: checks the script anywhere",
    )
    ap.add_argument("--trace", action="store_true", help="time every read on the workers in one extra run")
    ap.add_argument(
        "--saturation",
        type=float,
        default=None,
        help="dask's distributed.scheduler.worker-saturation (default: dask's own, 1.1: root tasks "
        "queued; inf: every read assigned up front)",
    )
    ap.add_argument(
        "--ops",
        default="mean,persist",
        help="comma-separated: mean (mean('t') and std() of the store) and persist (a full .compute() "
        "kept on the workers' GPUs)",
    )
    args = ap.parse_args()

    if args.cpu_workers:
        device, ngpu = "cpu", args.cpu_workers
    else:
        import cupy

        device, ngpu = "gpu", cupy.cuda.runtime.getDeviceCount()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    store = write_stores(root, args.size_gib, ["zstd"])["zstd"]
    all_gpus = ",".join(str(i) for i in range(ngpu))
    results = []
    for config in args.configs.split(","):
        tchunk, tpw = (int(v) for v in config.split("x"))

        def io(workers: int) -> int:
            if args.io_threads != "auto":
                return int(args.io_threads)
            return max(4, min(32, (os.cpu_count() or 8) // workers))

        for op in args.ops.split(","):
            common = (tchunk, args.repeat, tpw)
            one = run(store, "0", *common, io(1), args.trace, args.saturation, op, device)
            rows = [one] + (
                [run(store, all_gpus, *common, io(ngpu), args.trace, args.saturation, op, device)]
                if ngpu > 1
                else []
            )
            for r in rows:
                r.update(
                    tchunk=tchunk or "store's",
                    tasks_per_gpu=tpw,
                    speedup=r["gbps"] / one["gbps"],
                    median_speedup=r["median_gbps"] / one["median_gbps"],
                )
            results.extend(rows)
    print(f"\nstore: {store} ({results[0]['bytes'] / 2**30:.1f} GiB decoded, zstd)")
    print(
        "| op | dask chunk (t) | dask threads per GPU | worker-saturation | I/O threads per GPU | GPUs "
        "| best s | GB/s | speed-up | median GB/s | median speed-up | one-task s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['op']} | {r['tchunk']} | {r['tasks_per_gpu']} | {r['worker_saturation']} "
            f"| {r['io_threads']} "
            f"| {r['devices']} | {r['seconds']:.2f} | {r['gbps']:.2f} | {r['speedup']:.2f}x "
            f"| {r['median_gbps']:.2f} | {r['median_speedup']:.2f}x | {r['one_task_seconds']:.3f} |"
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
