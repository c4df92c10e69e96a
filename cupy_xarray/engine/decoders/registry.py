"""Codec names to decoders: the one table of what the engine decodes itself.

A chunk's byte codecs (``ChunkRecipe.bytes_codecs``, in decode order) are ``"crc32c"``, one
stream kind's name (:data:`STREAMS`), or ``"blosc-<cname>"`` (:mod:`.blosc`, whose blocks are
streams of one kind, ``BLOSC_STREAMS``).
"""

from __future__ import annotations

from ...options import DECODE_CHOICES, Options
from .base import StreamDecoder
from .deflate import GZIP, ZLIB
from .lz4 import LZ4_BLOCK, LZ4_PREFIXED
from .zstd import ZSTD

STREAMS: dict[str, StreamDecoder] = {d.name: d for d in (ZSTD, GZIP, ZLIB, LZ4_PREFIXED, LZ4_BLOCK)}
#: Blosc cname (and format name) -> the kind of stream its blocks hold
BLOSC_STREAMS = {"lz4": "lz4-block", "lz4hc": "lz4-block", "zstd": "zstd"}
#: the stream size Blosc chunks are modelled at by the scheduler (their blocks' streams)
BLOCK_STREAM_BYTES = 2**16

__all__ = ["BLOCK_STREAM_BYTES", "BLOSC_STREAMS", "DECODE_CHOICES", "STREAMS"]


def stream(kind: str) -> StreamDecoder:
    """The decoder of stream kind ``kind``."""
    try:
        return STREAMS[kind]
    except KeyError:
        raise ValueError(f"no decoder for {kind!r} streams") from None


def decode_choice(value: str | None, options: Options) -> str:
    """The ``decode=`` choice: the argument, else the ``decode`` option of ``options``
    (``set_options``, ``CUPY_XARRAY_DECODE``; by default ``"auto"``)."""
    if value is None:
        return options.decode
    if value not in DECODE_CHOICES:
        raise ValueError(f"decode must be 'auto', 'gpu' or 'cpu', got {value!r} (from the decode= argument)")
    return value


def compressor(codecs: tuple[str, ...]) -> str | None:
    """The chain's compressor (the codec that is not ``crc32c``), or None."""
    return next((c for c in codecs if c != "crc32c"), None)


def stream_kind(codecs: tuple[str, ...]) -> str | None:
    """The stream kind a chain's compressor writes (for Blosc: its blocks' kind), or None."""
    name = compressor(codecs)
    if name is None or not name.startswith("blosc-"):
        return name
    return BLOSC_STREAMS[name[len("blosc-") :]]


def stream_bytes(codecs: tuple[str, ...]) -> int | None:
    """The size of the streams a chunk of the chain is made of, where it is made of many
    (Blosc: one per block, modelled at 64 KiB); None where the chunk is one stream."""
    name = compressor(codecs)
    return BLOCK_STREAM_BYTES if name is not None and name.startswith("blosc-") else None


def proven(codecs: tuple[str, ...]) -> bool:
    """True when a crc32c codec checks the stored bytes before the compressor sees them."""
    name = compressor(codecs)
    return name is not None and "crc32c" in codecs[: codecs.index(name)]


def stream_lead(codecs: tuple[str, ...]) -> int:
    """Bytes of framing before the bare stream of a chain's compressor (0 for most), so that
    staging can align the stream nvCOMP reads."""
    name = compressor(codecs)
    return STREAMS[name].lead if name in STREAMS else 0
