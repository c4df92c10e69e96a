"""Decoders: compressed chunks to bytes, one module per codec family.

Each family's module is the one place that knows its format, on both processors::

    zstd.py       zstd frames: header and block walk (host and runtime/kernels/zstd.cu), libzstd
    deflate.py    gzip members and zlib streams: framing, zlib
    lz4.py        numcodecs' LZ4 and Blosc's bare LZ4 blocks: liblz4, the GPU block walk
    blosc.py      Blosc chunks: layout check, their streams (kinds above), unshuffle
                  (runtime/kernels/blosc.cu), c-blosc

and what they share::

    base.py       StreamDecoder (checks, both decodes, cost) and Rates
    registry.py   codec names -> decoders; decode="auto" | "gpu" | "cpu"
    batch.py      a batch of one kind decoded in one call: CPU threads | nvCOMP
    chain.py      a chunk's chain of codecs over its stored bytes, for both routes

nvCOMP's binding, the GPU checksums and the CUDA kernels are :mod:`cupy_xarray.runtime`'s.
"""

from ...runtime.nvcomp import while_decoding
from .base import Box, DecodeFailure, Rates, StreamDecoder
from .chain import (
    decode_group,
    decode_on_host,
    decodes_into_boxes,
    decodes_through_scratch,
    prepare_group,
    prepares,
    writes_into_output,
)
from .registry import (
    DECODE_CHOICES,
    compressor,
    decode_choice,
    proven,
    stream,
    stream_bytes,
    stream_kind,
    stream_lead,
)

__all__ = [
    "DECODE_CHOICES",
    "Box",
    "DecodeFailure",
    "Rates",
    "StreamDecoder",
    "compressor",
    "decode_choice",
    "decode_group",
    "decode_on_host",
    "decodes_into_boxes",
    "decodes_through_scratch",
    "prepare_group",
    "prepares",
    "proven",
    "stream",
    "stream_bytes",
    "stream_kind",
    "stream_lead",
    "while_decoding",
    "writes_into_output",
]
