"""nvCOMP's batched compression through its C API: many chunks a call, on the caller's stream.

The C API rather than nvCOMP's Python one because a call through ctypes lets go of the
interpreter while it is queued and an asynchronous call returns at once: the threads writing
the batch before go on while the GPU compresses this one. Every chunk is compressed into a
slot of the size nvCOMP says it may need and reports its size and a status.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.nvcomp import Alignments, c_function, one_per_algorithm, status_text, version

#: compressors the writer runs on the GPU, by the nvCOMP algorithm that makes their streams
ALGORITHMS = ("Zstd", "LZ4")
#: the largest chunk each compresses as one stream
MAX_CHUNK_BYTES = {"Zstd": 16 << 20, "LZ4": 1 << 24}


class _CompressOpts(ctypes.Structure):
    """``nvcompBatched{Zstd,LZ4}CompressOpts_t``: 64 bytes, all zero is the default for both
    (LZ4's first field, the data type, is ``NVCOMP_TYPE_CHAR`` = 0)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


@dataclass
class Compressed:
    """A batch compressed on the GPU (or still compressing: the stream it was queued on)."""

    sizes: Any  # device uint64 (n,)
    statuses: Any  # device int32 (n,)
    out: Any  # device uint8 (n, slot)
    ptrs: Any  # device uint64 (n,): where each chunk's output starts
    keep: tuple  # device memory the call reads or writes: alive until it finished


class BatchedEncoder:
    """Batched compression of one algorithm through nvCOMP's C API (nvCOMP 5 or later)."""

    def __init__(self, lib: Any, algo: str, version: int) -> None:
        self.algo = algo
        p, n = ctypes.c_void_p, ctypes.c_size_t
        if version >= 6000:  # nvCOMP 6 takes a stream; nvCOMP 5's "...GetTempSizeAsync" does not
            self._temp = c_function(
                lib, f"nvcompBatched{algo}CompressGetTempSize", [n, n, _CompressOpts, ctypes.POINTER(n), n, p]
            )
        else:
            name = f"nvcompBatched{algo}CompressGetTempSizeAsync"
            fn = c_function(lib, name, [n, n, _CompressOpts, ctypes.POINTER(n), n])
            self._temp = lambda count, most, opts, out, total, stream: fn(count, most, opts, out, total)
        self._max_out = c_function(
            lib, f"nvcompBatched{algo}CompressGetMaxOutputChunkSize", [n, _CompressOpts, ctypes.POINTER(n)]
        )
        self._compress = c_function(
            lib, f"nvcompBatched{algo}CompressAsync", [p, p, n, n, p, n, p, p, _CompressOpts, p, p]
        )
        align = Alignments()
        name = f"nvcompBatched{algo}CompressGetRequiredAlignments"
        fn = c_function(lib, name, [_CompressOpts, ctypes.POINTER(Alignments)])
        self._opts = _CompressOpts()
        if fn(self._opts, ctypes.byref(align)) != 0:
            raise RuntimeError(f"nvCOMP {algo}: alignment query failed")
        #: every slot (input, output) starts at a multiple of this
        self.alignment = max(int(align.input), int(align.output), int(align.temp), 256)

    def max_output(self, chunk_bytes: int) -> int:
        """The most bytes a chunk of ``chunk_bytes`` may compress to."""
        out = ctypes.c_size_t(0)
        if self._max_out(chunk_bytes, self._opts, ctypes.byref(out)) != 0:
            raise RuntimeError(f"nvCOMP {self.algo}: cannot bound the output of {chunk_bytes}-byte chunks")
        return int(out.value)

    def slot(self, nbytes: int) -> int:
        a = self.alignment
        return -(-nbytes // a) * a

    def temp_bytes(self, count: int, chunk_bytes: int) -> int:
        out = ctypes.c_size_t(0)
        status = self._temp(count, chunk_bytes, self._opts, ctypes.byref(out), count * chunk_bytes, None)
        if status != 0:
            raise RuntimeError(f"nvCOMP {self.algo}: temp size query failed ({status_text(status)})")
        return int(out.value)

    def compress(self, src: Any, chunk_bytes: int, stream: Any) -> Compressed:
        """Queue the compression of each row's first ``chunk_bytes`` of ``src`` (a cupy uint8
        ``(n, stride)`` array, rows aligned) on ``stream``."""
        import cupy

        n = src.shape[0]
        slot = self.slot(self.max_output(chunk_bytes))
        out = cupy.empty((n, slot), dtype=cupy.uint8)
        host = np.empty((3, n), dtype=np.uint64)
        host[0] = src.data.ptr + np.arange(n, dtype=np.uint64) * np.uint64(src.strides[0])
        host[1] = chunk_bytes
        host[2] = out.data.ptr + np.arange(n, dtype=np.uint64) * np.uint64(slot)
        meta = cupy.empty((3, n), dtype=cupy.uint64)
        meta.set(host, stream=stream)
        sizes = cupy.empty((n,), dtype=cupy.uint64)
        statuses = cupy.empty((n,), dtype=cupy.int32)
        temp_n = self.temp_bytes(n, chunk_bytes)
        temp = cupy.empty((max(temp_n, 1),), dtype=cupy.uint8)
        ptr = int(meta.data.ptr)
        status = self._compress(
            ptr, ptr + 8 * n, chunk_bytes, n, temp.data.ptr, temp_n, ptr + 16 * n, sizes.data.ptr,
            self._opts, statuses.data.ptr, stream.ptr,
        )  # fmt: skip
        if status != 0:
            why = status_text(status)
            raise RuntimeError(f"nvCOMP {self.algo}: batched compression failed to launch ({why})")
        return Compressed(sizes, statuses, out, meta[2], (src, meta, temp, host))


_encoders: dict[str, BatchedEncoder | None] = {}


def batched_encoder(algo: str) -> BatchedEncoder | None:
    """The C API compressor for ``algo`` (:data:`ALGORITHMS`), or None where nvCOMP's C
    library (version 5 or later) is not there."""
    if algo not in ALGORITHMS:
        return None
    v = version()  # outside: the cache's lock is the library's
    return one_per_algorithm(_encoders, algo, lambda lib, a: BatchedEncoder(lib, a, v))
