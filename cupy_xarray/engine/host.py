"""The host route: one CPU thread reads a chunk, decodes and checks it, and places it.

Chunks are jobs on a shared pool of CPU threads (small ones a few to a job, :func:`groups`),
each chunk in turn: ``os.preadv`` of its stored bytes,
its byte codecs in decode order (the same decoders and checks as the batched CPU path:
libzstd, zlib, liblz4, c-blosc after the engine's own Blosc layout check, crc32c), then:

- a CPU read decodes straight into the output where the chunk is one run of it, else
  scatters from the thread's buffer;
- a GPU read decodes into pinned host memory and copies it to the device on the thread's
  own CUDA stream: straight into the output where the chunk is one run of it, with strided
  2-D copies where the piece is a box of rows (:func:`~.scatter.box_copies`), else into a
  scratch buffer of one chunk that is scattered on the GPU.

Uncompressed chunks fetched from a remote store are the exception on a GPU: the calling
thread queues their copies, and the kernel that places tile boxes reads them from the
page-locked memory they landed in (:func:`_place_fetched`).

Memory beside the output is bounded by the pool: per thread, one chunk's stored bytes and
one chunk's decoded bytes on the host (kept by the thread for its next chunk; pinned for a
GPU read: the stored bytes where they are copied to the GPU as they are), and for a GPU read
of tiles one decoded chunk on the device, given back when the job ends.
Jobs of concurrent reads share the pool, so reads in many threads never decode on more CPU
threads than it has.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .decoders import decode_on_host
from .io import ReadOp, _pread_into, blob_bytes, first_error, run_now
from .scatter import Boxes, box_copies, copy_bytes, place_chunk

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_local = threading.local()


def pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` decode threads (kept: small reads must not start
    threads every time)."""
    with _pools_lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="cupy-xarray-decode")
        return p


def _buffer(name: str, nbytes: int, pinned: bool = False) -> np.ndarray:
    """This thread's host buffer ``name`` of at least ``nbytes`` (grown, never shrunk);
    ``pinned``: page-locked, so that copies from it to the GPU run at full speed."""
    key = f"{name}-pinned" if pinned else name
    buf = getattr(_local, key, None)
    if buf is None or len(buf) < nbytes:
        if pinned:
            from .decoders.batch import pinned_buffer

            buf = pinned_buffer(nbytes)
        else:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
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


def _stream(cupy: Any) -> Any:
    """This thread's CUDA stream (one per thread: jobs of different threads overlap)."""
    return _thread_stream(cupy, "jobs")


def side_stream(cupy: Any) -> Any:
    """This thread's second CUDA stream: for work started ahead of what its own stream runs
    (:func:`_stream`), so that the two overlap. Blocking, as that one is: both wait for
    copies on the legacy default stream."""
    return _thread_stream(cupy, "side")


def _timed_job(task: Any, out: Any, device: Any, jobs: Jobs) -> None:
    t0 = time.perf_counter()
    try:
        _job(task, out, device, jobs.stats)
    finally:
        jobs._spent.append((id(task.spec.recipe), time.perf_counter() - t0))  # (append: thread-safe)


def byte_span(recipe: Any, chunk_sel: tuple) -> tuple[int, int]:
    """The bytes of an uncompressed C-order chunk that hold a selection: from its first
    element to its last (a small selection of a large chunk reads only these)."""
    if recipe.bytes_codecs or recipe.transpose is not None or (recipe.order == "F" and len(recipe.shape) > 1):
        return 0, recipe.nbytes
    size = recipe.dtype.itemsize
    lo = hi = 0
    stride = size  # bytes, innermost dimension first (plain Python: this runs per chunk)
    for s, n in zip(reversed(chunk_sel), reversed(recipe.shape)):
        if isinstance(s, (int, np.integer)):
            first = last = int(s)
        elif isinstance(s, slice):
            idx = range(*s.indices(n))
            if not idx:
                return 0, 0
            first, last = min(idx[0], idx[-1]), max(idx[0], idx[-1])
        else:
            if not len(s):
                return 0, 0
            first, last = int(np.min(s)), int(np.max(s))
        lo += first * stride
        hi += last * stride
        stride *= n
    return lo, hi + size


def _span(task: Any) -> tuple[int, int]:
    """:func:`byte_span` of an uncompressed task, computed once (kept on the task)."""
    if task.span is None:
        task.span = byte_span(task.spec.recipe, task.piece.chunk_sel)
    return task.span


def _job(task: Any, out: Any, device: Any, stats: dict | None) -> None:
    if task.direct is not None:
        _direct_job(task, out, device)
        return
    recipe = task.spec.recipe
    t0 = time.perf_counter()
    lo, hi = (0, task.nbytes) if recipe.bytes_codecs else _span(task)
    if task.blob is not None:  # fetched: decoded or copied from where it landed
        op = ReadOp(task.path, task.offset, task.nbytes, None, task.spec.name, task.key, task.blob)
        stored = blob_bytes(op)
    else:
        # uncompressed chunks go to the GPU from this buffer: pinned (a pageable copy is 7x slower)
        stored = _buffer("stored", task.nbytes, pinned=device.name == "gpu" and not recipe.bytes_codecs)
        if hi > lo:
            _pread_into(ReadOp(task.path, task.offset + lo, hi - lo, stored[lo:hi], task.spec.name, task.key))
    if stats is not None:
        stats["host pread (thread-s)"] += time.perf_counter() - t0
    if device.name != "gpu":
        target = task.target
        final = target if target is not None else _buffer("decoded", recipe.nbytes + 8)
        data = decode_on_host(task, stored, final) if recipe.bytes_codecs else stored
        if len(data) < recipe.nbytes:
            raise task.error(f"chunk holds {len(data)} bytes, expected {recipe.nbytes}")
        if target is not None and data.ctypes.data == target.ctypes.data:
            return
        _place_host(task, data, out, device)
        return
    _job_gpu(task, stored, out, device, stats, (lo, hi))


def _placer(boxes: dict[int, Boxes], i: int, out: Any) -> Boxes:
    placer = boxes.get(i)
    if placer is None:
        placer = boxes[i] = Boxes(out)
    return placer


def _place_fetched(tasks: list[Any], outs: list[Any], device: Any, jobs: Jobs) -> None:
    """Copy fetched uncompressed chunks into their GPU outputs from the calling thread, every
    copy queued before one wait: runs of an output with one copy each; boxes of pieces in
    page-locked memory all with one kernel launch, which reads them where they landed; other
    boxes with 2-D copies; the rest by way of a scratch chunk and the scatter kernel.

    A pool job per chunk, each waiting for its own copies, cost more than the copies (1 GiB
    of 4 MiB tiles over loopback HTTP on an H200: 5.3 GB/s; 2-D copies queued here: 6.5; one
    kernel: 7.4, against 8.9 for the fetches alone)."""
    cupy = device.xp
    stream = _stream(cupy)
    rt = cupy.cuda.runtime
    h2d = rt.memcpyHostToDevice
    boxes: dict[int, Boxes] = {}  # per output: the boxes of page-locked pieces, one kernel
    t0 = time.perf_counter()
    try:
        for task in tasks:
            out = outs[task.out]
            at, size, dst = task.direct if task.direct is not None else (task.offset, task.nbytes, None)
            op = ReadOp(task.path, at, size, None, task.spec.name, task.key, task.blob)
            data = np.ascontiguousarray(blob_bytes(op))
            src = data.ctypes.data
            if dst is not None:
                rt.memcpyAsync(out.data.ptr + dst, src, size, h2d, stream.ptr)
                continue
            n = task.spec.recipe.nbytes
            if len(data) < n:
                raise task.error(f"chunk holds {len(data)} bytes, expected {n}")
            if task.target is not None:
                rt.memcpyAsync(task.target.data.ptr, src, n, h2d, stream.ptr)
            elif task.copy is not None:
                s, k, d = task.copy
                rt.memcpyAsync(out.data.ptr + d, src + s, k, h2d, stream.ptr)
            elif task.mapped and _placer(boxes, task.out, out).add(data, task.spec.recipe, task.piece):
                continue  # copied by the kernel below, from where it landed
            elif (copies := box_copies(task.spec.recipe, task.piece, out.shape)) is not None:
                for s, d, w, h, spitch, dpitch in copies:
                    rt.memcpy2DAsync(out.data.ptr + d, dpitch, src + s, spitch, w, h, h2d, stream.ptr)
            else:
                with stream:
                    scratch = cupy.empty(n, dtype=cupy.uint8)
                    lo, hi = _span(task)
                    if hi > lo:
                        rt.memcpyAsync(scratch.data.ptr + lo, src + lo, hi - lo, h2d, stream.ptr)
                    place_chunk(cupy, out, scratch, task.spec.recipe, task.piece)
        with stream:
            for placer in boxes.values():
                placer.run(cupy)
    finally:
        stream.synchronize()  # the fetched bytes are released once this returns, an error's way too
        jobs._spent.append((id(tasks[0].spec.recipe), time.perf_counter() - t0))


def _direct_job(task: Any, out: Any, device: Any) -> None:
    """A piece whose stored bytes are one run of the output: read straight into a host
    output, or into the thread's pinned buffer (a fetched one: from where it landed) and
    copied once into a GPU one."""
    file_off, n, dst = task.direct
    if not n:
        return
    op = ReadOp(task.path, file_off, n, None, task.spec.name, task.key, task.blob)
    if device.name != "gpu":
        op.dest = out.reshape(-1).view(np.uint8)[dst : dst + n]
        _pread_into(op)
        return
    if task.blob is not None:
        src = np.ascontiguousarray(blob_bytes(op))
    else:
        src = op.dest = _buffer("stored", n, pinned=True)
        _pread_into(op)
    cupy = device.xp
    stream = _stream(cupy)
    rt = cupy.cuda.runtime
    try:
        rt.memcpyAsync(out.data.ptr + dst, src.ctypes.data, n, rt.memcpyHostToDevice, stream.ptr)
    finally:
        stream.synchronize()  # the pinned buffer is reused by this thread's next job


def _place_host(task: Any, data: np.ndarray, out: np.ndarray, device: Any) -> None:
    if task.copy is not None:
        src, n, dst = task.copy
        copy_bytes(out, dst, data, src, n, device)
        return
    place_chunk(np, out, data, task.spec.recipe, task.piece)


def _job_gpu(task: Any, stored: np.ndarray, out: Any, device: Any, stats: dict | None, span: tuple) -> None:
    cupy = device.xp
    recipe = task.spec.recipe
    n = recipe.nbytes
    t0 = time.perf_counter()
    # the thread's own pinned buffer: a pinned allocation per chunk costs more than
    # decoding a small one, and the copies below end before the thread's next job
    pinned = _buffer("decoded", n + 8, pinned=True) if recipe.bytes_codecs else None
    data = decode_on_host(task, stored, pinned) if recipe.bytes_codecs else stored
    t1 = time.perf_counter()
    if len(data) < n:
        raise task.error(f"chunk holds {len(data)} bytes, expected {n}")
    stream = _stream(cupy)
    rt = cupy.cuda.runtime
    h2d = rt.memcpyHostToDevice
    src = data.ctypes.data
    try:  # the copies name their stream: only the scatter's kernel needs it made current
        if task.target is not None:
            rt.memcpyAsync(task.target.data.ptr, src, n, h2d, stream.ptr)
        elif task.copy is not None:
            s, k, d = task.copy
            rt.memcpyAsync(out.data.ptr + d, src + s, k, h2d, stream.ptr)
        elif (copies := box_copies(recipe, task.piece, out.shape)) is not None:
            # a box of the chunk into a box of the output: strided copies, no scratch or kernel
            for s, d, width, height, spitch, dpitch in copies:
                rt.memcpy2DAsync(out.data.ptr + d, dpitch, src + s, spitch, width, height, h2d, stream.ptr)
        else:
            with stream:
                scratch = cupy.empty(n, dtype=cupy.uint8)
                lo, hi = span if not recipe.bytes_codecs else (0, n)  # only the bytes read
                if hi > lo:
                    rt.memcpyAsync(scratch.data.ptr + lo, src + lo, hi - lo, h2d, stream.ptr)
                place_chunk(cupy, out, scratch, recipe, task.piece)
    finally:
        stream.synchronize()  # the host buffers are reused by this thread's next job, an error's way too
    if stats is not None:
        stats["host decode (thread-s)"] += t1 - t0
        stats["host to GPU (thread-s)"] += time.perf_counter() - t1


class Jobs:
    """The host route's jobs of one read, running."""

    def __init__(self, stats: dict | None = None) -> None:
        self._futures: list = []
        #: thread-seconds per phase (with ``CUPY_XARRAY_PROFILE=1``), else None
        self.stats = stats
        self._spent: list[tuple[int, float]] = []  # (id(recipe), seconds) per job
        self.started = time.perf_counter()
        #: seconds from the start of the jobs to the end of the last (set by :meth:`wait`)
        self.wall = 0.0

    def spent(self) -> dict[int, float]:
        """Thread-seconds per recipe (``id(recipe)``), once the jobs have ended."""
        out: dict[int, float] = defaultdict(float)
        for key, seconds in self._spent:
            out[key] += seconds
        return out

    def wait(self) -> None:
        """Wait for every job; raise the first task's error (in task order)."""
        first = first_error(self._futures)
        self._futures = []
        self.wall = time.perf_counter() - self.started
        if first is not None:
            raise first

    def cancel(self) -> None:
        """Drop the jobs not started yet and wait for the others (errors ignored)."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                f.exception()
        self._futures = []


#: uncompressed bytes (those the selection spans in each chunk) a read with nothing else to
#: wait for reads on the calling thread, one chunk after the other (each hand-off to the pool
#: costs a thread's wake-up)
INLINE_BYTES = 4 * 2**20


def _runs_inline(tasks: list[Any]) -> bool:
    if len(tasks) == 1:
        return True
    if any(t.spec.recipe.bytes_codecs for t in tasks):
        return False
    total = 0
    for t in tasks:  # the bytes each reads: a small selection of a large chunk reads a span of it
        lo, hi = _span(t)
        total += hi - lo
        if total > INLINE_BYTES:
            return False
    return True


def start(tasks: list[Any], outs: list[Any], device: Any, inline: bool = False) -> Jobs:
    """Start reading, decoding and placing every task on the pool; ``inline``: a read with
    nothing else to wait for runs a single task, or a few small uncompressed ones
    (:data:`INLINE_BYTES`), on the calling thread (handing a task to the pool costs a
    thread's wake-up, which is much of a small selection's time)."""
    jobs = Jobs(defaultdict(float) if os.environ.get("CUPY_XARRAY_PROFILE") == "1" else None)
    if not tasks:
        return jobs
    if device.name == "gpu":
        device.synchronize()  # the outputs' fill values are written before other streams write
        if all(t.blob is not None and not t.spec.recipe.bytes_codecs for t in tasks):
            jobs._futures.append(run_now(_place_fetched, tasks, outs, device, jobs))
            return jobs
    if inline and _runs_inline(tasks):
        for t in tasks:
            done = run_now(_timed_job, t, outs[t.out], device, jobs)
            jobs._futures.append(done)
            if done.exception() is not None:
                break  # the first error is the one reported; the rest need not be read
        return jobs
    p = pool(device.threads)
    jobs._futures = [p.submit(_run_group, g, outs, device, jobs) for g in groups(tasks, device.threads)]
    return jobs


#: decoded bytes one job on the pool works through, chunk after chunk, where a read has
#: enough of them to keep every thread busy: handing a job to the pool costs about as much
#: interpreter time as a small chunk's own work (a 1 MiB zstd chunk), and 16 threads share one
JOB_BYTES = 4 * 2**20


def groups(tasks: list[Any], threads: int) -> list[list[Any]]:
    """Consecutive tasks in groups of about :data:`JOB_BYTES` decoded bytes (a chunk at
    least), with at least four groups per thread where there are chunks enough."""
    total = sum(t.spec.recipe.nbytes for t in tasks)
    per = min(JOB_BYTES, total // (4 * max(threads, 1)))
    out: list[list[Any]] = []
    cur: list[Any] = []
    held = 0
    for t in tasks:
        cur.append(t)
        held += t.spec.recipe.nbytes
        if held >= per:
            out.append(cur)
            cur, held = [], 0
    if cur:
        out.append(cur)
    return out


def _run_group(group: list[Any], outs: list[Any], device: Any, jobs: Jobs) -> None:
    """One job: its tasks in order, up to the first error (the one :meth:`Jobs.wait` raises,
    as groups are waited for in task order)."""
    for t in group:
        _timed_job(t, outs[t.out], device, jobs)


@contextlib.contextmanager
def stream(cupy: Any):
    """Make this thread's own CUDA stream the current one."""
    with _stream(cupy):
        yield
