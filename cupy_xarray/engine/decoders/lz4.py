"""LZ4 blocks: numcodecs' ``LZ4`` (a 4-byte little-endian size, then one block per chunk) and
``"lz4-block"``, the bare blocks Blosc stores.

nvCOMP's LZ4 decoder does not check a block's structure (a truncated block decodes to garbage
of the right size, safely): every block's sequences are walked on the GPU
(:func:`~.checksums.lz4_check`, a warp per block) while nvCOMP decodes them, and a batch with
a damaged block fails. A block is one chunk in numcodecs' LZ4, and its walk is one warp's
sequential work, so ``decode="auto"`` leaves small reads to liblz4 on CPU threads (the cost
model's ``gpu_stream``) and gives nvCOMP large ones; Blosc's many small blocks fill the GPU.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from .base import Rates, StreamDecoder


class _LZ4(StreamDecoder):
    nvcomp = "LZ4"

    def start_check_on_gpu(
        self, ptrs: np.ndarray, lens: np.ndarray, want: np.ndarray
    ) -> Callable[[], tuple[int, str] | None]:
        import cupy

        from ...runtime.checksums import lz4_check_start

        status = lz4_check_start(ptrs, lens, want)
        launched_on = cupy.cuda.get_current_stream()

        def verdict() -> tuple[int, str] | None:
            bad = np.flatnonzero(status.get(stream=launched_on))  # waits for the walk itself
            return (int(bad[0]), f"{self.name} block is malformed or truncated") if len(bad) else None

        return verdict

    def decode_host(self, src: np.ndarray, expected: int, into: np.ndarray | None = None) -> np.ndarray:
        from numcodecs import LZ4 as NumcodecsLZ4

        buf = memoryview(np.ascontiguousarray(src)).cast("B")
        if self.lead:
            declared = int.from_bytes(bytes(buf[:4]), "little") if len(buf) >= 4 else -1
            if declared != expected:
                raise ValueError(f"lz4 size prefix says {declared} bytes, expected {expected}")
            if into is not None and len(into) == expected:
                from numcodecs import lz4

                return lz4.decompress(buf, into)  # liblz4 writes the chunk in place
            out = NumcodecsLZ4().decode(buf)
        else:
            out = NumcodecsLZ4().decode(struct.pack("<I", expected) + bytes(buf))
        result = np.frombuffer(out, dtype=np.uint8)
        if into is not None and len(result) == len(into):
            into[:] = result
            return into
        return result

    def sample(self, data: bytes) -> bytes:
        from numcodecs import LZ4 as NumcodecsLZ4

        return bytes(NumcodecsLZ4().encode(data))[4 - self.lead :]


class LZ4(_LZ4):
    name = "lz4"
    lead = 4
    min_length = 5
    # nvCOMP: 1,024 blocks of 4 MiB in 102 ms on an H200; one block's walk about as long
    rates = Rates(1.0e9, 40e9, 0.04e9, 1e-3, host_pool=7e9)

    def check(self, head: bytes, tail: bytes, expected: int) -> str | None:
        declared = int.from_bytes(head[:4], "little")
        if declared != expected:
            return f"lz4 size prefix says {declared} bytes, expected {expected}"
        return None


class LZ4Block(_LZ4):
    name = "lz4-block"
    # Blosc: its layout check, unshuffle and copies add launches and host round trips per call
    # (one 4 MiB chunk read through them took 11.7 ms; one CPU thread, 4.5 ms)
    rates = Rates(0.9e9, 25e9, 1.0e9, 1e-2, host_pool=3.2e9)
    sample_bytes = 2**16  # Blosc's block streams
    # 64 MiB of bare blocks decoded at 6.5 GB/s on an H200, whole Blosc reads at 21
    calibrates_gpu = False


LZ4_PREFIXED = LZ4()
LZ4_BLOCK = LZ4Block()
