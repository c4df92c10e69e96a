"""Blosc 1 chunks as bytes: the header and block table, parsed and checked
(:func:`layout` for a batch, vectorized; :func:`check_one` for one chunk), the prefixes a
writer puts before its streams, and the byte and bit shuffles.

A Blosc chunk is a 16-byte header, a table of block starts, and per block one stream (or one
per byte of the element type, "split") of LZ4 or Zstd data, each prefixed by its compressed
size; a stream whose size equals its decoded size is stored as is. After decoding, each block
is unshuffled (byte shuffle or bit shuffle).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .words import le32

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
        check_vectorized(src, expected, cname)
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
        check_vectorized(src, expected, cname)
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


def check_vectorized(src: np.ndarray, expected: int, cname: str) -> None:
    """The checks of :func:`check_one` for one chunk, by :func:`layout`'s vectorized walk (for
    chunks of many blocks and streams); raises :class:`BloscLayoutError`."""

    def read_u32(positions: np.ndarray) -> np.ndarray:
        return le32(src[np.minimum(positions[:, None] + np.arange(4)[None, :], max(len(src) - 1, 0))])

    layout(read_u32, np.zeros(1, np.int64), np.array([len(src)], np.int64), expected, cname)
