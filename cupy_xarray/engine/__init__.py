"""The read engine: Zarr chunks from local files or remote stores into NumPy or cupy arrays.

Data path, one module per stage (:mod:`.reader` runs them for a :class:`~.read.Read`)::

    spec.py      zarr metadata -> ArraySpec (files, codec recipe, shard layout)
    plan.py      selection -> chunk pieces (chunk-local and output selections)
    locate.py    pieces -> ChunkTasks: chunk files, shard indexes (shards.py), remote fetches
                 (remote.py, http.py)
    route.py     THE route decision: batches (kvikio + nvCOMP or CPU decode) | CPU threads |
                 zarr-python, and where fetched bytes land
    batches.py   batched tasks -> batches with staging slots, how many in flight
    execute.py   batches in flight: read (io.py) -> decode (decoders/) -> place, overlapped
    host.py      the CPU-thread route: read, decode, check, a chunk per job
    place.py     where each piece goes in the output, and putting it there (scatter.py: kernels)
    waves.py     large remote reads in waves
    fallback.py  arrays the engine does not decode: zarr-python's pipeline
    read.py      Read (one per read: device, options, outputs, report) and ReadReport
    tasks.py     ChunkTask, Placement, Group
    reader.py    read_arrays: the entry point
"""

from .read import Read, ReadReport, record_reads
from .reader import describe, read_arrays
from .route import Decision, Scheduler
from .spec import ArraySpec, array_spec
from .tasks import ChunkTask, Group, Placement

__all__ = [
    "ArraySpec",
    "ChunkTask",
    "Decision",
    "Group",
    "Placement",
    "Read",
    "ReadReport",
    "Scheduler",
    "array_spec",
    "describe",
    "read_arrays",
    "record_reads",
]
