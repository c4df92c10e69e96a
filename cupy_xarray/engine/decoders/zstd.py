"""Zstandard frames (zarr's ``zstd``, numcodecs' ``Zstd``, and the streams of Blosc zstd).

A frame is a header (magic number, descriptor, optional content size), blocks each with a
3-byte header, and an optional content checksum (the low 32 bits of XXH64). The host walks
the block headers of every frame before nvCOMP sees it (:func:`frame_length`, and
:file:`runtime/kernels/zstd.cu` for frames already on the GPU): nvCOMP can fault on truncated
frames. nvCOMP's zstd decoder reports nothing for damaged blocks (they decode to garbage,
fault the GPU or never finish), so ``decode="auto"`` hands it only frames whose stored bytes
a crc32c proved first; the others go to libzstd on CPU threads, which checks everything.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...formats.words import le32
from .base import Rates, StreamDecoder

MAGIC = b"\x28\xb5\x2f\xfd"


def header_length(fhd: int) -> int:
    """Bytes of a zstd frame header (magic number included) whose descriptor byte is ``fhd``:
    the first block header follows."""
    single = (fhd >> 5) & 1
    return 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (1 if single else 0, 2, 4, 8)[fhd >> 6]


def content_size(head: bytes) -> int | None:
    """The frame content size a zstd frame header declares, or None if it has none."""
    fhd = head[4]
    size = (1 if (fhd >> 5) & 1 else 0, 2, 4, 8)[fhd >> 6]
    if size == 0:
        return None
    pos = header_length(fhd) - size  # the content size is the header's last field
    value = int.from_bytes(head[pos : pos + size], "little")
    return value + 256 if size == 2 else value


def frame_length(data: bytes | np.ndarray) -> int:
    """Length in bytes of the zstd frame at the start of ``data`` (walking its block headers);
    -1 when the frame is malformed or runs past the end of ``data``."""
    buf = memoryview(np.ascontiguousarray(data)).cast("B")
    n = len(buf)
    if n < 6 or bytes(buf[:4]) != MAGIC:
        return -1
    fhd = buf[4]
    pos = header_length(fhd)
    while True:
        if pos + 3 > n:
            return -1
        header = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            return -1
        pos += 3 + (1 if kind == 1 else size)
        if last:
            break
    pos += 4 if (fhd >> 2) & 1 else 0
    return pos if pos <= n else -1


def frame_lengths(xp: Any, buffer: Any, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """:func:`frame_length` of many streams held in one buffer (one kernel launch on cupy)."""
    if xp.__name__ != "cupy":
        return np.array([frame_length(buffer[o : o + n]) for o, n in zip(offs, lens)], dtype=np.int64)
    from ...runtime.kernels import function

    count = len(offs)
    out = xp.empty(count, dtype=xp.int64)
    d_offs, d_lens = xp.asarray(offs, dtype=xp.int64), xp.asarray(lens, dtype=xp.int64)
    args = (buffer, d_offs, d_lens, out, np.int32(count))
    function("zstd", "zstd_frame_length")(((count + 127) // 128,), (128,), args)
    return out.get()


def _decode_frames(src: np.ndarray, expected: int, out: np.ndarray) -> np.ndarray:
    """Decode a chunk of several zstd frames into ``out``, each frame in turn (each must
    declare its content size, and together they must make the chunk's)."""
    from numcodecs import zstd

    pos = done = 0
    while pos < len(src):
        n = frame_length(src[pos:])
        head = bytes(memoryview(np.ascontiguousarray(src[pos : pos + 18])).cast("B"))
        size = content_size(head) if n > 0 else None
        if n <= 0 or size is None or done + size > expected:
            raise ValueError(
                f"zstd frame at byte {pos} of the chunk is malformed, declares no size, or runs "
                f"past the {expected} bytes of the chunk"
            )
        frame = memoryview(np.ascontiguousarray(src[pos : pos + n])).cast("B")
        zstd.decompress(frame, out[done : done + size])
        pos, done = pos + n, done + size
    if done != expected:
        raise ValueError(f"zstd frames hold {done} bytes, expected {expected}")
    return out


class Zstd(StreamDecoder):
    name = "zstd"
    unit = "frame"
    nvcomp = "Zstd"
    nvcomp_faults = True
    checksum = "xxh64"
    host_only = "nvCOMP's zstd decoder does not report damaged frames; decode='gpu' for trusted stores"
    rates = Rates(0.5e9, 40e9, 0.07e9, 1e-3, host_pool=6.5e9)

    def check(self, head: bytes, tail: bytes, expected: int) -> str | None:
        if head[:4] != MAGIC:
            return "not a zstd frame (bad magic number)"
        declared = content_size(head) if len(head) >= 6 else None
        if declared is not None and declared != expected:
            return f"zstd frame declares {declared} bytes, expected {expected}"
        return None

    def walk(self, xp: Any, buffer: Any, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        return frame_lengths(xp, buffer, offs, lens)

    def decode_host(self, src: np.ndarray, expected: int, into: np.ndarray | None = None) -> np.ndarray:
        from numcodecs import zstd

        head = bytes(memoryview(np.ascontiguousarray(src[:18])).cast("B"))
        out = into if into is not None else np.empty(expected, dtype=np.uint8)
        if len(head) >= 6 and head[:4] == MAGIC:
            declared = content_size(head)
            if declared is not None and declared != expected:
                first = frame_length(src)
                if 0 < first < len(src):  # frames one after another, as zstd writes streams
                    return _decode_frames(src, expected, out)
                raise ValueError(f"zstd frame declares {declared} bytes, expected {expected}")
        # libzstd checks the content checksum; ``out`` bounds the decoded size
        zstd.decompress(memoryview(np.ascontiguousarray(src)).cast("B"), out)
        return out

    def stored_checksums(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # the descriptor's Content_Checksum_flag; the checksum is the frame's last 4 bytes
        return (ends[:, 4] & 0x04) != 0, le32(ends[:, 12:16])

    def sample(self, data: bytes) -> bytes:
        from numcodecs import Zstd as NumcodecsZstd

        return bytes(NumcodecsZstd(level=1).encode(data))


ZSTD = Zstd()
