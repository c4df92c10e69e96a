"""A batch of streams of one kind, decoded on either processor in one call.

:class:`CPUCodecs` decodes on CPU threads (each kind's :meth:`~.base.StreamDecoder.decode_host`:
zlib, libzstd, liblz4); :class:`GPUCodecs` in one call of nvCOMP's batched C API
(:mod:`.nvcomp`) on the bare streams (``bitstream_kind=RAW``, :meth:`~.base.StreamDecoder.deframe`),
each stream's status and size checked, then the checksums the framing stores verified on the
GPU (:mod:`.checksums`). Streams come with their framing and are decoded into at most the
chunk's size. ``Device.codecs`` is one of the two.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ...options import Options
from ...runtime.buffers import pinned_buffer
from ...runtime.notes import note
from .base import Decoded, DecodeFailure, FramingError, aligned_slots, decoded_sizes
from .registry import stream

log = logging.getLogger("cupy_xarray")


def _size_failure(algo: str, i: int, got: int, expected: int) -> DecodeFailure:
    return DecodeFailure(i, f"{algo} stream decoded to {got} bytes, expected {expected}")


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


def _in_decoder_process(
    isolation: Any,
    algo: str,
    srcs: list[Any],
    expected: list[int],
    into,
    on_device: bool,
    seconds: float,
    options: Options,
):
    """Decode in the decoder process (``isolation``: its ``decode_batch`` and ``DecoderLost``,
    :mod:`..sandbox`); None where it was lost (logged: the caller decodes the batch again on
    CPU threads, which name a damaged stream)."""
    try:
        outs, owner = isolation.decode_batch(algo, srcs, expected, into, on_device, seconds, options=options)
    except isolation.DecoderLost as exc:
        log.warning("%s; decoding its batch of %d %s streams again on CPU threads", exc, len(srcs), algo)
        note(f"{exc}; its batch of {len(srcs)} {algo} streams was decoded again on CPU threads")
        return None
    decoded = Decoded(outs)
    decoded.owner = owner
    return decoded


class CPUCodecs:
    """Decode on CPU threads, each stream with its kind's
    :meth:`~.base.StreamDecoder.decode_host` (zlib, libzstd, liblz4), which verifies the
    checksums the stream carries. ``isolation``: the decoder process (:mod:`..sandbox`) that
    streams a route isolates go to first (None: decoded here).
    """

    name = "cpu"

    def __init__(self, isolation: Any = None) -> None:
        self.threads = 4
        self.isolation = isolation

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
        on_gpu: bool = False,
        isolated: bool = False,
        options: Options | None = None,
    ) -> Decoded:
        """Decode every stream; ``into`` optionally gives, per stream, the buffer of exactly
        ``expected[i]`` bytes to decode into (``None``: a new buffer). Raises DecodeFailure
        naming the first stream that does not decode to exactly its expected size.
        (``on_gpu``: see :meth:`GPUCodecs.decode`; on the CPU all is decoded on CPU threads,
        ``isolated``: in the decoder process first, the machinery GPU reads use, with the
        read's settings ``options``, which an isolated batch needs.)"""

        decoder = stream(algo)
        if isolated and self.isolation is not None:
            seconds = sum(expected) / decoder.rates.host_thread + 0.01
            decoded = _in_decoder_process(self.isolation, algo, srcs, expected, into, False, seconds, options)
            if decoded is not None:
                return decoded

        def one(i: int) -> np.ndarray:
            target = None if into is None else into[i]
            try:
                out = decoder.decode_host(srcs[i], expected[i], target)
            except Exception as exc:  # noqa: BLE001 - re-raised with the index
                raise DecodeFailure(i, f"{algo} decode failed: {exc}") from exc
            if len(out) != expected[i]:
                raise _size_failure(algo, i, len(out), expected[i])
            return out

        if len(srcs) == 1:
            return Decoded([one(0)])
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            return Decoded(pool.map(one, range(len(srcs))))


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
    """Decode on the GPU: one batched nvCOMP call per codec (``bitstream_kind=RAW``).

    Streams come with their framing, as for :class:`CPUCodecs`. nvCOMP's C API decodes the
    bare streams into buffers of the expected size and reports a status and size per
    stream; the checksums the framing stores are then verified on the GPU
    (:mod:`.checksums`). ``isolation``: the decoder process (:mod:`..sandbox`) that streams a
    route isolates go to (None: decoded here).
    """

    name = "nvcomp"

    def __init__(self, isolation: Any = None) -> None:
        self.isolation = isolation
        self._local = threading.local()  # nvCOMP codecs must not be shared across threads
        try:
            from nvidia import nvcomp
        except ImportError:
            nvcomp = None
            log.warning(
                "nvidia-nvcomp is not installed: compressed chunks are decoded on the CPU "
                "(install nvidia-nvcomp-cu13, or -cu12, or this package's '.[cuda13]' extra, "
                "for GPU decoding)"
            )
        self._nvcomp = nvcomp

    @property
    def available(self) -> bool:
        return self._nvcomp is not None

    def batched(self, algo: str):
        """nvCOMP's C API decoder for the bare streams of ``algo`` (:mod:`.nvcomp`), or
        None where only the Python API can be used (``CUPY_XARRAY_NVCOMP_C=0`` forces that)."""
        if self._nvcomp is None:
            return None
        from ...runtime.nvcomp import batched_decoder

        return batched_decoder(stream(algo).nvcomp)

    def _codec(self, algo: str):
        """This thread's codec for ``algo``. nvCOMP runs it on a stream of its own: handing
        it our stream (``cuda_stream=``) crashed the process under concurrent reads."""
        cache = self._local.__dict__.setdefault("codecs", {})
        if algo not in cache:
            nv = self._nvcomp
            cache[algo] = nv.Codec(algorithm=stream(algo).nvcomp, bitstream_kind=nv.BitstreamKind.RAW)
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

    def _decode_on_host(
        self, algo: str, srcs: list[Any], expected: list[int], into, options: Options
    ) -> Decoded:
        """CPU threads (the ``decode_threads`` option of ``options``) decode (and check) the
        streams into pinned memory; one copy each to the device."""

        sizes = np.asarray(expected, dtype=np.int64)
        slots, total = aligned_slots(sizes)
        pinned = pinned_buffer(total)
        views = [pinned[p : p + n] for p, n in zip(slots.tolist(), sizes.tolist())]
        threads = options.host_decode_threads()
        CPUCodecs.with_threads(threads).decode(algo, host_copies(srcs), expected, views)
        outs, scratch = self._outputs(expected, into, 16)
        to_device(pinned, slots, sizes, outs)
        decoded = Decoded(outs)
        decoded.owner = scratch
        return decoded

    def _decode_c(self, batched: Any, algo: str, raw: list[Any], expected: list[int], into) -> Decoded:
        """One call of nvCOMP's C API; every stream's status and size checked, and the
        structure of streams nvCOMP does not check (LZ4 blocks) walked on a second CUDA stream
        during the call: nvCOMP decodes such a stream safely, damaged or not (only its zstd,
        deflate and gzip decoders need valid input), and a damaged one fails the batch."""
        import cupy

        from ...runtime.buffers import check_stream
        from ...runtime.nvcomp import status_text

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
        staged = cupy.cuda.Event()
        staged.record()
        checks = check_stream(cupy)
        checks.wait_event(staged)
        with checks:
            verdict = stream(algo).start_check_on_gpu(ptrs, lens, want.astype(np.int64))
        outs, scratch = self._outputs(expected, into, batched.output_alignment)
        dst = np.array([o.data.ptr for o in outs], dtype=np.uint64)
        try:
            sizes, status = batched.decode(ptrs, lens, dst, want)
        finally:
            problem = verdict()  # (the walk reads the streams: done before they are let go)
        if problem is not None:
            raise DecodeFailure(*problem)
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
        try:
            if into is not None and any(o is not None for o in into):
                return self._decode_into(algo, raw, expected, into)
            result = self._decode(algo, raw)
        except DecodeFailure:
            raise
        except Exception as batch_exc:  # noqa: BLE001 - find which stream failed
            for i, s in enumerate(raw):
                try:
                    (one,) = self._decode(algo, [s])
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
        on_gpu: bool = True,
        isolated: bool = False,
        options: Options | None = None,
    ) -> Decoded:
        """Decode every stream in one batched call (see :meth:`CPUCodecs.decode`): with nvCOMP,
        or with ``on_gpu=False`` on CPU threads (the group's route: ``Route.nvcomp``), then
        copied to the device. ``isolated`` (``Route.isolated``): nvCOMP runs in the decoder
        process (this object's ``isolation``); where that process is lost (a
        damaged stream made it fault or hang), the batch is decoded again on CPU threads.
        ``options``: the read's settings (the decoder process's limits, the CPU threads'
        count), which an isolated batch or one decoded on CPU threads needs."""
        if not on_gpu:
            return self._decode_on_host(algo, srcs, expected, into, options)
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
                raw.append(stream(algo).deframe(s))
            except FramingError as exc:
                raise DecodeFailure(i, str(exc)) from exc
        batched = self.batched(algo)
        decoded = None
        if isolated and batched is not None and self.isolation is not None:
            lens = np.array([r.size for r in raw], dtype=np.int64)
            ptrs = np.array([r.data.ptr for r in raw], dtype=np.uint64)
            problem = stream(algo).check_on_gpu(ptrs, lens.astype(np.uint64), np.asarray(expected, np.int64))
            if problem is not None:
                raise DecodeFailure(*problem)
            r = stream(algo).rates
            seconds = r.gpu_call + sum(expected) / r.gpu + max(expected, default=0) / r.gpu_stream
            decoded = _in_decoder_process(self.isolation, algo, raw, expected, into, True, seconds, options)
            if decoded is None:
                return self._decode_on_host(algo, srcs, expected, into, options)
        elif batched is not None:
            decoded = self._decode_c(batched, algo, raw, expected, into)
        else:
            decoded = self._decode_python(algo, raw, expected, into)
        from ...runtime.checksums import CHECKSUM_NAMES, verify

        decoder = stream(algo)
        bad = verify(decoder, srcs, decoded)
        if bad is not None:
            what = CHECKSUM_NAMES[decoder.checksum]
            raise DecodeFailure(bad, f"{algo} {what} does not match the decoded bytes")
        return decoded
