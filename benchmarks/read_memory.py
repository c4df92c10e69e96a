"""Host memory of a CPU read beyond its output, against its bound: ``batch_bytes`` plus one
chunk per thread. Each read runs in a process of its own (peak RSS is per process), public
``engine="kvikio"`` with ``device="cpu"``, on a store of large zstd chunks.

Usage::

    python benchmarks/read_memory.py --chunk-mib 64 --chunks 16 --threads 2,8 --batch-mib 16,256
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

_READ = """
import resource, time
import xarray as xr
import cupy_xarray
ds = xr.open_dataset({store!r}, engine="kvikio", device="cpu", threads={threads}, batch_bytes={batch})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
out = ds["v"].values
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(peak - out.nbytes, out.nbytes, seconds)
"""


def make_store(path: Path, chunk_mib: int, chunks: int) -> None:
    import numpy as np
    import xarray as xr
    import zarr

    if (path / "zarr.json").exists():
        return
    side = int((chunk_mib * 2**20 // 4) ** 0.5)
    rng = np.random.default_rng(0)
    field = np.sin(np.arange(side * side, dtype="f4").reshape(side, side) / 1000)
    data = np.stack([field + rng.normal(0, 0.01, field.shape).astype("f4") for _ in range(chunks)])
    enc = {"v": {"chunks": (1, side, side), "compressors": [zarr.codecs.ZstdCodec(level=1)]}}
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(path, encoding=enc, zarr_format=3, mode="w")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/cupy-xarray-read-memory")
    p.add_argument("--chunk-mib", type=int, default=64)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", default="2,8")
    p.add_argument("--batch-mib", default="16,256")
    a = p.parse_args()
    store = Path(a.dir) / f"zstd-{a.chunk_mib}mib-x{a.chunks}.zarr"
    # in a process of its own: a child inherits its parent's peak RSS, which the reads measure from
    make = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import read_memory as m; "
    make += f"m.make_store(m.Path({str(store)!r}), {a.chunk_mib}, {a.chunks})"
    subprocess.run([sys.executable, "-c", make], check=True)
    chunk = a.chunk_mib * 2**20
    print("| threads | batch_bytes MiB | beyond the output MiB | bound MiB | within | GB/s |")
    print("| ---: | ---: | ---: | ---: | --- | ---: |")
    for threads in (int(t) for t in a.threads.split(",")):
        for batch in (int(b) << 20 for b in a.batch_mib.split(",")):
            script = _READ.format(store=str(store), threads=threads, batch=batch)
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
            extra, nbytes, seconds = out.stdout.split()
            bound = batch + threads * chunk
            print(
                f"| {threads} | {batch >> 20} | {int(extra) / 2**20:.0f} | {bound / 2**20:.0f} | "
                f"{'yes' if int(extra) <= bound else 'NO'} | {int(nbytes) / float(seconds) / 1e9:.2f} |"
            )


if __name__ == "__main__":
    main()
