"""Zarr v3's sharding as bytes: a shard's layout, the ``sharding_indexed`` codec read from
an array's metadata, and a shard's index as its file stores it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .crc32c import value as crc32c_value

#: an absent inner chunk's offset and length in a shard's index
EMPTY = np.uint64(2**64 - 1)


class Unsupported(Exception):
    """A codec chain this package does not read or write itself (zarr-python does instead)."""


@dataclass(frozen=True)
class ShardLayout:
    """Where a sharded array keeps its inner chunks."""

    shard_shape: tuple[int, ...]
    index_at_start: bool
    index_crc32c: bool

    def chunks_per_shard(self, inner: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard_shape, inner))

    def index_nbytes(self, inner: tuple[int, ...]) -> int:
        return 16 * math.prod(self.chunks_per_shard(inner)) + (4 if self.index_crc32c else 0)


def plain_codecs(codecs: tuple[Any, ...]) -> list[dict]:
    """Codecs (objects or dicts) as ``{"name", "configuration"}`` dicts."""
    out = []
    for c in codecs:
        d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
        out.append({"name": d["name"], "configuration": d.get("configuration") or {}})
    return out


def sharding(
    codecs: tuple[Any, ...], shard_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], list[dict], ShardLayout]:
    """A sharded array's inner chunk shape, inner codecs (as dicts) and :class:`ShardLayout`,
    from its codecs (a ``sharding_indexed`` codec alone); :class:`Unsupported` for codecs
    after it, sharding inside it, or an index other than little-endian bytes [and crc32c]."""
    codecs = plain_codecs(codecs)
    if len(codecs) > 1:
        raise Unsupported("codecs after sharding")
    conf = codecs[0]["configuration"]
    inner = tuple(int(i) for i in conf["chunk_shape"])
    inner_codecs = plain_codecs(conf["codecs"])
    if any(c["name"] == "sharding_indexed" for c in inner_codecs):
        raise Unsupported("nested sharding")
    index = [c["name"] for c in plain_codecs(conf["index_codecs"])]
    index_endian = plain_codecs(conf["index_codecs"])[0]["configuration"].get("endian")
    if index not in (["bytes"], ["bytes", "crc32c"]) or index_endian == "big":
        raise Unsupported(f"shard index codecs {index}")
    location = conf.get("index_location", "end")
    location = str(getattr(location, "value", location))
    return (
        inner,
        inner_codecs,
        ShardLayout(tuple(shard_shape), location == "start", index == ["bytes", "crc32c"]),
    )


def encode_index(index: np.ndarray, layout: ShardLayout) -> bytes:
    """A shard's index as its file stores it: ``index`` (``chunks_per_shard + (2,)`` uint64
    offsets and lengths, :data:`EMPTY` for absent chunks) little-endian, then its crc32c where
    the layout has one."""
    raw = np.ascontiguousarray(index, dtype="<u8").tobytes()
    if layout.index_crc32c:
        raw += crc32c_value(raw).to_bytes(4, "little")
    return raw
