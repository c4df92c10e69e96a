"""The decoder process: ``python -m cupy_xarray.engine.sandbox.worker READ_FD WRITE_FD MODE``.

It answers ``("ready", pid)`` once it can decode (``MODE`` ``"nvcomp"``: CUDA and nvCOMP
loaded; ``"host"``: the CPU decoders, which is how CI runs the same machinery), then for each
``("decode", arena, kind, src_off, src_len, dst_off, dst_cap, fault)`` maps the arena, decodes
stream ``i`` (``src_len[i]`` bytes at ``src_off[i]``) into ``dst_cap[i]`` bytes at
``dst_off[i]``, and answers ``("done", sizes, statuses)`` (status 0: decoded). A failure that
may have cost its CUDA context answers ``("failed", why)`` and ends the process. ``fault``
(``"die"``, ``"stall"``) makes it fail on purpose, for tests of the watchdog.
"""

from __future__ import annotations

import os
import sys
import time

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

    from ..decoders.nvcomp import batched_decoder
    from ..decoders.registry import stream

    decoder = batched_decoder(stream(kind).nvcomp)
    if decoder is None:
        raise RuntimeError(f"nvCOMP's C API cannot decode {kind} streams here")
    base = np.uint64(mapped.base)
    with cupy.cuda.Stream(non_blocking=True):
        sizes, statuses = decoder.decode(
            base + src_off.astype(np.uint64),
            src_len.astype(np.uint64),
            base + dst_off.astype(np.uint64),
            dst_cap.astype(np.uint64),
        )
    return sizes, statuses


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    from .arena import Mapped

    rfd, wfd, mode = int(argv[0]), int(argv[1]), argv[2]
    inbox, outbox = Connection(rfd, writable=False), Connection(wfd, readable=False)
    if mode == "nvcomp":
        import cupy

        from ..decoders import nvcomp

        cupy.cuda.runtime.getDeviceCount()
        cupy.empty(1)  # the CUDA context, made now rather than at the first batch
        if nvcomp.library() is None:
            outbox.send(("failed", f"nvCOMP's C library is not usable: {nvcomp._lib_error}"))
            return
    decode = _decode_nvcomp if mode == "nvcomp" else _decode_host
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "decode":
            return
        _, spec, kind, src_off, src_len, dst_off, dst_cap, fault = msg
        if fault == "die":
            os._exit(3)
        if fault == "stall":
            time.sleep(3600)
        mapped = None
        try:
            mapped = Mapped(spec)
            sizes, statuses = decode(mapped, kind, src_off, src_len, dst_off, dst_cap)
        except Exception as exc:  # noqa: BLE001 - told to the reading process, then this one ends
            outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
            if mode == "nvcomp":
                os._exit(4)  # its CUDA context may be lost
            continue
        finally:
            if mapped is not None:
                try:
                    mapped.close()
                except Exception:  # noqa: BLE001 - a lost context cannot unmap: the process ends anyway
                    pass
        outbox.send(("done", sizes, statuses))


if __name__ == "__main__":
    main(sys.argv[1:])
