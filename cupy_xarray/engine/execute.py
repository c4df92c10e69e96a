"""Execute: located tasks -> their outputs, batches in flight.

The scheduler splits the tasks by route (:meth:`.schedule.Scheduler.plan`). The host route's
jobs start on CPU threads (:mod:`.host`); the batches are read by the device's I/O (kvikio
on a GPU) into staging, ``depth`` of them in flight. Shared tasks wait in one queue
(:mod:`.share`): the CPU threads take them from its back while the batches, once the fixed
ones are cut, are drawn from its front as each is submitted. while one batch is decoded (one call
per codec, :func:`.decoders.decode_group`) and placed (:func:`.place.place_group`), the next
ones are read, and the next batch's checks start on a side stream once its reads land.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from ..runtime.buffers import side_stream
from . import batches as cut
from . import host, observed
from .decoders import decode_group, prepare_group, prepares, stream_kind, while_decoding
from .place import bytes_of, copy_twins, host_twins, place_group, plan_boxes
from .read import Read
from .schedule import device_key, pace_key
from .share import WorkQueue
from .tasks import ChunkTask, Group


def _submit(session: Any, batch: list[ChunkTask], read: Read, size: int, slots=None):
    """Allocate the batch's staging buffer (at least ``size`` bytes: :func:`.batches.staging_bytes`)
    and start its reads; what to wait on for them (the tasks hold the staging). ``slots``:
    :func:`.batches.slots` of the batch, where already computed."""
    staged, offsets, total = slots if slots is not None else cut.slots(batch)
    staging = read.device.empty((max(total, size),), np.uint8) if staged else None  # none for direct reads
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
            dest = flat[t.out][out_off : out_off + n]
            ops.append(t.read_op(file_off, n, dest))
    return session.submit(ops)


def _groups(batch: list[ChunkTask], plan: Any) -> list[Group]:
    """A batch's staged tasks by recipe, each group decoded in one call per codec where the
    scheduler's ``plan`` says (:class:`.schedule.RoutePlan`)."""
    groups: dict[int, list[ChunkTask]] = {}
    for t in batch:
        if t.direct is None:
            groups.setdefault(t.spec.recipe.key, []).append(t)
    return [
        Group(tasks, plan.on_gpu.get(k, False), plan.isolated.get(k, False)) for k, tasks in groups.items()
    ]


def _side(device: Any) -> Any:
    """The stream work started ahead runs on
    (:func:`~cupy_xarray.runtime.buffers.side_stream`); none on the CPU."""
    return side_stream(device.xp) if device.name == "gpu" else contextlib.nullcontext()


def _start_ahead(groups: list[Group], device: Any) -> bool:
    """Start what the groups need before their decode (:func:`.decoders.prepare_group`), on
    the current stream; whether any group had something to start."""
    started = False
    for group in groups:
        prepare_group(group, device)
        started = started or group.ready is not None
    return started


def _ahead(groups: list[Group], waiter: Any, read: Read, state: dict):
    """The work that starts a batch's checks on the side stream once its reads have landed,
    run while the batch before it decodes; it records ``started``, or the ``error`` (raised
    after that decode), and its time in ``clock.ahead``."""
    device, clock = read.device, read.clock

    def work() -> None:
        t0 = time.perf_counter()
        try:
            waiter.wait()
            with _side(device):
                state["started"] = _start_ahead(groups, device)
        except BaseException as exc:  # noqa: BLE001 - raised once the decode it overlaps is done
            state["error"] = exc
        finally:
            clock.ahead += time.perf_counter() - t0

    return work


def _finish(groups: list[Group], read: Read, geometry: dict) -> None:
    """Decode a batch whose reads have landed and place its chunks (``geometry``: see
    :func:`.place.place_group`)."""
    clock = read.clock
    for group in groups:
        t0, ahead = time.perf_counter(), clock.ahead
        if group.recipe.bytes_codecs:
            decode_group(group, read.device, clock)
            spent = time.perf_counter() - t0 - (clock.ahead - ahead)
            clock.groups[group.recipe.key] += spent
            if group.on_gpu:
                read.scheduler.saw_gpu(group.tasks, read.device, spent)
        place_group(group, read.outs, read.device, geometry)
        clock.lap("scatter")
        group.release()


def _kind(tasks: list[ChunkTask]) -> str | None:
    """The one codec chain of compressed tasks, as paces are kept (None: none, or several)."""
    chains = {t.spec.recipe.bytes_codecs for t in tasks}
    if len(chains) != 1 or stream_kind(next(iter(chains))) is None:
        return None
    return pace_key(chains.pop())


def _saw_io(batch: list[ChunkTask], read: Read, seconds: float) -> None:
    """The first batch's reads (nothing else ran on the I/O threads yet): their pace."""
    kind = _kind(batch)
    if read.device.name == "gpu" and kind is not None and not read.clock.crowded:
        observed.saw_io(device_key(read.device), kind, sum(t.nbytes for t in batch), seconds)


def _saw_pool(on_host: list[ChunkTask], queue: WorkQueue | None, read: Read, seconds: float) -> None:
    """The CPU threads' pace where they all had work: a shared queue's back end, or a host
    route of many chunks of one stream kind."""
    device = read.device
    if device.name != "gpu" or read.clock.crowded:
        return
    if queue is not None and queue.taken_back and queue.back_started:
        kind = _kind(queue.taken_back)
        if kind is not None and len(queue.taken_back) >= 2 * device.threads:
            seconds = queue.back_ended - queue.back_started
            observed.saw_pool(device_key(device), kind, queue.back_done, seconds, shared=True)
    elif on_host and len(on_host) >= 2 * device.threads:
        kind = _kind(on_host)
        if kind is not None and all(t.spec.recipe.bytes_codecs for t in on_host):
            observed.saw_pool(device_key(device), kind, sum(t.spec.recipe.nbytes for t in on_host), seconds)


def _free_for_batches(read: Read, tasks: list[ChunkTask]) -> int | None:
    """Device memory free beyond the outputs, for a large GPU read nvCOMP may decode (asking
    the driver costs every read: small ones keep their fixed batch size)."""
    device = read.device
    if device.name != "gpu" or read.batch_bytes is not None or read.decode == "cpu":
        return None
    if not any(t.spec.recipe.bytes_codecs for t in tasks):
        return None
    if (
        sum(int(getattr(o, "nbytes", 0)) for o in read.outs if o is not None)
        < read.options.check_memory_bytes
    ):
        return None
    return device.free_bytes()


def execute(read: Read, tasks: list[ChunkTask], streamed=(), assemble: bool = True) -> None:
    """Read, decode and place located tasks into the read's outputs. ``assemble``: a small GPU
    read may be assembled in pinned host memory (:func:`.place.host_twins`); ``streamed``:
    requests located and planned a batch at a time, as their batches are submitted."""
    device, clock, options = read.device, read.clock, read.options
    outs = read.outs
    began = time.perf_counter()
    limit = cut.staging_limit(outs, read.batch_bytes, read.decode, options, _free_for_batches(read, tasks))
    plan = read.scheduler.plan(tasks, device, read.decode, limit)
    read.report.decisions.extend(plan.decisions)
    batched, on_host = plan.batched, plan.on_host
    queue = WorkQueue(plan.shared, plan.front_bytes, plan.fixed_s, cut.max_ops()) if plan.shared else None
    plan_boxes(batched, outs)
    depth = cut.depth(batched + plan.shared, clock.crowded, options)
    per_batch = limit * 2 // depth
    batches: list = cut.batches(batched, per_batch) if batched else []
    slots: list = [cut.slots(b) for b in batches]
    size = cut.staging_bytes(slots)
    if streamed:
        segments = cut.segments(streamed, per_batch)
        size = max([size] + [seg.staging_bound() for seg in segments])
        batches += segments
        slots += [None] * len(segments)
    read.report.batches += len(batches)
    read.report.staging_bytes = max(read.report.staging_bytes, size)
    grouped: dict[int, list[Group]] = {}

    def draw() -> bool:
        """Cut one more batch from the shared queue's front; False when it gives none."""
        if queue is None:
            return False
        taken = queue.take_front(per_batch, cut.cost)
        if not taken:
            return False
        plan_boxes(taken, outs)
        batches.append(taken)
        slots.append(cut.slots(taken))
        read.report.batches += 1
        read.report.staging_bytes = max(read.report.staging_bytes, slots[-1][2])
        return True

    def groups_of(k: int) -> list[Group]:
        if k not in grouped:
            grouped[k] = _groups(batches[k], plan)
        return grouped[k]

    submitted: dict[int, float] = {}

    def submit(k: int):
        submitted[k] = time.perf_counter()
        if isinstance(batches[k], cut.Segment):
            located = batches[k].locate(outs, device)
            read.report.chunks += len(located)
            tasks.extend(located)  # released with the others
            read.grow_progress(located)
            batches[k] = located
        return _submit(session, batches[k], read, size, slots[k])

    pending: list = []
    jobs = None
    try:
        twins = host_twins(read, on_host, batches or plan.shared) if assemble else None
        # reads of the host route alone need no session (kvikio's setup costs every dask task)
        with device.io.session(device.threads) if batches or queue else contextlib.nullcontext() as session:
            try:
                alone = not batches and queue is None  # nothing else runs beside the host route's jobs
                host_t0 = time.perf_counter()
                if twins is not None:
                    jobs = host.start(on_host, twins, host.host_device(device), options, inline=alone)
                else:
                    jobs = host.start(on_host, outs, device, options, inline=alone)
                for k in range(depth - 1):
                    if k < len(batches) or (k == len(batches) and draw()):
                        pending.append(submit(k))
                cpu_waits = queue is not None and bool(batches) and options.share_start == "decode"
                if queue is not None and not cpu_waits:  # (after the first batch is drawn)
                    host.take_from(queue, outs, device, options, jobs)
                ahead: dict = {}  # the next batch's checks, started while this one decodes
                geometry: dict = {}  # per output: its pieces' box copies (Boxes)
                b = 0
                while b < len(batches) or (queue is not None and draw()):
                    if b == len(batches) - 1 and not pending:  # drawn late: the CPU threads lag
                        pending.append(submit(b))
                    nxt_k = b + depth - 1
                    if nxt_k < len(batches) or (nxt_k == len(batches) and draw()):
                        pending.append(submit(nxt_k))
                    clock.lap("submit")
                    waiter = pending.pop(0)
                    waiter.wait()
                    clock.lap("io wait")
                    if b == 0:
                        _saw_io(batches[0], read, time.perf_counter() - submitted[0])
                    if cpu_waits:  # the batch's reads have landed: the CPU threads start now
                        cpu_waits = False
                        host.take_from(queue, outs, device, options, jobs)
                    groups = groups_of(b)
                    if not ahead.pop("started", False):
                        _start_ahead(groups, device)
                    # (the next batch is located: it was submitted before this one was waited for)
                    nxt = groups_of(b + 1) if b + 1 < len(batches) else None
                    if nxt is not None and any(prepares(g, device) for g in nxt):
                        work = _ahead(nxt, pending[0], read, ahead)
                        with while_decoding(work):
                            _finish(groups, read, geometry)
                        if not ahead:  # no decode of this batch ran on the GPU: now, then
                            work()
                        if "error" in ahead:
                            raise ahead.pop("error")
                    else:
                        _finish(groups, read, geometry)
                    device.synchronize()  # staging memory is reused by the next batch's reads
                    # hold no reference to this batch's staging: the next batch's is allocated
                    # before this loop comes back, and only ``depth`` may be alive at once
                    waiter = None
                    grouped.pop(b, None)
                    clock.lap("sync")
                    read.advance(batches[b])
                    batches[b] = ()  # its tasks are placed: the list need not hold them
                    b += 1
                if cpu_waits:  # (no batch was read after all)
                    host.take_from(queue, outs, device, options, jobs)
                jobs.wait()
                _saw_pool(on_host, queue, read, time.perf_counter() - host_t0)
                if twins is not None:
                    copy_twins(twins, outs, device)
                clock.lap("host route")
                clock.stats.update(jobs.stats or {})
                read.advance(on_host)
                if queue is not None:
                    read.advance(queue.taken_back)
                if device.name == "gpu" and not clock.crowded:
                    read.scheduler.saw_read(plan, device, time.perf_counter() - began)
            except BaseException:
                # let reads in flight land before their buffers are released
                if queue is not None:
                    queue.close()
                if jobs is not None:
                    jobs.cancel()
                if device.name == "gpu" and batches:
                    side_stream(device.xp).synchronize()  # checks started ahead read staging
                for waiter in pending:
                    try:
                        waiter.wait()
                    except Exception:  # noqa: BLE001 - the first error is the one reported
                        pass
                outs.clear()
                raise
    finally:
        if queue is not None:
            queue.count(plan.decisions)
        pending.clear()
        for t in tasks:
            t.release()
