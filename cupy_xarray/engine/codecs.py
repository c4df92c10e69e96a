"""Decode batches of compressed chunks: nvCOMP on the GPU, zlib/numcodecs on the CPU.

Zarr's compressors write standard streams, each with its own framing; nvCOMP decodes the
bare streams (``bitstream_kind=RAW``). :func:`deframe` strips the framing the same way for
both implementations, so the CPU path in CI exercises exactly what the GPU path decodes:

========  ==================================  ==================
zarr      stored as                           decoded as
========  ==================================  ==================
zstd      zstd frame                          ``Zstd``
gzip      gzip member                         ``Gzip``
zlib      2-byte header + deflate + Adler-32  ``Deflate`` (body)
lz4       4-byte LE size + LZ4 block          ``LZ4`` (block)
========  ==================================  ==================
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

log = logging.getLogger("cupy_xarray")

#: engine codec name -> nvCOMP algorithm
NVCOMP_ALGORITHMS = {"zstd": "Zstd", "gzip": "Gzip", "zlib": "Deflate", "lz4": "LZ4"}


class DecodeFailure(Exception):
    """Stream ``index`` of a batch could not be decoded."""

    def __init__(self, index: int, message: str):
        self.index = index
        super().__init__(message)


class FramingError(ValueError):
    """A stream is too short to hold its codec's framing."""


_MIN_LEN = {"zstd": 1, "gzip": 18, "zlib": 7, "lz4": 5}


def deframe(name: str, data: Any) -> Any:
    """The bare stream nvCOMP decodes, as a view of ``data`` (numpy or cupy, uint8)."""
    if len(data) < _MIN_LEN[name]:
        raise FramingError(f"{len(data)} bytes is too short for a {name} stream")
    if name == "zlib":
        return data[2:-4]
    if name == "lz4":
        return data[4:]
    return data


def _zstd_content_size(head: bytes) -> int | None:
    """The frame content size a zstd frame header declares, or None if it has none."""
    fhd = head[4]
    size = (1 if (fhd >> 5) & 1 else 0, 2, 4, 8)[fhd >> 6]
    if size == 0:
        return None
    pos = zstd_header_length(fhd) - size  # the content size is the header's last field
    value = int.from_bytes(head[pos : pos + size], "little")
    return value + 256 if size == 2 else value


def check_frame(name: str, head: bytes, tail: bytes, expected: int) -> str | None:
    """Cheap host-side sanity check of a compressed stream before it reaches the GPU.

    ``head`` holds the stream's first 32 bytes (fewer if shorter), ``tail`` its last 4.
    nvCOMP can fault on streams that are not what they claim to be; random bytes, wrong
    codecs and truncated gzip members are refused here with a message instead.
    Returns None when the stream looks right, else what is wrong.
    """
    if name == "zstd":
        if head[:4] != b"\x28\xb5\x2f\xfd":
            return "not a zstd frame (bad magic number)"
        declared = _zstd_content_size(head)
        if declared is not None and declared != expected:
            return f"zstd frame declares {declared} bytes, expected {expected}"
    elif name == "gzip":
        if head[:3] != b"\x1f\x8b\x08":
            return "not a gzip member (bad magic number)"
        if int.from_bytes(tail, "little") != expected % 2**32:
            return "gzip trailer size does not match the chunk (truncated or corrupt)"
    elif name == "zlib":
        cmf, flg = head[0], head[1]
        if cmf & 0x0F != 8 or (cmf * 256 + flg) % 31 or flg & 0x20:
            return "not a zlib stream (bad header)"
    elif name == "lz4":
        declared = int.from_bytes(head[:4], "little")
        if declared != expected:
            return f"lz4 size prefix says {declared} bytes, expected {expected}"
    return None


def zstd_header_length(fhd: int) -> int:
    """Bytes of a zstd frame header (magic number included) whose descriptor byte is ``fhd``:
    the first block header follows."""
    single = (fhd >> 5) & 1
    return 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (1 if single else 0, 2, 4, 8)[fhd >> 6]


def zstd_frame_length(data: bytes | np.ndarray) -> int:
    """Length in bytes of the zstd frame at the start of ``data`` (walking its block headers).

    Returns -1 when the frame is malformed or runs past the end of ``data``. nvCOMP can
    fault on truncated frames, so every zstd stream is measured before it is decoded.
    :data:`ZSTD_FRAME_LENGTH_KERNEL` is the same walk on the GPU.
    """
    buf = bytes(memoryview(np.ascontiguousarray(data)).cast("B"))
    n = len(buf)
    if n < 6 or buf[:4] != b"\x28\xb5\x2f\xfd":
        return -1
    fhd = buf[4]
    pos = zstd_header_length(fhd)
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


ZSTD_FRAME_LENGTH_KERNEL = r"""
extern "C" __global__ void zstd_frame_length(const unsigned char* buf, const long long* offs,
                                             const long long* lens, long long* out, int count) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const unsigned char* b = buf + offs[i];
  long long n = lens[i];
  out[i] = -1;
  if (n < 6 || b[0] != 0x28 || b[1] != 0xb5 || b[2] != 0x2f || b[3] != 0xfd) return;
  int fhd = b[4];
  int single = (fhd >> 5) & 1;
  const int dict[4] = {0, 1, 2, 4};
  const int fcs[4] = {single ? 1 : 0, 2, 4, 8};
  long long pos = 5 + (single ? 0 : 1) + dict[fhd & 3] + fcs[fhd >> 6];
  while (true) {
    if (pos + 3 > n) return;
    unsigned int h = b[pos] | (b[pos + 1] << 8) | (b[pos + 2] << 16);
    int last = h & 1, kind = (h >> 1) & 3;
    long long size = h >> 3;
    if (kind == 3) return;
    pos += 3 + (kind == 1 ? 1 : size);
    if (last) break;
  }
  if ((fhd >> 2) & 1) pos += 4;
  out[i] = pos <= n ? pos : -1;
}
"""


def zstd_frame_lengths(xp: Any, staging: Any, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """:func:`zstd_frame_length` of many streams held in one buffer (GPU kernel on cupy)."""
    if xp.__name__ != "cupy":
        return np.array([zstd_frame_length(staging[o : o + n]) for o, n in zip(offs, lens)])
    kernel = _zstd_kernel()
    count = len(offs)
    out = xp.empty(count, dtype=xp.int64)
    d_offs, d_lens = xp.asarray(offs, dtype=xp.int64), xp.asarray(lens, dtype=xp.int64)
    kernel(((count + 127) // 128,), (128,), (staging, d_offs, d_lens, out, np.int32(count)))
    return out.get()


_KERNELS: dict[str, Any] = {}


def _zstd_kernel():
    if "zstd" not in _KERNELS:
        import cupy

        _KERNELS["zstd"] = cupy.RawKernel(ZSTD_FRAME_LENGTH_KERNEL, "zstd_frame_length")
    return _KERNELS["zstd"]


class Decoded(list):
    """Decoded buffers, with whatever owns their memory kept alive beside them."""

    owner: Any = None


def _cpu_decode_one(algo: str, src: np.ndarray, expected: int) -> np.ndarray:
    buf = memoryview(np.ascontiguousarray(src))
    if algo == "zstd":
        from numcodecs import Zstd

        out = Zstd().decode(buf)
    elif algo == "gzip":
        out = zlib.decompress(buf, 31)
    elif algo == "zlib":
        out = zlib.decompress(buf, -15)
    elif algo == "lz4":
        from numcodecs import LZ4

        out = LZ4().decode(struct.pack("<I", expected) + bytes(buf))
    else:  # pragma: no cover - guarded by spec parsing
        raise ValueError(f"unknown codec {algo}")
    return np.frombuffer(out, dtype=np.uint8)


def _size_failure(algo: str, i: int, got: int, expected: int) -> DecodeFailure:
    return DecodeFailure(i, f"{algo} stream decoded to {got} bytes, expected {expected}")


class CPUCodecs:
    """Decode on the host: zlib for gzip/deflate, numcodecs for zstd and LZ4 blocks."""

    name = "cpu"

    def __init__(self) -> None:
        self.threads = 4

    def decode(
        self, algo: str, srcs: list[np.ndarray], expected: list[int], into: list[Any] | None = None
    ) -> Decoded:
        """Decode every stream; ``into`` optionally gives, per stream, the buffer of exactly
        ``expected[i]`` bytes to decode into (``None``: a new buffer)."""

        def one(i: int) -> np.ndarray:
            try:
                out = _cpu_decode_one(algo, srcs[i], expected[i])
            except Exception as exc:  # noqa: BLE001 - re-raised with the index
                raise DecodeFailure(i, f"{algo} decode failed: {exc}") from exc
            if into is None or into[i] is None:
                return out
            if len(out) != expected[i]:
                raise _size_failure(algo, i, len(out), expected[i])
            into[i][:] = out
            return into[i]

        if len(srcs) == 1:
            return Decoded([one(0)])
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            return Decoded(pool.map(one, range(len(srcs))))


def aligned_slots(lengths: np.ndarray, align: int = 16) -> tuple[np.ndarray, int]:
    """Offsets that lay buffers of ``lengths`` bytes out back to back, each starting on an
    ``align``-byte boundary (nvCOMP's requirement), and the bytes that layout needs."""
    slots = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        slots[1:] = np.cumsum(-(-lengths[:-1] // align) * align)
    total = int(slots[-1] + lengths[-1]) if len(lengths) else 0
    return slots, total + align


def _nv_arrays(nv: Any, arrs: list[Any]) -> Any:
    """nvCOMP arrays for many 1-D uint8 cupy views, carved from their common buffer in one call
    when they share one (converting view by view costs microseconds each)."""
    base = arrs[0].base if arrs else None
    if base is None or not base.flags.c_contiguous or any(a.base is not base for a in arrs):
        return nv.as_arrays(arrs)
    flat = base.reshape(-1).view(np.uint8)
    start = flat.data.ptr
    return nv.as_arrays(flat, [a.data.ptr - start for a in arrs], [a.size for a in arrs])


class GPUCodecs:
    """Decode on the GPU: one batched nvCOMP call per codec (``bitstream_kind=RAW``)."""

    name = "nvcomp"

    def __init__(self) -> None:
        self._local = threading.local()  # nvCOMP codecs must not be shared across threads
        try:
            from nvidia import nvcomp
        except ImportError:
            nvcomp = None
            log.warning(
                "nvidia-nvcomp is not installed: compressed chunks are decoded on the CPU "
                "(install cupy-xarray[cuda13] or [cuda12] for GPU decoding)"
            )
        self._nvcomp = nvcomp

    @property
    def available(self) -> bool:
        return self._nvcomp is not None

    def batched(self, algo: str):
        """nvCOMP's C API decoder for ``algo`` (:mod:`.nvcomp_api`), or None where only the
        Python API can be used (``CUPY_XARRAY_NVCOMP_C=0`` forces that)."""
        if self._nvcomp is None:
            return None
        from .nvcomp_api import batched_decoder

        return batched_decoder(algo)

    def _codec(self, algo: str):
        """This thread's codec for ``algo``. nvCOMP runs it on a stream of its own: handing
        it our stream (``cuda_stream=``) crashed the process under concurrent reads."""
        cache = self._local.__dict__.setdefault("codecs", {})
        if algo not in cache:
            nv = self._nvcomp
            cache[algo] = nv.Codec(algorithm=NVCOMP_ALGORITHMS[algo], bitstream_kind=nv.BitstreamKind.RAW)
        return cache[algo]

    def _decode(self, algo: str, srcs: list[Any]) -> Decoded:
        import cupy

        out = self._codec(algo).decode(_nv_arrays(self._nvcomp, srcs))
        result = Decoded(cupy.asarray(a).view(cupy.uint8).reshape(-1) for a in out)
        result.owner = out
        return result

    def _decode_into(self, algo: str, srcs: list[Any], expected: list[int], into: list[Any]) -> Decoded:
        """Decode straight into the given buffers (no copy afterwards); the streams without
        one get 16-byte aligned slots of one new buffer."""
        import cupy

        nv = self._nvcomp
        outs = list(into)
        missing = [i for i, o in enumerate(outs) if o is None]
        scratch = None
        if missing:
            sizes = np.array([expected[i] for i in missing], dtype=np.int64)
            slots, total = aligned_slots(sizes)
            scratch = cupy.empty(total, dtype=cupy.uint8)
            for i, p, n in zip(missing, slots.tolist(), sizes.tolist()):
                outs[i] = scratch[p : p + n]
        current = cupy.cuda.get_current_stream()
        current.synchronize()  # nvCOMP runs on its own stream: the outputs must be ready for it
        result = self._codec(algo).decode(_nv_arrays(nv, srcs), out=_nv_arrays(nv, outs))
        got = decoded_sizes(result, len(outs))
        done = cupy.cuda.Event()
        done.record(cupy.cuda.Stream.null)
        current.wait_event(done)  # later work on our stream sees the decoded bytes
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise _size_failure(algo, i, g, e)
        decoded = Decoded(outs)
        decoded.owner = (scratch, result)
        return decoded

    def decode(
        self, algo: str, srcs: list[Any], expected: list[int], into: list[Any] | None = None
    ) -> Decoded:
        """Decode every stream in one batched call (see :meth:`CPUCodecs.decode`)."""
        if self._nvcomp is None:
            import cupy

            host = CPUCodecs().decode(algo, [s.get() for s in srcs], expected)
            result = Decoded(cupy.asarray(h) for h in host)
            for i, (h, o) in enumerate(zip(host, into or [None] * len(host))):
                if o is not None:
                    if len(h) != expected[i]:
                        raise _size_failure(algo, i, len(h), expected[i])
                    o[:] = result[i]
                    result[i] = o
            return result
        try:
            if into is not None and any(o is not None for o in into):
                return self._decode_into(algo, srcs, expected, into)
            return self._decode(algo, srcs)
        except DecodeFailure:
            raise
        except Exception as batch_exc:  # noqa: BLE001 - find which stream failed
            for i, s in enumerate(srcs):
                try:
                    (one,) = self._decode(algo, [s])
                except Exception as exc:  # noqa: BLE001
                    raise DecodeFailure(i, f"nvCOMP {algo} decode failed: {exc}") from exc
                if len(one) != expected[i]:
                    raise _size_failure(algo, i, len(one), expected[i]) from batch_exc
            raise DecodeFailure(0, f"nvCOMP {algo} batch decode failed: {batch_exc}") from batch_exc


def decoded_sizes(result: Any, count: int) -> list[int]:
    """Decoded byte counts of an nvCOMP ``decode(..., out=...)`` result."""
    sizes = getattr(result, "buffer_sizes", None)
    sizes = sizes() if callable(sizes) else sizes
    if sizes is None:
        sizes = [len(result[i]) for i in range(count)]
    return [int(n) for n in sizes]


def crc32c_value(data: Any) -> int:
    """CRC-32C (Castagnoli) of a host buffer, as zarr's ``crc32c`` codec computes it."""
    import google_crc32c

    return int(google_crc32c.value(bytes(memoryview(data))))


def crc32c_strip(xp: Any, data: Any) -> Any:
    """Check and remove a trailing little-endian crc32c; raise ValueError on mismatch."""
    if len(data) < 4:
        raise ValueError("too short to hold a crc32c checksum")
    host = data.get() if xp.__name__ == "cupy" else data
    host = np.ascontiguousarray(host)
    stored = int.from_bytes(host[-4:].tobytes(), "little")
    if crc32c_value(host[:-4]) != stored:
        raise ValueError("crc32c checksum mismatch (corrupt chunk)")
    return data[:-4]
