"""Zarr v3 sharding: read a shard's index and find its inner chunks' byte ranges (and encode
an index, for the writer).

Shard indexes are small, so they are always read on the host with ``os.pread`` and
checked there (crc32c), whatever the output device.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import ChunkError
from ..formats.crc32c import value as crc32c_value
from ..formats.sharding import EMPTY
from .io import file_ident, open_chunk
from .spec import ArraySpec


def read_shard_index(
    spec: ArraySpec, shard_coords: tuple[int, ...], idents: dict | None = None
) -> np.ndarray | None:
    """The index of one shard: an array of shape ``chunks_per_shard + (2,)`` of uint64.

    Returns None when the shard file does not exist (all its chunks read as fill value).
    ``idents``: where to keep the shard file's identity (:func:`.io.file_ident`), by shard,
    so that its inner chunks are read from the file this index came from.
    """
    layout = spec.shard
    assert layout is not None
    path = spec.chunk_path(shard_coords)
    key = spec.chunk_key(shard_coords)
    nbytes = layout.index_nbytes(spec.chunks)
    if spec.containment is not None:
        try:
            spec.stat_file(path, key)
        except FileNotFoundError:
            return None
    try:
        fd, st = open_chunk(path, spec.containment, spec.name, key)
    except FileNotFoundError:
        return None
    size = st.st_size
    if idents is not None:
        idents[shard_coords] = file_ident(st)
    try:
        if size < nbytes:
            raise ChunkError(
                f"shard is {size} bytes, shorter than its {nbytes}-byte index (truncated?)",
                array=spec.name,
                chunk=key,
                path=path,
            )
        offset = 0 if layout.index_at_start else size - nbytes
        raw = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    return parse_index(spec, raw, size, key, path)


def remote_shard_indexes(
    spec: ArraySpec, shards: list[tuple[int, ...]], options: Any
) -> list[np.ndarray | None]:
    """The indexes of shards in a remote store (None where the shard does not exist), all
    fetched at once: one range request per shard (the first or last bytes), no size query.
    Index entries that point past the shard's end are caught when their bytes are fetched."""
    from .remote import Request

    source = spec.source
    assert source is not None and spec.shard is not None
    nbytes = spec.shard.index_nbytes(spec.chunks)
    keys = [spec.chunk_key(c) for c in shards]
    where = -nbytes, None
    if spec.shard.index_at_start:
        where = 0, nbytes
    raws = source.fetch([Request(k, *where, most=shard_bound(spec)) for k in keys], options)
    return [
        None if raw is None else parse_index(spec, raw, None, key, source.location(key))
        for key, raw in zip(keys, raws)
    ]


def stored_bound(decoded: int) -> int:
    """The most bytes any codec the engine decodes stores a ``decoded``-byte chunk in (zstd,
    LZ4, deflate and Blosc all expand incompressible data by well under 1/16, plus headers)."""
    return decoded + decoded // 16 + 65536


def shard_bound(spec: ArraySpec) -> int:
    """The most bytes a shard of ``spec`` can hold: every inner chunk at its stored bound, and
    the index (a server that ignores Range answers with the whole shard, read up to this)."""
    layout = spec.shard
    assert layout is not None
    per_shard = int(np.prod(layout.chunks_per_shard(spec.chunks)))
    return per_shard * stored_bound(spec.recipe.nbytes) + layout.index_nbytes(spec.chunks)


def parse_index(spec: ArraySpec, raw: bytes, size: int | None, key: str, path: str) -> np.ndarray:
    """Check a shard's index bytes (length, crc32c, ranges inside the ``size``-byte shard when
    the size is known) and return it as an array of shape ``chunks_per_shard + (2,)`` of uint64."""
    layout = spec.shard
    assert layout is not None
    per_shard = layout.chunks_per_shard(spec.chunks)
    nbytes = layout.index_nbytes(spec.chunks)
    raw = bytes(raw)
    if size is not None and size < nbytes:
        raise ChunkError(
            f"shard is {size} bytes, shorter than its {nbytes}-byte index (truncated?)",
            array=spec.name,
            chunk=key,
            path=path,
        )
    if len(raw) != nbytes:
        raise ChunkError("short read of shard index", array=spec.name, chunk=key, path=path)
    if layout.index_crc32c:
        body, stored = raw[:-4], int.from_bytes(raw[-4:], "little")
        if crc32c_value(body) != stored:
            raise ChunkError(
                "shard index crc32c mismatch (corrupt shard)", array=spec.name, chunk=key, path=path
            )
        raw = body
    index = np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(per_shard + (2,))
    offsets, lengths = index[..., 0], index[..., 1]
    half = (offsets == EMPTY) != (lengths == EMPTY)
    if half.any():  # the spec marks an empty inner chunk with both fields: one alone is damage
        inner = tuple(int(i) for i in np.argwhere(half)[0])
        raise ChunkError(
            f"shard index entry of inner chunk {inner} is half empty (only its "
            f"{'offset' if offsets[inner] == EMPTY else 'length'} is 2**64-1: corrupt shard)",
            array=spec.name,
            chunk=key,
            path=path,
        )
    present = offsets != EMPTY
    starts, counts = offsets[present], lengths[present]
    # every inner chunk bounded by what it can hold, as a chunk file is (before any is read: a
    # shard file may be sparse and huge)
    most = np.uint64(stored_bound(spec.recipe.nbytes))
    if counts.size and (counts > most).any():
        inner = tuple(int(i) for i in np.argwhere(present & (lengths > most))[0])
        raise ChunkError(
            f"shard index gives inner chunk {inner} {int(lengths[inner])} bytes, more than any codec "
            f"stores a {spec.recipe.nbytes}-byte chunk in (corrupt shard)",
            array=spec.name,
            chunk=key,
            path=path,
        )
    if size is None:  # a remote shard: its size is not known
        return index
    # room after each start, so that offset + length (which can wrap around 64 bits) is never formed
    room = np.uint64(size) - np.minimum(starts, np.uint64(size))
    if starts.size and ((starts > np.uint64(size)).any() or (counts > room).any()):
        raise ChunkError(
            f"shard index points past the end of the {size}-byte shard file (corrupt shard)",
            array=spec.name,
            chunk=key,
            path=path,
        )
    return index
