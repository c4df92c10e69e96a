"""The read engine: Zarr chunks from local files or remote stores into NumPy or cupy arrays.

Data path, one module per step::

    spec.py     zarr metadata -> ArraySpec (files, codec recipe, shard layout)
    plan.py     selection -> chunk pieces (chunk-local and output selections)
    shards.py   shard index -> inner chunk byte ranges
    io.py       byte ranges -> device buffers (os.preadv | kvikio)
    remote.py   chunk bytes of remote stores, fetched through the zarr store (retries, checks)
    http.py     chunk bytes of HTTP(S) stores, fetched on a pool of threads
    schedule.py which chunks nvCOMP decodes and which CPU threads do: the cost model
    host.py     the CPU-thread route: read, decode, check, copy, one chunk per thread
    decoders/   compressed streams -> bytes, one module per codec family (nvCOMP | CPU)
    scatter.py  bytes -> chunk arrays -> the output
    reader.py   the orchestration: batches, routes, overlap, errors
"""

from .reader import describe, read_arrays
from .spec import ArraySpec, array_spec

__all__ = ["ArraySpec", "array_spec", "describe", "read_arrays"]
