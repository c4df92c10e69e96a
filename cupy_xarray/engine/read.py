"""A read: one object that every stage of the engine takes, and the report it leaves.

:class:`Read` is built once per :func:`~.reader.read_arrays` call from its requests, the
device and the settings in effect (:mod:`cupy_xarray.options`), with the route policy (a
:class:`~.route.Scheduler`), the outputs and the read's :class:`ReadReport`. A report
belongs to its read: inside ``with record_reads() as reports:``, each read the block makes
(in this thread, and in the engine's threads working for it) appends its own, so concurrent
reads never overwrite each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..device import Device
from ..errors import OutOfMemoryError
from ..options import Options
from ..runtime.buffers import release_idle_memory
from ..runtime.notes import collecting, file
from .decoders.base import aligned_slots
from .fallback import is_oom
from .plan import output_shape
from .route import Decision, Scheduler
from .spec import ArraySpec


@dataclass
class ReadReport:
    """What one read did.

    Attributes
    ----------
    arrays
        The arrays read, by name.
    device, decode
        Where the outputs went, and the ``decode`` choice.
    nbytes
        Bytes of the outputs.
    chunks
        Stored chunks (inner chunks of shards) the read fetched; missing ones, read as the
        fill value, are not counted.
    seconds
        Wall time of the read.
    phases
        Seconds per phase (outputs: the one allocation of ``one_buffer``, plan, submit, io
        wait, decode ..., scatter, host route); exact with the ``profile`` option, which
        synchronizes the GPU between phases.
    decisions
        Where each group of compressed chunks was decoded and why (:class:`~.route.Decision`).
    batches
        Batches read with kvikio / the I/O threads (0: the host route alone).
    staging_bytes
        Memory each batch's staging buffer took beside the outputs (0: none).
    crowded
        Another read ran beside this one (its timings are not its own).
    notes
        What the read had to change to succeed (device memory ran short: smaller batches).
    gathered
        How many reads of other threads this one read together (:mod:`.gather`; 1: alone).
    """

    arrays: list[str] = field(default_factory=list)
    device: str = ""
    decode: str = "auto"
    nbytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    batches: int = 0
    staging_bytes: int = 0
    crowded: bool = False
    notes: list[str] = field(default_factory=list)
    gathered: int = 1

    def __str__(self) -> str:
        gbs = self.nbytes / self.seconds / 1e9 if self.seconds else 0.0
        head = (
            f"read of {', '.join(self.arrays) or 'nothing'} to the {self.device}: "
            f"{self.nbytes / 2**20:.1f} MiB ({self.chunks} chunks) in {self.seconds * 1e3:.1f} ms "
            f"({gbs:.2f} GB/s)"
        )
        if self.device == "gpu":  # batches, staging and decode= are what a GPU read chooses
            head += (
                f", {self.batches} batch(es), staging {self.staging_bytes / 2**20:.1f} MiB, "
                f"decode={self.decode!r}"
            )
        elif self.batches:
            head += f", {self.batches} batch(es)"
        if self.gathered > 1:
            head += f", {self.gathered} reads gathered into one"
        lines = [head]
        lines += [f"  {d}" for d in self.decisions]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


recorders: contextvars.ContextVar[list | None] = contextvars.ContextVar("cupy_xarray_reports", default=None)


@contextlib.contextmanager
def record_reads():
    """Collect the :class:`ReadReport` of every read made inside the block.

    Examples
    --------
    >>> with cupy_xarray.record_reads() as reports:  # doctest: +SKIP
    ...     ds.load()
    >>> print(reports[-1])  # doctest: +SKIP
    """
    with collecting(recorders) as reports:
        yield reports


class Clock:
    """Where a read's time goes, phase by phase."""

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        #: where given (exact timings: the ``profile`` option), waits for the device's work at
        #: each lap (``Device.wait_all``: every stream, nvCOMP runs on its own)
        self.wait = wait
        self.stats: dict[str, float] = defaultdict(float)
        self.groups: dict[int, float] = defaultdict(float)  # decode seconds per recipe
        self.crowded = False  # another read ran beside this one (its timings are not its own)
        self.ahead = 0.0  # seconds of the next batch's work run inside this batch's decodes
        self.t = self.start = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.wait is not None:
            self.wait()
        now = time.perf_counter()
        self.stats[phase] += now - self.t
        self.t = now


class Read:
    """One read of selections of many arrays: everything its stages share.

    Parameters
    ----------
    requests
        ``(spec, selection)`` pairs, the selections normalized.
    device
        Where the outputs go.
    options
        The settings in effect (:func:`cupy_xarray.options.get_options`).
    decode, batch_bytes, progress
        The read's own choices (the options' where not given).
    scheduler
        Gives each chunk its route.
    one_buffer
        The outputs are cut from one allocation (:class:`Outputs`).
    ready
        Called with a request's index and output as soon as all of its chunks are placed
        (:meth:`hand_out`), before the read ends.
    """

    def __init__(
        self,
        requests: list[tuple[ArraySpec, tuple]],
        device: Any,
        options: Options,
        decode: str,
        batch_bytes: int | None,
        progress: bool,
        scheduler: Scheduler,
        one_buffer: bool = False,
        ready: Callable[[int, Any], None] | None = None,
    ) -> None:
        self.requests = requests
        self.device = device
        self.options = options
        self.decode = decode
        self.batch_bytes = batch_bytes
        self.progress = progress
        self.scheduler = scheduler
        self.outs: list[Any] = [None] * len(requests)
        self.one_buffer = one_buffer
        self._buffer: Outputs | None = None
        self.filled: set[int] = set()  # outputs with missing chunks: filled with the fill value first
        self.ready = ready
        self._left: dict[int, int] = {}  # per output: its tasks not placed yet
        self._handing = threading.Lock()  # (the batches' thread and the CPU threads place)
        self.clock = Clock(device.wait_all if options.profile else None)
        self.bar: Any = None
        self.report = ReadReport(
            arrays=[spec.name for spec, _ in requests],
            device=getattr(device, "name", "buffer prototype"),
            decode=decode,
        )

    def new_output(self, i: int, shape: tuple[int, ...], fill: bool = False) -> Any:
        """Make request ``i``'s output (``fill``: filled with its array's fill value), cut
        from the read's one buffer where it has one."""
        spec, device = self.requests[i][0], self.device
        if self.one_buffer and isinstance(device, Device):
            out = self.buffer().take(i)
            if out is not None:
                if fill:
                    out.fill(spec.fill_value)
                return out
        return device.full(shape, spec.fill_value, spec.dtype) if fill else device.empty(shape, spec.dtype)

    def buffer(self) -> Outputs:
        """The one allocation the outputs are cut from (``one_buffer``), made on first use."""
        if self._buffer is None:
            self._buffer = Outputs(self.requests, self.device)
        return self._buffer

    def count_tasks(self, tasks: list) -> None:
        """The located tasks whose placing completes their outputs (:meth:`hand_out`), with
        ``ready``; outputs with none (all their chunks missing, or located later) are
        returned with the read."""
        if self.ready is not None:
            with self._handing:
                self._left.clear()
                for t in tasks:
                    self._left[t.out] = self._left.get(t.out, 0) + 1

    def hand_out(self, placed: list) -> None:
        """``placed`` are placed, the device's work on them done (a batch after its
        synchronization, a CPU thread's task after its copies): hand each output that has all
        its chunks now to ``ready`` (those of a read planned batch by batch, of remote waves
        or assembled in host memory first are returned with the read only)."""
        if self.ready is None:
            return
        done = []
        with self._handing:
            for t in placed:
                left = self._left.get(t.out)
                if left is not None:
                    self._left[t.out] = left - 1
                    if left == 1:
                        done.append(t.out)
        for i in done:
            self.ready(i, self.outs[i])

    def smaller_batches(self, exc: BaseException) -> bool:
        """After memory ran short (``exc``), start again with batches a quarter the size (of
        the staging the failed attempt took); False where they are at the ``min_batch_bytes``
        option already, or the outputs alone could not be made."""
        tried = min((n for n in (self.batch_bytes, self.report.staging_bytes) if n), default=0)
        least = self.options.min_batch_bytes
        if not tried or tried <= least:
            return False
        release_idle_memory()  # the decoder process's idle arenas first
        self.batch_bytes = max(least, tried // 4)
        self.again(
            f"memory ran short with batches of {tried / 2**20:.0f} MiB ({type(exc).__name__}); "
            f"read again in batches of {self.batch_bytes / 2**20:.0f} MiB"
        )
        return True

    def again(self, note: str) -> None:
        """Forget a failed attempt's outputs, before the read starts again; ``note`` says why
        in the report."""
        self.outs[:] = [None] * len(self.requests)
        self._buffer = None
        self.filled.clear()
        self.report.chunks = 0
        self.report.notes.append(note)
        self.report.staging_bytes = 0
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def progress_bar(self, tasks: list) -> None:
        """Start the progress bar over the bytes read for ``tasks`` (with ``progress``)."""
        if self.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=progress_bytes(tasks), unit="B", unit_scale=True, desc="reading")

    def grow_progress(self, tasks: list) -> None:
        """Count ``tasks``, located after the bar started, in its total."""
        if self.bar is not None:
            self.bar.total += progress_bytes(tasks)
            self.bar.refresh()

    def advance(self, tasks: list) -> None:
        """Count ``tasks`` as read."""
        if self.bar is not None:
            self.bar.update(progress_bytes(tasks))

    def finish(self) -> None:
        """Close the progress bar and file the report (with the reads being recorded)."""
        if self.bar is not None:
            self.bar.close()
        report = self.report
        report.seconds = time.perf_counter() - self.clock.start
        report.phases = dict(self.clock.stats)
        report.crowded = self.clock.crowded
        report.nbytes = sum(int(getattr(o, "nbytes", 0)) for o in self.outs if o is not None)
        file(recorders, report)


class Outputs:
    """The outputs of a read's requests cut from one device allocation, each a C-contiguous
    array of its own, aligned to 256 bytes.

    One allocation costs what one output's does: where a read has hundreds of outputs (a
    read-ahead window, a block per dask task), their own allocations on the read's stream
    would cost more than planning them. Every output keeps the whole allocation alive.
    """

    ALIGN = 256

    def __init__(self, requests: list[tuple[ArraySpec, tuple]], device: Any) -> None:
        placed: list[tuple[int, int, tuple[int, ...], np.dtype]] = []  # (request, bytes, shape, dtype)
        for i, (spec, sel) in enumerate(requests):
            shape = output_shape(sel, spec.shape)
            n = math.prod(shape) * spec.dtype.itemsize
            if n and spec.dtype.kind in "biufc":  # (cupy has no datetime or string arrays)
                placed.append((i, n, shape, spec.dtype))
        slots, total = aligned_slots(np.array([n for _, n, _, _ in placed], dtype=np.int64), self.ALIGN)
        #: per request, (offset, shape, dtype) of its output in the buffer; None: made on its own
        self.places: list[tuple[int, tuple[int, ...], np.dtype] | None] = [None] * len(requests)
        for (i, _, shape, dtype), start in zip(placed, slots.tolist()):
            self.places[i] = (start, shape, dtype)
        self.buffer: Any = None
        if placed:
            try:
                self.buffer = device.empty((total,), np.uint8)
            except Exception as exc:  # memory too fragmented for one piece: an allocation each
                if not is_oom(exc):
                    raise

    def take(self, i: int) -> Any:
        """Request ``i``'s output (a view of the buffer), or None where it has none."""
        place = self.places[i]
        if place is None or self.buffer is None:
            return None
        start, shape, dtype = place
        buf = self.buffer
        if isinstance(buf, np.ndarray):
            return np.ndarray(shape, dtype, buffer=buf, offset=start)
        # one cupy call where a slice, a view and a reshape take three; the pointer keeps the
        # allocation alive
        return type(buf)(shape, dtype, memptr=buf.data + start)


def progress_bytes(tasks: list) -> int:
    """The bytes the progress bar counts for ``tasks``: what is read for them (the bar's work
    is done only where a bar is shown: the sums run over every task of a read)."""
    return sum(t.direct[1] if t.direct else t.nbytes for t in tasks)


class _Running:
    """The reads running in this process now: two that overlap are each marked crowded
    (their timings are not their own, and uncompressed reads keep fewer batches in flight)."""

    def __init__(self) -> None:
        self._clocks: set[Clock] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, clock: Clock):
        with self._lock:
            if self._clocks:
                clock.crowded = True
                for other in self._clocks:
                    other.crowded = True
            self._clocks.add(clock)
        try:
            yield
        finally:
            with self._lock:
                self._clocks.discard(clock)


RUNNING = _Running()


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_memory(read: Read) -> None:
    """Refuse a read whose outputs and smallest read buffers (two batches of the
    ``min_batch_bytes`` option) cannot fit in its device's free memory (reads below the
    ``check_memory_bytes`` option are not checked: asking the driver costs every read, and an
    allocation that fails still raises OutOfMemoryError). A read that fits takes smaller
    batches where memory is short."""
    requests, device, options = read.requests, read.device, read.options
    batch_bytes = options.min_batch_bytes
    out = sum(math.prod(output_shape(sel, spec.shape)) * spec.dtype.itemsize for spec, sel in requests)
    needed = out + min(2 * batch_bytes, 2 * out)
    if needed < options.check_memory_bytes:
        return
    free = device.free_bytes()
    if free is None:
        return
    if needed > free:
        names = ", ".join(repr(spec.name) for spec, _ in requests[:5]) + (" ..." if len(requests) > 5 else "")
        raise OutOfMemoryError(
            f"reading {names} needs about {_gib(needed)} of {device.name.upper()} memory ({_gib(out)} of "
            f"output plus up to {_gib(needed - out)} of read buffers), but only {_gib(free)} is free; "
            "open the store lazily with chunks={...} (dask reads one piece at a time) or select a "
            "subset (.isel/.sel) before loading"
        )
