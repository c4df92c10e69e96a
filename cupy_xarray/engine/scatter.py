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
