"""The decoder process: ``python -m cupy_xarray.engine.sandbox.worker READ_FD WRITE_FD MODE``.

It answers ``("ready", pid)`` once it can decode (``MODE`` ``"nvcomp"``: CUDA and nvCOMP
loaded; ``"host"``: the CPU decoders, which is how CI runs the same machinery), then for each
``("decode", rid, arena, kind, src_off, src_len, dst_off, dst_cap, fault)`` decodes stream
``i`` of the arena (``src_len[i]`` bytes at ``src_off[i]``) into ``dst_cap[i]`` bytes at
``dst_off[i]`` and answers ``("done", rid, sizes, statuses, seconds)`` (status 0: decoded;
``seconds``: mapping the arena and decoding). Once ready, it decodes a small stream of zarr's
default compressors, so that the first batch finds nvCOMP's kernels loaded. Up to
:data:`IN_FLIGHT` batches decode at once, each on a thread and a CUDA stream of its own
(nvCOMP's speed is streams in flight). An arena is mapped at its first batch and kept until
``("forget", arena_id)``. A failure that may have cost its CUDA context answers ``("failed",
rid, why)`` and ends the process. ``fault`` (``"die"``, ``"stall"``) makes it fail on
purpose, for tests of the watchdog.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _decode_host(mapped, kind: str, src_off, src_len, dst_off, dst_cap):
    from ..decoders.registry import stream

    decoder = stream(kind)
    n = len(src_off)
    sizes, statuses = np.zeros(n, np.int64), np.zeros(n, np.int32)
    for i in range(n):
        dst = mapped.view(int(dst_off[i]), int(dst_cap[i]))
        try:
            out = decoder.decode_host(mapped.view(int(src_off[i]), int(src_len[i])), int(dst_cap[i]), dst)
        except Exception:  # noqa: BLE001 - a status, as nvCOMP's
            statuses[i] = -1
            continue
        if out.ctypes.data != dst.ctypes.data:
            dst[: len(out)] = out[: len(dst)]
        sizes[i] = len(out)
    return sizes, statuses


def _decode_nvcomp(mapped, kind: str, src_off, src_len, dst_off, dst_cap):
    import cupy

    from ...runtime.nvcomp import batched_decoder
    from ..decoders.registry import stream

    decoder = batched_decoder(stream(kind).nvcomp)
    if decoder is None:
        raise RuntimeError(f"nvCOMP's C API cannot decode {kind} streams here")
    base = np.uint64(mapped.base)
    with cupy.cuda.Device(mapped.spec["device"]), cupy.cuda.Stream(non_blocking=True):
        sizes, statuses = decoder.decode(
            base + src_off.astype(np.uint64),
            src_len.astype(np.uint64),
            base + dst_off.astype(np.uint64),
            dst_cap.astype(np.uint64),
        )
    return sizes, statuses


#: nvCOMP algorithms whose kernels a new decoder process loads before its first batch: those of
#: zarr's default compressors (zstd for zarr v3, Blosc LZ4 for v2)
WARM_ALGORITHMS = ("Zstd", "LZ4")


def _warm_nvcomp() -> None:
    """Decode one small stream of each of :data:`WARM_ALGORITHMS`, so that the first batch does
    not wait for nvCOMP's kernels to load (and cupy's pool to start) in this process. What
    fails here, the first batch meets again and reports."""
    import cupy

    from ...runtime.nvcomp import batched_decoder
    from ..decoders.registry import STREAMS

    data = np.sin(np.arange(2**14, dtype=np.float32) / 64).tobytes()  # 64 KiB, as a chunk's data
    for algo in WARM_ALGORITHMS:
        kind = next((d for d in STREAMS.values() if d.nvcomp == algo), None)
        decoder = batched_decoder(algo) if kind is not None else None
        if decoder is None:
            continue
        try:
            bare = cupy.asarray(kind.deframe(np.frombuffer(kind.sample(data), dtype=np.uint8)))
            out = cupy.empty(len(data), dtype=cupy.uint8)
            with cupy.cuda.Stream(non_blocking=True):
                decoder.decode(
                    np.array([bare.data.ptr], np.uint64),
                    np.array([bare.size], np.uint64),
                    np.array([out.data.ptr], np.uint64),
                    np.array([out.size], np.uint64),
                )
        except Exception:  # noqa: BLE001
            continue


#: batches decoded at once (measured on an H200: 1,024 zstd frames of 4 MiB, one call 85 ms;
#: two calls of 512 in flight at once 102 ms, one after another 161 ms)
IN_FLIGHT = 4


class _Arenas:
    """The arenas this process has mapped, by id, until the reading process forgets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict = {}

    def get(self, spec: dict):
        from .arena import Mapped

        with self._lock:
            mapped = self._mapped.get(spec["id"])
            if mapped is None:
                mapped = self._mapped[spec["id"]] = Mapped(spec)
            return mapped

    def forget(self, arena_id: str) -> None:
        with self._lock:
            mapped = self._mapped.pop(arena_id, None)
        if mapped is not None:
            mapped.close()


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    rfd, wfd, mode = int(argv[0]), int(argv[1]), argv[2]
    inbox, outbox = Connection(rfd, writable=False), Connection(wfd, readable=False)
    if mode == "nvcomp":
        import cupy

        from ...runtime import nvcomp

        cupy.cuda.runtime.getDeviceCount()
        cupy.empty(1)  # the CUDA context, made now rather than at the first batch
        if nvcomp.library() is None:
            outbox.send(("failed", None, f"nvCOMP's C library is not usable: {nvcomp._lib_error}"))
            return
    decode = _decode_nvcomp if mode == "nvcomp" else _decode_host
    arenas = _Arenas()
    sending = threading.Lock()

    def answer(msg: tuple) -> None:
        with sending:
            outbox.send(msg)

    def run(rid, spec, kind, src_off, src_len, dst_off, dst_cap) -> None:
        try:
            t0 = time.perf_counter()
            mapped = arenas.get(spec)
            t1 = time.perf_counter()
            sizes, statuses = decode(mapped, kind, src_off, src_len, dst_off, dst_cap)
            seconds = {"map": t1 - t0, "decode": time.perf_counter() - t1}
        except Exception as exc:  # noqa: BLE001 - told to the reading process, then this one ends
            answer(("failed", rid, f"{type(exc).__name__}: {exc}"))
            if mode == "nvcomp":
                os._exit(4)  # its CUDA context may be lost
            return
        answer(("done", rid, sizes, statuses, seconds))

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        outbox.send(("ready", os.getpid()))
        if mode == "nvcomp":
            pool.submit(_warm_nvcomp)
        while True:
            try:
                msg = inbox.recv()
            except (EOFError, OSError):
                os._exit(0)  # the reading process is gone: decodes in flight are not wanted
            if msg[0] == "forget":
                arenas.forget(msg[1])
                continue
            if msg[0] != "decode":
                os._exit(0)
            _, rid, spec, kind, src_off, src_len, dst_off, dst_cap, fault = msg
            if fault == "die":
                os._exit(3)
            if fault == "stall":
                time.sleep(3600)
            pool.submit(run, rid, spec, kind, src_off, src_len, dst_off, dst_cap)


if __name__ == "__main__":
    main(sys.argv[1:])
