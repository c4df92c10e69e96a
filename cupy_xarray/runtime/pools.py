"""The process's thread pools, one registry: kept for the process, one per kind of work and
size, and what waiting on their futures needs."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_kept_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_kept_lock = threading.Lock()


def kept_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` threads for ``name`` work (``"io"``, ``"write"``,
    ``"encode"``), kept for the process: dask tasks read and write many small pieces, and a
    pool per call would start its threads again every time, each making its buffers and
    streams again."""
    with _kept_lock:
        pool = _kept_pools.get((name, threads))
        if pool is None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix=f"cupy-xarray-{name}")
            _kept_pools[(name, threads)] = pool
        return pool


def first_error(futures) -> BaseException | None:
    """Wait for every future; the first one's error in their order, or None."""
    first = None
    for f in futures:
        exc = f.exception()
        if exc is not None and first is None:
            first = exc
    return first


def run_now(fn, *args: Any) -> Future:
    """``fn(*args)`` on this thread, its outcome as a finished future (what a pool's would be)."""
    done: Future = Future()
    try:
        fn(*args)
        done.set_result(None)
    except Exception as exc:  # noqa: BLE001 - raised by whoever waits, as from the pool
        done.set_exception(exc)
    return done
