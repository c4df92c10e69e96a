"""The zarr-python route: arrays (or devices) the engine does not read itself go through
zarr-python's own codec pipeline, with the same checks of the files it will open and errors
that name the chunk."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ..containment import regular_shards
from ..device import PrototypeDevice
from ..errors import ChunkError
from .locate import check_chunk_file
from .plan import output_shape, plan_chunks
from .spec import ArraySpec


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out (host or device)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _zarr_grid(spec: ArraySpec) -> tuple[int, ...] | None:
    """The grid of files zarr-python reads (shards for sharded arrays), None if irregular."""
    grid = regular_shards(spec.zarr_array) or spec.chunks
    return grid if len(grid) == len(spec.shape) else None


def check_files(spec: ArraySpec, selection: tuple) -> None:
    """Before zarr-python reads a selection: the chunk (or shard) files it will open must be
    files (zarr-python reads a directory as a missing chunk: fill values), and for an untrusted
    store they and their directories must stay inside the root. Only the files the selection
    touches are checked, so that every dask task does not walk the whole array."""
    if not spec.directory or spec.source is not None:
        return
    c = spec.containment
    grid = _zarr_grid(spec)
    if grid is None:  # no regular grid (rectilinear chunks): check every link below the array
        if c is not None:
            c.check_tree(spec.directory, spec.name)
        return
    decoded = None  # what bounds a file's size: numbers, one chunk per file
    if spec.dtype.kind in "biufcmM" and not regular_shards(spec.zarr_array):
        decoded = math.prod(grid) * spec.dtype.itemsize
    for coords in {p.coords for p in plan_chunks(selection, spec.shape, grid)}:
        key = spec.chunk_key(coords)
        path = os.path.join(spec.directory, key)
        try:
            st = spec.stat_file(path, key)
        except FileNotFoundError:
            continue
        check_chunk_file(spec, st, key, path, decoded)


def zarr_read(spec: ArraySpec, selection: tuple, read: Any):
    """Read through zarr-python's own codec pipeline (codecs the engine does not decode), onto
    the read's device."""
    from ..device import buffer_prototype, empty_on

    device = read.device
    shape = output_shape(selection, spec.shape)
    if 0 in shape:  # zarr-python refuses empty integer selections; there is nothing to read
        return empty_on(device, shape, spec.dtype)
    sel = tuple(s.tolist() if isinstance(s, np.ndarray) else s for s in selection)
    if isinstance(device, PrototypeDevice):
        _check_prototype(device)
    try:
        if isinstance(device, PrototypeDevice):
            return spec.zarr_array.get_orthogonal_selection(sel, prototype=buffer_prototype(device))
        result = spec.zarr_array.get_orthogonal_selection(sel)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the chunk
        if is_oom(exc):
            raise
        raise _zarr_chunk_error(spec, selection, exc) from exc
    result = np.asarray(result)
    if result.dtype.kind in "biufc":
        return device.asarray(result.astype(spec.dtype, copy=False))
    if result.dtype.byteorder not in ("|", "="):  # big-endian datetimes and the like: native order out
        return result.astype(result.dtype.newbyteorder("="))
    return result


def _check_prototype(device: PrototypeDevice) -> None:
    """A GPU ``BufferPrototype`` needs cupy and a GPU: say so, rather than let zarr-python's
    failure read as a corrupt chunk."""
    if not device.gpu:
        return
    from ..device import require_gpu

    require_gpu("pass a CPU prototype (zarr.core.buffer.default_buffer_prototype()) or device='cpu'")


def _zarr_chunk_error(spec: ArraySpec, selection: tuple, exc: Exception) -> ChunkError:
    """A ChunkError for zarr-python's failure to read ``selection``: read the selection's chunk
    files one at a time to find the one that fails."""
    what = f"zarr-python cannot decode it ({type(exc).__name__}: {exc}) (corrupt chunk?)"
    grid = _zarr_grid(spec)
    if grid is not None:
        for coords in sorted({p.coords for p in plan_chunks(selection, spec.shape, grid)}):
            region = tuple(slice(c * g, min((c + 1) * g, n)) for c, g, n in zip(coords, grid, spec.shape))
            try:
                spec.zarr_array.get_orthogonal_selection(region)
            except Exception as one:  # noqa: BLE001 - this is the chunk to name
                key = spec.chunk_key(coords)
                what = f"zarr-python cannot decode it ({type(one).__name__}: {one}) (corrupt chunk?)"
                return ChunkError(what, array=spec.name, chunk=key, path=os.path.join(spec.directory, key))
    return ChunkError(what, array=spec.name, chunk="(one of the selection's chunks)", path=spec.directory)
