"""A seeded campaign of server faults on a loopback HTTP store: random faults on random
objects (status codes, resets, bodies cut short, stalls, dripping bodies, gzip-encoded
answers, ignored ranges, redirects, dropped kept-alive connections), each case read one way.

Outcomes: ``same`` (the values zarr-python reads without faults), ``refused`` (one of the
package's own errors naming the object), or failures: ``differs`` (other values), ``bare``
(an exception not the package's), ``slow`` (longer than the retries' deadlines allow).

    python tests/remote_faults.py --cases 500
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import warnings

FAULTS = ("503", "500", "429", "reset", "short", "stall", "stall-body", "drip", "gzip", "ignore-range",
          "redirect", "close-after")  # fmt: skip
VARIABLES = ("tiles", "zstd", "gzip", "sharded", "sharded_start")
READS = ("lazy", "dask", "eager", "selection")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import numpy as np
    import xarray as xr
    from loopback import HTTPStores
    from tally import Tally
    from test_remote import _write

    import cupy_xarray
    from cupy_xarray.errors import CupyXarrayError

    root = tempfile.mkdtemp(prefix="faults-")
    store = _write(root)
    tally = Tally(ok=("same", "refused"))
    timeout, retries = 0.5, 2
    bound = (retries + 1) * (timeout + 0.2) * 4 + 5  # a few objects in a row, each retried
    with warnings.catch_warnings(), HTTPStores(root) as server, cupy_xarray.set_options(
        remote_timeout=timeout, remote_retries=retries, remote_backoff=0.01
    ):  # fmt: skip
        warnings.simplefilter("ignore")
        server.stall_s = 1.0
        server.redirect_to = server.url
        url = f"{server.url}/s.zarr"
        want = xr.open_dataset(url, engine="zarr").load()
        objects = {v: sorted(
            "/" + os.path.relpath(os.path.join(top, f), root)
            for top, _, files in os.walk(os.path.join(store, v)) for f in files if f != "zarr.json"
        ) for v in VARIABLES}  # fmt: skip
        for i in range(args.cases):
            rng = random.Random(args.seed * 1_000_003 + i)
            var, how = rng.choice(VARIABLES), rng.choice(READS)
            plan = {}
            for obj in rng.sample(objects[var], min(len(objects[var]), rng.randint(1, 3))):
                plan[obj] = [rng.choice(FAULTS) for _ in range(rng.randint(1, retries + 2))]
            label = f"#{i} {var} {how} {plan}"
            server.faults.clear()
            server.faults.update(plan)
            t0 = time.perf_counter()
            try:
                ds = xr.open_dataset(url, engine="kvikio", device="cpu", cache=False)
                if how == "lazy":
                    got, ref = ds[var].load(), want[var]
                elif how == "dask":
                    ds = xr.open_dataset(url, engine="kvikio", device="cpu", chunks={}, cache=False)
                    got, ref = ds[var].compute(), want[var]
                elif how == "eager":
                    got, ref = cupy_xarray.read_zarr_gds(url, device="cpu")[var], want[var]
                else:
                    sel = {d: slice(1, max(2, n // 2)) for d, n in ds[var].sizes.items()}
                    got, ref = ds[var].isel(sel).load(), want[var].isel(sel)
                outcome = (
                    "same" if np.array_equal(np.asarray(got), np.asarray(ref), equal_nan=True) else "differs"
                )
                detail = ""
            except CupyXarrayError as exc:
                outcome, detail = "refused", f"{type(exc).__name__}: {exc}"[:200]
            except Exception as exc:  # noqa: BLE001 - a failure of the campaign
                outcome, detail = "bare", f"{type(exc).__name__}: {exc}"[:200]
            seconds = time.perf_counter() - t0
            if seconds > bound:
                outcome, detail = "slow", f"{seconds:.1f} s"
            tally.add(label, outcome, detail, seconds)
        server.faults.clear()
    tally.finish(args.cases)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
