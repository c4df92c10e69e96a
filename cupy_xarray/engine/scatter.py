"""Turn decoded chunk bytes into arrays and place them into the output (numpy or cupy)."""

from __future__ import annotations

from typing import Any

import numpy as np

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


def copy_bytes(out: Any, dst: int, src: Any, src_off: int, n: int, device: Any) -> None:
    """Copy ``n`` bytes of ``src`` (on the output's device) into the C-contiguous output at byte
    ``dst``."""
    if device.name == "gpu":
        rt = device.xp.cuda.runtime
        stream = device.xp.cuda.get_current_stream().ptr
        rt.memcpyAsync(out.data.ptr + dst, src.data.ptr + src_off, n, rt.memcpyDeviceToDevice, stream)
    else:
        out.reshape(-1).view(np.uint8)[dst : dst + n] = src[src_off : src_off + n]


#: a piece is placed with 2-D copies only when it takes at most this many, each row at least
#: ``BOX_MIN_ROW`` bytes (narrower rows copy slowly; the scatter kernel is then faster)
BOX_MAX_COPIES = 16
BOX_MIN_ROW = 512


def box_copies(recipe: ChunkRecipe, piece: Any, out_shape: tuple[int, ...]) -> list[tuple] | None:
    """A piece that selects a box of a C-order chunk (ints and step-1 slices), placed into a
    box of the C-contiguous output, as 2-D copies ``(src, dst, width, height, spitch,
    dpitch)`` in bytes; None where the piece is not such a box or would need too many copies
    (:data:`BOX_MAX_COPIES`, :data:`BOX_MIN_ROW`)."""
    if recipe.transpose is not None or recipe.needs_swap or (recipe.order == "F" and len(recipe.shape) > 1):
        return None
    size = recipe.dtype.itemsize
    cstride = [size] * len(recipe.shape)
    for k in range(len(recipe.shape) - 2, -1, -1):
        cstride[k] = cstride[k + 1] * recipe.shape[k + 1]
    ostride = [size] * len(out_shape)
    for k in range(len(out_shape) - 2, -1, -1):
        ostride[k] = ostride[k + 1] * out_shape[k + 1]
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
    if count > BOX_MAX_COPIES or (height > 1 and width < BOX_MIN_ROW):
        return None
    copies = []
    for idx in np.ndindex(*[d[0] for d in reversed(outer)]) if outer else [()]:
        so = src + sum(i * d[1] for i, d in zip(idx, reversed(outer)))
        do = dst + sum(i * d[2] for i, d in zip(idx, reversed(outer)))
        copies.append((so, do, width, height, spitch, dpitch))
    return copies
