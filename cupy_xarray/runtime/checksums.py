"""The checks of decoded streams nvCOMP does not make, run on the GPU where the bytes are.

nvCOMP decodes zarr's streams as bare streams (``bitstream_kind=RAW``) and checks none of
their checksums: a zstd frame's content checksum (low 32 bits of XXH64), a gzip member's
CRC-32, a zlib stream's Adler-32. :func:`verify` computes them over the decoded bytes where
they lie (one kernel launch per batch, :file:`kernels/checksums.cu`) and compares them with
the stored ones. On the CPU the decoders (zlib, libzstd) check them themselves.

CRC-32 and Adler-32 are computed in segments of :data:`SEGMENT` bytes, one thread each,
and combined; :func:`crc32_segmented` and :func:`adler32_segmented` are the same
arithmetic on the host, tested against zlib. The same kernel computes zarr's CRC-32C (another
polynomial) of the chunks the writer compresses on the GPU (:func:`crc_start`).

nvCOMP's LZ4 decoder does not check the structure of a block either (a truncated block
decodes to garbage of the right size): :func:`lz4_check` walks every block's sequences
before it is decoded, with the rules of liblz4's safe decoder (:func:`lz4_walk_host` is the
kernel's twin on the host).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

SEGMENT = 2048  # SEG in kernels/checksums.cu
#: the reflected polynomials: zlib's CRC-32 and zarr's CRC-32C (Castagnoli)
CRC_POLYS = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}
_ADLER_MOD = 65521


def multmodp(a: int, b: int, poly: int = CRC_POLYS["crc32"]) -> int:
    """``a(x) * b(x)`` modulo a CRC polynomial, bit-reflected (zlib's ``multmodp``)."""
    p = 0
    for i in range(31, -1, -1):
        if a & (1 << i):
            p ^= b
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return p


@functools.cache
def x2n_table(poly: int = CRC_POLYS["crc32"]) -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial, k = 0..31."""
    p, table = 1 << 30, []
    for _ in range(32):
        table.append(p)
        p = multmodp(p, p, poly)
    return tuple(table)


def zeros_operator(n: int, poly: int = CRC_POLYS["crc32"]) -> int:
    """The operator appending ``n`` zero bytes to a CRC: ``x^(8 n)`` modulo the polynomial."""
    p, k, table = 1 << 31, 3, x2n_table(poly)
    while n:
        if n & 1:
            p = multmodp(table[k & 31], p, poly)
        n >>= 1
        k += 1
    return p


def crc32_segmented(data: bytes, kind: str = "crc32") -> int:
    """zlib's CRC-32 (or zarr's CRC-32C) of ``data`` the way the GPU kernel computes it: per
    segment, combined."""
    import zlib

    poly = CRC_POLYS[kind]
    whole = zlib.crc32 if kind == "crc32" else _crc32c
    n = len(data)
    crc = 0
    for start in range(0, n, SEGMENT):
        end = min(start + SEGMENT, n)
        # a segment's CRC without the inversions: the library's with both inversions undone
        inverted = multmodp(zeros_operator(end - start, poly), 0xFFFFFFFF, poly)
        raw = whole(data[start:end]) ^ inverted ^ 0xFFFFFFFF
        part = multmodp(zeros_operator(n - end, poly), raw, poly)
        if start == 0:
            part ^= multmodp(zeros_operator(n, poly), 0xFFFFFFFF, poly) ^ 0xFFFFFFFF
        crc ^= part
    return crc


def _crc32c(data: bytes) -> int:
    from ..formats.crc32c import value

    return value(data)


def adler32_segmented(data: bytes) -> int:
    """zlib's Adler-32 of ``data`` the way the GPU kernel computes it: per segment, summed."""
    n = len(data)
    d = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    sa = sb = 0
    for start in range(0, n, SEGMENT):
        end = min(start + SEGMENT, n)
        seg = d[start:end]
        a = int(seg.sum()) % _ADLER_MOD
        w = int((seg * np.arange(end - start, 0, -1, dtype=np.uint64)).sum())
        sa += a
        sb += (w % _ADLER_MOD + ((n - end) % _ADLER_MOD) * a) % _ADLER_MOD
    return ((n + sb) % _ADLER_MOD) << 16 | (1 + sa) % _ADLER_MOD


def _lz4_length(p: bytes, pos: int, value: int) -> tuple[int, int] | None:
    """An LZ4 length whose 4-bit field is ``value``, continued by bytes of 255 from ``pos``:
    (length, next position), or None when the input ends first."""
    if value != 15:
        return value, pos
    while True:
        if pos >= len(p):
            return None
        b = p[pos]
        pos += 1
        value += b
        if b != 255:
            return value, pos


def lz4_walk_host(block: bytes, expected: int) -> int:
    """0 when ``block`` is an LZ4 block that decodes to exactly ``expected`` bytes (liblz4's
    safe-decoder rules), else 1 + the position where it fails; the ``lz4_walk_warps`` kernel's twin."""
    p, n, pos, out = block, len(block), 0, 0
    while True:
        if pos >= n:
            return pos + 1
        token = p[pos]
        got = _lz4_length(p, pos + 1, token >> 4)
        if got is None:
            return n + 1
        lit, pos = got
        cpy = out + lit
        if lit > n - pos or cpy > expected:
            return pos + 1
        if cpy > expected - 12 or pos + lit > n - 8:  # necessarily the last sequence
            return 0 if pos + lit == n and cpy == expected else pos + 1
        pos += lit
        out = cpy
        if n - pos < 2:
            return pos + 1
        offset = p[pos] | p[pos + 1] << 8
        pos += 2
        if offset == 0 or offset > out:
            return pos - 1
        got = _lz4_length(p, pos, token & 15)
        if got is None:
            return n + 1
        ml, pos = got
        out += ml + 4
        if out > expected - 5:
            return pos + 1


def _kernel(name: str) -> Any:
    from .kernels import function

    return function("checksums", name)


def _segments(cp: Any, lens: np.ndarray) -> tuple[Any, int]:
    counts = -(-lens // SEGMENT)
    first = np.zeros(len(lens), dtype=np.int64)
    first[1:] = np.cumsum(counts)[:-1]
    return cp.asarray(first), int(counts.sum())


def stream_ends(ptrs: Any, lens: Any, count: int) -> np.ndarray:
    """The first and last 8 bytes of ``count`` device streams: a (count, 16) host array."""
    import cupy

    out = cupy.zeros((count, 16), dtype=cupy.uint8)
    _kernel("stream_ends")(((count + 127) // 128,), (128,), (ptrs, lens, out, np.int32(count)))
    return out.get()


def compute(kind: str, ptrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``"xxh64"``, ``"crc32"`` or ``"adler32"`` of device streams (addresses, lengths), on the
    host as uint64; one kernel launch for the batch."""
    import cupy

    count = len(ptrs)
    if count == 0:
        return np.zeros(0, np.uint64)
    lens = np.asarray(lens, dtype=np.int64)
    d_ptrs, d_lens = cupy.asarray(ptrs, dtype=cupy.uint64), cupy.asarray(lens)
    if kind == "xxh64":
        out = cupy.empty(count, dtype=cupy.uint64)
        _kernel("xxh64_streams")((count,), (32,), (d_ptrs, d_lens, out, np.int32(count)))
        return out.get()
    if kind in CRC_POLYS:
        return crc_start(kind, d_ptrs, d_lens, count, lens).get().astype(np.uint64)
    first, nseg = _segments(cupy, lens)
    grid = (max(1, (nseg + 255) // 256),)
    if kind == "adler32":
        sums = cupy.zeros(2 * count, dtype=cupy.uint64)
        _kernel("adler32_segments")(
            grid, (256,), (d_ptrs, d_lens, first, np.int32(count), np.int64(nseg), sums)
        )
        s = sums.get().reshape(count, 2)
        a = (1 + s[:, 0]) % _ADLER_MOD
        b = (lens.astype(np.uint64) + s[:, 1]) % _ADLER_MOD
        return b << np.uint64(16) | a
    raise ValueError(f"unknown checksum {kind!r}")


def crc_start(kind: str, d_ptrs: Any, d_lens: Any, count: int, lens: Any) -> Any:
    """``"crc32"`` or ``"crc32c"`` of ``count`` device streams (device addresses and int64 or
    uint64 lengths) launched on the current stream, not waited for: a device uint32 array.
    ``lens``: the lengths on the host, or one bound on all of them (the kernel then reads the
    lengths on the device, and threads past a stream's end do nothing)."""
    import cupy

    out = cupy.zeros(count, dtype=cupy.uint32)
    if count == 0:
        return out
    if np.ndim(lens) == 0:
        per = max(1, -(-int(lens) // SEGMENT))
        first, nseg = cupy.arange(count, dtype=cupy.int64) * per, per * count
    else:
        first, nseg = _segments(cupy, np.asarray(lens, dtype=np.int64))
    poly = CRC_POLYS[kind]
    x2n = cupy.asarray(np.array(x2n_table(poly), dtype=np.uint32))
    args = (d_ptrs, d_lens, first, np.int32(count), np.int64(nseg), x2n, np.uint32(poly), out)
    _kernel("crc32_segments")((max(1, (nseg + 255) // 256),), (256,), args)
    return out


#: streams each block of the ``lz4_walk_warps`` kernel walks, a warp each (its LZ4_WARPS)
_LZ4_WARPS = 4


def lz4_check(ptrs: np.ndarray, lens: np.ndarray, want: np.ndarray) -> np.ndarray:
    """:func:`lz4_walk_host` of LZ4 blocks on the device (addresses, stored and decoded
    lengths): one status per block on the host, 0 where the block is sound."""
    if len(ptrs) == 0:
        return np.zeros(0, np.int64)
    return lz4_check_start(ptrs, lens, want).get()


def lz4_check_start(ptrs: np.ndarray, lens: np.ndarray, want: np.ndarray) -> Any:
    """:func:`lz4_check` launched on the current stream, not waited for: the statuses as a
    device array (each block's walk is a long chain of dependent reads, so a caller can
    decode other streams meanwhile)."""
    import cupy

    count = len(ptrs)
    status = cupy.empty(count, dtype=cupy.int64)
    if count == 0:
        return status
    args = (
        cupy.asarray(np.asarray(ptrs, dtype=np.uint64)),
        cupy.asarray(np.asarray(lens, dtype=np.int64)),
        cupy.asarray(np.asarray(want, dtype=np.int64)),
        status,
        np.int32(count),
    )
    _kernel("lz4_walk_warps")(((count + _LZ4_WARPS - 1) // _LZ4_WARPS,), (32 * _LZ4_WARPS,), args)
    return status


#: checksum kinds (:attr:`~.base.StreamDecoder.checksum`), as messages name them
CHECKSUM_NAMES = {"xxh64": "content checksum (XXH64)", "crc32": "CRC-32", "adler32": "Adler-32"}


def verify(decoder: Any, framed: list[Any], decoded: list[Any]) -> int | None:
    """Index of the first stream whose decoded bytes do not match the checksum its framing
    stores (``decoder.stored_checksums``), or None (also for kinds that store none).
    ``framed``: the stored streams; ``decoded``: what they decoded to (cupy uint8 views)."""
    import cupy

    kind = decoder.checksum
    if kind is None or not framed:
        return None
    f_ptrs = cupy.asarray(np.array([f.data.ptr for f in framed], dtype=np.uint64))
    f_lens = cupy.asarray(np.array([f.size for f in framed], dtype=np.int64))
    has, values = decoder.stored_checksums(stream_ends(f_ptrs, f_lens, len(framed)))
    which = np.flatnonzero(has)
    if not len(which):
        return None
    ptrs = np.array([decoded[i].data.ptr for i in which], dtype=np.uint64)
    lens = np.array([decoded[i].size for i in which], dtype=np.int64)
    got = compute(kind, ptrs, lens)
    if kind == "xxh64":
        got = got & np.uint64(0xFFFFFFFF)
    bad = np.flatnonzero(got != values[which].astype(np.uint64))
    return int(which[bad[0]]) if len(bad) else None
