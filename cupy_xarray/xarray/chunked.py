"""Dask chunks for ``engine="kvikio"``: each task reads through the engine, meta on the device.

xarray (up to at least 2026.9; pydata/xarray#11383 is open) builds dask arrays for every
lazily loaded backend array with ``meta=np.ndarray`` and lets dask call ``np.asarray`` on each
block, which fails for cupy blocks ("Implicit conversion to a NumPy array is not allowed").
:func:`install` wraps ``DaskManager.from_array`` once: arrays read by this package's engine
get a :class:`EngineChunkSource` (blocks come back as the device's own arrays) and the
device's meta (a cupy array for ``device="gpu"``); every other array goes to xarray's own
``from_array`` untouched. The same goes for xarray's ``as_shared_dtype``, which would
otherwise cast fill values of ``where`` to NumPy next to cupy blocks.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import numpy as np

from . import dask_plan
from .readahead import dask_block


def _backend_array(data: Any):
    from .backend import KvikioBackendArray
    from .cf import find_backend_array

    return find_backend_array(data, KvikioBackendArray)


def _undecoded_backend(adapter: Any, decoded: bool = False) -> Any:
    """The engine's array under xarray's wrappers when they neither decode nor select
    (implicit-to-explicit, copy-on-write, a lazy index of the whole array), else None;
    ``decoded``: also where they decode element by element (CF's scale, offset and mask), so
    that a block's key reaches the engine as it is."""
    from xarray.core import indexing

    from .backend import KvikioBackendArray

    passing = (
        indexing.ImplicitToExplicitIndexingAdapter,
        indexing.CopyOnWriteArray,
        indexing.MemoryCachedArray,
    )
    data = adapter
    for _ in range(16):
        if isinstance(data, KvikioBackendArray):
            return data if data.shape == tuple(adapter.shape) else None
        if isinstance(data, indexing.LazilyIndexedArray):
            whole = all(k == slice(None) for k in data.key.tuple)
            if type(data.key) is not indexing.BasicIndexer or not whole or data.shape != data.array.shape:
                return None
        elif type(data) not in passing and not (decoded and _elementwise(data)):
            return None
        data = getattr(data, "array", None)
    return None


def _elementwise(data: Any) -> bool:
    """Whether ``data`` is one of xarray's decoding wrappers that keep each element in place."""
    from xarray.coding import common

    return isinstance(data, common._ElementwiseFunctionArray) and data.shape == data.array.shape


def empty_meta(device: Any, ndim: int, dtype: np.dtype) -> Any:
    """A 0-size array of ``device``'s array type (what dask keeps as ``_meta``)."""
    from ..device import empty_on

    return empty_on(device, (0,) * ndim, dtype)


class EngineChunkSource:
    """What ``dask.array.from_array`` indexes: one block = one engine read, on the device.

    Parameters
    ----------
    adapter
        xarray's ``ImplicitToExplicitIndexingAdapter`` around the lazily decoded variable.
    """

    __slots__ = ("adapter", "direct", "dtype", "engine", "ndim", "shape", "token")

    def __init__(self, adapter: Any):
        self.adapter = adapter
        self.shape = tuple(adapter.shape)
        self.dtype = adapter.dtype
        self.ndim = len(self.shape)
        self.token = uuid.uuid4().hex
        self.direct = _undecoded_backend(adapter)
        self.engine = _undecoded_backend(adapter, decoded=True)  # which sees a block's key as it is

    def plans(self) -> bool:
        """Whether the engine's array would read ahead by a compute's plan (:meth:`expect`)."""
        return self.engine is not None and self.engine.plans()

    def expect(self, keys: list[tuple], token: Any) -> bool:
        """The blocks a dask compute (``token``) will ask for, in the order it runs them
        (:mod:`.dask_plan`), told to the engine's array where it sees their keys unchanged;
        whether it took them."""
        return self.engine is not None and self.engine.expect(keys, token)

    def unexpect(self, token: Any) -> None:
        """The compute ``token`` ended."""
        if self.engine is not None:
            self.engine.unexpect(token)

    def __getitem__(self, key: Any) -> Any:
        with dask_block():  # (the ``read_ahead`` setting reads ahead for dask blocks)
            if self.direct is not None and type(key) is tuple and all(type(k) is slice for k in key):
                # a block of an array xarray does not transform: its wrappers would only pass
                # the key on (tens of microseconds of a small task), so the engine is asked at once
                return self.direct.read(key)
            out = self.adapter[key]
            # xarray hands back lazy wrappers for lazy inputs; a dask block must be an array
            return out.get_duck_array() if hasattr(out, "get_duck_array") else out

    def __dask_tokenize__(self) -> tuple[str, str]:
        return ("cupy-xarray-chunk-source", self.token)

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def install() -> None:
    """Route xarray's dask chunking of engine arrays through :class:`EngineChunkSource`.

    Idempotent. Arrays that do not come from ``engine="kvikio"`` are chunked exactly as
    before.
    """
    try:
        from xarray.namedarray.daskmanager import DaskManager
    except ImportError:  # pragma: no cover - xarray without the chunk manager API
        return
    if getattr(DaskManager.from_array, "_cupy_xarray", False):
        return
    original = DaskManager.from_array

    @functools.wraps(original)
    def from_array(self, data, chunks, **kwargs):
        backend = _backend_array(data)
        if backend is None:
            return original(self, data, chunks, **kwargs)
        import dask.array as da

        if isinstance(chunks, tuple) and "auto" in chunks and any(s == 0 for s in data.shape):
            chunks = data.shape
        kwargs["meta"] = empty_meta(backend.resolved_device(), data.ndim, data.dtype)
        kwargs["asarray"] = False
        dask_plan.install(EngineChunkSource)  # (dask is imported by now)
        return da.from_array(EngineChunkSource(data), chunks, **kwargs)

    from_array._cupy_xarray = True
    DaskManager.from_array = from_array
    _install_shared_dtype()


def _is_cupy_dask(x: Any) -> bool:
    from ..device import is_cupy_array

    return hasattr(x, "__dask_graph__") and is_cupy_array(getattr(x, "_meta", None))


def _install_shared_dtype() -> None:
    """Let xarray's ``where`` (``sum(min_count=...)``, ``.where``, ``fillna``) keep cupy meta.

    xarray picks NumPy to cast the fill value when the other operand is a dask array, even
    one of cupy blocks, and the task then mixes a NumPy scalar array into ``cupy.where``
    (cupy-xarray#52). Only calls with such a dask array are changed.
    """
    from xarray.core import duck_array_ops

    original = duck_array_ops.as_shared_dtype
    if getattr(original, "_cupy_xarray", False):
        return

    @functools.wraps(original)
    def as_shared_dtype(scalars_or_arrays, xp=None):
        out = original(scalars_or_arrays, xp=xp)
        if any(_is_cupy_dask(x) for x in scalars_or_arrays):
            import cupy

            # the cast itself stays xarray's (dask's astype); only host constants move
            out = [cupy.asarray(o) if isinstance(o, np.ndarray) else o for o in out]
        return out

    as_shared_dtype._cupy_xarray = True
    duck_array_ops.as_shared_dtype = as_shared_dtype
