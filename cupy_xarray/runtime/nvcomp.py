"""nvCOMP's batched C API through ctypes: every GPU decode, with a status per stream.

Two reasons to call the C API rather than the Python one (``nvidia.nvcomp``):

- Damaged streams. Every stream gets an output buffer of the size the chunk must decode to
  and reports a status and its decoded size; the Python API sizes outputs from the streams
  themselves and reports neither, and damaged zstd, LZ4 and deflate streams made it fault
  (``cudaErrorIllegalAddress``, the CUDA context lost) or loop.
- Many streams. The Python API wraps every stream in an ``Array`` object, three times; a
  Blosc batch holds tens of thousands of streams. Here a batch is four arrays of pointers
  and sizes, copied to the device at once, and one call on the caller's stream.

Only nvCOMP 5 and later (the ``DecompressOpts`` signature); :func:`batched_decoder`
returns None otherwise, and the engine keeps the Python API.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..options import get_options

#: nvCOMP C API algorithm prefixes (each decoder's ``nvcomp``; ``Deflate``: the body of a zlib
#: stream, ``LZ4``: an LZ4 block). Zstd's scratch memory is sized by reading the streams
#: (``GetTempSizeSync``; the bound without them is 3x the output), which also refuses
#: malformed frames before the decode is launched.
ALGORITHMS = ("LZ4", "Zstd", "Gzip", "Deflate")
#: nvcompStatus_t values, for messages
STATUS_NAMES = {
    10: "invalid value", 11: "not supported", 12: "cannot decompress", 13: "bad checksum",
    14: "cannot verify checksums", 15: "output buffer too small", 16: "wrong header length",
    17: "alignment", 18: "chunk size too large", 20: "wrong input length", 1000: "CUDA error",
    10000: "internal error",
}  # fmt: skip
_BACKEND_CUDA = 2  # nvCOMP's CUDA kernels: they report corrupt streams (a hardware engine need not)


class _Opts(ctypes.Structure):
    """The first field and size every ``nvcompBatched*DecompressOpts_t`` shares (64 bytes; the
    rest zeroed means the defaults)."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class Alignments(ctypes.Structure):
    """nvCOMP's ``nvcompAlignmentRequirements_t``: the byte alignment of inputs, outputs and
    scratch a batched call needs."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


_lib_lock = threading.Lock()
_lib: Any = None
_lib_version = 0  # nvCOMP's semantic version, major * 1000 + minor * 100 + patch
_lib_error: str | None = None


def enabled() -> bool:
    """False when the ``nvcomp_c`` option (``CUPY_XARRAY_NVCOMP_C=0``) asks for nvCOMP's
    Python API only."""
    return get_options().nvcomp_c


def _find_library() -> ctypes.CDLL:
    for name in ("libnvcomp.so.6", "libnvcomp.so.5", "libnvcomp.so"):
        try:  # the nvidia.nvcomp module has loaded it already, if installed
            return ctypes.CDLL(name)
        except OSError:
            pass
    import nvidia

    for root in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(root, "libnvcomp", "lib*", "libnvcomp.so*")), reverse=True):
            return ctypes.CDLL(path)
    raise OSError("libnvcomp.so not found")


def library() -> Any:
    """The loaded ``libnvcomp`` (version 5 or later), or None with :data:`_lib_error` set."""
    global _lib, _lib_version, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                lib = _find_library()
                props = _Properties()
                if lib.nvcompGetProperties(ctypes.byref(props)) != 0:
                    raise OSError("nvcompGetProperties failed")
                if props.version // 1000 < 5:
                    raise OSError(f"nvCOMP {props.version} predates the batched API used here")
                _lib, _lib_version = lib, int(props.version)
            except (OSError, ImportError, AttributeError) as exc:
                _lib_error = str(exc)
        return _lib


def version() -> int:
    """nvCOMP's version as ``major * 1000 + minor * 100 + patch`` (0 when not loaded)."""
    library()
    return _lib_version


def c_function(lib: Any, name: str, argtypes: list) -> Any:
    """``lib``'s C function ``name`` taking ``argtypes`` and returning an nvcompStatus_t."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int  # nvcompStatus_t
    return fn


def describe() -> str:
    """One line for ``python -m cupy_xarray info``: is the C API used, and if not, why."""
    if not enabled():
        return "off (CUPY_XARRAY_NVCOMP_C=0): GPU decodes go through nvCOMP's Python API"
    if library() is None:
        return f"not used ({_lib_error})"
    v = _lib_version
    return f"libnvcomp {v // 1000}.{v // 100 % 10}.{v % 100}: GPU reads decode through it (status per stream)"


def status_text(status: int) -> str:
    """``nvCOMP status 12 (cannot decompress)``."""
    name = STATUS_NAMES.get(int(status))
    return f"nvCOMP status {int(status)}" + (f" ({name})" if name else "")


#: the longest pause between two looks at a decode that has not finished: what a decode may
#: finish before it is noticed (a batch calls nvCOMP once per codec, each call costs ms)
WAIT_POLL_S = 2e-4


_meanwhile = threading.local()


@contextlib.contextmanager
def while_decoding(work: Callable[[], None]) -> Iterator[None]:
    """Run ``work`` on this thread once the next batched decode this thread starts in the
    block is queued on the GPU, before waiting for it: host work (and GPU work on another
    stream) that overlaps the decode. ``work`` must not raise; it is dropped when no decode
    starts in the block."""
    _meanwhile.work = work
    try:
        yield
    finally:
        _meanwhile.work = None


class DecodeTimeout(RuntimeError):
    """A batched decode did not finish within the ``decode_timeout`` option's seconds."""


def wait(stream: Any, what: str) -> None:
    """Wait for the work queued on ``stream`` so far, at most ``decode_timeout`` seconds (an option).

    A bounded wait is the last line against a decode that never ends; the streams are
    checked before they are decoded so that it should never be needed.
    """
    import cupy

    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record(stream)
    if done.done:
        return
    timeout = get_options().decode_timeout
    deadline = time.monotonic() + timeout
    pause = 2e-5
    while not done.done:
        if time.monotonic() > deadline:
            raise DecodeTimeout(
                f"{what} did not finish within {timeout:.0f} s (a damaged stream?); the GPU may "
                "stay busy: restart the Python process (CUPY_XARRAY_DECODE_TIMEOUT sets the limit)"
            )
        time.sleep(pause)
        pause = min(pause * 2, WAIT_POLL_S)


class BatchedDecoder:
    """Batched decompression of one algorithm through nvCOMP's C API."""

    def __init__(self, lib: Any, algo: str) -> None:
        name = self.algo = algo
        p, n = ctypes.c_void_p, ctypes.c_size_t
        self._temp_size = c_function(
            lib, f"nvcompBatched{name}DecompressGetTempSize", [n, n, _Opts, ctypes.POINTER(n), n, p]
        )
        self._decompress = c_function(
            lib, f"nvcompBatched{name}DecompressAsync", [p, p, p, p, n, p, n, p, _Opts, p, p]
        )
        alignments = c_function(
            lib, f"nvcompBatched{name}DecompressGetRequiredAlignments", [_Opts, ctypes.POINTER(Alignments)]
        )
        self._temp_size_sync = None
        if name == "Zstd":
            self._temp_size_sync = c_function(
                lib,
                f"nvcompBatched{name}DecompressGetTempSizeSync",
                [p, p, n, n, ctypes.POINTER(n), n, _Opts, p, p],
            )
        self._opts = _Opts(backend=_BACKEND_CUDA)
        align = Alignments()
        status = alignments(self._opts, ctypes.byref(align))
        if status != 0:
            raise RuntimeError(f"nvCOMP {name}: alignment query failed (status {status})")
        #: alignment each compressed stream must start at
        self.input_alignment = int(align.input)
        self.output_alignment = int(align.output)

    def decode(
        self,
        src_ptrs: np.ndarray,
        src_bytes: np.ndarray,
        dst_ptrs: np.ndarray,
        dst_bytes: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode stream ``i`` (``src_bytes[i]`` at device address ``src_ptrs[i]``) into the
        ``dst_bytes[i]`` at ``dst_ptrs[i]``, on the current cupy stream.

        Returns the decoded sizes and nvCOMP's status per stream (0: success), on the host;
        the call waits for the decoding to finish (:func:`wait`, bounded). Streams that
        zstd's scratch query already refuses are not decoded: sizes 0, their status.
        """
        import cupy

        n = len(src_ptrs)
        if n == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        host = np.empty((4, n), dtype=np.uint64)
        host[0], host[1], host[2], host[3] = src_ptrs, src_bytes, dst_bytes, dst_ptrs
        meta = cupy.asarray(host)
        result = cupy.zeros((2 * n,), dtype=cupy.uint64)  # decoded sizes, then statuses (int32)
        statuses = result[n:].view(cupy.int32)[:n]
        temp_bytes = ctypes.c_size_t(0)
        stream = cupy.cuda.get_current_stream().ptr
        src, src_n, dst_n, dst = (int(meta.data.ptr) + k * 8 * n for k in range(4))
        max_out, total_out = int(dst_bytes.max()), int(dst_bytes.sum())
        if self._temp_size_sync is not None:
            status = self._temp_size_sync(
                src,
                src_n,
                n,
                max_out,
                ctypes.byref(temp_bytes),
                total_out,
                self._opts,
                statuses.data.ptr,
                stream,
            )
            if status != 0:
                raise RuntimeError(f"nvCOMP {self.algo}: temp size query failed (status {status})")
            checked = statuses.get()
            if (checked != 0).any():
                return np.zeros(n, np.int64), checked.copy()
        else:
            status = self._temp_size(n, max_out, self._opts, ctypes.byref(temp_bytes), total_out, stream)
        if status != 0:
            raise RuntimeError(f"nvCOMP {self.algo}: temp size query failed (status {status})")
        temp = cupy.empty((max(int(temp_bytes.value), 1),), dtype=cupy.uint8)
        status = self._decompress(
            src, src_n, dst_n, result.data.ptr, n, temp.data.ptr, temp_bytes.value, dst, self._opts,
            statuses.data.ptr, stream,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"nvCOMP {self.algo}: batched decode failed to launch (status {status})")
        work = getattr(_meanwhile, "work", None)
        if work is not None:
            _meanwhile.work = None
            work()
        try:
            wait(cupy.cuda.get_current_stream(), f"nvCOMP {self.algo} decode of {n} streams")
        except DecodeTimeout:
            _stuck.append((meta, result, temp))  # the GPU may still write to them: never free
            raise
        back = result.get()  # meta and temp stay alive until here
        return back[:n].astype(np.int64), back[n:].view(np.int32)[:n].copy()


_decoders: dict[str, BatchedDecoder | None] = {}
_stuck: list[Any] = []


def batched_decoder(algo: str) -> BatchedDecoder | None:
    """The C API decoder for nvCOMP algorithm ``algo`` (:data:`ALGORITHMS`), or None where
    nvCOMP's C library is not usable or not wanted (:func:`enabled`)."""
    if algo not in ALGORITHMS:
        return None
    return one_per_algorithm(_decoders, algo, BatchedDecoder)


def one_per_algorithm(cache: dict, algo: str, make: Any) -> Any:
    """``cache[algo]``, made once per process by ``make(lib, algo)``; None where nvCOMP's C
    library is not usable or not wanted (:func:`enabled`), or lacks the entry points."""
    if not enabled():
        return None
    lib = library()
    if lib is None:
        return None
    with _lib_lock:
        if algo not in cache:
            try:
                cache[algo] = make(lib, algo)
            except (AttributeError, RuntimeError):  # an nvCOMP without these entry points
                cache[algo] = None
        return cache[algo]
