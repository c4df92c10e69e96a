"""Chunk encoders: a chunk's bytes in memory -> the bytes its file holds, many chunks a call.

One interface, two implementations: :class:`CPUEncoder` (numcodecs on CPU threads: the same
bytes zarr-python writes) and :class:`GPUEncoder` (one nvCOMP call per batch of chunks in GPU
memory, the compressed bytes copied to the host once). What a chunk's codec chain asks for is a
:class:`Recipe`; :func:`recipe_of` reads it from a zarr array's metadata.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Any

import numpy as np


class Unsupported(Exception):
    """A codec chain the engine's writer does not encode (zarr-python writes it instead)."""


@dataclass(frozen=True)
class Recipe:
    """What turns a chunk's elements into its file: byte order and element order, an optional
    compressor (a zstd frame, or another numcodecs codec CPU threads run), an optional crc32c
    after it."""

    big_endian: bool = False
    order: str = "C"
    zstd_level: int | None = None  # None: no zstd
    zstd_checksum: bool = False
    crc32c: bool = False
    #: another compressor (Blosc, LZ4, gzip ...): the numcodecs codec zarr-python encodes with
    host_codec: Any = None
    #: zarr v2 hands its compressor the chunk as an array of its dtype (Blosc's typesize)
    typed: Any = None

    @property
    def compressed(self) -> bool:
        return self.zstd_level is not None or self.host_codec is not None


def _numcodecs_of(codec: Any) -> Any:
    """The numcodecs codec a zarr v3 bytes-to-bytes codec encodes with, or None."""
    for attr in ("_blosc_codec", "_gzip_codec", "_codec"):
        inner = getattr(codec, attr, None)
        if inner is not None and hasattr(inner, "encode"):
            return inner
    return None


def recipe_of(meta: Any) -> Recipe:
    """The recipe of a zarr v2 or v3 array's metadata; :class:`Unsupported` where its chain is
    not bytes -> [zstd] -> [crc32c] (v3) or [Zstd compressor], no filters (v2)."""
    import numcodecs

    if getattr(meta, "zarr_format", 3) == 2:
        if meta.filters:
            raise Unsupported("v2 filters")
        comp = meta.compressor
        stored = np.dtype(
            meta.dtype.to_native_dtype() if hasattr(meta.dtype, "to_native_dtype") else meta.dtype
        )
        big = stored.byteorder == ">"
        if comp is None:
            return Recipe(big_endian=big, order=meta.order)
        if isinstance(comp, numcodecs.Zstd):
            cfg = comp.get_config()
            return Recipe(big, meta.order, int(cfg.get("level", 0)), bool(cfg.get("checksum", False)))
        if hasattr(comp, "encode"):
            return Recipe(big, meta.order, host_codec=comp, typed=stored)
        raise Unsupported(f"compressor {comp!r}")
    import zarr

    codecs = list(meta.codecs)
    first = codecs.pop(0) if codecs else None
    if not isinstance(first, zarr.codecs.BytesCodec):
        raise Unsupported(f"first codec {first!r}")
    endian = getattr(first.endian, "value", first.endian)  # an Enum in zarr 3.1, a str in 3.4
    big = endian == "big"
    level, checksum, crc, other = None, False, False, None
    if codecs and isinstance(codecs[0], zarr.codecs.ZstdCodec):
        level, checksum = int(codecs[0].level), bool(codecs[0].checksum)
        codecs.pop(0)
    elif codecs and not isinstance(codecs[0], zarr.codecs.Crc32cCodec):
        other = _numcodecs_of(codecs[0])
        if other is None:
            raise Unsupported(f"codec {codecs[0]!r}")
        codecs.pop(0)
    if codecs and isinstance(codecs[0], zarr.codecs.Crc32cCodec):
        crc = True
        codecs.pop(0)
    if codecs:
        raise Unsupported(f"codecs {codecs!r}")
    return Recipe(big, "C", level, checksum, crc, other)


def _with_crc32c(encoded: bytes | np.ndarray) -> np.ndarray:
    """``encoded`` and the little-endian CRC-32C zarr's ``crc32c`` codec appends."""
    from ..engine.decoders import crc32c

    buf = np.frombuffer(encoded, np.uint8) if not isinstance(encoded, np.ndarray) else encoded
    out = np.empty(len(buf) + 4, np.uint8)
    out[:-4] = buf
    out[-4:] = np.frombuffer(crc32c.value(buf).to_bytes(4, "little"), np.uint8)
    return out


class CPUEncoder:
    """numcodecs on CPU threads, chunks in host memory: the bytes zarr-python writes."""

    name = "cpu"

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)

    def supports(self, recipe: Recipe, chunk_bytes: int = 0) -> bool:
        return True

    def encode(self, recipe: Recipe, raws: list[np.ndarray]) -> list[np.ndarray]:
        """Each chunk's file bytes (``raws``: 1-D uint8 arrays of its elements' bytes)."""
        import numcodecs

        codec = recipe.host_codec
        if recipe.zstd_level is not None:
            codec = numcodecs.Zstd(level=recipe.zstd_level, checksum=recipe.zstd_checksum)

        def one(raw: np.ndarray) -> np.ndarray:
            out = raw
            if codec is not None:
                typed = raw.view(recipe.typed) if recipe.typed is not None else raw
                out = numcodecs.compat.ensure_ndarray(codec.encode(typed)).view(np.uint8).reshape(-1)
            return _with_crc32c(out) if recipe.crc32c else out

        if len(raws) == 1 or self.threads == 1:
            return [one(r) for r in raws]
        with cf.ThreadPoolExecutor(min(self.threads, len(raws))) as pool:
            return list(pool.map(one, raws))


class GPUEncoder:
    """Chunks in GPU memory: zstd frames by one nvCOMP call per batch (nvCOMP has no levels
    and writes no content checksum: such chains go to :class:`CPUEncoder`), the bytes copied
    to the host in one pass, a crc32c appended there."""

    name = "gpu"
    #: the largest chunk nvCOMP's zstd compresses as one frame
    max_chunk_bytes = 16 << 20

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._codec = None

    def supports(self, recipe: Recipe, chunk_bytes: int = 0) -> bool:
        if not recipe.compressed:
            return True
        if recipe.host_codec is not None or recipe.zstd_checksum or chunk_bytes > self.max_chunk_bytes:
            return False
        return self._nvcomp() is not None

    @staticmethod
    def _nvcomp() -> Any:
        try:
            from nvidia import nvcomp
        except ImportError:
            return None
        return nvcomp

    def encode(self, recipe: Recipe, raws: list[Any]) -> list[np.ndarray]:
        import cupy

        if recipe.compressed:
            nv = self._nvcomp()
            if self._codec is None:
                self._codec = nv.Codec(algorithm="Zstd", bitstream_kind=nv.BitstreamKind.RAW)
            cupy.cuda.get_current_stream().synchronize()  # nvCOMP runs on a stream of its own
            encoded = self._codec.encode(nv.as_arrays(raws))
            cupy.cuda.Device().synchronize()
            device = [cupy.asarray(e).view(cupy.uint8).reshape(-1) for e in encoded]
        else:
            device = raws
        outs = _to_host(device)
        if recipe.crc32c:
            with cf.ThreadPoolExecutor(min(self.threads, max(len(outs), 1))) as pool:
                outs = list(pool.map(_with_crc32c, outs))
        return outs


def _to_host(arrays: list[Any]) -> list[np.ndarray]:
    """Copy 1-D uint8 GPU arrays into one page-locked host buffer (one wait for all)."""
    import cupy

    from ..engine.buffers import pinned_buffer

    sizes = np.array([a.size for a in arrays], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else sizes
    host = pinned_buffer(int(sizes.sum()) or 1)
    stream = cupy.cuda.get_current_stream()
    rt = cupy.cuda.runtime
    for a, s in zip(arrays, starts.tolist()):
        if a.size:
            rt.memcpyAsync(host.ctypes.data + s, a.data.ptr, a.size, rt.memcpyDeviceToHost, stream.ptr)
    stream.synchronize()
    return [host[s : s + n] for s, n in zip(starts.tolist(), sizes.tolist())]
