"""Point (vectorized) selections: read only the chunks the points lie in, then gather the
points on the output's device.

xarray's vectorized indexing (``ds.isel(x=DataArray(...), y=DataArray(...))``) asks for
points, not a box: reading the outer box of the indices would read up to N^k chunks for N
scattered points. Here the points are grouped by the chunk they fall in; each group is one
request of the box its points span inside that chunk (whole along sliced dimensions),
all requests of a wave go to the engine as one read, and one gather puts the points in order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import normalize_selection, output_shape
from .spec import ArraySpec


def read_points(spec: ArraySpec, key: tuple, read, limit: int = 2**30) -> Any:
    """The vectorized selection ``key`` of ``spec``: integer arrays (broadcast together) and
    slices, one per dimension. The points' dimensions come first in the result, then the
    sliced ones in order (NumPy's rule for separated advanced indices, xarray's for
    vectorized indexers). ``read(requests)``: the engine's read of outer requests, returning
    their outputs. The chunk boxes are read in waves of about ``limit`` output bytes (the
    ``point_wave_bytes`` setting); each wave's points are gathered before the next is read."""
    shape, chunks = spec.shape, spec.chunks
    key = tuple(key) + (slice(None),) * (len(shape) - len(key))
    adv = [d for d, k in enumerate(key) if not isinstance(k, slice)]
    if not adv:
        return read([(spec, key)])[0]
    arrays = dict(zip(adv, np.broadcast_arrays(*(np.asarray(key[d]) for d in adv))))
    pshape = arrays[adv[0]].shape
    for d, a in arrays.items():
        if a.size and a.dtype.kind not in "iu":
            raise IndexError(f"axis {d}: point indices must be integers, got {a.dtype}")
    # bounds checked, indices made >= 0, slices made positive-step (or index arrays)
    norm = normalize_selection(
        tuple(arrays[d].reshape(-1) if d in arrays else k for d, k in enumerate(key)), shape
    )
    flat = [norm[d] for d in adv]
    sliced = [d for d in range(len(shape)) if d not in arrays]
    lengths = output_shape(tuple(norm[d] for d in sliced), tuple(shape[d] for d in sliced))
    npoints = int(np.prod(pshape, dtype=np.int64))
    if npoints == 0 or 0 in lengths:
        out = read(
            [(spec, tuple(np.zeros(0, np.int64) if d in arrays else norm[d] for d in range(len(shape))))]
        )[0]
        return out.reshape(pshape + lengths)
    cell = np.stack([f // chunks[d] for f, d in zip(flat, adv)], axis=1)
    _, group = np.unique(cell, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")
    bounds = np.flatnonzero(np.diff(group[order])) + 1
    row = int(np.prod(lengths, dtype=np.int64)) * spec.dtype.itemsize
    result = None
    wave: list[tuple[tuple, np.ndarray, list[np.ndarray]]] = []
    wave_bytes = 0
    for ids in np.split(order, bounds):
        # the box the chunk's points span, as slices: read straight into a box of the output
        # (integer indices would scatter element by element)
        sel, where = [], []
        for f in flat:
            mine = f[ids]
            lo = int(mine.min())
            sel.append(slice(lo, int(mine.max()) + 1))
            where.append(mine - lo)
        it = iter(sel)
        request = tuple(next(it) if d in arrays else norm[d] for d in range(len(shape)))
        wave.append((request, ids, where))
        wave_bytes += int(np.prod([s.stop - s.start for s in sel])) * row
        if wave_bytes >= limit:
            result = _gather(spec, wave, read, adv, npoints, lengths, result)
            wave, wave_bytes = [], 0
    if wave:
        result = _gather(spec, wave, read, adv, npoints, lengths, result)
    return result.reshape(pshape + lengths)


def _gather(spec, wave, read, adv, npoints, lengths, result):
    """Read a wave's boxes in one engine read and put their points into ``result``."""
    outs = read([(spec, request) for request, _, _ in wave])
    xp = _xp(outs[0])
    if result is None:
        result = xp.empty((npoints,) + lengths, dtype=outs[0].dtype)
    k = len(adv)
    parts, flat_ids, dest = [], [], []
    start = 0
    for out, (_, ids, where) in zip(outs, wave):
        box = xp.moveaxis(out, adv, list(range(k)))  # the points' dimensions first
        inner = box.shape[:k]
        parts.append(box.reshape(-1, *lengths))
        flat_ids.append(start + np.ravel_multi_index(tuple(where), inner))
        dest.append(ids)
        start += int(np.prod(inner))
    boxes = xp.concatenate(parts) if len(parts) > 1 else parts[0]
    take = np.concatenate(flat_ids)
    to = np.concatenate(dest)
    result[xp.asarray(to)] = boxes[xp.asarray(take)]
    return result


def _xp(array: Any):
    if hasattr(array, "__cuda_array_interface__"):
        import cupy

        return cupy
    return np
