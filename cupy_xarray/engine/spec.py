"""What the engine needs to know about one Zarr array, read from zarr-python's metadata.

:func:`array_spec` turns a ``zarr.Array`` into an :class:`ArraySpec`: the files its chunks
live in (for a store that is not a local directory, the source they are fetched from), and
a :class:`ChunkRecipe` that says how the bytes of one chunk become an array (byte codecs in
decode order, byte order, memory order, transpose). Arrays whose codecs the engine does not
decode itself get ``fallback`` set to the reason, and are read through zarr-python's own
codec pipeline instead.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..containment import Containment, check_array
from ..formats.sharding import ShardLayout, Unsupported, plain_codecs, sharding
from .remote import RemoteSource

# zarr v3 codec names and numcodecs ids -> the engine's own names
_BYTES_CODECS = {
    "zstd": "zstd",
    "numcodecs.zstd": "zstd",
    "gzip": "gzip",
    "numcodecs.gzip": "gzip",
    "zlib": "zlib",
    "numcodecs.zlib": "zlib",
    "lz4": "lz4",
    "numcodecs.lz4": "lz4",
    "crc32c": "crc32c",
    "blosc-lz4": "blosc-lz4",
    "blosc-lz4hc": "blosc-lz4hc",
    "blosc-zstd": "blosc-zstd",
}
#: compressors the engine decodes itself (on the GPU with nvCOMP)
COMPRESSORS = frozenset({"zstd", "gzip", "zlib", "lz4", "blosc-lz4", "blosc-lz4hc", "blosc-zstd"})
_ENGINE_KINDS = frozenset("biufc")


_keys: dict[tuple, int] = {}
_keys_lock = threading.Lock()


@dataclass(frozen=True)
class ChunkRecipe:
    """How the stored bytes of one chunk become an array of ``shape``.

    Attributes
    ----------
    shape
        The chunk's shape (the inner chunk's, for sharded arrays).
    dtype
        The output dtype, native byte order.
    byteorder
        ``"<"``, ``">"`` or ``"|"``: byte order of the stored elements.
    order
        ``"C"`` or ``"F"`` (zarr v2's memory order).
    transpose
        The v3 ``transpose`` codec's order, or None.
    bytes_codecs
        Byte-to-byte codecs in *decode* order, e.g. ``("crc32c", "zstd")``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    byteorder: str = "|"
    order: str = "C"
    transpose: tuple[int, ...] | None = None
    bytes_codecs: tuple[str, ...] = ()

    @functools.cached_property
    def key(self) -> int:
        """The same number for equal recipes: chunks of several arrays stored alike (the
        variables of a dataset) are routed together and decoded in one call."""
        fields = (self.shape, self.dtype.str, self.byteorder, self.order, self.transpose, self.bytes_codecs)
        with _keys_lock:
            return _keys.setdefault(fields, len(_keys))

    @functools.cached_property  # read per chunk: worked out once
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def needs_swap(self) -> bool:
        native = "<" if np.little_endian else ">"
        return self.byteorder not in ("|", "=", native) and self.dtype.itemsize > 1

    @functools.cached_property
    def is_raw(self) -> bool:
        """True when the stored bytes are the C-order array itself."""
        return (
            not self.bytes_codecs
            and not self.needs_swap
            and self.transpose is None
            and (self.order == "C" or len(self.shape) <= 1)
        )


@dataclass(frozen=True)
class ArraySpec:
    """One Zarr array as the engine sees it."""

    name: str
    directory: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fill_value: Any
    chunks: tuple[int, ...]
    recipe: ChunkRecipe | None
    shard: ShardLayout | None
    zarr_array: Any
    fallback: str | None = None
    containment: Containment | None = None
    source: RemoteSource | None = None  # a store that is not a local directory
    #: directories of this array already shown to stay inside the store root (kept while the
    #: array is open: a dask task or a small selection would otherwise walk them every read)
    checked_dirs: set[str] = field(default_factory=set, compare=False, repr=False)

    def chunk_key(self, file_coords: tuple[int, ...]) -> str:
        form = self._key_form
        if form is None:
            return self.zarr_array.metadata.encode_chunk_key(file_coords)
        prefix, sep = form
        return prefix + sep.join(map(str, file_coords))

    @functools.cached_property
    def _key_form(self) -> tuple[str, str] | None:
        """``(prefix, separator)`` of the array's chunk keys, where joining the coordinates
        gives zarr's own keys for two probes (zarr's call costs microseconds per chunk);
        None for any other encoding (zarr's call then)."""
        encode = self.zarr_array.metadata.encode_chunk_key
        ndim = len(self.shape)
        if ndim == 0:
            return None
        probes = [(0,) * ndim, tuple(range(3, 3 + ndim))]
        for sep in ("/", "."):
            for prefix in ("c" + sep, ""):
                if all(prefix + sep.join(map(str, p)) == encode(p) for p in probes):
                    return prefix, sep
        return None

    def chunk_path(self, file_coords: tuple[int, ...]) -> str:
        return os.path.join(self.directory, self.chunk_key(file_coords))

    def stat_file(self, path: str, key: str) -> os.stat_result:
        """``os.stat`` of a chunk or shard file; for an untrusted store, after checking that it
        and its directories stay inside the root (each directory once while the array is
        open: :attr:`checked_dirs`; the file itself on every read). Raises FileNotFoundError
        for a missing file."""
        if self.containment is None:
            return os.stat(path)
        return self.containment.stat_chunk(path, key, self.checked_dirs, self.directory)


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder not in ("|", "=") else dtype


def _blosc_name(conf: dict) -> str:
    """``blosc-<cname>`` for Blosc with a compressor nvCOMP decodes, else Unsupported."""
    from ..formats.blosc import CNAMES

    cname = str(conf.get("cname", "lz4"))
    if cname not in CNAMES:
        raise Unsupported(f"blosc with {cname} is decoded by zarr-python on the CPU")
    return f"blosc-{cname}"


def _bytes_codecs_decode_order(names: list[str]) -> tuple[str, ...]:
    mapped = []
    for name in names:
        if name not in _BYTES_CODECS:
            raise Unsupported(f"codec {name!r} is decoded by zarr-python on the CPU")
        mapped.append(_BYTES_CODECS[name])
    if sum(m in COMPRESSORS for m in mapped) > 1:
        raise Unsupported("more than one compressor in the chain")
    return tuple(reversed(mapped))


def _recipe_v3(codecs: list[dict], shape: tuple[int, ...], dtype: np.dtype) -> ChunkRecipe:
    transpose = None
    byteorder = "|"
    rest: list[str] = []
    stage = "array"
    for codec in codecs:
        name, conf = codec["name"], codec.get("configuration") or {}
        if stage == "array" and name == "transpose":
            if transpose is not None:
                raise Unsupported("more than one transpose codec")
            transpose = tuple(int(i) for i in conf["order"])
        elif stage == "array" and name == "bytes":
            endian = conf.get("endian")
            byteorder = {"little": "<", "big": ">", None: "|"}[endian]
            stage = "bytes"
        elif stage == "bytes":
            rest.append(_blosc_name(conf) if name in ("blosc", "numcodecs.blosc") else name)
        else:
            raise Unsupported(f"codec {name!r} is decoded by zarr-python on the CPU")
    if stage != "bytes":
        raise Unsupported("no 'bytes' codec")
    if dtype.itemsize == 1:
        byteorder = "|"
    return ChunkRecipe(shape, _native(dtype), byteorder, "C", transpose, _bytes_codecs_decode_order(rest))


def _spec_v3(array: Any, dtype: np.dtype):
    codecs = plain_codecs(array.metadata.codecs)
    if codecs and codecs[0]["name"] == "sharding_indexed":
        shard_shape = tuple(int(i) for i in array.shards)
        inner, inner_codecs, layout = sharding(array.metadata.codecs, shard_shape)
        return inner, _recipe_v3(inner_codecs, inner, dtype), layout
    chunks = tuple(int(i) for i in array.chunks)
    return chunks, _recipe_v3(codecs, chunks, dtype), None


def _spec_v2(array: Any, dtype: np.dtype):
    meta = array.metadata
    if meta.filters:
        raise Unsupported("v2 filters are decoded by zarr-python on the CPU")
    names = []
    if meta.compressor is not None:
        conf = meta.compressor.get_config()
        names.append(_blosc_name(conf) if conf["id"] == "blosc" else conf["id"])
    chunks = tuple(int(i) for i in meta.chunks)
    byteorder = dtype.byteorder if dtype.itemsize > 1 else "|"
    if byteorder == "=":
        byteorder = "<" if np.little_endian else ">"
    recipe = ChunkRecipe(
        chunks, _native(dtype), byteorder, meta.order, None, _bytes_codecs_decode_order(names)
    )
    return chunks, recipe, None


def store_root(array: Any) -> str | None:
    """The local directory behind a zarr array's store, or None for other stores."""
    store = array.store
    root = getattr(store, "root", None)
    if root is None or type(store).__name__ != "LocalStore":
        return None
    return str(root)


def _fetches(store: Any) -> bool:
    """True for a zarr store the engine fetches chunk bytes from itself (any store with zarr's
    async ``get``: fsspec's, obstore's, in-memory ones)."""
    from zarr.abc.store import Store

    return isinstance(store, Store)


def array_spec(array: Any, name: str | None = None, containment: Containment | None = None) -> ArraySpec:
    """Describe a ``zarr.Array`` for the engine.

    Parameters
    ----------
    array
        An open ``zarr.Array``.
    name
        Name used in messages; default the array's path in its store.
    containment
        The store root reads must stay inside (untrusted stores); None trusts the store.

    Raises
    ------
    UnsafeStoreError
        For keys that leave the root or sizes no genuine array has.
    """
    name = name or array.path or "/"
    check_array(array, name, containment)
    dtype = np.dtype(array.dtype)
    shape = tuple(int(s) for s in array.shape)
    fill = array.fill_value
    if fill is None:
        fill = 0 if dtype.kind in "biufc" else None
    root = store_root(array)
    directory = os.path.join(root, array.path) if root is not None else ""
    source = None
    if root is None and _fetches(array.store):
        source = RemoteSource(array.store, array.path, name)
        directory = source.location("").rstrip("/")
    fallback = None
    recipe = shard = None
    try:
        chunks = tuple(int(c) for c in array.chunks)
    except NotImplementedError:  # rectilinear chunk grids (zarr >= 3.2)
        chunks = ()
        fallback = "rectilinear chunk grid"
    if fallback:
        pass
    elif root is None and source is None:
        fallback = f"store {type(array.store).__name__} is not a local directory"
    elif dtype.kind not in _ENGINE_KINDS:
        fallback = f"dtype {dtype} is read by zarr-python"
    else:
        try:
            if array.metadata.zarr_format == 3:
                chunks, recipe, shard = _spec_v3(array, dtype)
            else:
                chunks, recipe, shard = _spec_v2(array, dtype)
        except Unsupported as exc:
            fallback = str(exc)
        except NotImplementedError:  # shards of a rectilinear chunk grid (zarr >= 3.2)
            fallback = "rectilinear chunk grid"
    out_dtype = _native(dtype) if dtype.kind in "biufcMmU" else dtype  # outputs are in native order
    if fill is not None and dtype.kind in _ENGINE_KINDS:
        fill = np.asarray(fill).astype(out_dtype)[()]
    return ArraySpec(
        name, directory, shape, out_dtype, fill, chunks, recipe, shard, array, fallback, containment, source
    )
