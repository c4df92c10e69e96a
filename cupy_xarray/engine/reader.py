"""The read engine's entry point: selections of many arrays -> their outputs, in one go.

:func:`read_arrays` builds a :class:`~.read.Read` and runs the stages, each a module::

    plan.py      selection -> chunk pieces
    locate.py    pieces -> tasks (chunk files, shard indexes, remote fetches)
    route.py     the route of every task: batches (kvikio + nvCOMP) | CPU threads | zarr-python
    place.py     where each piece's bytes go in the output, and putting them there
    batches.py   the batched tasks cut into batches with staging slots
    execute.py   batches in flight: read -> decode -> check -> place, overlapped
    host.py      the CPU-thread route, a chunk per job
    waves.py     large remote reads, fetched in waves
    fallback.py  arrays the engine does not decode: zarr-python's pipeline
"""

from __future__ import annotations

import functools
import logging
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..device import Device, PrototypeDevice
from ..errors import ChunkChangedError, OutOfMemoryError
from ..options import get_options
from ..runtime.notes import reporting
from .decoders import decode_choice
from .execute import execute
from .fallback import check_files, is_oom, zarr_read
from .gather import SERVICE
from .locate import locate
from .place import take_located
from .plan import normalize_selection, output_shape, plan_chunks
from .read import RUNNING, Read, check_memory, record_reads, recorders
from .route import Scheduler, describe_route, stream_kind
from .spec import ArraySpec
from .waves import execute_waves, wave_bytes

log = logging.getLogger("cupy_xarray")

_DEFAULT_SCHEDULER = Scheduler()  # stateless: shares what both processors may decode


@functools.cache
def _scheduler(route: str) -> Scheduler:
    """The process's scheduler, or one that sends every chunk one way (the ``force_route``
    setting: ``"host"``, ``"batch"`` or ``"share"``)."""
    return _DEFAULT_SCHEDULER if route == "auto" else Scheduler(force=route)


def describe(spec: ArraySpec, device: Device | PrototypeDevice, decode: str | None = None) -> str:
    """One line saying which path the engine takes for an array (``decode``: the choice)."""
    if isinstance(device, PrototypeDevice):
        return f"{spec.name}: zarr-python pipeline with the given BufferPrototype"
    if spec.fallback:
        return f"{spec.name}: zarr-python on the CPU ({spec.fallback})"
    r = spec.recipe
    codecs = ", ".join(r.bytes_codecs) or "uncompressed"
    where = device.codecs.name if r.bytes_codecs else device.io.name
    if stream_kind(r.bytes_codecs) is not None:
        options = get_options()
        read = Read([], device, options, decode_choice(decode, options), None, False, _DEFAULT_SCHEDULER)
        where = describe_route(r.bytes_codecs, read)
    shard = f", sharded {spec.shard.shard_shape}" if spec.shard else ""
    fetched = f", fetched from {spec.source.url}" if spec.source is not None else ""
    return f"{spec.name}: engine, {codecs} via {where}{shard}, chunks {spec.chunks}{fetched}"


def _run(read: Read) -> list[Any]:
    """Plan every request, then run the batches and the host route, then the remote waves."""
    device, scheduler, clock = read.device, read.scheduler, read.clock
    outs = read.outs
    tasks: list = []
    remote: list = []  # fetched in waves
    streamed: list = []  # planned batch by batch
    size = wave_bytes(read)
    if read.one_buffer and isinstance(device, Device) and not any(s.fallback for s, _ in read.requests):
        read.buffer()  # (the one allocation: a phase of its own in the report)
        clock.lap("outputs")
    for i, (spec, nsel) in enumerate(read.requests):
        if log.isEnabledFor(logging.DEBUG):
            log.debug(describe(spec, device, read.decode))
        if isinstance(device, PrototypeDevice) or spec.fallback:
            check_files(spec, nsel)
            outs[i] = zarr_read(spec, nsel, read)
            continue
        oshape = output_shape(nsel, spec.shape)
        pieces = plan_chunks(nsel, spec.shape, spec.chunks)
        if spec.source is not None and len(pieces) * spec.recipe.nbytes > size:
            remote.append((i, spec, pieces))
            outs[i] = read.new_output(i, oshape)
            continue
        if scheduler.streams(spec, pieces, read):
            streamed.append((i, spec, pieces))
            outs[i] = read.new_output(i, oshape)
            continue
        found, missing = locate(spec, pieces, i, read)
        take_located(read, i, found, missing, oshape)
        tasks.extend(found)
    clock.lap("plan")
    if not tasks and not remote and not streamed:
        return outs
    read.progress_bar(tasks)
    read.count_tasks(tasks)  # (those of remote waves and streamed requests are located later)
    if tasks or streamed:
        execute(read, tasks, streamed=streamed)
    if remote:
        execute_waves(read, remote, size)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("read phases (s): %s", {k: round(v, 4) for k, v in clock.stats.items()})
    return outs


def _attempt(read: Read) -> list[Any]:
    device = read.device
    if isinstance(device, Device):
        with device.own_stream():  # this thread's own stream: reads in other threads overlap
            outs = _run(read)
            device.synchronize()
            return outs
    return _run(read)


def _read(read: Read) -> list[Any]:
    """Run the read; where memory runs short, again with smaller batches (a read whose
    outputs fit succeeds, slower, and its report says so)."""
    device = read.device
    if isinstance(device, Device):
        check_memory(read)
    changed = 0
    try:
        with RUNNING.running(read.clock), reporting(read.report):
            while True:
                try:
                    return _attempt(read)
                except BaseException as exc:
                    found = _changed(exc)
                    if found is not None and changed < CHANGED_TRIES:
                        changed += 1
                        time.sleep(min(0.001 * 2**changed, 0.05))  # let a writer's burst pass
                        read.again(f"{found.chunk!r} of {found.array!r} was replaced by a writer; read again")
                    elif not is_oom(exc) or not isinstance(device, Device) or not read.smaller_batches(exc):
                        raise
                    traceback.clear_frames(exc.__traceback__)  # the failed attempt's buffers go now
                    del exc
                    if isinstance(device, Device):
                        device.release_cached()
    finally:
        read.finish()


#: reads started again because a writer replaced a chunk file under them, before the
#: :class:`~cupy_xarray.errors.ChunkChangedError` is raised
CHANGED_TRIES = 20


def _changed(exc: BaseException) -> ChunkChangedError | None:
    """The ChunkChangedError that ``exc`` is or was raised from, if any."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, ChunkChangedError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def read_arrays(
    requests: list[tuple[ArraySpec, Any]],
    device: Device | PrototypeDevice,
    *,
    batch_bytes: int | None = None,
    progress: bool = False,
    decode: str | None = None,
    scheduler: Scheduler | None = None,
    one_buffer: bool = False,
    ready: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Read selections of many arrays in one go.

    Parameters
    ----------
    requests
        ``(spec, selection)`` pairs; a selection is orthogonal (ints, slices, int arrays).
    device
        Where the outputs go (:func:`.devices.resolve_device`).
    batch_bytes
        Bytes read (and decoded) per batch; bounds the memory used beside the outputs (two
        batches are in flight; uncompressed reads keep more, smaller ones in the same memory).
        Default None: an eighth of the outputs (128 MiB to 2 GiB), 2 GiB for ``decode="gpu"``.
    progress
        Show a progress bar (tqdm) over the bytes read.
    decode
        Where a GPU read decodes compressed chunks: ``"auto"`` (nvCOMP for the streams it
        decodes safely, CPU threads for the others), ``"gpu"`` (nvCOMP for all: for stores
        you trust) or ``"cpu"``; default ``CUPY_XARRAY_DECODE`` or ``"auto"``
        (:func:`~cupy_xarray.engine.route.safe_on_gpu`). The values are the same.
    scheduler
        Gives each chunk its route (:class:`~cupy_xarray.engine.route.Scheduler`); default
        large groups shared by both processors (:mod:`.share`).
    one_buffer
        Cut the outputs from one allocation (:class:`~.read.Outputs`): one allocation for many
        outputs, which then keep each other's memory until the last is dropped. Such a read is
        not gathered with other threads' (:mod:`.gather`).
    ready
        Called as ``ready(i, output)`` as soon as request ``i``'s output is complete (every
        chunk decoded, checked and placed, the device's work on it done), before the read
        ends: from the reading thread after a batch, or from a CPU thread after a chunk's
        job. The read may still fail after, or start again (a writer replaced a chunk, memory
        ran short), handing out some outputs twice. Such a read is not gathered.

    Returns
    -------
    list
        One output array per request (cupy on the GPU, numpy on the CPU).

    Raises
    ------
    ChunkError
        A chunk is missing bytes, corrupt, or unreadable (names the array, chunk and file).
    OutOfMemoryError
        The outputs do not fit in free memory (checked before anything is allocated).
    """
    options = get_options()
    normalized = [(spec, normalize_selection(sel, spec.shape)) for spec, sel in requests]
    choice = decode_choice(decode, options)
    size = batch_bytes if batch_bytes is not None else options.batch_bytes
    show = progress or options.progress
    sched = scheduler or _scheduler(options.force_route)
    nbytes = _output_bytes(normalized)
    # one read of these requests (or of those gathered with them), every choice made
    reading = functools.partial(
        Read, device=device, options=options, decode=choice, batch_bytes=size, progress=show, scheduler=sched
    )
    if not one_buffer and ready is None and _gathers(device, nbytes, show, options):

        def read(some: list) -> tuple[list, list]:
            with record_reads() as reports:
                outs = _read_now(reading(some))
            return outs, reports

        key = (id(device), choice, size, id(sched), options)
        return SERVICE.read(
            normalized, nbytes, key, read, recorders.get(), options.gather_wait, options.gather_bytes
        )
    return _read_now(reading(normalized, one_buffer=one_buffer, ready=ready))


def _output_bytes(requests: list) -> int:
    return sum(math.prod(output_shape(sel, spec.shape)) * spec.dtype.itemsize for spec, sel in requests)


def _gathers(device: Any, nbytes: int, progress: bool, options: Any) -> bool:
    """Whether a read goes through the read service (:mod:`.gather`): a small read, without a
    progress bar, on a GPU (or on any device with ``gather="on"``)."""
    if options.gather == "off" or progress or not isinstance(device, Device):
        return False
    if options.gather == "auto" and device.host_memory:
        return False
    return nbytes <= options.gather_read_bytes


def _read_now(read: Read) -> list[Any]:
    """Run ``read``; a failure gives its memory back at once, and one that ran out of memory
    says what to do."""
    try:
        return _read(read)
    except BaseException as exc:
        # the traceback keeps every frame below alive, and with them device buffers: clear
        # their locals so a failed read gives its GPU memory back at once
        traceback.clear_frames(exc.__traceback__)
        if is_oom(exc) and not isinstance(exc, OutOfMemoryError):
            names = ", ".join(repr(spec.name) for spec, _ in read.requests[:5])
            raise OutOfMemoryError(
                f"out of {getattr(read.device, 'name', 'device')} memory while reading {names} ({exc}); "
                "open the store lazily with chunks={...} or select a subset before loading"
            ) from None
        raise
