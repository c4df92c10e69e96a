"""A fresh process's loads of one store, each with its read report: where the first loads go.

Usage (GPU machine; a store of one variable ``field``, as ``route_table.py`` writes them)::

    SLEEP=3 python3 -P benchmarks/first_batches.py /tmp/routes/zstd-tiles-64.zarr 3
    python3 -P benchmarks/first_batches.py /tmp/routes/zstd-tiles-64.zarr 2 one   # one chunk

Each load opens the store again and reads all of ``field`` (or its first chunk with ``one``);
with ``SLEEP`` set, the process waits that many seconds after the first load, so that the next
one is the decoder process's first batch rather than another read on CPU threads.
"""

import os
import sys
import time

T0 = time.perf_counter()
import cupy  # noqa: E402
import xarray as xr  # noqa: E402

import cupy_xarray  # noqa: E402

path, n, sel = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "all"
for i in range(n):
    t0 = time.perf_counter()
    f = xr.open_dataset(path, engine="kvikio")["field"]
    with cupy_xarray.record_reads() as reports:
        if sel == "all":
            _ = f.data
        else:
            ct, cy, cx = f.encoding["chunks"]
            _ = f[:ct, :cy, :cx].data
        cupy.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    r = reports[-1] if reports else None
    phases = {k: round(v * 1e3, 1) for k, v in (r.phases.items() if r else [])}
    print(f"load {i} at {t0 - T0:.2f} s: {dt * 1e3:.0f} ms (open included), phases {phases}")
    for d in r.decisions if r else []:
        print("    ", d)
    del _
    if i == 0 and os.environ.get("SLEEP"):
        time.sleep(float(os.environ["SLEEP"]))
