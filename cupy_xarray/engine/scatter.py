"""Turn decoded chunk bytes into arrays and place them into the output (numpy or cupy)."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .spec import ChunkRecipe


def bytes_to_chunk(xp: Any, data: Any, recipe: ChunkRecipe):
    """View the decoded bytes of one chunk as an array of ``recipe.shape`` (native order)."""
    n = recipe.nbytes
    data = data[:n]
    dtype = recipe.dtype
    if recipe.needs_swap:
        # reverse the bytes of each element (of each component, for complex numbers)
        width = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
        data = data.reshape(-1, width)[:, ::-1].copy().reshape(-1)
    arr = data.view(dtype)
    shape = recipe.shape
    if recipe.transpose is not None:
        order = recipe.transpose
        arr = arr.reshape(tuple(shape[i] for i in order)).transpose(tuple(np.argsort(order)))
    elif recipe.order == "F":
        arr = arr.reshape(shape[::-1]).transpose()
    else:
        arr = arr.reshape(shape)
    return arr


def select(xp: Any, chunk: Any, chunk_sel: tuple) -> Any:
    """Apply a chunk-local orthogonal selection (ints, slices, int arrays)."""
    basic = tuple(s if isinstance(s, int | slice) else slice(None) for s in chunk_sel)
    part = chunk[basic]
    axis = 0
    for s in chunk_sel:
        if isinstance(s, int):
            continue
        if not isinstance(s, slice):
            part = xp.take(part, xp.asarray(s), axis=axis)
        axis += 1
    return part


def scatter(xp: Any, out: Any, out_sel: tuple, part: Any) -> None:
    """``out[out_sel] = part`` with orthogonal (outer) semantics for index arrays."""
    arrays = [i for i, s in enumerate(out_sel) if not isinstance(s, slice)]
    if len(arrays) <= 1:
        index = tuple(s if isinstance(s, slice) else xp.asarray(s) for s in out_sel)
        out[index] = part
        return
    full = [np.arange(*s.indices(out.shape[i])) if isinstance(s, slice) else s for i, s in enumerate(out_sel)]
    out[xp.ix_(*[xp.asarray(f) for f in full])] = part


def place_chunk(xp: Any, out: Any, data: Any, recipe: ChunkRecipe, piece: Any) -> None:
    """Put the part of one chunk's decoded bytes that a piece selects where it goes in the output."""
    chunk = bytes_to_chunk(xp, data, recipe)
    scatter(xp, out, piece.out_sel, select(xp, chunk, piece.chunk_sel))


def copy_bytes(out: Any, dst: int, src: Any, src_off: int, n: int, xp: Any) -> None:
    """Copy ``n`` bytes of ``src`` (on the output's device; ``xp``: its array module) into the
    C-contiguous output at byte ``dst``."""
    if xp is not np:
        rt = xp.cuda.runtime
        stream = xp.cuda.get_current_stream().ptr
        rt.memcpyAsync(out.data.ptr + dst, src.data.ptr + src_off, n, rt.memcpyDeviceToDevice, stream)
    else:
        out.reshape(-1).view(np.uint8)[dst : dst + n] = src[src_off : src_off + n]


def c_strides(shape: tuple[int, ...], size: int) -> list[int]:
    """Byte strides of a C-contiguous array of ``shape`` with ``size``-byte elements."""
    strides = [size] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return strides


def box_copies(
    recipe: ChunkRecipe,
    piece: Any,
    out_shape: tuple[int, ...],
    max_copies: int,
    min_row: int,
) -> list[tuple] | None:
    """A piece that selects a box of a C-order chunk (ints and step-1 slices), placed into a
    box of the C-contiguous output, as 2-D copies ``(src, dst, width, height, spitch,
    dpitch)`` in bytes; None where the piece is not such a box or would need more than
    ``max_copies`` copies or rows narrower than ``min_row`` bytes (a read's: the options
    ``box_max_copies`` and ``box_min_row``; narrower rows copy slowly, and the scatter kernel
    is then faster)."""
    if recipe.transpose is not None or recipe.needs_swap or (recipe.order == "F" and len(recipe.shape) > 1):
        return None
    size = recipe.dtype.itemsize
    cstride = c_strides(recipe.shape, size)
    ostride = c_strides(out_shape, size)
    src = dst = 0
    dims = []  # (extent, src stride, dst stride) of the box's dimensions, outermost first
    j = 0
    for k, s in enumerate(piece.chunk_sel):
        if type(s) is int:
            src += s * cstride[k]
            continue
        o = piece.out_sel[j]
        if type(s) is not slice or type(o) is not slice or s.step not in (None, 1) or o.step not in (None, 1):
            return None
        extent = s.stop - s.start
        if extent <= 0:
            return []
        src += s.start * cstride[k]
        dst += o.start * ostride[j]
        if extent > 1:
            dims.append([extent, cstride[k], ostride[j]])
        j += 1
    merged: list[list[int]] = []
    for d in reversed(dims):  # innermost first: fold a dimension into the one inside it
        if merged and d[1] == merged[-1][0] * merged[-1][1] and d[2] == merged[-1][0] * merged[-1][2]:
            merged[-1] = [merged[-1][0] * d[0], merged[-1][1], merged[-1][2]]
        else:
            merged.append(d)
    if not merged:
        return [(src, dst, size, 1, size, size)]
    if merged[0][1] != size or merged[0][2] != size:  # elements not side by side: rows of one
        merged.insert(0, [1, size, size])
    width = merged[0][0] * size
    height, spitch, dpitch = merged[1] if len(merged) > 1 else (1, width, width)
    outer = merged[2:]
    count = int(np.prod([d[0] for d in outer])) if outer else 1
    if count > max_copies or (height > 1 and width < min_row):
        return None
    copies = []
    for idx in np.ndindex(*[d[0] for d in reversed(outer)]) if outer else [()]:
        so = src + sum(i * d[1] for i, d in zip(idx, reversed(outer)))
        do = dst + sum(i * d[2] for i, d in zip(idx, reversed(outer)))
        copies.append((so, do, width, height, spitch, dpitch))
    return copies


def chunk_box(recipe: ChunkRecipe, piece: Any, out_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where a piece that takes a whole C-order chunk lies in the C-contiguous output, as
    ``(start, width, rows, row_pitch, planes, plane_pitch)`` in bytes: the chunk's bytes are
    ``planes`` planes of ``rows`` rows of ``width`` bytes. None for any other piece (part of
    a chunk, index arrays, steps, other layouts, or more than three levels of rows)."""
    if recipe.transpose is not None or recipe.needs_swap or (recipe.order == "F" and len(recipe.shape) > 1):
        return None
    kept = []
    for s, n in zip(piece.chunk_sel, recipe.shape):
        if type(s) is int:
            if n != 1:
                return None
        elif type(s) is slice and s.start == 0 and s.stop == n and s.step in (None, 1):
            kept.append(n)
        else:
            return None
    if len(kept) != len(out_shape):
        return None
    if any(type(o) is not slice or o.step not in (None, 1) for o in piece.out_sel):
        return None
    size = recipe.dtype.itemsize
    geometry = _box_geometry(tuple(kept), size, tuple(out_shape))
    if geometry is None:
        return None
    start = sum(o.start * st for o, st in zip(piece.out_sel, c_strides(out_shape, size)))
    return (start, *geometry)


@functools.lru_cache(maxsize=256)
def _box_geometry(extents: tuple[int, ...], size: int, out_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """(width, rows, row_pitch, planes, plane_pitch) of a whole chunk of ``extents`` (its
    axes the output keeps) in an output of ``out_shape``: dimensions folded into the one
    inside them where both chunk and output are contiguous across them."""
    ostride = c_strides(out_shape, size)
    levels: list[list[int]] = []  # innermost first: [extent, output stride]
    for n, o in zip(reversed(extents), reversed(ostride)):
        if n == 1:
            continue
        if levels and o == levels[-1][0] * levels[-1][1]:
            levels[-1][0] *= n
        else:
            levels.append([n, o])
    if not levels or levels[0][1] != size:
        levels.insert(0, [1, size])
    if len(levels) > 3:
        return None
    width = levels[0][0] * size
    rows, row_pitch = levels[1] if len(levels) > 1 else (1, width)
    planes, plane_pitch = levels[2] if len(levels) > 2 else (1, rows * row_pitch)
    return width, rows, row_pitch, planes, plane_pitch


#: a piece placed with the other pieces of its batch may take up to this many 2-D copies
FUSED_MAX_COPIES = 4096


def _box_key(recipe: ChunkRecipe, piece: Any) -> tuple | None:
    """What a piece's copies depend on, but for where its box starts in the output; None
    for a piece with index arrays (never a box)."""
    sel = []
    for s in piece.chunk_sel:
        if type(s) is slice:
            sel.append((s.start, s.stop, s.step))
        elif isinstance(s, int):
            sel.append(s)
        else:
            return None
    return id(recipe), tuple(sel)


class Boxes:
    """Pieces of decoded chunks that are boxes, placed into one C-contiguous output with
    2-D copies (:func:`box_copies`): all of them with one kernel launch on the GPU, where a
    scatter per piece costs a launch and tens of microseconds of Python each.

    Parameters
    ----------
    out
        The output (numpy or cupy, C-contiguous).
    geometry
        Where the copies of each kind of piece are kept: pass the same dict to the ``Boxes``
        of every batch of a read into ``out`` and each kind is worked out once per read.
    """

    def __init__(self, out: Any, geometry: dict | None = None) -> None:
        self.out = out
        self._ostride = c_strides(out.shape, out.dtype.itemsize)
        self._sources: list[Any] = []
        self._shifts: list[int] = []  # per queued piece: how far its box is from its geometry's
        self._members: dict[tuple, list[int]] = {}  # the queued pieces of each geometry
        self._geometry: dict[tuple, tuple[np.ndarray, int] | None] = {} if geometry is None else geometry

    def _base(self, piece: Any) -> int:
        """Byte offset in the output of the first element a piece's box covers."""
        base = 0
        for o, stride in zip(piece.out_sel, self._ostride):
            base += o.start * stride
        return base

    def add(self, data: Any, recipe: ChunkRecipe, piece: Any) -> bool:
        """Queue the copies of ``piece`` from the chunk's decoded bytes ``data`` (1-D uint8,
        at least ``recipe.nbytes``); False where the piece is not a box (place it with
        :func:`place_chunk`)."""
        key = _box_key(recipe, piece)
        if key is None:
            return False
        geometry = self._geometry.get(key, False)
        if geometry is False:
            if any(type(o) is not slice for o in piece.out_sel):
                copies = None
            else:
                copies = box_copies(recipe, piece, self.out.shape, FUSED_MAX_COPIES, 0)
            if copies:
                geometry = (np.array(copies, dtype=np.int64), self._base(piece))
            else:
                geometry = None
            self._geometry[key] = geometry
        if geometry is None:
            return False
        self._members.setdefault(key, []).append(len(self._sources))
        self._sources.append(data)
        self._shifts.append(self._base(piece) - geometry[1])
        return True

    def table(self) -> np.ndarray:
        """The queued copies, one row each: source index, source offset, output offset,
        width, height, source pitch, output pitch (bytes), in the order the pieces were
        queued. Raises ValueError where a copy would reach past its source or the output (a
        bug, never a store's doing)."""
        if not self._sources:
            return np.empty((0, 7), np.int64)
        shifts = np.array(self._shifts, dtype=np.int64)
        # the pieces of a batch share a few geometries (tiles: one): rows are built per
        # geometry, at once, then put back in the order the pieces were queued (column 0)
        parts = []
        for key, members in self._members.items():
            copies = self._geometry[key][0]
            idx = np.array(members, dtype=np.int64)
            rows = np.empty((len(idx), len(copies), 7), np.int64)
            rows[:, :, 0] = idx[:, None]
            rows[:, :, 1:] = copies
            rows[:, :, 2] += shifts[idx, None]
            parts.append(rows.reshape(-1, 7))
        if len(parts) == 1:
            t = parts[0]  # one geometry: already in order
        else:
            t = np.concatenate(parts)
            t = t[np.argsort(t[:, 0], kind="stable")]
        lengths = np.array([len(s) for s in self._sources], dtype=np.int64)
        last = t[:, 4] - 1
        src_end = t[:, 1] + last * t[:, 5] + t[:, 3]
        dst_end = t[:, 2] + last * t[:, 6] + t[:, 3]
        if (t[:, 1:] < 0).any() or (src_end > lengths[t[:, 0]]).any() or (dst_end > self.out.nbytes).any():
            raise ValueError("a box copy reaches past its chunk or the output")
        return t

    def run(self, xp: Any) -> int:
        """Do the queued copies (on the GPU: on the current stream); how many there were."""
        t = self.table()
        if len(t):
            if xp.__name__ == "cupy":
                _run_gpu(xp, self.out, self._sources, t)
            else:
                _run_host(self.out, self._sources, t)
        self._sources, self._shifts, self._members = [], [], {}
        return len(t)


def _run_host(out: np.ndarray, sources: list[np.ndarray], t: np.ndarray) -> None:
    flat = out.reshape(-1).view(np.uint8)
    for i, s, d, width, height, spitch, dpitch in t.tolist():
        src = as_strided(sources[i][s:], shape=(height, width), strides=(spitch, 1), writeable=False)
        as_strided(flat[d:], shape=(height, width), strides=(dpitch, 1))[...] = src


#: bytes of a row one block of the copy kernel copies in one go
_SEGMENT = 16384
#: copy tables in flight per thread and device: pinned host memory that the kernel reads in
#: place (uploading a small table waited behind the read's own copies: 0.14 ms a batch on an
#: H200 while kvikio's threads copied, against 0.03 ms idle), each reused once its kernel ran
_TABLES = 4
_tables = threading.local()


def _pinned_table(cupy: Any, rows: int) -> tuple[np.ndarray, list]:
    """A pinned host table of ``rows`` rows of 6 int64 for the current device, and its slot
    (``[buffer, event]``: record the event once the kernel that reads it is launched)."""
    device = cupy.cuda.Device().id
    ring = _tables.__dict__.get(device)
    if ring is None:
        ring = _tables.__dict__[device] = [0, [[None, None] for _ in range(_TABLES)]]
    slot = ring[1][ring[0]]
    ring[0] = (ring[0] + 1) % _TABLES
    buf, event = slot
    if event is not None:
        event.synchronize()  # the kernel that read this table last has run
    if buf is None or len(buf) < rows:
        from ..runtime.buffers import pinned_buffer

        buf = slot[0] = pinned_buffer(max(rows, 256) * 48).view(np.int64).reshape(-1, 6)
    return buf[:rows], slot


def _run_gpu(cupy: Any, out: Any, sources: list[Any], t: np.ndarray) -> None:
    from ..runtime.kernels import function

    # sources on the device, or in page-locked host memory (read in place, as the table is)
    ptrs = np.array([s.ctypes.data if isinstance(s, np.ndarray) else s.data.ptr for s in sources], np.int64)
    table, slot = _pinned_table(cupy, len(t))
    np.add(ptrs[t[:, 0]], t[:, 1], out=table[:, 0])
    np.add(t[:, 2], out.data.ptr, out=table[:, 1])
    table[:, 2:] = t[:, 3:]
    units = int((t[:, 4] * -(-t[:, 3] // _SEGMENT)).max())
    grid = (min(len(t), 65535), min(units, 64))
    # pinned memory is mapped into the device's address space (unified addressing): the
    # kernel reads the table where it is
    args = (np.int64(table.ctypes.data), np.int32(len(t)), np.int64(_SEGMENT))
    stream = cupy.cuda.get_current_stream()
    function("scatter", "copy_boxes")(grid, (128,), args)
    if slot[1] is None:
        slot[1] = cupy.cuda.Event(block=False, disable_timing=True)
    slot[1].record(stream)
