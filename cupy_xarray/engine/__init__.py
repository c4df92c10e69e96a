"""The read engine: Zarr chunks from local files into NumPy or cupy arrays.

Data path, one module per step::

    spec.py     zarr metadata -> ArraySpec (files, codec recipe, shard layout)
    plan.py     selection -> chunk pieces (chunk-local and output selections)
    shards.py   shard index -> inner chunk byte ranges
    io.py       byte ranges -> device buffers (os.preadv | kvikio)
    codecs.py   compressed streams -> bytes (numcodecs/zlib | nvCOMP), framing
    scatter.py  bytes -> chunk arrays -> the output
    reader.py   the orchestration: batches, overlap, errors
"""

from .reader import describe, read_arrays
from .spec import ArraySpec, array_spec

__all__ = ["ArraySpec", "array_spec", "describe", "read_arrays"]
