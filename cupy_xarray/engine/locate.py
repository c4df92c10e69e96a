"""Locate: chunk pieces -> tasks. Where each piece's stored bytes are: a chunk file (its
size checked), an inner chunk of a shard (from the shard's index), or the bytes fetched from
a remote store (whole chunks; for shards the indexes, then the inner chunks' ranges,
neighbours coalesced)."""

from __future__ import annotations

import os
import stat
from typing import Any

from ..containment import file_kind
from ..errors import ChunkError
from .io import file_ident
from .plan import ChunkPiece
from .route import lands_pinned
from .shards import EMPTY, read_shard_index, remote_shard_indexes, shard_bound, stored_bound
from .spec import ArraySpec
from .tasks import ChunkTask


def locate(
    spec: ArraySpec, pieces: list[ChunkPiece], out: int, read: Any = None
) -> tuple[list[ChunkTask], list[ChunkPiece]]:
    """Find each piece's bytes; return (tasks, the pieces whose chunks are missing). ``read``: the
    :class:`~.read.Read` they are for (fetched bytes that go to a GPU as they are land in
    pinned memory: :func:`.route.lands_pinned`)."""
    if spec.source is not None:
        return fetch(spec, pieces, out, read)
    tasks: list[ChunkTask] = []
    missing: list[ChunkPiece] = []
    if spec.shard is None:
        root = os.path.join(spec.directory, "")
        for p in pieces:
            key = spec.chunk_key(p.coords)
            path = root + key
            try:
                st = spec.stat_file(path, key)
            except FileNotFoundError:
                missing.append(p)
                continue
            except OSError as exc:
                raise ChunkError(f"cannot stat chunk: {exc}", array=spec.name, chunk=key, path=path) from exc
            check_chunk_file(spec, st, key, path, spec.recipe.nbytes if spec.recipe is not None else None)
            tasks.append(ChunkTask(out, spec, p, path, key, 0, st.st_size, ident=file_ident(st)))
        return tasks, missing
    indexes: dict[tuple[int, ...], Any] = {}
    idents: dict[tuple[int, ...], tuple[int, int]] = {}
    for p, (shard, local) in zip(pieces, places(spec, pieces)):
        if shard not in indexes:
            indexes[shard] = read_shard_index(spec, shard, idents)
        found = inner(spec, shard, local, indexes[shard])
        if found is None:
            missing.append(p)
            continue
        offset, nbytes, key = found
        tasks.append(
            ChunkTask(out, spec, p, spec.chunk_path(shard), key, offset, nbytes, ident=idents.get(shard))
        )
    return tasks, missing


def check_chunk_file(spec: ArraySpec, st: os.stat_result, key: str, path: str, decoded: int | None) -> None:
    """Before a chunk file is read: a regular file (not a directory, FIFO, device or socket),
    no larger than any codec stores a ``decoded``-byte chunk in (a store cannot make a read
    take more memory than its chunks' bound: :func:`.shards.stored_bound`; None: no bound)."""
    if stat.S_ISDIR(st.st_mode):
        raise ChunkError("chunk path is a directory, not a file", array=spec.name, chunk=key, path=path)
    if not stat.S_ISREG(st.st_mode):
        raise ChunkError(
            f"chunk path is {file_kind(st.st_mode)}, not a regular file (refused)",
            array=spec.name,
            chunk=key,
            path=path,
        )
    if decoded is not None and st.st_size > stored_bound(decoded):
        raise ChunkError(
            f"chunk file is {st.st_size} bytes, more than any codec stores a {decoded}-byte "
            "chunk in (corrupt or hostile store; nothing was read)",
            array=spec.name,
            chunk=key,
            path=path,
        )


def places(spec: ArraySpec, pieces: list[ChunkPiece]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each piece's shard, and its chunk's place in that shard (a sharded array)."""
    per_shard = spec.shard.chunks_per_shard(spec.chunks)
    found = []
    for p in pieces:
        shard = tuple(c // n for c, n in zip(p.coords, per_shard))
        found.append((shard, tuple(c % n for c, n in zip(p.coords, per_shard))))
    return found


def inner(spec: ArraySpec, shard: tuple[int, ...], local: tuple[int, ...], index: Any) -> tuple | None:
    """Where inner chunk ``local`` lies in its shard, from the shard's index: (offset, nbytes,
    the name errors give it); None where the shard or the chunk does not exist."""
    if index is None or index[local + (0,)] == EMPTY:
        return None
    offset, nbytes = (int(v) for v in index[local])
    return offset, nbytes, f"{spec.chunk_key(shard)}[inner {', '.join(map(str, local))}]"


def fetch(
    spec: ArraySpec,
    pieces: list[ChunkPiece],
    out: int,
    read: Any,
    indexes: dict | None = None,
) -> tuple[list[ChunkTask], list[ChunkPiece]]:
    """:func:`locate` for a remote store: fetch the pieces' objects (whole chunks; for sharded
    arrays the shards' indexes, then their inner chunks' ranges, neighbours coalesced).
    Returns (tasks, the pieces whose chunks do not exist). ``indexes``: shard indexes already
    fetched (filled in; default the source's own, kept while the dataset is open); ``read``:
    the :class:`~.read.Read` they are for (its settings; :func:`.route.lands_pinned`)."""
    from .remote import Request, coalesce

    source, options = spec.source, read.options
    pinned = lands_pinned(spec, read)
    tasks: list[ChunkTask] = []
    missing: list[ChunkPiece] = []
    if spec.shard is None:
        keys = [spec.chunk_key(p.coords) for p in pieces]
        most = stored_bound(spec.recipe.nbytes)
        blobs = source.fetch([Request(k, most=most) for k in keys], options, pinned=pinned)
        for p, key, blob in zip(pieces, keys, blobs):
            if blob is None:
                missing.append(p)
            else:
                tasks.append(ChunkTask(out, spec, p, source.location(key), key, 0, len(blob), blob=blob))
        return tasks, missing
    where = places(spec, pieces)
    cache = source.shard_indexes if indexes is None else indexes
    known = known_indexes(spec, [shard for shard, _ in where], cache, options)
    wanted: dict[tuple[int, ...], list[tuple[ChunkPiece, int, int, str]]] = {}
    for p, (shard, local) in zip(pieces, where):
        found = inner(spec, shard, local, known[shard])
        if found is None:
            missing.append(p)
            continue
        wanted.setdefault(shard, []).append((p, *found))
    requests, members, names = [], [], []
    bound = shard_bound(spec)
    for shard, items in wanted.items():
        ranges = [(o, o + n) for _, o, n, _ in items]
        for start, end, held in coalesce(ranges, options.coalesce_gap, options.coalesce_max):
            requests.append(Request(spec.chunk_key(shard), start, end, most=bound))
            members.append((shard, start, held))
            # an answer cut short names the first inner chunk it does not hold whole
            names.append(sorted((o + n - start, key) for _, o, n, key in (wanted[shard][i] for i in held)))
    blobs = source.fetch(requests, options, names, pinned=pinned)
    for (shard, start, held), blob, req in zip(members, blobs, requests):
        for i in held:
            p, offset, nbytes, key = wanted[shard][i]
            if blob is None:
                raise ChunkError(
                    "the shard disappeared while it was read",
                    array=spec.name,
                    chunk=key,
                    path=source.location(req.key),
                )
            location = source.location(req.key)
            tasks.append(ChunkTask(out, spec, p, location, key, offset - start, nbytes, blob=blob))
    return tasks, missing


def known_indexes(spec: ArraySpec, shards: list[tuple[int, ...]], cache: dict, options: Any) -> dict:
    """The index of each shard (None: no such shard): from ``cache`` where it is kept, the
    others fetched at once (with the read's settings ``options``) and kept there."""
    known, new = {}, []
    for sh in dict.fromkeys(shards):
        index = cache.get((id(spec), sh), _UNKNOWN)
        if index is _UNKNOWN:
            new.append(sh)
        else:
            known[sh] = index
    for sh, index in zip(new, remote_shard_indexes(spec, new, options)):
        known[sh] = index
        spec.source.remember(cache, (id(spec), sh), index, options)
    return known


_UNKNOWN = object()


def shard_indexes(remote: list[tuple[int, ArraySpec, list[ChunkPiece]]], options: Any) -> dict:
    """The indexes of every shard the remote requests touch, fetched at once before the waves
    (waves fetched side by side would otherwise each fetch the indexes they share)."""
    indexes: dict = {}
    for _, spec, pieces in remote:
        if spec.shard is not None:
            shards = [shard for shard, _ in places(spec, pieces)]
            for sh, index in known_indexes(spec, shards, spec.source.shard_indexes, options).items():
                indexes[id(spec), sh] = index
    return indexes
