"""Blosc 1 chunks: the layout is parsed on the host, the blocks are decoded on the device.

A Blosc chunk is a 16-byte header, a table of block starts, and per block one stream
(or one per byte of the element type, "split") of LZ4 or Zstd data, each prefixed by its
compressed size; a stream whose size equals its decoded size is stored as is. After
decoding, each block is unshuffled (byte shuffle or bit shuffle).

:func:`layout` walks that structure with a few vectorized gathers of 4-byte integers
(whatever device holds the bytes) and checks it, so that nothing malformed reaches nvCOMP.
:func:`decode_chunks` then decodes every stream of a batch with one call per codec
(``Device.codecs``) and unshuffles every block: NumPy on the CPU, one CUDA kernel on the GPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Box, DecodeFailure, aligned_slots, decoded_sizes, le32
from .nvcomp import DecodeTimeout, status_text
from .registry import BLOSC_STREAMS as STREAMS
from .registry import stream
from .zstd import frame_lengths as zstd_frame_lengths

#: Blosc compressor format codes (header flags >> 5) the engine decodes
FORMATS = {1: "lz4", 4: "zstd"}
FORMAT_NAMES = {0: "blosclz", 1: "lz4", 2: "snappy", 3: "zlib", 4: "zstd"}
#: cnames whose chunks the engine decodes (lz4hc writes LZ4 blocks)
CNAMES = {"lz4": "lz4", "lz4hc": "lz4", "zstd": "zstd"}

_SHUFFLE, _MEMCPYED, _BITSHUFFLE, _DONT_SPLIT = 0x1, 0x2, 0x4, 0x10
_MAX_SPLITS, _MIN_BUFFERSIZE = 16, 128
MODE_NONE, MODE_BYTE, MODE_BIT, MODE_BIT_V2 = 0, 1, 2, 3


class BloscLayoutError(ValueError):
    """Chunk ``index`` of a batch is not a well-formed Blosc chunk."""

    def __init__(self, index: int, message: str):
        self.index = index
        super().__init__(message)


@dataclass
class Layout:
    """Where every stream and block of a batch of Blosc chunks lies.

    Stream arrays (one entry per stream): ``src`` position of the compressed bytes in
    the buffer, ``clen`` their length, ``dlen`` the decoded length, ``raw`` stored
    uncompressed, ``chunk`` the chunk it belongs to, ``algo`` "lz4" or "zstd" per chunk.
    Block arrays: ``out`` byte offset of the block in its chunk, ``bsize``, ``typesize``,
    ``mode`` (none, byte, bit, bit in format 2), ``nsplits``, ``s0`` its first stream,
    ``bchunk`` its chunk.
    """

    src: np.ndarray
    clen: np.ndarray
    dlen: np.ndarray
    raw: np.ndarray
    chunk: np.ndarray
    out: np.ndarray
    bsize: np.ndarray
    typesize: np.ndarray
    mode: np.ndarray
    nsplits: np.ndarray
    s0: np.ndarray
    bchunk: np.ndarray
    algo: list[str]


def layout(read_u32: Any, starts: np.ndarray, lengths: np.ndarray, expected: int, cname: str) -> Layout:
    """Parse and check the structure of a batch of Blosc chunks (vectorized over blocks).

    Parameters
    ----------
    read_u32
        ``read_u32(positions) -> np.ndarray`` of little-endian uint32 at byte positions of
        the buffer holding the chunks (one gather per call, on any device).
    starts, lengths
        Each chunk's position and stored length in that buffer.
    expected
        Decoded bytes of every chunk.
    cname
        The compressor the array's metadata names.

    Raises
    ------
    BloscLayoutError
        Naming the chunk, for anything that does not add up.
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(starts)
    for i in np.flatnonzero(lengths < 16):
        raise BloscLayoutError(int(i), f"{lengths[i]} bytes is too short for a Blosc chunk")
    words = read_u32((starts[:, None] + np.arange(0, 16, 4)[None, :]).reshape(-1)).reshape(n, 4)
    version = (words[:, 0] & 0xFF).astype(np.int64)
    flags = ((words[:, 0] >> 16) & 0xFF).astype(np.int64)
    typesize = ((words[:, 0] >> 24) & 0xFF).astype(np.int64)
    nbytes, blocksize, cbytes = (words[:, k].astype(np.int64) for k in (1, 2, 3))
    fmt = flags >> 5
    memcpyed = (flags & _MEMCPYED) != 0
    want = CNAMES[cname]
    fmt_ok = np.array([FORMATS.get(int(f)) == want for f in range(8)])[fmt] | memcpyed
    checks = [
        (~np.isin(version, (1, 2, 3)) | (typesize == 0), "not a Blosc 1 chunk (version {v}, typesize {t})"),
        (nbytes != expected, "Blosc header declares {nb} decoded bytes, expected {e}"),
        (cbytes > lengths, "Blosc header declares {cb} stored bytes, the chunk has {ln} (truncated?)"),
        (cbytes < 16, "Blosc header declares {cb} stored bytes, fewer than its own 16"),
        (
            (blocksize <= 0) | ((blocksize > nbytes) & (nbytes > 0)),
            "Blosc block size {bs} does not fit {nb} bytes",
        ),
        (~fmt_ok, "chunk is compressed with {f}, the metadata says {c}"),
    ]
    for bad, message in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            text = message.format(
                v=version[i], t=typesize[i], nb=nbytes[i], e=expected, cb=cbytes[i], ln=lengths[i],
                bs=blocksize[i], f=FORMAT_NAMES.get(int(fmt[i]), int(fmt[i])), c=cname,
            )  # fmt: skip
            raise BloscLayoutError(i, text + " (corrupt chunk)")
    # bytes after cbytes are not the chunk's (some writers pad chunks): c-blosc ignores them too
    lengths = np.minimum(lengths, cbytes)

    # blocks of the compressed chunks
    comp = np.flatnonzero(~memcpyed & (nbytes > 0))
    nb = -(-nbytes[comp] // np.maximum(blocksize[comp], 1))
    bchunk = np.repeat(comp, nb)
    first = np.repeat(np.cumsum(nb) - nb, nb)
    j = np.arange(len(bchunk), dtype=np.int64) - first
    bs, nbc, ts = blocksize[bchunk], nbytes[bchunk], typesize[bchunk]
    leftover = (j == np.repeat(nb, nb) - 1) & (nbc % bs != 0)
    size = np.where(leftover, nbc - j * bs, bs)
    split = (
        ((flags[bchunk] & _DONT_SPLIT) == 0)
        & (ts <= _MAX_SPLITS)
        & (size // ts >= _MIN_BUFFERSIZE)
        & ~leftover
    )
    nsplits = np.where(split, ts, 1)
    bstart = read_u32(starts[bchunk] + 16 + 4 * j).astype(np.int64) if len(bchunk) else np.zeros(0, np.int64)
    bad = (bstart < 16 + 4 * np.repeat(nb, nb)) | (bstart >= lengths[bchunk])
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise BloscLayoutError(
            int(bchunk[b]), f"Blosc block {j[b]} starts at {bstart[b]}, outside the chunk (corrupt chunk)"
        )
    # walk the split streams of every block at once: step s reads the s-th size prefix
    neblock = size // nsplits
    pos = starts[bchunk] + bstart
    end = starts[bchunk] + lengths[bchunk]
    maxs = int(nsplits.max()) if len(nsplits) else 0
    spos = np.zeros((len(bchunk), max(maxs, 1)), dtype=np.int64)
    slen = np.zeros_like(spos)
    for step in range(maxs):
        live = np.flatnonzero(nsplits > step)
        over = pos[live] + 4 > end[live]
        if over.any():
            b = int(live[np.flatnonzero(over)[0]])
            raise BloscLayoutError(int(bchunk[b]), "Blosc stream runs past the end of the chunk (truncated?)")
        c = read_u32(pos[live]).astype(np.int64)
        wrong = (c <= 0) | (c > neblock[live]) | (pos[live] + 4 + c > end[live])
        if wrong.any():
            k = int(np.flatnonzero(wrong)[0])
            b = int(live[k])
            raise BloscLayoutError(
                int(bchunk[b]),
                f"Blosc block {j[b]} stream {step} claims {c[k]} bytes (truncated or corrupt chunk)",
            )
        spos[live, step] = pos[live] + 4
        slen[live, step] = c
        pos[live] += 4 + c
    valid = np.arange(spos.shape[1])[None, :] < nsplits[:, None]
    src, clen = spos[valid], slen[valid]
    dlen = np.repeat(neblock, nsplits)
    mode = np.where(
        ((flags & _SHUFFLE) != 0) & (typesize > 1),
        MODE_BYTE,
        np.where((flags & _BITSHUFFLE) != 0, np.where(version <= 2, MODE_BIT_V2, MODE_BIT), MODE_NONE),
    )
    b_out, b_size, b_ts, b_mode, b_ns = j * bs, size, ts, mode[bchunk], nsplits
    b_s0 = np.cumsum(nsplits) - nsplits
    schunk = np.repeat(bchunk, nsplits)
    # memcpyed chunks: one raw block holding everything, not shuffled
    mc = np.flatnonzero(memcpyed & (nbytes > 0))
    wrong = lengths[mc] != 16 + nbytes[mc]
    if wrong.any():
        raise BloscLayoutError(
            int(mc[np.flatnonzero(wrong)[0]]), "uncompressed Blosc chunk has the wrong length (corrupt chunk)"
        )
    nstream = len(src)
    src = np.concatenate([src, starts[mc] + 16])
    clen = np.concatenate([clen, nbytes[mc]])
    dlen = np.concatenate([dlen, nbytes[mc]])
    schunk = np.concatenate([schunk, mc])
    b_out = np.concatenate([b_out, np.zeros(len(mc), np.int64)])
    b_size = np.concatenate([b_size, nbytes[mc]])
    b_ts = np.concatenate([b_ts, np.ones(len(mc), np.int64)])
    b_mode = np.concatenate([b_mode, np.full(len(mc), MODE_NONE)])
    b_ns = np.concatenate([b_ns, np.ones(len(mc), np.int64)])
    b_s0 = np.concatenate([b_s0, nstream + np.arange(len(mc))])
    bchunk = np.concatenate([bchunk, mc])
    algo = [FORMATS.get(int(f), want) for f in fmt]

    def a(x, dt=np.int64):
        return np.asarray(x, dtype=dt)

    return Layout(
        a(src), a(clen), a(dlen), a(clen == dlen, bool), a(schunk),
        a(b_out), a(b_size), a(b_ts), a(b_mode), a(b_ns), a(b_s0), a(bchunk), algo,
    )  # fmt: skip


def _one_block_header(flags: int, typesize: int, nbytes: int, cbytes: int) -> bytes:
    """A Blosc header (format 2) of a zstd chunk of one ``nbytes`` block, one stream a block."""
    return struct.pack("<BBBBIII", 2, 1, flags | _DONT_SPLIT | (4 << 5), typesize, nbytes, nbytes, cbytes)


def one_block_prefix(nbytes: int, typesize: int, shuffled: bool, csize: int) -> bytes:
    """What precedes the zstd stream of a Blosc chunk written as one block: the header (byte
    shuffle or none), the block's start and the stream's size."""
    head = _one_block_header(_SHUFFLE if shuffled and typesize > 1 else 0, typesize, nbytes, 24 + csize)
    return head + struct.pack("<Ii", 24 - 4, csize)


def one_block_fits(nbytes: int, csize: int) -> bool:
    """Whether a ``csize``-byte stream makes a one-block chunk of ``nbytes`` smaller than the
    chunk stored as is (else it is: a stream is never longer than its block)."""
    return 24 + csize <= 16 + nbytes


def memcpyed_prefix(nbytes: int, typesize: int) -> bytes:
    """The header of a Blosc chunk stored as is (what compresses no smaller than itself)."""
    return _one_block_header(_MEMCPYED, typesize, nbytes, 16 + nbytes)


def shuffle_rows(src: Any, dst: Any, nbytes: int, typesize: int) -> None:
    """Blosc's byte shuffle of the first ``nbytes`` of each row of ``src`` (uint8, NumPy or
    cupy) into ``dst``, each row one block: byte ``k`` of every element together, in element
    order, then the bytes that make no whole element as they are."""
    m = nbytes // typesize
    whole = m * typesize
    rows = src.shape[0]
    dst[:, :whole].reshape(rows, typesize, m)[...] = (
        src[:, :whole].reshape(rows, m, typesize).transpose(0, 2, 1)
    )
    if whole < nbytes:
        dst[:, whole:nbytes] = src[:, whole:nbytes]


def unshuffle_block(shuffled: np.ndarray, typesize: int, mode: int) -> np.ndarray:
    """Undo Blosc's byte or bit shuffle of one block (NumPy; the GPU kernel's twin)."""
    size = len(shuffled)
    if mode == MODE_NONE or typesize <= 1 and mode == MODE_BYTE:
        return shuffled
    out = shuffled.copy()
    n = size // typesize
    if mode == MODE_BYTE:
        out[: n * typesize] = shuffled[: n * typesize].reshape(typesize, n).T.reshape(-1)
        return out
    if mode == MODE_BIT_V2 and n % 8:
        return out  # format 2 left such blocks as they were
    n8 = n - n % 8
    if n8 == 0:
        return out
    bits = np.unpackbits(shuffled[: n8 * typesize].reshape(typesize * 8, n8 // 8), axis=1, bitorder="little")
    # bits[b * 8 + k, e] is bit k of byte b of element e
    planes = bits.reshape(typesize, 8, n8).transpose(2, 0, 1)  # element, byte, bit
    out[: n8 * typesize] = np.packbits(planes, axis=2, bitorder="little").reshape(-1)
    return out


#: a box's row width and every block's start must be multiples of this for the unshuffle to
#: write into it: no store of the kernel (at most 64 bytes, at a multiple of its width) then
#: crosses a row
BOX_ALIGN = 64


def _boxable(lay: Layout, boxes: list[Box | None] | None, nchunks: int, device: Any) -> list[Box | None]:
    """The boxes the unshuffle writes into: those given, for chunks whose every block is
    shuffled (a block stored as is would be copied a byte at a time) and starts at a multiple
    of :data:`BOX_ALIGN`, with the box's rows and pitches aligned for the kernel's stores."""
    if boxes is None or not any(b is not None for b in boxes):
        return [None] * nchunks
    ok = np.zeros(nchunks, dtype=bool)
    for i, b in enumerate(boxes):
        if b is None or b.width % BOX_ALIGN or b.row_pitch % 16 or b.plane_pitch % 16:
            continue
        if device.name == "gpu" and (b.out.data.ptr + b.start) % 16:
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
    device: Any,
    lap: Any = None,
    targets: list[Any] | None = None,
    ready: dict[str, Ready] | None = None,
    boxes: list[Box | None] | None = None,
    isolated: bool = False,
) -> tuple[list[Any], list[Any]]:
    """Decode every stream and unshuffle every block.

    ``targets`` optionally gives, per chunk, the ``expected`` bytes its blocks are
    unshuffled into (a view of the output); ``boxes``, per chunk without one, the box of the
    output its blocks are unshuffled into (:class:`Box`; where the chunk and box allow it:
    no scratch, no scatter). Other chunks get a new buffer. ``ready``: what
    :func:`ready_streams` started for this batch.
    Returns the buffers to keep alive until the device is synchronized, and the decoded
    bytes of each chunk (None for a chunk unshuffled into its box). ``isolated``: streams
    nvCOMP may fault on (zstd) are decoded in the decoder process (:mod:`..sandbox`; again on
    CPU threads where it is lost).

    Raises
    ------
    BloscLayoutError
        Naming the chunk whose stream did not decode.
    """
    xp = device.xp
    targets = list(targets) if targets is not None else [None] * nchunks
    if boxes is not None:
        boxes = [None if t is not None else b for t, b in zip(targets, boxes)]
    boxed = _boxable(lay, boxes, nchunks, device)
    need = [i for i, t in enumerate(targets) if t is None and (boxed[i] is None or device.name != "gpu")]
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
            batched = device.codecs.batched(STREAMS[algo]) if device.name == "gpu" else None
        if batched is not None:
            mine = (ready or {}).get(algo)
            owners.append(_decode_gpu_c(device, batched, algo, buffer, lay, idx, ptr, lap, mine))
            continue
        if device.name == "gpu" and _carve_supported(device) and not isolated:
            owners.append(_decode_gpu(device, algo, buffer, lay, idx, ptr, lap))
            continue
        source, src = _pack(xp, buffer, lay.src[idx], lay.clen[idx], device)
        srcs = [source[int(p) : int(p) + int(c)] for p, c in zip(src, lay.clen[idx])]
        result = _decode_streams(device, algo, srcs, lay, idx, isolated)
        for s, d in zip(idx, result):
            decoded[int(s)] = d
            if device.name == "gpu":
                ptr[s] = d.data.ptr
        owners.append(result)  # nvCOMP's buffers: alive until the unshuffle kernel has run
    if lap:
        lap("blosc decode")
    if device.name == "gpu":
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
    chunks: list[Any], expected: int, device: Any, targets: list[Any] | None = None
) -> tuple[list[Any], list[Any]]:
    """Decode whole Blosc chunks (already checked by :func:`layout`) with c-blosc on CPU
    threads into pinned memory, and copy them to the device (``targets`` where given).
    Returns the buffers to keep alive and each chunk's decoded bytes on the device."""
    from concurrent.futures import ThreadPoolExecutor

    from ..buffers import pinned_buffer
    from .batch import host_copies, host_threads, to_device

    n = len(chunks)
    sizes = np.full(n, expected, dtype=np.int64)
    slots, total = aligned_slots(sizes)
    pinned = pinned_buffer(total)
    srcs = host_copies(chunks)

    def one(i: int) -> None:
        c_blosc_into(srcs[i], pinned[slots[i] : slots[i] + expected], i)

    with ThreadPoolExecutor(max_workers=min(host_threads(), n)) as pool:
        list(pool.map(one, range(n)))
    outs, scratch = device.codecs._outputs([expected] * n, targets, 16)
    to_device(pinned, slots, sizes, outs)
    return [scratch], outs


#: streams of a chunk up to which :func:`check_one` walks them in Python (beyond, the vectorized
#: :func:`layout`: a chunk of tiny blocks must not cost a long Python loop)
_WALK_STREAMS = 4096


def check_one(src: np.ndarray, expected: int, cname: str) -> None:
    """The checks :func:`layout` makes of one chunk, without the layout: for a CPU thread about
    to hand the chunk to c-blosc. In plain Python for a chunk of a few streams (:func:`layout`'s
    numpy calls cost a millisecond per chunk, with the interpreter held), else :func:`layout`;
    the same errors, found in the same order.

    Raises
    ------
    BloscLayoutError
        As :func:`layout` does.
    """
    n = len(src)
    if n < 16:
        raise BloscLayoutError(0, f"{n} bytes is too short for a Blosc chunk")
    data = memoryview(src).cast("B")
    word0, nbytes, blocksize, cbytes = struct.unpack_from("<4I", data, 0)
    version, flags, typesize = word0 & 0xFF, (word0 >> 16) & 0xFF, (word0 >> 24) & 0xFF
    memcpyed = bool(flags & _MEMCPYED)
    splittable = not memcpyed and nbytes > 0 and blocksize > 0
    blocks = -(-nbytes // blocksize) if splittable else 0
    if blocks * max(typesize, 1) > _WALK_STREAMS:
        _check_vectorized(src, expected, cname)
        return
    fmt = flags >> 5
    problem = None
    if version not in (1, 2, 3) or typesize == 0:
        problem = f"not a Blosc 1 chunk (version {version}, typesize {typesize})"
    elif nbytes != expected:
        problem = f"Blosc header declares {nbytes} decoded bytes, expected {expected}"
    elif cbytes > n:
        problem = f"Blosc header declares {cbytes} stored bytes, the chunk has {n} (truncated?)"
    elif cbytes < 16:
        problem = f"Blosc header declares {cbytes} stored bytes, fewer than its own 16"
    elif blocksize <= 0 or (blocksize > nbytes and nbytes > 0):
        problem = f"Blosc block size {blocksize} does not fit {nbytes} bytes"
    elif not (FORMATS.get(fmt) == CNAMES[cname] or memcpyed):
        problem = f"chunk is compressed with {FORMAT_NAMES.get(fmt, fmt)}, the metadata says {cname}"
    if problem is not None:
        raise BloscLayoutError(0, problem + " (corrupt chunk)")
    end = min(n, cbytes)
    if memcpyed:
        if nbytes > 0 and end != 16 + nbytes:
            raise BloscLayoutError(0, "uncompressed Blosc chunk has the wrong length (corrupt chunk)")
        return
    if nbytes == 0:
        return
    starts = struct.unpack_from(f"<{blocks}I", data, 16) if 16 + 4 * blocks <= n else None
    if starts is None:  # the block starts themselves run past the chunk: as layout reads them
        _check_vectorized(src, expected, cname)
        return
    plan = []
    for j, bstart in enumerate(starts):
        leftover = j == blocks - 1 and nbytes % blocksize != 0
        size = nbytes - j * blocksize if leftover else blocksize
        split = not (flags & _DONT_SPLIT) and typesize <= _MAX_SPLITS and size // typesize >= _MIN_BUFFERSIZE
        split = split and not leftover
        if bstart < 16 + 4 * blocks or bstart >= end:
            raise BloscLayoutError(
                0, f"Blosc block {j} starts at {bstart}, outside the chunk (corrupt chunk)"
            )
        nsplits = typesize if split else 1
        plan.append([j, bstart, nsplits, size // nsplits])
    for step in range(max(p[2] for p in plan)):
        for block in plan:
            j, pos, nsplits, neblock = block
            if nsplits <= step:
                continue
            if pos + 4 > end:
                raise BloscLayoutError(0, "Blosc stream runs past the end of the chunk (truncated?)")
            (c,) = struct.unpack_from("<I", data, pos)
            if c <= 0 or c > neblock or pos + 4 + c > end:
                raise BloscLayoutError(
                    0, f"Blosc block {j} stream {step} claims {c} bytes (truncated or corrupt chunk)"
                )
            block[1] = pos + 4 + c


def _check_vectorized(src: np.ndarray, expected: int, cname: str) -> None:
    def read_u32(positions: np.ndarray) -> np.ndarray:
        return le32(src[np.minimum(positions[:, None] + np.arange(4)[None, :], max(len(src) - 1, 0))])

    layout(read_u32, np.zeros(1, np.int64), np.array([len(src)], np.int64), expected, cname)


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
    device: Any, algo: str, srcs: list[Any], lay: Layout, idx: np.ndarray, isolated: bool = False
) -> list[Any]:
    """Decode with ``Device.codecs`` (one batched call; ``isolated``: in the decoder process);
    check every decoded length."""
    expected = [int(lay.dlen[s]) for s in idx]  # Blosc's LZ4 streams carry no size prefix
    try:
        if isolated:
            result = device.codecs.decode(STREAMS[algo], srcs, expected, isolated=True)
        else:
            result = device.codecs.decode(STREAMS[algo], srcs, expected)
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


def gpu_streams(device: Any, lay: Layout, isolated: bool = False) -> dict[str, tuple[Any, np.ndarray]]:
    """The codecs of a batch that nvCOMP's C API decodes in this process, with their batched
    decoder and the indexes of their compressed streams (``isolated``: not those the decoder
    process takes)."""
    if device.name != "gpu":
        return {}
    found = {}
    for algo, idx in codec_groups(lay):
        if isolated and stream(STREAMS[algo]).nvcomp_faults:
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


def ready_streams(device: Any, buffer: Any, lay: Layout, isolated: bool = False) -> dict[str, Ready]:
    """Pack the compressed streams of each codec nvCOMP's C API decodes and start their
    structure checks, on the current stream (a batch's checks run while the batch before it
    decodes: a check is one long chain of reads per stream, and leaves the GPU idle)."""
    return {
        algo: _ready(device, batched, algo, buffer, lay, idx)
        for algo, (batched, idx) in gpu_streams(device, lay, isolated).items()
    }


def _ready(device: Any, batched: Any, algo: str, buffer: Any, lay: Layout, idx: np.ndarray) -> Ready:
    clen, dlen = lay.clen[idx], lay.dlen[idx]
    source, src = _pack(device.xp, buffer, lay.src[idx], clen, device, batched.input_alignment)
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
    source, src = _pack(xp, buffer, lay.src[idx], clen, device)
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


def _pack(
    xp: Any, buffer: Any, src: np.ndarray, clen: np.ndarray, device: Any, align: int = 16
) -> tuple[Any, np.ndarray]:
    """The streams' buffer and positions, copied to 16-byte aligned slots where a stream does
    not start at the ``align`` bytes nvCOMP needs."""
    if device.name != "gpu" or not len(src) or not (src % align).any():
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
    from .kernels import function

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
