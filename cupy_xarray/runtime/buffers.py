"""Memory and streams the engine's stages share: page-locked host buffers, each thread's own
reusable host buffers and CUDA streams."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..options import get_options

_local = threading.local()
_holders: list[Callable[[], None]] = []


def holds_idle_memory(release: Callable[[], None]) -> None:
    """Register ``release``, which frees the device memory its owner keeps idle (the decoder
    process's arenas): :func:`release_idle_memory` calls it where memory runs short."""
    if release not in _holders:
        _holders.append(release)


def release_idle_memory() -> None:
    """Free the device memory kept idle by those that registered (:func:`holds_idle_memory`),
    for a read or write that ran short of memory."""
    for release in list(_holders):
        release()


def pinned_buffer(nbytes: int) -> np.ndarray:
    """Page-locked host memory (cupy's pinned pool): copies from it to the GPU run at full speed.

    (``cupyx.empty_pinned`` does the same, but importing ``cupyx`` imports SciPy's sparse
    matrices, 0.2-0.6 s that a process's first small read would wait for.)"""
    import cupy

    n = max(nbytes, 1)
    return np.ndarray((n,), dtype=np.uint8, buffer=cupy.cuda.alloc_pinned_memory(n))


def thread_buffer(name: str, nbytes: int, pinned: bool = False) -> np.ndarray:
    """This thread's host buffer ``name`` of at least ``nbytes``, kept for its next jobs up to
    the ``kept_buffer_bytes`` option (a larger one is made for the job alone: chunks of a GiB
    must not leave a GiB held per thread after the read); ``pinned``: page-locked, so that
    copies from it to the GPU run at full speed (cupy's pinned pool keeps those)."""
    if not pinned and nbytes > get_options().kept_buffer_bytes:
        return np.empty(max(nbytes, 1), dtype=np.uint8)
    key = f"{name}-pinned" if pinned else name
    buf = getattr(_local, key, None)
    if buf is None or len(buf) < nbytes:
        buf = pinned_buffer(nbytes) if pinned else np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_local, key, buf)
    return buf[:nbytes]


def _thread_stream(cupy: Any, name: str) -> Any:
    """This thread's CUDA stream ``name`` on the current device, made on first use."""
    key = f"stream-{name}"
    s = getattr(_local, key, None)
    if s is None or s.device_id != cupy.cuda.Device().id:
        s = cupy.cuda.Stream()
        setattr(_local, key, s)
    return s


def thread_stream(cupy: Any) -> Any:
    """This thread's CUDA stream (one per thread: reads and jobs of different threads overlap)."""
    return _thread_stream(cupy, "jobs")


def side_stream(cupy: Any) -> Any:
    """This thread's second CUDA stream: for work started ahead of what its own stream runs
    (:func:`thread_stream`), so that the two overlap. Blocking, as that one is: both wait for
    copies on the legacy default stream."""
    return _thread_stream(cupy, "side")


def write_stream(cupy: Any, k: int) -> Any:
    """This thread's ``k``-th CUDA stream for batches a write queues beyond its first two."""
    return _thread_stream(cupy, f"write-{k}")


def check_stream(cupy: Any) -> Any:
    """This thread's CUDA stream for checks that run while the streams they check decode
    (the LZ4 walk beside nvCOMP's call)."""
    return _thread_stream(cupy, "checks")


@contextlib.contextmanager
def on_thread_stream(cupy: Any):
    """Make this thread's own CUDA stream the current one."""
    with thread_stream(cupy):
        yield
