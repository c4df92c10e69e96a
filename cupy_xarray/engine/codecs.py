"""Decode batches of compressed chunks: nvCOMP on the GPU, zlib/numcodecs on the CPU.

Zarr's compressors write standard streams, each with its own framing. Both implementations
take the stored streams, framing included, decode each into at most the chunk's size and
verify the checksum its framing stores: the CPU decoders (zlib, libzstd) check it
themselves; nvCOMP decodes the bare streams (``bitstream_kind=RAW``, :func:`deframe`) and
the GPU then verifies what :func:`deframe` left out (:mod:`.checksums`):

========  ==================================  ==================
zarr      stored as                           decoded as
========  ==================================  ==================
zstd      zstd frame (XXH64 if flagged)       ``Zstd``
gzip      gzip member (CRC-32, size)          ``Gzip``
zlib      2-byte header + deflate + Adler-32  ``Deflate`` (body)
lz4       4-byte LE size + LZ4 block          ``LZ4`` (block)
========  ==================================  ==================

(``lz4-block``: a bare LZ4 block, as Blosc stores its streams.)
"""

from __future__ import annotations

import logging
import os
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


DECODE_CHOICES = ("auto", "gpu", "cpu")


def decode_choice(value: str | None = None) -> str:
    """The ``decode=`` choice: the argument, else ``CUPY_XARRAY_DECODE``, else ``"auto"``."""
    choice = value if value is not None else os.environ.get("CUPY_XARRAY_DECODE", "auto")
    if choice not in DECODE_CHOICES:
        raise ValueError(
            f"decode must be 'auto', 'gpu' or 'cpu', got {choice!r} (from "
            + ("the decode= argument" if value is not None else "CUPY_XARRAY_DECODE")
            + ")"
        )
    return choice


def decodes_on_gpu(algo: str, decode: str = "auto", proven: bool = False) -> bool:
    """Whether a GPU read hands ``algo``'s streams to nvCOMP (else: CPU threads, then a copy).

    ``decode="auto"`` gives nvCOMP the streams it decodes safely after the engine's checks:
    gzip and zlib (a status and size per stream, then their CRC-32 / Adler-32 on the GPU),
    Blosc's LZ4 blocks (their structure walked on the GPU first). nvCOMP's zstd decoder
    checks nothing: damaged frames decode to garbage, fault the GPU or never finish, so zstd
    frames go to nvCOMP only when ``proven`` (their stored bytes passed a crc32c check)
    and otherwise to libzstd on CPU threads. numcodecs' LZ4 (one block per chunk) decodes
    faster with liblz4 on CPU threads than on the GPU. ``"gpu"`` hands nvCOMP everything
    (for stores you trust: the fastest), ``"cpu"`` nothing.
    """
    if decode == "cpu":
        return False
    if decode == "gpu":
        return True
    if algo in ("gzip", "zlib", "lz4-block"):
        return True
    return algo == "zstd" and proven


_MIN_LEN = {"zstd": 1, "gzip": 18, "zlib": 7, "lz4": 5, "lz4-block": 1}


def deframe(name: str, data: Any) -> Any:
    """The bare stream nvCOMP decodes, as a view of ``data`` (numpy or cupy, uint8); the
    stored checksums it leaves out are verified after decoding (:mod:`.checksums`)."""
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
    buf = memoryview(np.ascontiguousarray(data)).cast("B")
    n = len(buf)
    if n < 6 or bytes(buf[:4]) != b"\x28\xb5\x2f\xfd":
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


def frame_problem(name: str, head: bytes, tail: bytes, length: int, expected: int) -> str | None:
    """The error for a stored stream of ``length`` bytes whose first 32 and last 4 bytes are
    ``head`` and ``tail`` (:func:`check_frame`), or None."""
    if length < 4:
        return f"{length} bytes is too short for a {name} stream (corrupt chunk)"
    problem = check_frame(name, head, tail, expected)
    return f"{problem} (corrupt chunk)" if problem else None


def zstd_length_problem(walked: int, length: int) -> str | None:
    """The error for a zstd frame whose block walk (:func:`zstd_frame_length`) ended at
    ``walked`` in a stream of ``length`` bytes, or None."""
    if walked == length:
        return None
    what = "runs past the end of" if walked < 0 else f"is {walked} bytes, not the {length} of"
    return f"zstd frame {what} the stored stream (truncated or corrupt chunk)"


def stream_problem(name: str, data: np.ndarray, expected: int) -> str | None:
    """The error for one stored stream held on the host (its framing, and for zstd the
    frame's length against the stream's), or None."""
    problem = frame_problem(name, bytes(data[:32]), bytes(data[-4:]), len(data), expected)
    if problem or name != "zstd":
        return problem
    return zstd_length_problem(zstd_frame_length(data), len(data))


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


def _zstd_declared(src: Any) -> int | None:
    head = bytes(memoryview(np.ascontiguousarray(src[:18])).cast("B"))
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None
    return _zstd_content_size(head)


def _inflate(buf: memoryview, wbits: int, expected: int, what: str) -> bytes:
    """Inflate a zlib (15) or gzip (31) stream, stopping past ``expected`` bytes; zlib checks
    the stream's Adler-32 or CRC-32 and length at its end."""
    d = zlib.decompressobj(wbits)
    out = d.decompress(buf, expected + 1)
    if len(out) > expected:
        raise ValueError(f"{what} stream inflates to more than the {expected} bytes of a chunk")
    if not d.eof:
        raise ValueError(f"{what} stream ends before its end marker (truncated)")
    if d.unused_data:
        raise ValueError(f"{len(d.unused_data)} bytes follow the end of the {what} stream")
    return out


def _cpu_decode_one(algo: str, src: np.ndarray, expected: int, into: np.ndarray | None = None) -> np.ndarray:
    """Decode one stored stream (``algo``'s framing included) into ``expected`` bytes at most,
    verifying the checksum its framing stores."""
    buf = memoryview(np.ascontiguousarray(src)).cast("B")
    if algo == "zstd":
        from numcodecs import zstd

        declared = _zstd_declared(src)
        if declared is not None and declared != expected:
            raise ValueError(f"zstd frame declares {declared} bytes, expected {expected}")
        out = into if into is not None else np.empty(expected, dtype=np.uint8)
        zstd.decompress(buf, out)  # libzstd checks the content checksum; out bounds the size
        return out
    if algo in ("gzip", "zlib"):
        out = _inflate(buf, 31 if algo == "gzip" else 15, expected, algo)
    elif algo in ("lz4", "lz4-block"):
        from numcodecs import LZ4

        if algo == "lz4":
            declared = int.from_bytes(bytes(buf[:4]), "little") if len(buf) >= 4 else -1
            if declared != expected:
                raise ValueError(f"lz4 size prefix says {declared} bytes, expected {expected}")
            out = LZ4().decode(buf)
        else:
            out = LZ4().decode(struct.pack("<I", expected) + bytes(buf))
    else:  # pragma: no cover - guarded by spec parsing
        raise ValueError(f"unknown codec {algo}")
    result = np.frombuffer(out, dtype=np.uint8)
    if into is not None and len(result) == len(into):
        into[:] = result
        return into
    return result


def _size_failure(algo: str, i: int, got: int, expected: int) -> DecodeFailure:
    return DecodeFailure(i, f"{algo} stream decoded to {got} bytes, expected {expected}")


def host_threads() -> int:
    """CPU threads that decode for a GPU read (``CUPY_XARRAY_DECODE_THREADS``; default: cores)."""
    return max(1, int(os.environ.get("CUPY_XARRAY_DECODE_THREADS", 0)) or min(32, os.cpu_count() or 4))


def host_copies(srcs: list[Any]) -> list[np.ndarray]:
    """Host copies of device streams, in one copy where they are views of one buffer."""
    base = srcs[0].base if srcs else None
    if base is None or not base.flags.c_contiguous or any(s.base is not base for s in srcs):
        return [s.get() for s in srcs]
    flat = base.reshape(-1).view(np.uint8)
    offs = [s.data.ptr - flat.data.ptr for s in srcs]
    lo, hi = min(offs), max(o + s.size for o, s in zip(offs, srcs))
    host = flat[lo:hi].get()
    return [host[o - lo : o - lo + s.size] for o, s in zip(offs, srcs)]


def pinned_buffer(nbytes: int) -> np.ndarray:
    """Page-locked host memory (cupy's pinned pool): copies from it to the GPU run at full speed."""
    import cupyx

    return cupyx.empty_pinned((max(nbytes, 1),), dtype=np.uint8)


def to_device(pinned: np.ndarray, slots: np.ndarray, sizes: np.ndarray, outs: list[Any]) -> None:
    """Copy ``sizes[i]`` bytes at ``slots[i]`` of a pinned buffer into device buffer ``outs[i]``;
    returns once the copies are done (the pinned buffer may then be reused)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    rt = cupy.cuda.runtime
    base = pinned.ctypes.data
    for o, p, n in zip(outs, slots.tolist(), sizes.tolist()):
        rt.memcpyAsync(o.data.ptr, base + p, n, rt.memcpyHostToDevice, stream.ptr)
    stream.synchronize()


class CPUCodecs:
    """Decode on the host: zlib for gzip/zlib, numcodecs (libzstd, liblz4) for zstd and LZ4.

    Streams come with their framing (a zstd frame, a gzip member, a zlib stream, numcodecs'
    4-byte LZ4 size prefix; ``"lz4-block"``: a bare LZ4 block as Blosc stores it), and the
    checksums they carry are verified.
    """

    name = "cpu"

    def __init__(self) -> None:
        self.threads = 4

    @classmethod
    def with_threads(cls, threads: int) -> CPUCodecs:
        codecs = cls()
        codecs.threads = threads
        return codecs

    def decode(
        self,
        algo: str,
        srcs: list[np.ndarray],
        expected: list[int],
        into: list[Any] | None = None,
        decode: str = "auto",
        proven: bool = False,
    ) -> Decoded:
        """Decode every stream; ``into`` optionally gives, per stream, the buffer of exactly
        ``expected[i]`` bytes to decode into (``None``: a new buffer). Raises DecodeFailure
        naming the first stream that does not decode to exactly its expected size.
        (``decode`` and ``proven``: see :func:`decodes_on_gpu`; on the CPU all is decoded here.)"""

        def one(i: int) -> np.ndarray:
            target = None if into is None else into[i]
            try:
                out = _cpu_decode_one(algo, srcs[i], expected[i], target)
            except Exception as exc:  # noqa: BLE001 - re-raised with the index
                raise DecodeFailure(i, f"{algo} decode failed: {exc}") from exc
            if len(out) != expected[i]:
                raise _size_failure(algo, i, len(out), expected[i])
            return out

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


#: stream kind handed to nvCOMP for each engine codec (after :func:`deframe`)
_BARE = {"zstd": "zstd", "gzip": "gzip", "zlib": "zlib", "lz4": "lz4", "lz4-block": "lz4"}


class GPUCodecs:
    """Decode on the GPU: one batched nvCOMP call per codec (``bitstream_kind=RAW``).

    Streams come with their framing, as for :class:`CPUCodecs`. nvCOMP's C API decodes the
    bare streams into buffers of the expected size and reports a status and size per
    stream; the checksums the framing stores are then verified on the GPU
    (:mod:`.checksums`).
    """

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
        """nvCOMP's C API decoder for the bare streams of ``algo`` (:mod:`.nvcomp_api`), or
        None where only the Python API can be used (``CUPY_XARRAY_NVCOMP_C=0`` forces that)."""
        if self._nvcomp is None:
            return None
        from .nvcomp_api import batched_decoder

        return batched_decoder(_BARE.get(algo, algo))

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

    def _outputs(self, expected: list[int], into: list[Any] | None, align: int) -> tuple[list[Any], Any]:
        """``into`` where given, else ``align``-byte aligned slots of one new buffer."""
        import cupy

        outs = list(into) if into is not None else [None] * len(expected)
        missing = [i for i, o in enumerate(outs) if o is None]
        scratch = None
        if missing:
            sizes = np.array([expected[i] for i in missing], dtype=np.int64)
            slots, total = aligned_slots(sizes, max(align, 16))
            scratch = cupy.empty(total, dtype=cupy.uint8)
            for i, p, n in zip(missing, slots.tolist(), sizes.tolist()):
                outs[i] = scratch[p : p + n]
        return outs, scratch

    def _decode_on_host(self, algo: str, srcs: list[Any], expected: list[int], into) -> Decoded:
        """CPU threads decode (and check) the streams into pinned memory; one copy each to the
        device."""

        sizes = np.asarray(expected, dtype=np.int64)
        slots, total = aligned_slots(sizes)
        pinned = pinned_buffer(total)
        views = [pinned[p : p + n] for p, n in zip(slots.tolist(), sizes.tolist())]
        CPUCodecs.with_threads(host_threads()).decode(algo, host_copies(srcs), expected, views)
        outs, scratch = self._outputs(expected, into, 16)
        to_device(pinned, slots, sizes, outs)
        decoded = Decoded(outs)
        decoded.owner = scratch
        return decoded

    def _decode_c(self, batched: Any, algo: str, raw: list[Any], expected: list[int], into) -> Decoded:
        """One call of nvCOMP's C API; every stream's status and size checked (LZ4 blocks'
        structure before the call)."""
        import cupy

        from .nvcomp_api import status_text

        align = max(batched.input_alignment, 1)
        keep = []
        ptrs = np.array([r.data.ptr for r in raw], dtype=np.uint64)
        lens = np.array([r.size for r in raw], dtype=np.uint64)
        off = np.flatnonzero(ptrs % np.uint64(align))
        if len(off):  # copy streams that do not start where nvCOMP needs them
            slots, total = aligned_slots(lens[off].astype(np.int64), max(align, 16))
            packed = cupy.empty(total, dtype=cupy.uint8)
            for i, p in zip(off.tolist(), slots.tolist()):
                packed[p : p + raw[i].size] = raw[i]
                ptrs[i] = packed.data.ptr + p
            keep.append(packed)
        want = np.asarray(expected, dtype=np.uint64)
        if algo in ("lz4", "lz4-block"):
            from .checksums import lz4_check

            bad = np.flatnonzero(lz4_check(ptrs, lens, want.astype(np.int64)))
            if len(bad):
                raise DecodeFailure(int(bad[0]), f"{algo} block is malformed or truncated")
        outs, scratch = self._outputs(expected, into, batched.output_alignment)
        dst = np.array([o.data.ptr for o in outs], dtype=np.uint64)
        sizes, status = batched.decode(ptrs, lens, dst, want)
        bad = np.flatnonzero((status != 0) | (sizes != want.astype(np.int64)))
        if len(bad):
            k = int(bad[0])
            if status[k]:
                raise DecodeFailure(k, f"{algo} stream does not decode: {status_text(status[k])}")
            raise _size_failure(algo, k, int(sizes[k]), expected[k])
        decoded = Decoded(outs)
        decoded.owner = (scratch, keep)
        return decoded

    def _decode_into(self, algo: str, srcs: list[Any], expected: list[int], into: list[Any]) -> Decoded:
        """Python API: decode straight into the given buffers (no copy afterwards); the
        streams without one get 16-byte aligned slots of one new buffer."""
        import cupy

        nv = self._nvcomp
        outs, scratch = self._outputs(expected, into, 16)
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

    def _decode_python(self, algo: str, raw: list[Any], expected: list[int], into) -> Decoded:
        """nvCOMP's Python API (nvCOMP before 5, or ``CUPY_XARRAY_NVCOMP_C=0``)."""
        bare = _BARE[algo]
        try:
            if into is not None and any(o is not None for o in into):
                return self._decode_into(bare, raw, expected, into)
            result = self._decode(bare, raw)
        except DecodeFailure:
            raise
        except Exception as batch_exc:  # noqa: BLE001 - find which stream failed
            for i, s in enumerate(raw):
                try:
                    (one,) = self._decode(bare, [s])
                except Exception as exc:  # noqa: BLE001
                    raise DecodeFailure(i, f"nvCOMP {algo} decode failed: {exc}") from exc
                if len(one) != expected[i]:
                    raise _size_failure(algo, i, len(one), expected[i]) from batch_exc
            raise DecodeFailure(0, f"nvCOMP {algo} batch decode failed: {batch_exc}") from batch_exc
        for i, d in enumerate(result):
            if len(d) != expected[i]:
                raise _size_failure(algo, i, len(d), expected[i])
        return result

    def decode(
        self,
        algo: str,
        srcs: list[Any],
        expected: list[int],
        into: list[Any] | None = None,
        decode: str = "auto",
        proven: bool = False,
    ) -> Decoded:
        """Decode every stream in one batched call (see :meth:`CPUCodecs.decode`), with nvCOMP
        or on CPU threads as :func:`decodes_on_gpu` says."""
        if not decodes_on_gpu(algo, decode, proven):
            return self._decode_on_host(algo, srcs, expected, into)
        if self._nvcomp is None:
            import cupy

            host = CPUCodecs().decode(algo, [s.get() for s in srcs], expected)
            result = Decoded(cupy.asarray(h) for h in host)
            for i, o in enumerate(into or [None] * len(host)):
                if o is not None:
                    o[:] = result[i]
                    result[i] = o
            return result
        raw = []
        for i, s in enumerate(srcs):
            try:
                raw.append(deframe(algo, s))
            except FramingError as exc:
                raise DecodeFailure(i, str(exc)) from exc
        batched = self.batched(algo)
        if batched is not None:
            decoded = self._decode_c(batched, algo, raw, expected, into)
        else:
            decoded = self._decode_python(algo, raw, expected, into)
        from .checksums import verify

        bad = verify(algo, srcs, decoded)
        if bad is not None:
            what = {"zstd": "content checksum (XXH64)", "gzip": "CRC-32", "zlib": "Adler-32"}[algo]
            raise DecodeFailure(bad, f"{algo} {what} does not match the decoded bytes")
        return decoded


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
