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

from . import batches as cut
from . import host
from .decoders import decode_group, prepare_group, prepares, while_decoding
from .devices import resolve_device
from .place import copy_twins, host_twins, place_group, plan_boxes
from .read import Read
from .route import RoutePlan
from .share import WorkQueue
from .tasks import ChunkTask, Group


def _start_ahead(groups: list[Group], read: Read) -> bool:
    """Start what the groups need before their decode (:func:`.decoders.prepare_group`), on
    the current stream; whether any group had something to start."""
    started = False
    for group in groups:
        prepare_group(group, read)
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
            with device.side_stream():
                state["started"] = _start_ahead(groups, read)
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
            decode_group(group, read)
            spent = time.perf_counter() - t0 - (clock.ahead - ahead)
            clock.groups[group.recipe.key] += spent
            read.scheduler.saw_gpu(group, read, spent)
        place_group(group, read, geometry)
        clock.lap("scatter")
        group.release()


def _free_for_batches(read: Read, plan: RoutePlan) -> int | None:
    """Device memory free beyond the outputs, for a large read nvCOMP decodes some of (asking
    the driver costs every read: small ones keep their fixed batch size)."""
    if read.batch_bytes is not None or not any(r.nvcomp for r in plan.routes.values()):
        return None
    if (
        sum(int(getattr(o, "nbytes", 0)) for o in read.outs if o is not None)
        < read.options.check_memory_bytes
    ):
        return None
    return read.device.free_bytes()


def execute(read: Read, tasks: list[ChunkTask], streamed=(), assemble: bool = True) -> None:
    """Read, decode and place located tasks into the read's outputs. ``assemble``: a small GPU
    read may be assembled in pinned host memory (:func:`.place.host_twins`); ``streamed``:
    requests located and planned a batch at a time, as their batches are submitted."""
    device, options = read.device, read.options
    began = time.perf_counter()
    plan = read.scheduler.plan(tasks, read)
    limit = cut.staging_limit(read, _free_for_batches(read, plan))
    read.report.decisions.extend(plan.decisions)
    queue = WorkQueue(plan.shared, plan.front_bytes, plan.fixed_s, cut.max_ops()) if plan.shared else None
    plan_boxes(plan.batched, read.outs)
    depth = cut.depth(plan.batched + plan.shared, read.clock.crowded, options)
    source = cut.BatchSource(read, tasks, plan, queue, limit * 2 // depth, streamed)
    jobs = None
    try:
        twins = host_twins(read, plan.on_host, source.items or plan.shared) if assemble else None
        # reads of the host route alone need no session (kvikio's setup costs every dask task)
        busy = bool(source.items) or queue is not None
        inline = options.inline_read_bytes
        with device.io.session(device.threads, inline) if busy else contextlib.nullcontext() as session:
            try:
                host_t0 = time.perf_counter()
                # (twins: the host route's CPU device assembles them, on the same threads)
                on = resolve_device("cpu", device.threads) if twins is not None else device
                outs = twins if twins is not None else read.outs
                # (twins are copied to the outputs at the end: nothing is handed out before)
                placed = read.hand_out if twins is None and read.ready is not None else None
                jobs = host.Jobs(outs, on, options, placed).start(plan.on_host, inline=not busy)
                _read_batches(read, source, session, depth, jobs)
                jobs.wait()
                read.scheduler.saw_pool(plan.on_host, queue, read, time.perf_counter() - host_t0)
                if twins is not None:
                    copy_twins(twins, read)
                read.clock.lap("host route")
                read.clock.stats.update(jobs.stats or {})
                read.advance(plan.on_host)
                if queue is not None:
                    read.advance(queue.taken_back)
                read.scheduler.saw_read(plan, read, time.perf_counter() - began)
            except BaseException:
                # let reads in flight land before their buffers are released
                if queue is not None:
                    queue.close()
                if jobs is not None:
                    jobs.cancel()
                if source.items:
                    device.side_stream().synchronize()  # checks started ahead read staging
                source.settle()
                read.outs.clear()
                raise
    finally:
        if queue is not None:
            queue.count(plan.decisions)
        source.pending.clear()
        for t in tasks:
            t.release()


def _read_batches(read: Read, source: cut.BatchSource, session: Any, depth: int, jobs: Any) -> None:
    """Read, decode and place every batch, ``depth`` of them in flight; a shared queue's CPU
    threads join ``jobs`` once the first batch's reads have landed (or at once: the
    ``share_start`` option)."""
    clock, device, options, queue = read.clock, read.device, read.options, source.queue
    for k in range(depth - 1):
        if source.has(k):
            source.submit(k, session)
    cpu_waits = queue is not None and len(source) > 0 and options.share_start == "decode"
    if queue is not None and not cpu_waits:  # (after the first batch is drawn)
        jobs.take_from(queue)
    ahead: dict = {}  # the next batch's checks, started while this one decodes
    geometry: dict = {}  # per output: its pieces' box copies (Boxes)
    b = 0
    while source.has(b):
        if b == len(source) - 1 and not source.pending:  # drawn late: the CPU threads lag
            source.submit(b, session)
        if source.has(b + depth - 1):
            source.submit(b + depth - 1, session)
        clock.lap("submit")
        source.land()
        clock.lap("io wait")
        if b == 0:
            read.scheduler.saw_io(source.items[0], read, time.perf_counter() - source.submitted[0])
        if cpu_waits:  # the batch's reads have landed: the CPU threads start now
            cpu_waits = False
            jobs.take_from(queue)
        _decode_batch(read, source, b, ahead, geometry)
        device.synchronize()  # staging memory is reused by the next batch's reads
        placed = source.items[b]
        source.done(b)
        read.hand_out(placed)
        clock.lap("sync")
        b += 1
    if cpu_waits:  # (no batch was read after all)
        jobs.take_from(queue)


def _decode_batch(read: Read, source: cut.BatchSource, b: int, ahead: dict, geometry: dict) -> None:
    """Decode and place batch ``b``, whose reads have landed; where the next batch has checks
    to start (Blosc's layout, on the side stream), start them once its reads land, while this
    one decodes."""
    groups = source.groups(b)
    if not ahead.pop("started", False):
        _start_ahead(groups, read)
    # (the next batch is located: it was submitted before this one was waited for)
    nxt = source.groups(b + 1) if b + 1 < len(source) else None
    if nxt is None or not any(prepares(g) for g in nxt):
        _finish(groups, read, geometry)
        return
    work = _ahead(nxt, source.pending[0], read, ahead)
    with while_decoding(work):
        _finish(groups, read, geometry)
    if not ahead:  # no decode of this batch ran on the GPU: now, then
        work()
    if "error" in ahead:
        raise ahead.pop("error")
