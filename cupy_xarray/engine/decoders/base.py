"""What every stream decoder offers the engine, and the types they share.

A *stream kind* is what one compressor writes for one chunk (a zstd frame, a gzip member, a
zlib stream, numcodecs' size-prefixed LZ4 block) or for one Blosc block (``"lz4-block"``: a
bare LZ4 block). Each kind has one :class:`StreamDecoder`, in the module of its codec family,
that holds all the engine knows of it: its framing and the host-side checks of it, the bare
stream nvCOMP decodes and the checksum nvCOMP leaves out, its CPU decode, whether
``decode="auto"`` trusts nvCOMP with it, and its cost (:class:`Rates`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class DecodeFailure(Exception):
    """Stream ``index`` of a batch could not be decoded."""

    def __init__(self, index: int, message: str):
        self.index = index
        super().__init__(message)


class FramingError(ValueError):
    """A stream is too short to hold its codec's framing."""


class Decoded(list):
    """Decoded buffers, with whatever owns their memory kept alive beside them."""

    owner: Any = None


@dataclass(frozen=True)
class Box:
    """Where a whole chunk's decoded bytes go in a C-contiguous output: ``planes`` planes of
    ``rows`` rows of ``width`` bytes, from byte ``start`` of ``out`` (its flat uint8 view),
    rows ``row_pitch`` and planes ``plane_pitch`` bytes apart
    (:func:`cupy_xarray.engine.scatter.chunk_box`)."""

    out: Any
    start: int
    width: int
    rows: int
    row_pitch: int
    planes: int
    plane_pitch: int

    def view(self) -> np.ndarray:
        """The box as a writable (planes, rows, width) view of a numpy output."""
        from numpy.lib.stride_tricks import as_strided

        return as_strided(
            self.out[self.start :],
            shape=(self.planes, self.rows, self.width),
            strides=(self.plane_pitch, self.row_pitch, 1),
        )


@dataclass(frozen=True)
class Rates:
    """How fast one stream kind decodes on this machine (decoded bytes per second).

    Attributes
    ----------
    host_thread
        One CPU thread alone: read, decode, checks and the copy to the device.
    gpu
        nvCOMP with many streams in flight.
    gpu_stream
        nvCOMP on one stream alone (nvCOMP decodes a stream with one group of threads).
    gpu_call
        Seconds one batched call costs whatever its size.
    measured
        Whether the figures were measured here (else: defaults measured on an H200 host).
    reads
        How many reads' own timings refined them since.
    host_pool
        All the pool's threads together (0: ``threads × host_thread``); less than that sum,
        since they share the interpreter, memory bandwidth and the copies to the GPU.
    """

    host_thread: float
    gpu: float
    gpu_stream: float
    gpu_call: float
    measured: bool = False
    reads: int = 0
    host_pool: float = 0.0

    def gpu_seconds(
        self, sizes: np.ndarray, stream_bytes: float | None = None, batch_bytes: float | None = None
    ) -> float:
        """Seconds for chunks of ``sizes`` decoded bytes in calls of up to ``batch_bytes``
        (default: one call); ``stream_bytes``: the largest stream (default: a chunk is one)."""
        if not len(sizes):
            return 0.0
        longest = float(sizes.max()) if stream_bytes is None else min(float(sizes.max()), stream_bytes)
        total = float(sizes.sum())
        calls = max(1, math.ceil(total / batch_bytes)) if batch_bytes else 1
        return calls * (self.gpu_call + longest / self.gpu_stream) + total / self.gpu

    def host_seconds(self, sizes: np.ndarray, threads: int) -> float:
        if not len(sizes):
            return 0.0
        # threads take chunks as they free up: at least one chunk's time on one thread
        pool = self.host_pool or threads * self.host_thread
        return max(float(sizes.sum()) / pool, float(sizes.max()) / self.host_thread)


class StreamDecoder:
    """One stream kind: framing, checks, both decodes and cost.

    Attributes
    ----------
    name
        The engine's name of the kind (``"zstd"``, ``"gzip"``, ``"zlib"``, ``"lz4"``,
        ``"lz4-block"``).
    lead, trail
        Bytes of framing before and after the bare stream nvCOMP decodes.
    min_length
        The fewest stored bytes a stream of this kind can have.
    nvcomp
        nvCOMP's algorithm for the bare stream (``Zstd``, ``Gzip``, ``Deflate``, ``LZ4``).
    checksum
        What the framing stores that nvCOMP does not check (``"xxh64"``, ``"crc32"``,
        ``"adler32"``) and :mod:`.checksums` verifies on the GPU; ``None``: nothing.
    host_only
        Why ``decode="auto"`` keeps the kind on CPU threads; ``""``: nvCOMP decodes it safely.
    rates
        Figures measured on an H200 host with 16 cores (4 MiB float32 chunks of smooth data;
        the pools' figures are full loads on CPU threads), used until this machine's are.
    sample_bytes
        The stream size calibration measures (:func:`cupy_xarray.engine.rates.calibrate`).
    nvcomp_faults
        nvCOMP's decoder of the kind may fault or hang on a damaged stream (its release notes:
        it "can only operate on valid input data"): streams no check has proven are decoded
        in the decoder process (:mod:`..sandbox`).
    calibrates_gpu
        Whether calibration measures nvCOMP's figures for the kind on bare streams. A kind
        decoded inside another format (Blosc's blocks) costs that format's launches and checks
        too, and fills the GPU with many more streams than a sample can: :attr:`rates` keeps
        its nvCOMP figures, and reads nvCOMP did alone refine them.
    """

    name: str = ""
    unit: str = "stream"  # what messages call one stream ("frame", "member", "block")
    lead: int = 0
    trail: int = 0
    min_length: int = 1
    nvcomp: str = ""
    checksum: str | None = None
    host_only: str = ""
    rates: Rates = Rates(0.5e9, 20e9, 0.05e9, 1e-3)
    sample_bytes: int = 2**20
    calibrates_gpu: bool = True
    nvcomp_faults: bool = False

    def check(self, head: bytes, tail: bytes, expected: int) -> str | None:
        """What is wrong with a stored stream, from its first 32 bytes (fewer if shorter) and
        last 4, before any decoder sees it; None when it looks right. nvCOMP can fault on
        streams that are not what they claim to be."""
        return None

    def walk(self, xp: Any, buffer: Any, offs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
        """Lengths the streams at ``offs`` of ``buffer`` have by their own structure (-1:
        malformed), for kinds whose framing says where they end; None for the others."""
        return None

    def check_on_gpu(self, ptrs: np.ndarray, lens: np.ndarray, want: np.ndarray) -> tuple[int, str] | None:
        """For bare streams on the device (addresses, stored and decoded lengths) that nvCOMP
        would decode without noticing damage: the first bad one's index and what is wrong."""
        return self.start_check_on_gpu(ptrs, lens, want)()

    def start_check_on_gpu(
        self, ptrs: np.ndarray, lens: np.ndarray, want: np.ndarray
    ) -> Callable[[], tuple[int, str] | None]:
        """:meth:`check_on_gpu` started on the current stream: call the result for its answer
        (it waits for the check)."""
        return lambda: None

    def deframe(self, data: Any) -> Any:
        """The bare stream nvCOMP decodes, as a view of ``data`` (numpy or cupy, uint8)."""
        if len(data) < self.min_length:
            raise FramingError(f"{len(data)} bytes is too short for a {self.name} stream")
        return data[self.lead : len(data) - self.trail]

    def decode_host(self, src: np.ndarray, expected: int, into: np.ndarray | None = None) -> np.ndarray:
        """Decode one stored stream (framing included) on this thread into at most
        ``expected`` bytes (into ``into`` where given), verifying the checksum it stores."""
        raise NotImplementedError

    def stored_checksums(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which streams carry a :attr:`checksum` and its stored values, from the first and last
        8 bytes of each framed stream (a ``(count, 16)`` array)."""
        return np.zeros(len(ends), dtype=bool), np.zeros(len(ends), dtype=np.uint64)

    def sample(self, data: bytes) -> bytes:
        """``data`` compressed into one stream of this kind, as zarr stores it (calibration)."""
        raise NotImplementedError


def aligned_slots(lengths: np.ndarray, align: int = 16) -> tuple[np.ndarray, int]:
    """Offsets that lay buffers of ``lengths`` bytes out back to back, each starting on an
    ``align``-byte boundary (nvCOMP's requirement), and the bytes that layout needs."""
    slots = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        slots[1:] = np.cumsum(-(-lengths[:-1] // align) * align)
    total = int(slots[-1] + lengths[-1]) if len(lengths) else 0
    return slots, total + align


def decoded_sizes(result: Any, count: int) -> list[int]:
    """Decoded byte counts of an nvCOMP ``decode(..., out=...)`` result."""
    sizes = getattr(result, "buffer_sizes", None)
    sizes = sizes() if callable(sizes) else sizes
    if sizes is None:
        sizes = [len(result[i]) for i in range(count)]
    return [int(n) for n in sizes]
