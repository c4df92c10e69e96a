"""Remote waves: a large read from a remote store is fetched in waves of about the
``wave_bytes`` option (decoded bytes), several side by side, each wave decoded and placed
(:func:`.execute.execute`) while the next ones are fetched."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

from ..options import carried
from .execute import execute
from .locate import fetch, shard_indexes
from .place import take_located
from .plan import ChunkPiece
from .read import Read
from .spec import ArraySpec
from .tasks import ChunkTask

Request = tuple[int, ArraySpec, list[ChunkPiece]]


def wave_bytes(read: Read) -> int:
    """Decoded bytes per wave of a read: ``wave_bytes``; for ``decode="gpu"`` on a GPU, the
    batch size (default ``gpu_wave_bytes``: nvCOMP's rate grows with the streams per call),
    within ``wave_bytes`` and half of ``fetch_ahead_bytes`` (all options)."""
    options = read.options
    if read.decode != "gpu" or read.device.host_memory:
        return options.wave_bytes
    wanted = read.batch_bytes if read.batch_bytes is not None else options.gpu_wave_bytes
    return max(options.wave_bytes, min(wanted, options.fetch_ahead_bytes // 2))


def waves(remote: list[Request], size: int) -> list[list]:
    """Split the pieces of remote requests into waves of about ``size`` decoded bytes."""
    out: list[list] = []
    cur: list = []
    held = 0
    for i, spec, pieces in remote:
        chunk = spec.recipe.nbytes
        for p in pieces:
            if cur and held + chunk > size:
                out.append(cur)
                cur, held = [], 0
            if cur and cur[-1][0] == i:
                cur[-1][2].append(p)
            else:
                cur.append((i, spec, [p]))
            held += chunk
    if cur:
        out.append(cur)
    return out


def fetch_wave(wave: list, indexes: dict, read: Read) -> list:
    """Fetch one wave of a read: per request, (output index, spec, tasks, missing pieces)."""
    return [(i, spec, *fetch(spec, pieces, i, read, indexes)) for i, spec, pieces in wave]


def execute_waves(read: Read, remote: list[Request], size: int) -> None:
    """Fetch large remote reads in waves of ``size``, several side by side (at least the
    ``waves_ahead`` option, more where waves hold few chunks so that about
    ``remote_concurrency`` requests stay in flight, at most ``fetch_ahead_bytes`` of them),
    each wave decoded while the next ones are fetched."""
    options = read.options
    indexes = shard_indexes(remote, options)
    planned = waves(remote, size)
    per_wave = sum(len(pieces) for wave in planned for _, _, pieces in wave) / len(planned)
    depth = max(options.waves_ahead, math.ceil(options.remote_concurrency / per_wave))
    depth = max(1, min(depth, options.fetch_ahead_bytes // size, len(planned) - 1))
    it = iter(planned)
    ahead: list = []
    # one thread per wave in flight: their fetches overlap on zarr's event loop
    fetcher = ThreadPoolExecutor(depth + 1, thread_name_prefix="cupy-xarray-fetch")
    run = carried(fetch_wave)  # with this read's settings

    def more() -> None:
        wave = next(it, None)
        if wave is not None:
            ahead.append(fetcher.submit(run, wave, indexes, read))

    try:
        for _ in range(depth + 1):
            more()
        while ahead:
            fetched = ahead.pop(0).result()
            more()
            read.clock.lap("fetch wait")
            tasks: list[ChunkTask] = []
            for i, _, found, missing in fetched:
                take_located(read, i, found, missing)
                tasks.extend(found)
            read.grow_progress(tasks)
            if tasks:
                execute(read, tasks, assemble=False)
    finally:
        fetcher.shutdown(wait=False, cancel_futures=True)
