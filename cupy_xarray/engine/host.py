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
page-locked memory they landed in (:func:`.place.place_fetched`). Where the bytes go is
:mod:`.place`'s business; this module reads and decodes.

Memory beside the output is bounded by the pool: per thread, one chunk's stored bytes and
one chunk's decoded bytes on the host (kept by the thread for its next chunk; pinned for a
GPU read: the stored bytes where they are copied to the GPU as they are), and for a GPU read
of tiles one decoded chunk on the device, given back when the job ends.
Jobs of concurrent reads share the pool, so reads in many threads never decode on more CPU
threads than it has.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..options import Options, carried
from ..runtime.buffers import thread_buffer
from ..runtime.pools import first_error, run_now
from .decoders import decode_on_host
from .io import blob_bytes, pread_into
from .place import place_fetched, place_from_host
from .tasks import ChunkTask

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` decode threads (kept: small reads must not start
    threads every time)."""
    with _pools_lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="cupy-xarray-decode")
        return p


def fetched_bytes(task: ChunkTask, offset: int, size: int) -> np.ndarray:
    """``size`` of a task's fetched bytes from ``offset``."""
    return blob_bytes(task.read_op(offset, size))


class Jobs:
    """The host route of one read: its jobs on the pool, placing into ``outs`` on ``device``
    with the read's ``options``.

    :meth:`start` runs the host route's tasks, :meth:`take_from` sets every thread on a
    shared queue's back end; :meth:`wait` raises the first task's error. ``placed``, where
    given, is called with each task once it is placed (on a GPU, its copies done).
    """

    def __init__(
        self, outs: list[Any], device: Any, options: Options, placed: Callable[[list], None] | None = None
    ) -> None:
        self.outs, self.device, self.options = outs, device, options
        self.placed = placed  # told of each task placed (its copies to the GPU done)
        self._futures: list = []
        #: thread-seconds per phase (with ``CUPY_XARRAY_PROFILE=1``), else None
        self.stats: dict | None = defaultdict(float) if options.profile else None
        self._spent: list[tuple[int, float]] = []  # (recipe.key, seconds) per job
        self.started = time.perf_counter()
        #: seconds from the start of the jobs to the end of the last (set by :meth:`wait`)
        self.wall = 0.0

    def spent(self) -> dict[int, float]:
        """Thread-seconds per recipe (``recipe.key``), once the jobs have ended."""
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

    def start(self, tasks: list[ChunkTask], inline: bool = False) -> Jobs:
        """Start reading, decoding and placing every task on the pool; ``inline``: a read with
        nothing else to wait for runs a single task, or a few small uncompressed ones (the
        ``inline_bytes`` option), on the calling thread (handing a task to the pool costs a
        thread's wake-up, which is much of a small selection's time)."""
        if not tasks:
            return self
        device, options = self.device, self.options
        device.synchronize()  # the outputs' fill values are written before other streams write
        if not device.host_memory:
            if all(t.blob is not None and not t.spec.recipe.bytes_codecs for t in tasks):
                self._futures.append(run_now(self._place_fetched, tasks))
                return self
        if inline and _runs_inline(tasks, options):
            for t in tasks:
                done = run_now(self.run_task, t)
                self._futures.append(done)
                if done.exception() is not None:
                    break  # the first error is the one reported; the rest need not be read
            return self
        p = pool(device.threads)
        run = carried(self._run_group)  # the jobs read with this read's settings
        self._futures = [p.submit(run, g) for g in groups(tasks, device.threads, options)]
        return self

    def take_from(self, queue: Any) -> None:
        """Start every thread of the pool on a shared queue's back end (:mod:`.share`): each
        takes a job of about ``job_bytes`` (a chunk at least), reads, decodes and places it,
        and takes the next, until the queue is empty; the first error closes the queue."""
        self.device.synchronize()  # the outputs' fill values are written before other streams write
        run = carried(self._take)
        p = pool(self.device.threads)
        self._futures += [p.submit(run, queue) for _ in range(self.device.threads)]

    def run_task(self, task: ChunkTask) -> None:
        """Read, decode, check and place one task, timed."""
        t0 = time.perf_counter()
        try:
            self._job(task, self.outs[task.out])
        finally:
            self._spent.append((task.spec.recipe.key, time.perf_counter() - t0))  # (append: thread-safe)
        if self.placed is not None:
            self.placed([task])

    def _job(self, task: ChunkTask, out: Any) -> None:
        """Read, decode and place one task on this thread."""
        device, stats = self.device, self.stats
        if task.direct is not None:
            self._direct_job(task, out)
            return
        recipe = task.spec.recipe
        copied = not device.host_memory  # to the GPU, from this thread's page-locked buffers
        t0 = time.perf_counter()
        lo, hi = (0, task.nbytes) if recipe.bytes_codecs else task.stored_span()
        if task.blob is not None:  # fetched: decoded or copied from where it landed
            stored = fetched_bytes(task, task.offset, task.nbytes)
        else:
            # uncompressed chunks go to the GPU from this buffer: pinned (a pageable copy is 7x slower)
            stored = thread_buffer("stored", task.nbytes, pinned=copied and not recipe.bytes_codecs)
            if hi > lo:
                pread_into(task.read_op(task.offset + lo, hi - lo, stored[lo:hi]))
        t1 = time.perf_counter()
        data = stored
        if recipe.bytes_codecs:
            # on a GPU, the thread's own pinned buffer: a pinned allocation per chunk costs more
            # than decoding a small one, and the copies end before the thread's next job
            target = None if copied else task.target
            final = (
                target if target is not None else thread_buffer("decoded", recipe.nbytes + 8, pinned=copied)
            )
            data = decode_on_host(task, stored, final)
        t2 = time.perf_counter()
        if len(data) < recipe.nbytes:
            raise task.error(f"chunk holds {len(data)} bytes, expected {recipe.nbytes}")
        if not copied and task.target is not None and data.ctypes.data == task.target.ctypes.data:
            return  # decoded straight into the output
        place_from_host(task, data, out, device, self.options)
        if stats is not None:
            stats["host pread (thread-s)"] += t1 - t0
            if copied:
                stats["host decode (thread-s)"] += t2 - t1
                stats["host to GPU (thread-s)"] += time.perf_counter() - t2

    def _direct_job(self, task: ChunkTask, out: Any) -> None:
        """A piece whose stored bytes are one run of the output: read straight into a host
        output, or into the thread's pinned buffer (a fetched one: from where it landed) and
        copied once into a GPU one."""
        device = self.device
        file_off, n, dst = task.direct
        if not n:
            return
        op = task.read_op(file_off, n)
        if device.host_memory:
            op.dest = out.reshape(-1).view(np.uint8)[dst : dst + n]
            pread_into(op)
            return
        if task.blob is not None:
            src = np.ascontiguousarray(blob_bytes(op))
        else:
            src = op.dest = thread_buffer("stored", n, pinned=True)
            pread_into(op)
        place_from_host(task, src, out, device, self.options)

    def _take(self, queue: Any) -> None:
        try:
            done = 0
            while group := queue.take_back(self.options.job_bytes, done):
                for t in group:
                    self.run_task(t)
                done = sum(t.spec.recipe.nbytes for t in group)
        except BaseException:
            queue.close()  # the batches take no more: the read ends with this error
            raise

    def _place_fetched(self, tasks: list[ChunkTask]) -> None:
        t0 = time.perf_counter()
        try:
            place_fetched(tasks, self.outs, self.device, self.options, fetched_bytes)
        finally:
            self._spent.append((tasks[0].spec.recipe.key, time.perf_counter() - t0))

    def _run_group(self, group: list[ChunkTask]) -> None:
        """One job: its tasks in order, up to the first error (the one :meth:`wait` raises,
        as groups are waited for in task order)."""
        for t in group:
            self.run_task(t)


def _runs_inline(tasks: list[ChunkTask], options: Options) -> bool:
    if len(tasks) == 1:
        return True
    if any(t.spec.recipe.bytes_codecs for t in tasks):
        return False
    total = 0
    for t in tasks:  # the bytes each reads: a small selection of a large chunk reads a span of it
        lo, hi = t.stored_span()
        total += hi - lo
        if total > options.inline_bytes:
            return False
    return True


def groups(tasks: list[ChunkTask], threads: int, options: Options) -> list[list[ChunkTask]]:
    """Consecutive tasks in groups of about ``job_bytes`` (an option) decoded bytes (a chunk
    at least), with at least four groups per thread where there are chunks enough: handing a
    job to the pool costs about as much interpreter time as a small chunk's own work (a 1 MiB
    zstd chunk), and 16 threads share one."""
    total = sum(t.spec.recipe.nbytes for t in tasks)
    per = min(options.job_bytes, total // (4 * max(threads, 1)))
    out: list[list[ChunkTask]] = []
    cur: list[ChunkTask] = []
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
