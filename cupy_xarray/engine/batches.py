"""Batches: the tasks read with kvikio (or the I/O threads) cut into batches of about equal
size, each with its staging slots, and how many are in flight at once; and a read's one
source of batches (:class:`BatchSource`): the batches cut at once, the streamed segments
located as they are submitted and the batches drawn from a shared queue's front, in order."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..options import Options
from .decoders import decodes_through_scratch, stream_lead
from .locate import locate
from .place import bytes_of, plan_boxes, take_located
from .plan import ChunkPiece
from .share import WorkQueue
from .spec import ArraySpec
from .tasks import ChunkTask, Group

_ALIGN = 256


@functools.cache
def max_ops() -> int:
    """Chunk reads per batch: nvCOMP wants big batches; each open file holds descriptors."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
    except (ImportError, OSError, ValueError):
        soft = 1024
    # two batches in flight, kvikio opens each file twice
    return max(64, min(4096, (soft - 128) // 5))


def staging_limit(read: Any, free: int | None = None) -> int:
    """Bytes a batch of ``read`` may hold: its ``batch_bytes`` where given. For a read
    nvCOMP decodes some of, ``free`` gives the device memory free beyond the outputs: nvCOMP's speed is
    streams in flight, so a batch may take a third of the ``memory_share`` option of it (two
    batches in flight, each holding its stored bytes, their copy and the decoded bytes in the
    decoder process's arena), at least 128 MiB, at most ``max_batch_bytes``. Else, for
    ``decode="auto"`` or ``"cpu"``, an eighth of the outputs (at least 128 MiB, at most the
    ``default_batch_bytes`` option): two batches are in flight (or :func:`depth` batches of
    ``2 / depth`` of it), and a compressed one holds its stored and decoded bytes.
    ``decode="gpu"``: ``default_batch_bytes``."""
    outs, batch_bytes, decode, options = read.outs, read.batch_bytes, read.decode, read.options
    if batch_bytes is not None:
        return max(1, batch_bytes)
    if free is not None and decode != "cpu":
        return int(min(options.max_batch_bytes, max(128 * 2**20, options.memory_share * free / 3)))
    if decode == "gpu":
        return options.default_batch_bytes
    out = sum(int(getattr(o, "nbytes", 0)) for o in outs if o is not None)
    return min(options.default_batch_bytes, max(128 * 2**20, out // 8))


def depth(batched: list[ChunkTask], crowded: bool, options: Options) -> int:
    """Batches in flight at once: 2 where any task is decoded (nvCOMP's throughput grows with
    the streams per call) or another read runs beside (dask's tasks, whose reads already keep
    the I/O threads busy); else the ``uncompressed_depth`` option: more, smaller batches in
    the same memory, so that the next reads keep the threads busy while one is placed."""
    if crowded or any(t.spec.recipe.bytes_codecs for t in batched):
        return 2
    return max(2, options.uncompressed_depth)


def cost(t: ChunkTask) -> int:
    """Bytes a task holds beside the output while its batch is in flight."""
    if t.direct:
        return 0
    if t.target is not None and not decodes_through_scratch(t.spec.recipe.bytes_codecs):
        return t.nbytes  # decoded straight into the output: only the stored bytes are held
    return t.spec.recipe.nbytes


def batches(tasks: list[ChunkTask], batch_bytes: int) -> list[list[ChunkTask]]:
    """Split tasks into batches of about equal size, each at most about ``batch_bytes``.

    Equal sizes matter because nvCOMP's throughput grows with the streams per call: a
    4 GiB read in batches of 1 + 1 + 1 + 0.1 GiB ends on a slow call.
    """
    costs = [cost(t) for t in tasks]
    most = max_ops()
    total = sum(costs)
    count = max(1, -(-total // max(batch_bytes, 1)), -(-len(tasks) // most))
    limit = total / count
    out, cur, cum, index = [], [], 0, 0
    for t, n in zip(tasks, costs):
        # a task joins the batch its middle byte falls in
        mid = int((cum + n / 2) // limit) if limit else 0
        if cur and (mid > index or len(cur) >= most):
            out.append(cur)
            cur, index = [], mid
        cur.append(t)
        cum += n
    if cur:
        out.append(cur)
    return out


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a staging slot's alignment."""
    return -(-nbytes // _ALIGN) * _ALIGN


def slots(batch: list[ChunkTask]) -> tuple[list[ChunkTask], list[int], int]:
    """The batch's staged tasks, where each one's bytes start in its staging buffer, and
    the bytes they take."""
    staged = [t for t in batch if t.direct is None]
    offsets, total = [], 0
    for t in staged:
        # start the slot so that the bare stream after the codec's framing is aligned
        lead = stream_lead(t.spec.recipe.bytes_codecs)
        start = total + (_ALIGN - lead) % _ALIGN
        offsets.append(start)
        total = aligned(start + t.nbytes)
    return staged, offsets, total


def staging_bytes(all_slots: list[tuple[list[ChunkTask], list[int], int]]) -> int:
    """The size every staging buffer of a read is given: its largest batch's (``all_slots``:
    :func:`slots` of each batch). Buffers of one size are reused whole by the memory pool;
    a slightly larger one would be carved out of the block a decode's output was just freed
    from, which then no longer fits that output and is allocated anew (a Blosc read grew by
    one batch's decoded bytes so)."""
    return max((total for _, _, total in all_slots), default=0)


@dataclass
class Segment:
    """Pieces of one request that become a batch when it is submitted
    (:meth:`.route.Scheduler.streams`)."""

    out: int
    spec: ArraySpec
    pieces: list[ChunkPiece]

    def staging_bound(self) -> int:
        """Staging bytes the batch can take: every piece staged, slots aligned."""
        return len(self.pieces) * aligned(self.spec.recipe.nbytes)

    def locate(self, read: Any) -> list[ChunkTask]:
        """Locate and plan the pieces for ``read``; the regions of missing chunks get the fill
        value (:func:`.place.take_located`)."""
        tasks, missing = locate(self.spec, self.pieces, self.out, read)
        take_located(read, self.out, tasks, missing)
        return tasks


def segments(streamed: list[tuple[int, ArraySpec, list[ChunkPiece]]], batch_bytes: int) -> list[Segment]:
    """Split streamed requests into segments of about ``batch_bytes`` (at most
    :func:`max_ops` pieces), as :func:`batches` splits located tasks."""
    out = []
    for i, spec, pieces in streamed:
        n = len(pieces)
        count = max(1, -(-n * spec.recipe.nbytes // max(batch_bytes, 1)), -(-n // max_ops()))
        step = -(-n // count)
        out.extend(Segment(i, spec, pieces[k : k + step]) for k in range(0, n, step))
    return out


class BatchSource:
    """Every batch of one read, in the order they are read: the route's batched tasks cut at
    once (:func:`batches`), the streamed requests' :class:`Segment`\\ s (located when
    submitted) and, where the route shares a group, batches drawn from the :class:`WorkQueue`'s
    front as the read goes. It submits each batch's reads (:meth:`submit`) and keeps what
    to wait on for them, oldest first.

    Parameters
    ----------
    read
        The :class:`~.read.Read` (its outputs, device, report and progress).
    tasks
        The read's located tasks; streamed ones join them as they are located, to be
        released with them.
    plan
        The scheduler's :class:`~.route.RoutePlan`.
    queue
        The shared queue, where the plan shares a group.
    per_batch
        Bytes a batch may hold (:func:`cost`).
    streamed
        Requests located and planned a batch at a time.
    """

    def __init__(
        self,
        read: Any,
        tasks: list[ChunkTask],
        plan: Any,
        queue: WorkQueue | None,
        per_batch: int,
        streamed=(),
    ) -> None:
        self.read, self.tasks, self.plan, self.queue, self.per_batch = read, tasks, plan, queue, per_batch
        self.items: list = batches(plan.batched, per_batch) if plan.batched else []
        self.slots: list = [slots(b) for b in self.items]
        #: the size of every staging buffer of the read (:func:`staging_bytes`)
        self.size = staging_bytes(self.slots)
        if streamed:
            cut = segments(streamed, per_batch)
            self.size = max([self.size] + [seg.staging_bound() for seg in cut])
            self.items += cut
            self.slots += [None] * len(cut)
        read.report.batches += len(self.items)
        read.report.staging_bytes = max(read.report.staging_bytes, self.size)
        self.pending: list = []  # what to wait on for the submitted batches' reads, oldest first
        self.submitted: dict[int, float] = {}  # when each batch was submitted
        self._groups: dict[int, list[Group]] = {}

    def __len__(self) -> int:
        return len(self.items)

    def has(self, k: int) -> bool:
        """Whether batch ``k`` is there, drawing it from the queue where it is the next one."""
        return k < len(self.items) or (k == len(self.items) and self._draw())

    def _draw(self) -> bool:
        """Cut one more batch from the shared queue's front; False when it gives none."""
        if self.queue is None:
            return False
        taken = self.queue.take_front(self.per_batch, cost)
        if not taken:
            return False
        plan_boxes(taken, self.read.outs)
        self.items.append(taken)
        self.slots.append(slots(taken))
        report = self.read.report
        report.batches += 1
        report.staging_bytes = max(report.staging_bytes, self.slots[-1][2])
        return True

    def submit(self, k: int, session: Any) -> None:
        """Start batch ``k``'s reads in the I/O ``session`` (a segment is located first):
        allocate its staging buffer and read each staged task into its slot, and each direct
        one straight into its output."""
        self.submitted[k] = time.perf_counter()
        read = self.read
        if isinstance(self.items[k], Segment):
            located = self.items[k].locate(read)
            self.tasks.extend(located)
            read.grow_progress(located)
            self.items[k] = located
        batch = self.items[k]
        staged, offsets, total = self.slots[k] if self.slots[k] is not None else slots(batch)
        staging = read.device.empty((max(total, self.size),), np.uint8) if staged else None
        ops = []
        for t, off in zip(staged, offsets):
            t.staging = staging
            t.data = staging[off : off + t.nbytes]
            t.stage = off
            ops.append(t.read_op(t.offset, t.nbytes, t.data))
        flat: dict[int, Any] = {}
        for t in batch:
            if t.direct is not None:
                file_off, n, out_off = t.direct
                if t.out not in flat:
                    flat[t.out] = bytes_of(read.outs[t.out])
                ops.append(t.read_op(file_off, n, flat[t.out][out_off : out_off + n]))
        self.pending.append(session.submit(ops))

    def land(self) -> None:
        """Wait for the oldest submitted batch's reads (holding no reference to them after)."""
        self.pending.pop(0).wait()

    def groups(self, k: int) -> list[Group]:
        """Batch ``k``'s staged tasks by recipe, each group decoded in one call per codec where
        the plan says (on the GPU, in the decoder process)."""
        if k not in self._groups:
            found: dict[int, list[ChunkTask]] = {}
            for t in self.items[k]:
                if t.direct is None:
                    found.setdefault(t.spec.recipe.key, []).append(t)
            route = self.plan.route_of
            self._groups[k] = [Group(ts, route(ts[0].spec.recipe, self.read)) for ts in found.values()]
        return self._groups[k]

    def done(self, k: int) -> None:
        """Batch ``k`` is placed: count its progress and hold its tasks no longer."""
        self._groups.pop(k, None)
        self.read.advance(self.items[k])
        self.items[k] = ()

    def settle(self) -> None:
        """Let every read in flight land (errors ignored: the first one is raised already)."""
        for waiter in self.pending:
            try:
                waiter.wait()
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        self.pending.clear()
