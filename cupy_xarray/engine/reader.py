"""The read engine: plan -> read byte ranges in batches -> decode per codec -> scatter.

:func:`read_arrays` reads selections of many arrays in one go. Chunks whose stored bytes
are the output's own bytes are read straight into the output; all others are read into a
staging buffer, decoded with one batched call per codec, and scattered. Batches overlap:
while one is decoded, the next one is already being read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import stat
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..device import Device, PrototypeDevice, resolve_device
from ..errors import ChunkError, OutOfMemoryError
from . import host
from .decoders import (
    Box,
    compressor,
    decode_choice,
    decode_group,
    decodes_into_boxes,
    decodes_through_scratch,
    prepare_group,
    prepares,
    stream_lead,
    while_decoding,
    writes_into_output,
)
from .io import ReadOp
from .plan import ChunkPiece, contiguous_span, normalize_selection, output_shape, plan_chunks
from .scatter import Boxes, chunk_box, place_chunk, scatter
from .scatter import copy_bytes as _copy_bytes
from .schedule import Decision, Scheduler, fixed_route, learn, stream_kind
from .shards import EMPTY, read_shard_index, remote_shard_indexes, stored_bound
from .spec import ArraySpec

log = logging.getLogger("cupy_xarray")

DEFAULT_BATCH_BYTES = 2048 * 2**20
#: a GPU read whose chunks all go to CPU threads, with outputs of at most this many bytes, is
#: assembled in pinned host memory and copied to the GPU in one copy per output (no copy,
#: scratch buffer or scatter kernel per chunk: what a small selection costs is its bytes)
HOST_ASSEMBLY_BYTES = 16 * 2**20
#: reads whose outputs are smaller than this are not checked against free memory first (an
#: allocation that fails still raises OutOfMemoryError; asking the driver costs every read)
CHECK_MEMORY_BYTES = 64 * 2**20
#: seconds spent per phase by the last read_arrays call in this process (set
#: CUPY_XARRAY_PROFILE=1 to synchronize the device between phases for exact figures)
last_read_stats: dict[str, float] = {}
#: what the scheduler chose for each group of chunks of the last read_arrays call
last_read_decisions: list[Decision] = []
_DEFAULT_SCHEDULER = Scheduler()


class _Clock:
    def __init__(self, device) -> None:
        self.device = device
        self.exact = os.environ.get("CUPY_XARRAY_PROFILE") == "1"
        self.stats: dict[str, float] = defaultdict(float)
        self.groups: dict[int, float] = defaultdict(float)  # decode seconds per recipe
        self.crowded = False  # another read ran beside this one (its timings are not its own)
        self.ahead = 0.0  # seconds of the next batch's work run inside this batch's decodes
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.exact and isinstance(self.device, Device) and self.device.name == "gpu":
            self.device.xp.cuda.Device().synchronize()  # every stream: nvCOMP runs on its own
        now = time.perf_counter()
        self.stats[phase] += now - self.t
        self.t = now


_ALIGN = 256


@functools.cache
def _max_ops() -> int:
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


@dataclass
class _Task:
    """One chunk piece located on disk."""

    out: int
    spec: ArraySpec
    piece: ChunkPiece
    path: str
    key: str
    offset: int
    nbytes: int
    direct: tuple[int, int, int] | None = None  # (file offset, nbytes, output byte offset)
    copy: tuple[int, int, int] | None = None  # decoded bytes -> output: (src off, n, dst off)
    data: Any = field(default=None, repr=False)
    staging: Any = field(default=None, repr=False)  # the batch's staging buffer
    stage: int = 0  # byte offset of data in the staging buffer
    owner: Any = field(default=None, repr=False)  # keeps nvCOMP's output alive until scattered
    target: Any = field(default=None, repr=False)  # output bytes the last codec decodes into
    box: Box | None = field(default=None, repr=False)  # the output box it decodes into (a tile)
    landed: bool = False  # decoded straight into the output: nothing left to scatter
    blob: Any = field(default=None, repr=False)  # bytes fetched from a remote store (offset: into it)
    mapped: bool = False  # the blob is page-locked memory, which a GPU kernel reads in place
    ready: Any = field(default=None, repr=False)  # what chain.prepare_group started for its group
    span: tuple[int, int] | None = None  # host route: the bytes of the chunk the piece needs

    def error(self, msg: str) -> ChunkError:
        return ChunkError(msg, array=self.spec.name, chunk=self.key, path=self.path)

    def release(self) -> None:
        """Drop the buffers this task holds (device memory goes back to the pool)."""
        self.data = self.staging = self.owner = self.target = self.ready = self.box = None


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
        choice = decode_choice(decode)
        route = fixed_route(r.bytes_codecs, choice)[0] if device.name == "gpu" else "host"
        if device.name != "gpu":
            where = "CPU threads, one chunk each"
        elif route == "batch":
            where = f"nvCOMP (decode={choice!r})"
        elif route == "host":
            where = f"CPU threads (decode={choice!r}), copied to the GPU"
        else:
            where = "nvCOMP and CPU threads, chosen per read by the cost model (decode='auto')"
    shard = f", sharded {spec.shard.shard_shape}" if spec.shard else ""
    fetched = f", fetched from {spec.source.url}" if spec.source is not None else ""
    return f"{spec.name}: engine, {codecs} via {where}{shard}, chunks {spec.chunks}{fetched}"


def _locate(spec: ArraySpec, pieces: list[ChunkPiece], out: int, device: Any = None, decode: str = "auto"):
    """Find each piece's bytes; return (tasks, number of missing chunks). ``device`` and
    ``decode``: where the read goes and how it decodes (fetched bytes that go to a GPU as
    they are land in pinned memory: :func:`_lands_pinned`)."""
    if spec.source is not None:
        tasks, missing_pieces = _fetch(spec, pieces, out, device=device, decode=decode)
        return tasks, len(missing_pieces)
    tasks: list[_Task] = []
    missing = 0
    if spec.shard is None:
        root = os.path.join(spec.directory, "")
        for p in pieces:
            key = spec.chunk_key(p.coords)
            path = root + key
            try:
                st = spec.stat_file(path, key)
            except FileNotFoundError:
                missing += 1
                continue
            except OSError as exc:
                raise ChunkError(f"cannot stat chunk: {exc}", array=spec.name, chunk=key, path=path) from exc
            if stat.S_ISDIR(st.st_mode):
                raise ChunkError(
                    "chunk path is a directory, not a file", array=spec.name, chunk=key, path=path
                )
            tasks.append(_Task(out, spec, p, path, key, 0, st.st_size))
        return tasks, missing
    indexes: dict[tuple[int, ...], Any] = {}
    for p, (shard, local) in zip(pieces, _places(spec, pieces)):
        if shard not in indexes:
            indexes[shard] = read_shard_index(spec, shard)
        found = _inner(spec, shard, local, indexes[shard])
        if found is None:
            missing += 1
            continue
        offset, nbytes, key = found
        tasks.append(_Task(out, spec, p, spec.chunk_path(shard), key, offset, nbytes))
    return tasks, missing


def _places(spec: ArraySpec, pieces: list[ChunkPiece]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each piece's shard, and its chunk's place in that shard (a sharded array)."""
    per_shard = spec.shard.chunks_per_shard(spec.chunks)
    places = []
    for p in pieces:
        shard = tuple(c // n for c, n in zip(p.coords, per_shard))
        places.append((shard, tuple(c % n for c, n in zip(p.coords, per_shard))))
    return places


def _inner(spec: ArraySpec, shard: tuple[int, ...], local: tuple[int, ...], index: Any) -> tuple | None:
    """Where inner chunk ``local`` lies in its shard, from the shard's index: (offset, nbytes,
    the name errors give it); None where the shard or the chunk does not exist."""
    if index is None or index[local + (0,)] == EMPTY:
        return None
    offset, nbytes = (int(v) for v in index[local])
    return offset, nbytes, f"{spec.chunk_key(shard)}[inner {', '.join(map(str, local))}]"


def _lands_pinned(spec: ArraySpec, device: Any, decode: str = "auto") -> bool:
    """Whether an array's fetched bytes land in pinned memory: those read to a GPU that go
    there as they are (uncompressed chunks, copied or read in place by a kernel; streams
    nvCOMP may decode), where copies run at full speed (cupy's pinned pool keeps the blocks
    for the next fetches)."""
    if getattr(device, "name", None) != "gpu":
        return False
    codecs = spec.recipe.bytes_codecs
    if not codecs:
        return True
    return compressor(codecs) is not None and fixed_route(codecs, decode)[0] != "host"


def _fetch(
    spec: ArraySpec,
    pieces: list[ChunkPiece],
    out: int,
    indexes: dict | None = None,
    device: Any = None,
    decode: str = "auto",
):
    """:func:`_locate` for a remote store: fetch the pieces' objects (whole chunks; for sharded
    arrays the shards' indexes, then their inner chunks' ranges, neighbours coalesced).
    Returns (tasks, the pieces whose chunks do not exist). ``indexes``: shard indexes already
    fetched (filled in; default the source's own, kept while the dataset is open); ``device``
    and ``decode``: where the read goes and how it decodes (:func:`_lands_pinned`)."""
    from .remote import Request, coalesce

    source = spec.source
    pinned = _lands_pinned(spec, device, decode)
    mapped = pinned and source.lands_pinned
    tasks: list[_Task] = []
    missing: list[ChunkPiece] = []
    if spec.shard is None:
        keys = [spec.chunk_key(p.coords) for p in pieces]
        most = stored_bound(spec.recipe.nbytes)
        blobs = source.fetch([Request(k, most=most) for k in keys], pinned=pinned)
        for p, key, blob in zip(pieces, keys, blobs):
            if blob is None:
                missing.append(p)
            else:
                tasks.append(
                    _Task(out, spec, p, source.location(key), key, 0, len(blob), blob=blob, mapped=mapped)
                )
        return tasks, missing
    places = _places(spec, pieces)
    cache = source.shard_indexes if indexes is None else indexes
    known = _known_indexes(spec, [shard for shard, _ in places], cache)
    wanted: dict[tuple[int, ...], list[tuple[ChunkPiece, int, int, str]]] = {}
    for p, (shard, local) in zip(pieces, places):
        found = _inner(spec, shard, local, known[shard])
        if found is None:
            missing.append(p)
            continue
        wanted.setdefault(shard, []).append((p, *found))
    requests, members = [], []
    for shard, items in wanted.items():
        for start, end, held in coalesce([(o, o + n) for _, o, n, _ in items]):
            requests.append(Request(spec.chunk_key(shard), start, end))
            members.append((shard, start, held))
    blobs = source.fetch(requests, [wanted[sh][held[0]][3] for sh, _, held in members], pinned=pinned)
    for (shard, start, held), blob, req in zip(members, blobs, requests):
        for i in held:
            p, offset, nbytes, key = wanted[shard][i]
            if blob is None:
                raise ChunkError(
                    "the shard disappeared while it was read",
                    array=spec.name,
                    chunk=key,
                    path=source.location(req.key),
                )
            location = source.location(req.key)
            tasks.append(_Task(out, spec, p, location, key, offset - start, nbytes, blob=blob, mapped=mapped))
    return tasks, missing


#: a remote read of more than this many decoded bytes is fetched in waves of about this size,
#: each decoded while the next ones are fetched
WAVE_BYTES = 128 * 2**20
#: the waves of a GPU read with ``decode="gpu"``: nvCOMP's rate grows with the streams per
#: call (a 128 MiB wave of 4 MiB zstd frames is one call of 32 frames, about 1.4 GB/s on an H200)
GPU_WAVE_BYTES = 512 * 2**20
#: waves fetched at once beside the one decoding: at least this many, more where waves hold few
#: chunks (so that about CONCURRENCY requests stay in flight), at most FETCH_AHEAD_BYTES of them
WAVES_AHEAD = 3
FETCH_AHEAD_BYTES = 2 * 2**30


def _wave_bytes(device: Any, decode: str, batch_bytes: int | None) -> int:
    """Decoded bytes per wave: :data:`WAVE_BYTES`; for ``decode="gpu"`` on a GPU, the
    batch size (default :data:`GPU_WAVE_BYTES`), within ``WAVE_BYTES`` and half of
    :data:`FETCH_AHEAD_BYTES`."""
    if decode != "gpu" or getattr(device, "name", "") != "gpu":
        return WAVE_BYTES
    wanted = batch_bytes if batch_bytes is not None else GPU_WAVE_BYTES
    return max(WAVE_BYTES, min(wanted, FETCH_AHEAD_BYTES // 2))


def _waves(remote: list[tuple[int, ArraySpec, list[ChunkPiece]]], wave_bytes: int = WAVE_BYTES) -> list[list]:
    """Split the pieces of remote requests into waves of about ``wave_bytes`` (decoded)."""
    waves: list[list] = []
    cur: list = []
    size = 0
    for i, spec, pieces in remote:
        chunk = spec.recipe.nbytes
        for p in pieces:
            if cur and size + chunk > wave_bytes:
                waves.append(cur)
                cur, size = [], 0
            if cur and cur[-1][0] == i:
                cur[-1][2].append(p)
            else:
                cur.append((i, spec, [p]))
            size += chunk
    if cur:
        waves.append(cur)
    return waves


def _fetch_wave(wave: list, indexes: dict, device: Any = None, decode: str = "auto") -> list:
    return [(i, spec, *_fetch(spec, pieces, i, indexes, device, decode)) for i, spec, pieces in wave]


#: a GPU read of at least this many bytes of an uncompressed, unsharded local array is located
#: and planned one batch at a time, in the loop that submits the batches, so that its first
#: reads start once one batch is planned (planning all 256 tiles of a 1 GiB read before the
#: first one took 1.7-3.2 ms on an H200, 7-13 % of the time kvikio takes to read them)
STREAM_BYTES = 256 * 2**20


def _streams(spec: ArraySpec, pieces: list[ChunkPiece], device: Any, scheduler: Scheduler) -> bool:
    """Whether a request's pieces are planned batch by batch (:data:`STREAM_BYTES`): where
    every piece of it goes with the batches, whatever its chunks hold (a GPU read, or a
    scheduler that sends every chunk there)."""
    batched = getattr(device, "name", None) == "gpu" or scheduler.force == "batch"
    return (
        batched
        and spec.source is None
        and spec.shard is None
        and not spec.recipe.bytes_codecs
        and scheduler.force != "host"
        and len(pieces) * spec.recipe.nbytes >= STREAM_BYTES
    )


@dataclass
class _Segment:
    """Pieces of one request that become a batch when it is submitted (:func:`_streams`)."""

    out: int
    spec: ArraySpec
    pieces: list[ChunkPiece]

    def staging_bound(self) -> int:
        """Staging bytes the batch can take: every piece staged, slots aligned."""
        return len(self.pieces) * _aligned(self.spec.recipe.nbytes)

    def locate(self, outs: list, device: Device) -> list[_Task]:
        """Locate and plan the pieces; the regions of missing chunks get the fill value."""
        tasks, missing = _locate(self.spec, self.pieces, self.out, device)
        if missing:
            found = {id(t.piece) for t in tasks}
            for p in self.pieces:
                if id(p) not in found:
                    scatter(device.xp, outs[self.out], p.out_sel, self.spec.fill_value)
        _prepare(tasks, outs[self.out])
        return tasks


def _segments(streamed: list[tuple[int, ArraySpec, list[ChunkPiece]]], batch_bytes: int) -> list[_Segment]:
    """Split streamed requests into segments of about ``batch_bytes`` (at most
    :func:`_max_ops` pieces), as :func:`_batches` splits located tasks."""
    segments = []
    for i, spec, pieces in streamed:
        n = len(pieces)
        count = max(1, -(-n * spec.recipe.nbytes // max(batch_bytes, 1)), -(-n // _max_ops()))
        step = -(-n // count)
        segments.extend(_Segment(i, spec, pieces[k : k + step]) for k in range(0, n, step))
    return segments


def _known_indexes(spec: ArraySpec, shards: list[tuple[int, ...]], cache: dict) -> dict:
    """The index of each shard (None: no such shard): from ``cache`` where it is kept, the
    others fetched at once and kept there."""
    known, new = {}, []
    for sh in dict.fromkeys(shards):
        index = cache.get((id(spec), sh), _UNKNOWN)
        if index is _UNKNOWN:
            new.append(sh)
        else:
            known[sh] = index
    for sh, index in zip(new, remote_shard_indexes(spec, new)):
        known[sh] = index
        spec.source.remember(cache, (id(spec), sh), index)
    return known


_UNKNOWN = object()


def _shard_indexes(remote: list[tuple[int, ArraySpec, list[ChunkPiece]]]) -> dict:
    """The indexes of every shard the remote requests touch, fetched at once before the waves
    (waves fetched side by side would otherwise each fetch the indexes they share)."""
    indexes: dict = {}
    for _, spec, pieces in remote:
        if spec.shard is not None:
            shards = [shard for shard, _ in _places(spec, pieces)]
            for sh, index in _known_indexes(spec, shards, spec.source.shard_indexes).items():
                indexes[id(spec), sh] = index
    return indexes


def _plan_direct(task: _Task, out_shape: tuple[int, ...]) -> None:
    """Mark a task for a read straight into the output when its bytes are contiguous there."""
    recipe = task.spec.recipe
    c_order = (
        recipe.transpose is None and not recipe.needs_swap and (recipe.order == "C" or len(recipe.shape) <= 1)
    )
    if not c_order:
        return
    src = contiguous_span(recipe.shape, task.piece.chunk_sel)
    dst = contiguous_span(out_shape, task.piece.out_sel)
    if src is None or dst is None or src[1] != dst[1]:
        return
    size = recipe.dtype.itemsize
    if recipe.is_raw:
        task.direct = (task.offset + src[0] * size, src[1] * size, dst[0] * size)
    else:  # decoded bytes are copied straight into the output, no indexing
        task.copy = (src[0] * size, src[1] * size, dst[0] * size)


def _bytes_of(out: Any) -> Any:
    """The bytes of a C-contiguous output, as one flat uint8 view."""
    return out.reshape(-1).view(np.uint8)


def _plan_target(task: _Task, out_bytes: Any) -> None:
    """Let the last codec decode a whole chunk straight into the output, skipping the copy.

    Only where the chunk's decoded bytes are one run of the output, aligned for nvCOMP.
    """
    if task.copy is None or not writes_into_output(task.spec.recipe.bytes_codecs):
        return
    src_off, n, dst = task.copy
    if src_off == 0 and n == task.spec.recipe.nbytes and dst % 16 == 0:
        task.target = out_bytes[dst : dst + n]


def _plan_box(task: _Task, out: Any, out_bytes: Any) -> None:
    """Let the last codec decode a whole chunk that is a box of the output (a tile) straight
    into it, where the chain can (:func:`.decoders.decodes_into_boxes`)."""
    if task.target is not None or task.copy is not None:
        return
    if not decodes_into_boxes(task.spec.recipe.bytes_codecs):
        return
    geometry = chunk_box(task.spec.recipe, task.piece, out.shape)
    if geometry is not None:
        task.box = Box(out_bytes, *geometry)


def _check_size(task: _Task) -> None:
    recipe = task.spec.recipe
    if recipe.bytes_codecs:
        if task.nbytes == 0:
            raise task.error("chunk is empty (0 bytes)")
        return
    if task.nbytes != recipe.nbytes:
        raise task.error(
            f"chunk is {task.nbytes} bytes, expected {recipe.nbytes} "
            "for an uncompressed chunk (truncated or corrupt)"
        )


def _prepare(tasks: list[_Task], out: Any) -> None:
    """Check the located tasks' sizes and plan where their bytes go in ``out`` (the boxes
    of tiles are planned once the tasks have their routes: :func:`_plan_boxes`)."""
    out_bytes = _bytes_of(out)
    for t in tasks:
        _check_size(t)
        _plan_direct(t, out.shape)
        _plan_target(t, out_bytes)


def _plan_boxes(batched: list[_Task], outs: list) -> None:
    """:func:`_plan_box` for the tasks read with the batches (the host route's own jobs
    place their chunks themselves)."""
    flat: dict[int, Any] = {}
    for t in batched:
        if t.out not in flat:
            flat[t.out] = _bytes_of(outs[t.out])
        _plan_box(t, outs[t.out], flat[t.out])


def _progress_bytes(tasks: list[_Task]) -> int:
    """The bytes the progress bar counts for ``tasks``: what is read for them."""
    return sum(t.direct[1] if t.direct else t.nbytes for t in tasks)


def _batch_cost(t: _Task) -> int:
    """Bytes a task holds beside the output while its batch is in flight."""
    if t.direct:
        return 0
    if t.target is not None and not decodes_through_scratch(t.spec.recipe.bytes_codecs):
        return t.nbytes  # decoded straight into the output: only the stored bytes are held
    return t.spec.recipe.nbytes


def _batches(tasks: list[_Task], batch_bytes: int) -> list[list[_Task]]:
    """Split tasks into batches of about equal size, each at most about ``batch_bytes``.

    Equal sizes matter because nvCOMP's throughput grows with the streams per call: a
    4 GiB read in batches of 1 + 1 + 1 + 0.1 GiB ends on a slow call.
    """
    costs = [_batch_cost(t) for t in tasks]
    max_ops = _max_ops()
    total = sum(costs)
    count = max(1, -(-total // max(batch_bytes, 1)), -(-len(tasks) // max_ops))
    limit = total / count
    batches, cur, cum, index = [], [], 0, 0
    for t, n in zip(tasks, costs):
        # a task joins the batch its middle byte falls in
        mid = int((cum + n / 2) // limit) if limit else 0
        if cur and (mid > index or len(cur) >= max_ops):
            batches.append(cur)
            cur, index = [], mid
        cur.append(t)
        cum += n
    if cur:
        batches.append(cur)
    return batches


def _slots(batch: list[_Task]) -> tuple[list[_Task], list[int], int]:
    """The batch's staged tasks, where each one's bytes start in its staging buffer, and
    the bytes they take."""
    staged = [t for t in batch if t.direct is None]
    offsets, total = [], 0
    for t in staged:
        # start the slot so that the bare stream after the codec's framing is aligned
        lead = stream_lead(t.spec.recipe.bytes_codecs)
        start = total + (_ALIGN - lead) % _ALIGN
        offsets.append(start)
        total = _aligned(start + t.nbytes)
    return staged, offsets, total


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a staging slot's alignment."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _staging_bytes(slots: list[tuple[list[_Task], list[int], int]]) -> int:
    """The size every staging buffer of a read is given: its largest batch's (``slots``:
    :func:`_slots` of each batch). Buffers of one size are reused whole by the memory pool;
    a slightly larger one would be carved out of the block a decode's output was just freed
    from, which then no longer fits that output and is allocated anew (a Blosc read grew by
    one batch's decoded bytes so)."""
    return max((total for _, _, total in slots), default=0)


def _submit(session, batch: list[_Task], outs: list, device: Device, size: int = 0, slots=None):
    """Allocate the batch's staging buffer (at least ``size`` bytes: :func:`_staging_bytes`)
    and start its reads; what to wait on for them (the tasks hold the staging). ``slots``:
    :func:`_slots` of the batch, where already computed."""
    staged, offsets, total = slots if slots is not None else _slots(batch)
    staging = device.empty((max(total, size),), np.uint8) if staged else None  # none for direct reads alone
    for t in staged:
        t.staging = staging
    ops = []
    for t, off in zip(staged, offsets):
        t.data = staging[off : off + t.nbytes]
        t.stage = off
        ops.append(ReadOp(t.path, t.offset, t.nbytes, t.data, t.spec.name, t.key, t.blob))
    flat: dict[int, Any] = {}
    for t in batch:
        if t.direct is not None:
            file_off, n, out_off = t.direct
            if t.out not in flat:
                flat[t.out] = _bytes_of(outs[t.out])
            dest = flat[t.out][out_off : out_off + n]
            ops.append(ReadOp(t.path, file_off, n, dest, t.spec.name, t.key, t.blob))
    return session.submit(ops)


def _groups(batch: list[_Task]) -> dict[int, list[_Task]]:
    """A batch's staged tasks by recipe: each group is decoded in one call per codec."""
    groups: dict[int, list[_Task]] = {}
    for t in batch:
        if t.direct is None:
            groups.setdefault(id(t.spec.recipe), []).append(t)
    return groups


def _prepares(batch: list[_Task], device: Device, decode: str) -> bool:
    return any(prepares(group, device, decode) for group in _groups(batch).values())


def _side(device: Device) -> Any:
    """The stream work started ahead runs on (:func:`.host.side_stream`); none on the CPU."""
    return host.side_stream(device.xp) if device.name == "gpu" else contextlib.nullcontext()


def _ahead(batch: list[_Task], waiter: Any, device: Device, decode: str, state: dict, clock: _Clock):
    """The work that starts ``batch``'s checks on the side stream once its reads have
    landed, run while the batch before it decodes; it records ``started``, or the ``error``
    (raised by the reader after that decode), and its time in ``clock.ahead``."""

    def work() -> None:
        t0 = time.perf_counter()
        try:
            waiter.wait()
            with _side(device):
                state["started"] = _start_ahead(batch, device, decode)
        except BaseException as exc:  # noqa: BLE001 - raised once the decode it overlaps is done
            state["error"] = exc
        finally:
            clock.ahead += time.perf_counter() - t0

    return work


def _start_ahead(batch: list[_Task], device: Device, decode: str) -> bool:
    """Start what the batch's groups need before their decode (:func:`prepare_group`), on
    the current stream; whether any group had something to start."""
    started = False
    for group in _groups(batch).values():
        prepare_group(group, device, decode)
        started = started or group[0].ready is not None
    return started


def _finish(
    batch: list[_Task], outs: list, device: Device, clock: _Clock, decode: str, geometry: dict
) -> None:
    """Decode a batch whose reads have landed and place its chunks; ``geometry``: per output,
    the box copies its pieces take, kept across the read's batches (:class:`.scatter.Boxes`)."""
    groups = _groups(batch)
    xp = device.xp
    for key, group in groups.items():
        t0, ahead = time.perf_counter(), clock.ahead
        if group[0].spec.recipe.bytes_codecs:
            decode_group(group, device, clock, decode)
            # the group's own decode time: the scheduler learns rates from it
            clock.groups[key] += time.perf_counter() - t0 - (clock.ahead - ahead)
        boxes: dict[int, Boxes] = {}  # per output: the batch's pieces placed at once
        for t in group:
            if t.landed:
                continue
            recipe = t.spec.recipe
            if len(t.data) < recipe.nbytes:
                raise t.error(f"chunk holds {len(t.data)} bytes, expected {recipe.nbytes}")
            if t.copy is not None:
                src_off, n, dst = t.copy
                _copy_bytes(outs[t.out], dst, t.data, src_off, n, device)
                continue
            placer = boxes.get(t.out)
            if placer is None:
                placer = boxes[t.out] = Boxes(outs[t.out], geometry.setdefault(t.out, {}))
            if not placer.add(t.data, recipe, t.piece):
                place_chunk(xp, outs[t.out], t.data, recipe, t.piece)
        for placer in boxes.values():
            placer.run(xp)
        clock.lap("scatter")
        for t in group:
            t.release()


def _host_twins(normalized, outs, filled, on_host, batches, device) -> list | None:
    """Pinned host twins of a small GPU read's outputs (:data:`HOST_ASSEMBLY_BYTES`), where
    the host route's jobs assemble it; None for other reads. The tasks' straight-into-the-
    output targets are planned again, on the twins."""
    if device.name != "gpu" or batches or not on_host or not _assembles(on_host):
        return None
    used = {t.out for t in on_host}
    if sum(outs[i].nbytes for i in used) > HOST_ASSEMBLY_BYTES:
        return None
    from .decoders.batch import pinned_buffer

    twins: list[Any] = [None] * len(outs)
    for i in used:
        out, spec = outs[i], normalized[i][0]
        twin = pinned_buffer(out.nbytes)[: out.nbytes].view(out.dtype).reshape(out.shape)
        if i in filled:
            np.copyto(twin, spec.fill_value, casting="unsafe")
        twins[i] = twin
    for t in on_host:
        t.target = None
        _plan_target(t, _bytes_of(twins[t.out]))
    return twins


def _assembles(on_host: list[_Task]) -> bool:
    """Whether assembling a small GPU read in a pinned twin saves copies: not for one piece
    read straight into the output, which its job reads into the thread's own pinned buffer
    and copies once (no twin to allocate and copy from)."""
    return len(on_host) > 1 or on_host[0].direct is None


def _host_device(device: Device) -> Device:
    """The CPU device whose jobs assemble a GPU read on the host (the same threads)."""
    return resolve_device("cpu", device.threads)


def _copy_twins(twins: list, outs: list, device: Device) -> None:
    """Copy each assembled twin into its output on the GPU; returns once the copies are done
    (the twins' pinned memory goes back to the pool)."""
    rt = device.xp.cuda.runtime
    stream = device.xp.cuda.get_current_stream()
    for twin, out in zip(twins, outs):
        if twin is not None and out.nbytes:
            rt.memcpyAsync(out.data.ptr, twin.ctypes.data, out.nbytes, rt.memcpyHostToDevice, stream.ptr)
    stream.synchronize()


def _zarr_grid(spec: ArraySpec) -> tuple[int, ...] | None:
    """The grid of files zarr-python reads (shards for sharded arrays), None if irregular."""
    shards = getattr(spec.zarr_array, "shards", None)
    grid = tuple(int(n) for n in shards) if shards else spec.chunks
    return grid if len(grid) == len(spec.shape) else None


def _check_files_zarr_reads(spec: ArraySpec, selection: tuple) -> None:
    """Before zarr-python reads a selection: the chunk (or shard) files it will open must be
    files (zarr-python reads a directory as a missing chunk: fill values), and for an untrusted
    store they and their directories must stay inside the root. Only the files the selection
    touches are checked, so that every dask task does not walk the whole array."""
    if not spec.directory or spec.source is not None:
        return
    c = spec.containment
    grid = _zarr_grid(spec)
    if grid is None:  # no regular grid (rectilinear chunks): check every link below the array
        if c is not None:
            c.check_tree(spec.directory, spec.name)
        return
    for coords in {p.coords for p in plan_chunks(selection, spec.shape, grid)}:
        key = spec.chunk_key(coords)
        path = os.path.join(spec.directory, key)
        try:
            st = spec.stat_file(path, key)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            raise ChunkError("chunk path is a directory, not a file", array=spec.name, chunk=key, path=path)


def _zarr_read(spec: ArraySpec, selection: tuple, device: Device | PrototypeDevice):
    """Read through zarr-python's own codec pipeline (codecs the engine does not decode)."""
    from ..device import buffer_prototype, empty_on

    shape = output_shape(selection, spec.shape)
    if 0 in shape:  # zarr-python refuses empty integer selections; there is nothing to read
        return empty_on(device, shape, spec.dtype)
    sel = tuple(s.tolist() if isinstance(s, np.ndarray) else s for s in selection)
    try:
        if isinstance(device, PrototypeDevice):
            return spec.zarr_array.get_orthogonal_selection(sel, prototype=buffer_prototype(device))
        result = spec.zarr_array.get_orthogonal_selection(sel)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the chunk
        if _is_oom(exc):
            raise
        raise _zarr_chunk_error(spec, selection, exc) from exc
    result = np.asarray(result)
    if result.dtype.kind in "biufc":
        return device.asarray(result.astype(spec.dtype, copy=False))
    if result.dtype.byteorder not in ("|", "="):  # big-endian datetimes and the like: native order out
        return result.astype(result.dtype.newbyteorder("="))
    return result


def _zarr_chunk_error(spec: ArraySpec, selection: tuple, exc: Exception) -> ChunkError:
    """A ChunkError for zarr-python's failure to read ``selection``: read the selection's chunk
    files one at a time to find the one that fails."""
    what = f"zarr-python cannot decode it ({type(exc).__name__}: {exc}) (corrupt chunk?)"
    grid = _zarr_grid(spec)
    if grid is not None:
        for coords in sorted({p.coords for p in plan_chunks(selection, spec.shape, grid)}):
            region = tuple(slice(c * g, min((c + 1) * g, n)) for c, g, n in zip(coords, grid, spec.shape))
            try:
                spec.zarr_array.get_orthogonal_selection(region)
            except Exception as one:  # noqa: BLE001 - this is the chunk to name
                key = spec.chunk_key(coords)
                what = f"zarr-python cannot decode it ({type(one).__name__}: {one}) (corrupt chunk?)"
                return ChunkError(what, array=spec.name, chunk=key, path=os.path.join(spec.directory, key))
    return ChunkError(what, array=spec.name, chunk="(one of the selection's chunks)", path=spec.directory)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_memory(requests: list[tuple[ArraySpec, tuple]], device: Device, batch_bytes: int) -> None:
    """Refuse a read whose outputs and read buffers cannot fit in the device's free memory."""
    out = sum(math.prod(output_shape(sel, spec.shape)) * spec.dtype.itemsize for spec, sel in requests)
    needed = out + min(batch_bytes, 2 * out)
    if needed < CHECK_MEMORY_BYTES:
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


def read_arrays(
    requests: list[tuple[ArraySpec, Any]],
    device: Device | PrototypeDevice,
    *,
    batch_bytes: int | None = None,
    progress: bool = False,
    decode: str | None = None,
    scheduler: Scheduler | None = None,
) -> list[Any]:
    """Read selections of many arrays in one go.

    Parameters
    ----------
    requests
        ``(spec, selection)`` pairs; a selection is orthogonal (ints, slices, int arrays).
    device
        Where the outputs go (:func:`cupy_xarray.device.resolve_device`).
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
        (:func:`~cupy_xarray.engine.decoders.decodes_on_gpu`). The values are the same.
    scheduler
        Gives each chunk its route (:class:`~cupy_xarray.engine.schedule.Scheduler`); default
        the cost model with this machine's rates.

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
    try:
        return _read_arrays(
            requests, device, batch_bytes, progress, decode_choice(decode), scheduler or _DEFAULT_SCHEDULER
        )
    except BaseException as exc:
        # the traceback keeps every frame below alive, and with them device buffers: clear
        # their locals so a failed read gives its GPU memory back at once
        traceback.clear_frames(exc.__traceback__)
        if _is_oom(exc) and not isinstance(exc, OutOfMemoryError):
            names = ", ".join(repr(spec.name) for spec, _ in requests[:5])
            raise OutOfMemoryError(
                f"out of {getattr(device, 'name', 'device')} memory while reading {names} ({exc}); "
                "open the store lazily with chunks={...} or select a subset before loading"
            ) from None
        raise


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _routes(
    tasks: list[_Task], device: Device, decode: str, scheduler: Scheduler, limit: int
) -> tuple[list, list, list]:
    """Split the tasks into those read with the batches and those of the host route."""
    batched, on_host, groups, direct = [], [], {}, []
    for t in tasks:
        if t.direct is not None:
            direct.append(t)
        else:
            groups.setdefault(id(t.spec.recipe), []).append(t)
    if direct:
        for t, r in zip(direct, scheduler.direct_routes(direct, device)):
            (on_host if r == "host" else batched).append(t)
    decisions = []
    for group in groups.values():
        routes, decision = scheduler.routes(group, device, decode, limit)
        for t, r in zip(group, routes):
            (on_host if r == "host" else batched).append(t)
        if decision is not None:
            decisions.append(decision)
            log.debug("decode: %s", decision)
    last_read_decisions[:] = decisions
    return batched, on_host, decisions


def _learn(
    decisions: list[Decision], tasks: list[_Task], device: Device, clock: _Clock, jobs: host.Jobs
) -> None:
    """Hand the read's own timings of each scheduled group to the scheduler's rates."""
    if not decisions:
        return
    if clock.crowded:  # other reads ran beside this one: the timings are not its own
        return
    if any(getattr(t, "blob", None) is not None for t in tasks):  # fetches shared the CPU
        return
    spent = jobs.spent()
    sizes = {id(t.spec.recipe): t.spec.recipe.nbytes for t in tasks}
    for d in decisions:
        if d.learns and d.key in sizes:
            learn(d, device, sizes[d.key], clock.groups.get(d.key, 0.0), jobs.wall, spent.get(d.key, 0.0))


#: batches in flight at once when none is decoded (uncompressed tiles, staged only to be
#: placed) and no other read runs beside: more, smaller batches in the same memory, so that
#: the reads of the next ones keep the I/O threads busy while the calling thread places one;
#: compressed reads keep two (nvCOMP's throughput grows with the streams per call), and so do
#: reads beside others (dask's tasks), whose reads already keep the threads busy
UNCOMPRESSED_DEPTH = 4


def _depth(batched: list[_Task], crowded: bool = False) -> int:
    """Batches in flight at once: :data:`UNCOMPRESSED_DEPTH` where no task is decoded and no
    other read runs beside (``crowded``), else 2."""
    if crowded or any(t.spec.recipe.bytes_codecs for t in batched):
        return 2
    return max(2, UNCOMPRESSED_DEPTH)


def _staging_limit(outs: list, batch_bytes: int | None, decode: str) -> int:
    """Bytes a batch may hold: ``batch_bytes`` where given. Else, for ``decode="auto"`` or
    ``"cpu"``, an eighth of the outputs (at least 128 MiB, at most
    :data:`DEFAULT_BATCH_BYTES`): two batches are in flight (or :func:`_depth` batches of
    ``2 / depth`` of it), and a compressed one holds its stored and decoded bytes.
    ``decode="gpu"`` favours nvCOMP's throughput, which grows with the streams per call:
    :data:`DEFAULT_BATCH_BYTES`."""
    if batch_bytes is not None:
        return max(1, batch_bytes)
    if decode == "gpu":
        return DEFAULT_BATCH_BYTES
    out = sum(int(getattr(o, "nbytes", 0)) for o in outs if o is not None)
    return min(DEFAULT_BATCH_BYTES, max(128 * 2**20, out // 8))


def _read_arrays(requests, device, batch_bytes, progress, decode, scheduler) -> list[Any]:
    normalized = [(spec, normalize_selection(sel, spec.shape)) for spec, sel in requests]
    if isinstance(device, Device):
        check_memory(normalized, device, batch_bytes or DEFAULT_BATCH_BYTES)
    if isinstance(device, Device) and device.name == "gpu":
        with host.stream(device.xp):  # this thread's own stream: reads in other threads overlap
            outs = _read_arrays_on(normalized, device, batch_bytes, progress, decode, scheduler)
            device.synchronize()
            return outs
    return _read_arrays_on(normalized, device, batch_bytes, progress, decode, scheduler)


_active: set[_Clock] = set()  # the reads running now
_active_lock = threading.Lock()


@contextlib.contextmanager
def _running(clock: _Clock):
    """Count a read among those running; any two that overlap are marked crowded."""
    with _active_lock:
        if _active:
            clock.crowded = True
            for other in _active:
                other.crowded = True
        _active.add(clock)
    try:
        yield
    finally:
        with _active_lock:
            _active.discard(clock)


def _read_arrays_on(normalized, device, batch_bytes, progress, decode, scheduler) -> list[Any]:
    clock = _Clock(device)
    with _running(clock):
        return _read_arrays_timed(normalized, device, batch_bytes, progress, decode, scheduler, clock)


def _read_arrays_timed(normalized, device, batch_bytes, progress, decode, scheduler, clock) -> list[Any]:
    outs: list[Any] = [None] * len(normalized)
    tasks: list[_Task] = []
    filled: set[int] = set()  # outputs with missing chunks: filled with the fill value first
    remote: list[tuple[int, ArraySpec, list[ChunkPiece]]] = []  # fetched in waves
    streamed: list[tuple[int, ArraySpec, list[ChunkPiece]]] = []  # planned batch by batch
    wave_bytes = _wave_bytes(device, decode, batch_bytes)
    for i, (spec, nsel) in enumerate(normalized):
        if log.isEnabledFor(logging.DEBUG):
            log.debug(describe(spec, device, decode))
        if isinstance(device, PrototypeDevice) or spec.fallback:
            _check_files_zarr_reads(spec, nsel)
            outs[i] = _zarr_read(spec, nsel, device)
            continue
        oshape = output_shape(nsel, spec.shape)
        pieces = plan_chunks(nsel, spec.shape, spec.chunks)
        if spec.source is not None and len(pieces) * spec.recipe.nbytes > wave_bytes:
            remote.append((i, spec, pieces))
            outs[i] = device.empty(oshape, spec.dtype)
            continue
        if _streams(spec, pieces, device, scheduler):
            streamed.append((i, spec, pieces))
            outs[i] = device.empty(oshape, spec.dtype)
            continue
        found, missing = _locate(spec, pieces, i, device, decode)
        if missing:
            filled.add(i)
            outs[i] = device.full(oshape, spec.fill_value, spec.dtype)
        else:
            outs[i] = device.empty(oshape, spec.dtype)
        _prepare(found, outs[i])
        tasks.extend(found)
    clock.lap("plan")
    if not tasks and not remote and not streamed:
        return outs
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = _progress_bytes(tasks)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="reading")
    run = dict(
        device=device, batch_bytes=batch_bytes, decode=decode, scheduler=scheduler, clock=clock, bar=bar
    )
    try:
        if tasks or streamed:
            _execute(tasks, outs, normalized, filled, streamed=streamed, **run)
        if remote:
            _execute_waves(remote, outs, normalized, wave_bytes=wave_bytes, **run)
    finally:
        if bar is not None:
            bar.close()
        last_read_stats.clear()
        last_read_stats.update(clock.stats)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("read phases (s): %s", {k: round(v, 4) for k, v in clock.stats.items()})
    return outs


def _execute_waves(remote, outs, normalized, *, wave_bytes, device, clock, bar, **run) -> None:
    """Fetch large remote reads in waves of ``wave_bytes``, several side by side, each wave
    decoded while the next ones are fetched (:data:`WAVES_AHEAD`, :data:`FETCH_AHEAD_BYTES`)."""
    from concurrent.futures import ThreadPoolExecutor

    from .remote import CONCURRENCY

    indexes = _shard_indexes(remote)
    planned = _waves(remote, wave_bytes)
    per_wave = sum(len(pieces) for wave in planned for _, _, pieces in wave) / len(planned)
    depth = max(WAVES_AHEAD, math.ceil(CONCURRENCY / per_wave))
    depth = max(1, min(depth, FETCH_AHEAD_BYTES // wave_bytes, len(planned) - 1))
    waves = iter(planned)
    ahead: list = []
    # one thread per wave in flight: their fetches overlap on zarr's event loop
    fetcher = ThreadPoolExecutor(depth + 1, thread_name_prefix="cupy-xarray-fetch")

    def more() -> None:
        wave = next(waves, None)
        if wave is not None:
            ahead.append(fetcher.submit(_fetch_wave, wave, indexes, device, run["decode"]))

    try:
        for _ in range(depth + 1):
            more()
        while ahead:
            fetched = ahead.pop(0).result()
            more()
            clock.lap("fetch wait")
            tasks: list[_Task] = []
            for i, spec, found, missing in fetched:
                for p in missing:
                    scatter(device.xp, outs[i], p.out_sel, spec.fill_value)
                _prepare(found, outs[i])
                tasks.extend(found)
            if bar is not None:
                bar.total += _progress_bytes(tasks)
                bar.refresh()
            if tasks:
                _execute(tasks, outs, normalized, None, device=device, clock=clock, bar=bar, **run)
    finally:
        fetcher.shutdown(wait=False, cancel_futures=True)


def _execute(
    tasks, outs, normalized, filled, *, device, batch_bytes, decode, scheduler, clock, bar, streamed=()
) -> None:
    """Read, decode and place located tasks into their outputs. ``filled``: the outputs with
    missing chunks (None: small reads are not assembled on the host); ``streamed``: requests
    located and planned a batch at a time, as their batches are submitted (:func:`_streams`)."""
    limit = _staging_limit(outs, batch_bytes, decode)
    batched, on_host, decisions = _routes(tasks, device, decode, scheduler, limit)
    _plan_boxes(batched, outs)
    depth = _depth(batched, clock.crowded)
    batches: list = _batches(batched, limit * 2 // depth) if batched else []
    slots: list = [_slots(b) for b in batches]
    size = _staging_bytes(slots)
    if streamed:
        segments = _segments(streamed, limit * 2 // depth)
        size = max([size] + [seg.staging_bound() for seg in segments])
        batches += segments
        slots += [None] * len(segments)

    def submit(k: int):
        if isinstance(batches[k], _Segment):
            located = batches[k].locate(outs, device)
            tasks.extend(located)  # released with the others
            if bar is not None:
                bar.total += _progress_bytes(located)
                bar.refresh()
            batches[k] = located
        return _submit(session, batches[k], outs, device, size, slots[k])

    pending: list = []
    jobs = None
    try:
        twins = None if filled is None else _host_twins(normalized, outs, filled, on_host, batches, device)
        # reads of the host route alone need no session (kvikio's setup costs every dask task)
        with device.io.session(device.threads) if batches else contextlib.nullcontext() as session:
            try:
                alone = not batches  # nothing else runs beside the host route's jobs
                if twins is not None:
                    jobs = host.start(on_host, twins, _host_device(device), inline=alone)
                else:
                    jobs = host.start(on_host, outs, device, inline=alone)
                for k in range(min(depth - 1, len(batches))):
                    pending.append(submit(k))
                ahead: dict = {}  # the next batch's checks, started while this one decodes
                geometry: dict = {}  # per output: its pieces' box copies (Boxes)
                for b, batch in enumerate(batches):
                    if b + depth - 1 < len(batches):
                        pending.append(submit(b + depth - 1))
                    clock.lap("submit")
                    waiter = pending.pop(0)
                    waiter.wait()
                    clock.lap("io wait")
                    if not ahead.pop("started", False):
                        _start_ahead(batch, device, decode)
                    nxt = batches[b + 1] if b + 1 < len(batches) else None
                    if nxt is not None and _prepares(nxt, device, decode):
                        work = _ahead(nxt, pending[0], device, decode, ahead, clock)
                        with while_decoding(work):
                            _finish(batch, outs, device, clock, decode, geometry)
                        if not ahead:  # no decode of this batch ran on the GPU: now, then
                            work()
                        if "error" in ahead:
                            raise ahead.pop("error")
                    else:
                        _finish(batch, outs, device, clock, decode, geometry)
                    device.synchronize()  # staging memory is reused by the next batch's reads
                    # hold no reference to this batch's staging: the next batch's is allocated
                    # before this loop comes back, and only ``depth`` may be alive at once
                    waiter = None
                    clock.lap("sync")
                    if bar is not None:
                        bar.update(_progress_bytes(batch))
                jobs.wait()
                if twins is not None:
                    _copy_twins(twins, outs, device)
                clock.lap("host route")
                clock.stats.update(jobs.stats or {})
                _learn(decisions, tasks, device, clock, jobs)
                if bar is not None:
                    bar.update(sum(t.nbytes for t in on_host))
            except BaseException:
                # let reads in flight land before their buffers are released
                if jobs is not None:
                    jobs.cancel()
                if device.name == "gpu" and batches:
                    host.side_stream(device.xp).synchronize()  # checks started ahead read staging
                for waiter in pending:
                    try:
                        waiter.wait()
                    except Exception:  # noqa: BLE001 - the first error is the one reported
                        pass
                outs.clear()
                raise
    finally:
        pending.clear()
        for t in tasks:
            t.release()
