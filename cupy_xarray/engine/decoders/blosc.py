"""Blosc 1 chunks: the layout is parsed on the host, the blocks are decoded on the device.

The format itself (header, block table, checks, shuffles) is :mod:`cupy_xarray.formats.blosc`.
:func:`layout` walks that structure with a few vectorized gathers of 4-byte integers
(whatever device holds the bytes) and checks it, so that nothing malformed reaches nvCOMP.
:func:`decode_chunks` then decodes every stream of a batch with one call per codec
(``Device.codecs``) and unshuffles every block: NumPy on the CPU, one CUDA kernel on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...formats.blosc import (
    MODE_NONE,
    BloscLayoutError,
    Layout,
    check_one,
    unshuffle_block,
)
from ...runtime.nvcomp import DecodeTimeout, status_text
from .base import Box, DecodeFailure, aligned_slots, decoded_sizes
from .registry import BLOSC_STREAMS as STREAMS
from .registry import stream
from .zstd import frame_lengths as zstd_frame_lengths

#: a box's row width and every block's start must be multiples of this for the unshuffle to
#: write into it: no store of the kernel (at most 64 bytes, at a multiple of its width) then
#: crosses a row
BOX_ALIGN = 64


def _boxable(lay: Layout, boxes: list[Box | None] | None, nchunks: int, kernel: bool) -> list[Box | None]:
    """The boxes the unshuffle writes into: those given, for chunks whose every block is
    shuffled (a block stored as is would be copied a byte at a time) and starts at a multiple
    of :data:`BOX_ALIGN`, with the box's rows and pitches aligned for the kernel's stores
    (``kernel``: the GPU's unshuffle kernel writes them, its stores 16-byte aligned)."""
    if boxes is None or not any(b is not None for b in boxes):
        return [None] * nchunks
    ok = np.zeros(nchunks, dtype=bool)
    for i, b in enumerate(boxes):
        if b is None or b.width % BOX_ALIGN or b.row_pitch % 16 or b.plane_pitch % 16:
            continue
        if kernel and (b.out.data.ptr + b.start) % 16:
            continue
        ok[i] = True
    bad = (lay.mode == MODE_NONE) | (lay.out % BOX_ALIGN != 0)  # memcpyed chunks: MODE_NONE
    ok[np.unique(lay.bchunk[bad])] = False
    return [b if ok[i] else None for i, b in enumerate(boxes)]


def decode_chunks(
    buffer: Any,
    lay: Layout,
    nchunks: int,
    expected: int,
    read: Any,
    route: Any,
    targets: list[Any] | None = None,
    ready: dict[str, Ready] | None = None,
    boxes: list[Box | None] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Decode every stream and unshuffle every block of a batch of ``read`` (its device, its
    clock's laps, its settings), as the group's ``route`` says
    (:class:`~cupy_xarray.engine.route.Route`): nvCOMP and the GPU's unshuffle kernel
    (``route.nvcomp``), else the device's batch decoders and NumPy; ``route.isolated``:
    streams nvCOMP may fault on (zstd) are decoded in the decoder process (:mod:`..sandbox`;
    again on CPU threads where it is lost).

    ``targets`` optionally gives, per chunk, the ``expected`` bytes its blocks are
    unshuffled into (a view of the output); ``boxes``, per chunk without one, the box of the
    output its blocks are unshuffled into (:class:`Box`; where the chunk and box allow it:
    no scratch, no scatter). Other chunks get a new buffer. ``ready``: what
    :func:`ready_streams` started for this batch.
    Returns the buffers to keep alive until the device is synchronized, and the decoded
    bytes of each chunk (None for a chunk unshuffled into its box).

    Raises
    ------
    BloscLayoutError
        Naming the chunk whose stream did not decode.
    """
    device, lap = read.device, read.clock.lap
    xp, kernel, isolated = device.xp, route.nvcomp, route.isolated
    targets = list(targets) if targets is not None else [None] * nchunks
    if boxes is not None:
        boxes = [None if t is not None else b for t, b in zip(targets, boxes)]
    boxed = _boxable(lay, boxes, nchunks, kernel)
    need = [i for i, t in enumerate(targets) if t is None and (boxed[i] is None or not kernel)]
    scratch = device.empty((max(len(need) * expected, 1),), np.uint8)
    chunks = list(targets)
    for j, i in enumerate(need):
        chunks[i] = scratch[j * expected : (j + 1) * expected]
    owners: list[Any] = [scratch]
    ptr = np.zeros(len(lay.src), dtype=np.uint64)  # GPU: where each decoded stream lies
    decoded: dict[int, Any] = {}  # CPU: each decoded stream
    for algo, idx in codec_groups(lay):
        if algo == "zstd":
            _check_zstd(xp, buffer, lay, idx)
            if lap:
                lap("blosc zstd check")
        if isolated and stream(STREAMS[algo]).nvcomp_faults:
            batched = None  # not in this process: nvCOMP may fault or hang on a damaged stream
        else:
            batched = device.codecs.batched(STREAMS[algo]) if kernel else None
        if batched is not None:
            mine = (ready or {}).get(algo)
            owners.append(_decode_gpu_c(device, batched, algo, buffer, lay, idx, ptr, lap, mine))
            continue
        if kernel and _carve_supported(device) and not isolated:
            owners.append(_decode_gpu(device, algo, buffer, lay, idx, ptr, lap))
            continue
        source, src = _pack(xp, buffer, lay.src[idx], lay.clen[idx]) if kernel else (buffer, lay.src[idx])
        srcs = [source[int(p) : int(p) + int(c)] for p, c in zip(src, lay.clen[idx])]
        result = _decode_streams(device, algo, srcs, lay, idx, isolated, read.options)
        for s, d in zip(idx, result):
            decoded[int(s)] = d
            if kernel:
                ptr[s] = d.data.ptr
        owners.append(result)  # nvCOMP's buffers: alive until the unshuffle kernel has run
    if lap:
        lap("blosc decode")
    if kernel:
        raw = np.flatnonzero(lay.raw)
        ptr[raw] = np.uint64(buffer.data.ptr) + lay.src[raw].astype(np.uint64)
        _unshuffle_gpu(xp, _destinations(lay, chunks, boxed), lay, ptr)
    else:
        _unshuffle_cpu(buffer, chunks, lay, decoded)
        for c, b in zip(chunks, boxed):
            if b is not None:
                b.view()[...] = c.reshape(b.planes, b.rows, b.width)
    if lap:
        lap("blosc unshuffle")
    return owners, [None if b is not None else c for c, b in zip(chunks, boxed)]


def _destinations(lay: Layout, chunks: list[Any], boxed: list[Box | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the address the unshuffle kernel writes from and its geometry (w, c0, h,
    dp, pp; w == 0: one run from that address): a run of its chunk's buffer, or its chunk's
    box of the output."""
    nblocks = len(lay.out)
    base = np.zeros(len(chunks), dtype=np.uint64)
    geo_chunk = np.zeros((len(chunks), 5), dtype=np.int64)
    run = np.ones(len(chunks), dtype=bool)
    for i, (c, b) in enumerate(zip(chunks, boxed)):
        if b is not None:
            base[i] = b.out.data.ptr + b.start
            geo_chunk[i] = (b.width, 0, b.rows, b.row_pitch, b.plane_pitch)
            run[i] = False
        else:
            base[i] = c.data.ptr
    bdst = base[lay.bchunk] + np.where(run[lay.bchunk], lay.out, 0).astype(np.uint64)
    geo = geo_chunk[lay.bchunk] if nblocks else np.zeros((0, 5), np.int64)
    geo[:, 1] = np.where(run[lay.bchunk], 0, lay.out)
    return bdst, geo


def decode_chunks_on_host(
    chunks: list[Any], expected: int, device: Any, targets: list[Any] | None, threads: int
) -> tuple[list[Any], list[Any]]:
    """Decode whole Blosc chunks (already checked by :func:`layout`) with c-blosc on
    ``threads`` CPU threads into pinned memory, and copy them to the device (``targets``
    where given).
    Returns the buffers to keep alive and each chunk's decoded bytes on the device."""
    from concurrent.futures import ThreadPoolExecutor

    from ...runtime.buffers import pinned_buffer
    from .batch import host_copies, to_device

    n = len(chunks)
    sizes = np.full(n, expected, dtype=np.int64)
    slots, total = aligned_slots(sizes)
    pinned = pinned_buffer(total)
    srcs = host_copies(chunks)

    def one(i: int) -> None:
        c_blosc_into(srcs[i], pinned[slots[i] : slots[i] + expected], i)

    with ThreadPoolExecutor(max_workers=min(threads, n)) as pool:
        list(pool.map(one, range(n)))
    outs, scratch = device.codecs._outputs([expected] * n, targets, 16)
    to_device(pinned, slots, sizes, outs)
    return [scratch], outs


def decode_one_on_host(src: np.ndarray, expected: int, cname: str, into: np.ndarray) -> np.ndarray:
    """Check one Blosc chunk's layout (:func:`check_one`) and decode it with c-blosc into
    ``into`` (``expected`` bytes), on the calling thread."""
    src = np.ascontiguousarray(src)
    check_one(src, expected, cname)
    c_blosc_into(src, into, 0)
    return into


def c_blosc_into(src: np.ndarray, into: np.ndarray, index: int) -> None:
    """Decode one whole Blosc chunk (its layout checked) with c-blosc into ``into``; a failure
    names chunk ``index`` of the batch."""
    from numcodecs import blosc as cblosc

    try:
        cblosc.decompress(memoryview(src), into)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the chunk
        raise BloscLayoutError(index, f"c-blosc cannot decode it: {exc} (corrupt chunk)") from exc


def _decode_streams(
    device: Any, algo: str, srcs: list[Any], lay: Layout, idx: np.ndarray, isolated: bool, options: Any
) -> list[Any]:
    """Decode with ``Device.codecs`` (one batched call; ``isolated``: in the decoder process,
    with the read's settings ``options``); check every decoded length."""
    expected = [int(lay.dlen[s]) for s in idx]  # Blosc's LZ4 streams carry no size prefix
    try:
        result = device.codecs.decode(STREAMS[algo], srcs, expected, isolated=isolated, options=options)
    except DecodeFailure as exc:
        raise BloscLayoutError(int(lay.chunk[idx[exc.index]]), f"Blosc {algo} stream: {exc}") from exc
    for s, d in zip(idx, result):
        if len(d) != lay.dlen[s]:
            raise BloscLayoutError(
                int(lay.chunk[s]), f"Blosc {algo} stream decoded to {len(d)} bytes, expected {lay.dlen[s]}"
            )
    return result


def _carve_supported(device: Any) -> bool:
    nv = getattr(device.codecs, "_nvcomp", None)
    return nv is not None and hasattr(nv, "as_arrays")


@dataclass
class Ready:
    """The streams of one codec of a batch, packed for nvCOMP, their structure check started
    (:func:`ready_streams`); ``verdict()`` waits for it."""

    source: Any
    src_ptrs: np.ndarray
    verdict: Any


def gpu_streams(device: Any, lay: Layout, route: Any) -> dict[str, tuple[Any, np.ndarray]]:
    """The codecs of a batch that nvCOMP's C API decodes in this process, with their batched
    decoder and the indexes of their compressed streams (none where the group's ``route``
    does not send it to nvCOMP; not those it sends to the decoder process)."""
    if not route.nvcomp:
        return {}
    found = {}
    for algo, idx in codec_groups(lay):
        if route.isolated and stream(STREAMS[algo]).nvcomp_faults:
            continue
        batched = device.codecs.batched(STREAMS[algo])
        if batched is not None:
            found[algo] = (batched, idx)
    return found


def codec_groups(lay: Layout) -> list[tuple[str, np.ndarray]]:
    """The batch's compressed streams grouped by codec: ``(codec, stream indexes)``, by name."""
    comp = np.flatnonzero(~lay.raw)
    if not len(comp):
        return []
    algos = np.asarray(lay.algo, dtype=object)[lay.chunk[comp]]
    return [(algo, comp[algos == algo]) for algo in sorted(set(algos))]


def ready_streams(device: Any, buffer: Any, lay: Layout, route: Any) -> dict[str, Ready]:
    """Pack the compressed streams of each codec nvCOMP's C API decodes and start their
    structure checks, on the current stream (a batch's checks run while the batch before it
    decodes: a check is one long chain of reads per stream, and leaves the GPU idle)."""
    return {
        algo: _ready(device, batched, algo, buffer, lay, idx)
        for algo, (batched, idx) in gpu_streams(device, lay, route).items()
    }


def _ready(device: Any, batched: Any, algo: str, buffer: Any, lay: Layout, idx: np.ndarray) -> Ready:
    clen, dlen = lay.clen[idx], lay.dlen[idx]
    source, src = _pack(device.xp, buffer, lay.src[idx], clen, batched.input_alignment)
    src_ptrs = np.uint64(source.data.ptr) + src.astype(np.uint64)
    return Ready(source, src_ptrs, stream(STREAMS[algo]).start_check_on_gpu(src_ptrs, clen, dlen))


def _decode_gpu_c(
    device: Any,
    batched: Any,
    algo: str,
    buffer: Any,
    lay: Layout,
    idx: np.ndarray,
    ptr: np.ndarray,
    lap: Any = None,
    ready: Ready | None = None,
) -> Any:
    """Decode all streams of one codec with nvCOMP's C API (:mod:`.nvcomp`): pointer
    arrays into the staging buffer and 16-byte aligned slots of one output buffer, one call
    on our stream, a status per stream. ``ready``: the streams packed and their check started
    already (:func:`ready_streams`)."""
    xp = device.xp
    clen, dlen = lay.clen[idx], lay.dlen[idx]
    if ready is None:
        ready = _ready(device, batched, algo, buffer, lay, idx)
    source, src_ptrs = ready.source, ready.src_ptrs
    dst, total = aligned_slots(dlen)
    target = xp.empty((total,), dtype=xp.uint8)
    if lap:
        lap("blosc pack")
    out_ptrs = np.uint64(target.data.ptr) + dst.astype(np.uint64)
    problem = ready.verdict()
    if problem is not None:  # nvCOMP decodes malformed LZ4 blocks to garbage: walked first
        raise BloscLayoutError(
            int(lay.chunk[idx[problem[0]]]), f"Blosc {algo} stream is malformed or truncated (corrupt chunk)"
        )
    if lap:
        lap("blosc check")
    try:
        sizes, status = batched.decode(src_ptrs, clen.astype(np.uint64), out_ptrs, dlen.astype(np.uint64))
    except DecodeTimeout as exc:
        raise BloscLayoutError(int(lay.chunk[idx[0]]), f"{exc} (a batch of chunks from this one)") from exc
    except RuntimeError:  # no status names a stream: the Python API's search finds the chunk
        return _decode_gpu(device, algo, buffer, lay, idx, ptr)
    bad = np.flatnonzero((status != 0) | (sizes != dlen))
    if len(bad):
        k = int(bad[0])
        what = status_text(status[k]) if status[k] else f"decoded to {sizes[k]} bytes, expected {dlen[k]}"
        raise BloscLayoutError(int(lay.chunk[idx[k]]), f"Blosc {algo} stream: {what} (corrupt chunk)")
    ptr[idx] = out_ptrs
    return (source, target)


def _decode_gpu(
    device: Any, algo: str, buffer: Any, lay: Layout, idx: np.ndarray, ptr: np.ndarray, lap: Any = None
) -> Any:
    """Decode all streams of one codec into 16-byte aligned slots of one buffer (no per-stream
    Python objects): nvCOMP batches carved from the staging and output buffers."""
    xp, nv = device.xp, device.codecs._nvcomp
    clen, dlen = lay.clen[idx], lay.dlen[idx]
    source, src = _pack(xp, buffer, lay.src[idx], clen)
    dst, total = aligned_slots(dlen)
    target = xp.empty((total,), dtype=xp.uint8)
    if lap:
        lap("blosc pack")
    # nvCOMP runs on its own stream: what our stream wrote (and freed) must be done first
    xp.cuda.get_current_stream().synchronize()
    try:
        srcs = nv.as_arrays(source, src.tolist(), clen.tolist())
        outs = nv.as_arrays(target, dst.tolist(), dlen.tolist())
        result = device.codecs._codec(STREAMS[algo]).decode(srcs, out=outs)
        sizes = decoded_sizes(result, len(idx))
        bad = np.flatnonzero(np.asarray(sizes, dtype=np.int64) != dlen)
    except Exception:  # noqa: BLE001 - find the stream and say which chunk it belongs to
        views = [source[int(p) : int(p) + int(c)] for p, c in zip(src, clen)]
        _decode_streams(device, algo, views, lay, idx)
        raise
    if len(bad):
        s = int(idx[bad[0]])
        raise BloscLayoutError(
            int(lay.chunk[s]), f"Blosc {algo} stream decoded to {sizes[bad[0]]} bytes, expected {lay.dlen[s]}"
        )
    ptr[idx] = np.uint64(target.data.ptr) + dst.astype(np.uint64)
    return (source, target, result)


def _pack(xp: Any, buffer: Any, src: np.ndarray, clen: np.ndarray, align: int = 16) -> tuple[Any, np.ndarray]:
    """The streams' buffer (on the GPU) and positions, copied to 16-byte aligned slots where
    a stream does not start at the ``align`` bytes nvCOMP needs."""
    if not len(src) or not (src % align).any():
        return buffer, src
    slots, total = aligned_slots(clen)
    packed = xp.empty((total,), dtype=xp.uint8)
    _batched_copy(xp, buffer, packed, src, slots, clen)
    return packed, slots


def _check_zstd(xp: Any, buffer: Any, lay: Layout, idx: list[int]) -> None:
    """Walk each zstd frame's block headers before nvCOMP sees it (garbage can fault the GPU)."""
    offs, lens = lay.src[idx], lay.clen[idx]
    lengths = zstd_frame_lengths(xp, buffer, offs, lens)
    for s, n, c in zip(idx, lengths, lens):
        if n != c:
            raise BloscLayoutError(
                int(lay.chunk[s]), "Blosc zstd stream is not a whole zstd frame (corrupt chunk)"
            )


def _unshuffle_cpu(buffer: np.ndarray, chunks: list[np.ndarray], lay: Layout, decoded: dict) -> None:
    for b in range(len(lay.out)):
        s0, ns = int(lay.s0[b]), int(lay.nsplits[b])
        parts = [
            buffer[int(lay.src[s]) : int(lay.src[s] + lay.clen[s])] if lay.raw[s] else decoded[s]
            for s in range(s0, s0 + ns)
        ]
        block = np.concatenate(parts) if ns > 1 else parts[0]
        start = int(lay.out[b])
        chunks[int(lay.bchunk[b])][start : start + int(lay.bsize[b])] = unshuffle_block(
            block, int(lay.typesize[b]), int(lay.mode[b])
        )


def _kernel(name: str) -> Any:
    from ...runtime.kernels import function

    return function("blosc", name)


def _batched_copy(xp: Any, src: Any, dst: Any, soff: np.ndarray, doff: np.ndarray, lens: np.ndarray) -> None:
    if not len(lens):
        return
    args = (
        src,
        dst,
        xp.asarray(soff, dtype=xp.int64),
        xp.asarray(doff, dtype=xp.int64),
        xp.asarray(lens, dtype=xp.int64),
    )
    _kernel("batched_copy")((len(lens),), (256,), args)


def _unshuffle_gpu(xp: Any, dests: tuple[np.ndarray, np.ndarray], lay: Layout, ptr: np.ndarray) -> None:
    """Unshuffle every block into its destination (:func:`_destinations`), one kernel launch."""
    nblocks = len(lay.out)
    if not nblocks:
        return
    bdst, geo = dests
    grid_x = int(min(64, -(-int(lay.bsize.max()) // 256)))
    args = (
        xp.asarray(bdst, dtype=xp.uint64),
        xp.asarray(lay.bsize, dtype=xp.int32),
        xp.asarray(lay.typesize, dtype=xp.int32),
        xp.asarray(lay.mode, dtype=xp.int32),
        xp.asarray(lay.nsplits, dtype=xp.int32),
        xp.asarray(lay.s0, dtype=xp.int64),
        xp.asarray(ptr),
        xp.asarray(np.ascontiguousarray(geo, dtype=np.int64)),
    )
    for first in range(0, nblocks, 65535):  # grid.y is limited to 65535
        sl = slice(first, min(nblocks, first + 65535))
        part = tuple(a[sl] for a in args[:6]) + (args[6], args[7][sl])
        _kernel("blosc_unshuffle")((grid_x, sl.stop - sl.start), (256,), part)
