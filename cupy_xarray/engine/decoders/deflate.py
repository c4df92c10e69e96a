"""Deflate streams: zarr's ``gzip`` (a gzip member) and ``zlib`` (a zlib stream).

========  ==================================  ========================
zarr      stored as                           nvCOMP decodes (checked)
========  ==================================  ========================
gzip      gzip member (CRC-32, size)          ``Gzip`` (CRC-32)
zlib      2-byte header + deflate + Adler-32  ``Deflate`` (Adler-32)
========  ==================================  ========================

nvCOMP reports a status and size per stream; the checksum each stores is verified on the GPU
afterwards (:mod:`.checksums`). On the host, zlib decodes and checks both.
"""

from __future__ import annotations

import zlib

import numpy as np

from ...formats.words import be32, le32
from .base import Rates, StreamDecoder


def inflate(buf: memoryview, wbits: int, expected: int, what: str) -> bytes:
    """Inflate a zlib (15) or gzip (31) stream, stopping past ``expected`` bytes; zlib checks
    the stream's Adler-32 or CRC-32 and length at its end. A gzip chunk may hold several
    members one after another (as gzip writes appended files, and zarr-python reads them):
    each is inflated and checked in turn."""
    parts, got = [], 0
    while True:
        d = zlib.decompressobj(wbits)
        out = d.decompress(buf, expected - got + 1)
        got += len(out)
        parts.append(out)
        if got > expected:
            raise ValueError(f"{what} stream inflates to more than the {expected} bytes of a chunk")
        if not d.eof:
            raise ValueError(f"{what} stream ends before its end marker (truncated)")
        rest = d.unused_data
        if not rest:
            break
        if wbits != 31 or rest[:3] != b"\x1f\x8b\x08":
            raise ValueError(f"{len(rest)} bytes follow the end of the {what} stream")
        buf = memoryview(rest)  # the next gzip member
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Deflate(StreamDecoder):
    wbits = 15
    nvcomp_faults = True
    rates = Rates(0.17e9, 2.8e9, 0.03e9, 1e-3, host_pool=1.7e9)

    def decode_host(self, src: np.ndarray, expected: int, into: np.ndarray | None = None) -> np.ndarray:
        buf = memoryview(np.ascontiguousarray(src)).cast("B")
        out = np.frombuffer(inflate(buf, self.wbits, expected, self.name), dtype=np.uint8)
        if into is not None and len(out) == len(into):
            into[:] = out
            return into
        return out


class Gzip(_Deflate):
    name = "gzip"
    min_length = 18
    nvcomp = "Gzip"
    checksum = "crc32"
    wbits = 31

    def check(self, head: bytes, tail: bytes, expected: int) -> str | None:
        if head[:3] != b"\x1f\x8b\x08":
            return "not a gzip member (bad magic number)"
        if int.from_bytes(tail, "little") != expected % 2**32:
            return "gzip trailer size does not match the chunk (truncated or corrupt)"
        return None

    def stored_checksums(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(ends), dtype=bool), le32(ends[:, 8:12])  # CRC-32, then ISIZE

    def sample(self, data: bytes) -> bytes:
        from numcodecs import GZip

        return bytes(GZip(level=1).encode(data))


class Zlib(_Deflate):
    name = "zlib"
    lead, trail = 2, 4
    min_length = 7
    nvcomp = "Deflate"
    checksum = "adler32"

    def check(self, head: bytes, tail: bytes, expected: int) -> str | None:
        cmf, flg = head[0], head[1]
        if cmf & 0x0F != 8 or (cmf * 256 + flg) % 31 or flg & 0x20:
            return "not a zlib stream (bad header)"
        return None

    def stored_checksums(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(ends), dtype=bool), be32(ends[:, 12:16])  # Adler-32, big-endian

    def sample(self, data: bytes) -> bytes:
        return zlib.compress(data, 1)


GZIP = Gzip()
ZLIB = Zlib()
