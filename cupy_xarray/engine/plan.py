"""Selection -> chunks: which chunks a read touches, and where each piece goes.

Pure Python and NumPy; no I/O. A selection is orthogonal (outer) indexing: one entry per
dimension, each an ``int``, a ``slice`` or a 1-D integer array.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

Index = int | slice | np.ndarray


@dataclass(slots=True)
class ChunkPiece:
    """One chunk's contribution to the output.

    Attributes
    ----------
    coords
        The chunk's coordinates in the chunk grid.
    chunk_sel
        Per dimension of the chunk: int, slice or int array (chunk-local).
    out_sel
        Per output dimension (int-selected dimensions dropped): slice or int array.
    """

    coords: tuple[int, ...]
    chunk_sel: tuple[Index, ...]
    out_sel: tuple[slice | np.ndarray, ...]


def normalize_selection(selection, shape: tuple[int, ...]) -> tuple[Index, ...]:
    """Expand a selection to one entry per dimension, with bounds checked.

    Slices get non-negative ``start``/``stop`` and a positive step (negative steps become
    integer arrays), integers are made non-negative, arrays become int64.
    """
    if not isinstance(selection, tuple):
        selection = (selection,)
    if any(s is Ellipsis for s in selection):
        i = next(i for i, s in enumerate(selection) if s is Ellipsis)
        fill = (slice(None),) * (len(shape) - len(selection) + 1)
        selection = selection[:i] + fill + selection[i + 1 :]
    if len(selection) > len(shape):
        raise IndexError(f"too many indices ({len(selection)}) for shape {shape}")
    selection = tuple(selection) + (slice(None),) * (len(shape) - len(selection))
    out: list[Index] = []
    for dim, (sel, n) in enumerate(zip(selection, shape)):
        if isinstance(sel, slice):
            start, stop, step = sel.indices(n)
            if step < 0:
                out.append(np.arange(start, stop, step, dtype=np.int64))
            else:
                out.append(slice(start, max(start, stop), step))
        elif isinstance(sel, int | np.integer):
            i = int(sel)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {dim} with size {n}")
            out.append(i % n)
        else:
            arr = np.asarray(sel)
            if arr.dtype == bool:
                if arr.shape != (n,):
                    raise IndexError(f"boolean index of shape {arr.shape} for axis {dim} of size {n}")
                arr = np.nonzero(arr)[0]
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise IndexError(f"axis {dim}: only 1-D integer arrays are supported, got {arr!r}")
            arr = arr.astype(np.int64)
            if arr.size and (arr.min() < -n or arr.max() >= n):
                raise IndexError(f"index out of bounds for axis {dim} with size {n}")
            out.append(np.where(arr < 0, arr + n, arr))
    return tuple(out)


def _dim_pieces(sel: Index, c: int):
    """Yield (chunk index, chunk-local selection, output selection or None) for one dim."""
    if isinstance(sel, int):
        yield sel // c, sel % c, None
        return
    if isinstance(sel, slice):
        start, stop, step = sel.start, sel.stop, sel.step
        if stop <= start:
            return
        pos = 0
        first_chunk, last_chunk = start // c, (stop - 1) // c
        for ci in range(first_chunk, last_chunk + 1):
            c0, c1 = ci * c, min((ci + 1) * c, stop)
            # first selected index at or after c0
            first = start if start >= c0 else start + -(-(c0 - start) // step) * step
            if first >= c1:
                continue
            count = (c1 - 1 - first) // step + 1
            yield ci, slice(first - c0, first - c0 + (count - 1) * step + 1, step), slice(pos, pos + count)
            pos += count
        return
    arr = sel
    if arr.size == 0:
        return
    chunk_ids = arr // c
    order = np.argsort(chunk_ids, kind="stable")
    sorted_ids = chunk_ids[order]
    bounds = np.flatnonzero(np.diff(sorted_ids)) + 1
    for grp in np.split(order, bounds):
        ci = int(chunk_ids[grp[0]])
        local = arr[grp] - ci * c
        yield ci, _compact(local), _compact(grp)


def _compact(idx: np.ndarray) -> slice | np.ndarray:
    """Turn an increasing run of step-1 indices into a slice (cheaper to scatter)."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and np.all(np.diff(idx) == 1):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def output_shape(selection: tuple[Index, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for sel in selection:
        if isinstance(sel, slice):
            out.append(len(range(sel.start, sel.stop, sel.step)))
        elif not isinstance(sel, int):
            out.append(len(sel))
    return tuple(out)


def plan_chunks(
    selection: tuple[Index, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> list[ChunkPiece]:
    """All chunk pieces a normalized selection touches, in C order of chunk coordinates."""
    if any(n == 0 for n in shape):
        return []
    per_dim = [list(_dim_pieces(sel, c)) for sel, c in zip(selection, chunks)]
    if not per_dim:  # a 0-d array: one chunk
        return [ChunkPiece((), (), ())]
    dropped = any(isinstance(sel, int) for sel in selection)  # an int drops its output dimension
    pieces = []
    for combo in itertools.product(*per_dim):
        coords, chunk_sel, out_sel = zip(*combo)
        if dropped:
            out_sel = tuple([o for o in out_sel if o is not None])
        pieces.append(ChunkPiece(coords, chunk_sel, out_sel))
    return pieces


def contiguous_span(shape: tuple[int, ...], sel: tuple[Index, ...]) -> tuple[int, int] | None:
    """(first element, element count) if ``sel`` picks one C-contiguous run of ``shape``.

    ``sel`` holds ints and step-1 slices (anything else returns None).
    """
    first, count, partial = 0, 1, False
    for s, n in zip(sel, shape):
        kind = type(s)
        if kind is slice:
            if s.step is not None and s.step != 1:
                return None
            start, stop = s.start, s.stop
            if start is None or stop is None or start < 0 or stop > n:
                start, stop, _ = s.indices(n)
            m = stop - start if stop > start else 0
        elif kind is int:
            start, m = s, 1
        else:
            return None
        # contiguous iff, after the first dimension with more than one element, every one is full
        if partial:
            if m != n:
                return None
        elif m > 1:
            partial = True
        first = first * n + start
        count *= m
    return (first, count) if count else None


def byte_span(recipe: Any, chunk_sel: tuple) -> tuple[int, int]:
    """The bytes of an uncompressed C-order chunk that hold a selection: from its first
    element to its last (a small selection of a large chunk reads only these)."""
    if recipe.bytes_codecs or recipe.transpose is not None or (recipe.order == "F" and len(recipe.shape) > 1):
        return 0, recipe.nbytes
    size = recipe.dtype.itemsize
    lo = hi = 0
    stride = size  # bytes, innermost dimension first (plain Python: this runs per chunk)
    for s, n in zip(reversed(chunk_sel), reversed(recipe.shape)):
        if isinstance(s, (int, np.integer)):
            first = last = int(s)
        elif isinstance(s, slice):
            idx = range(*s.indices(n))
            if not idx:
                return 0, 0
            first, last = min(idx[0], idx[-1]), max(idx[0], idx[-1])
        else:
            if not len(s):
                return 0, 0
            first, last = int(np.min(s)), int(np.max(s))
        lo += first * stride
        hi += last * stride
        stride *= n
    return lo, hi + size
