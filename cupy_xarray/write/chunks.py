"""One array's chunks from memory into a local Zarr store: the array's metadata (written by
xarray and zarr-python) decides the chunk grid, keys, fill value and codecs; chunks that hold
only the fill value are not written (zarr-python's default); every file is written under a
temporary name and renamed into place, so that a write that fails midway leaves no chunk that
reads as what it was not."""

from __future__ import annotations

import concurrent.futures as cf
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .encoders import Recipe, recipe_of

#: bytes of decoded chunks encoded in one batch (one nvCOMP call on the GPU)
BATCH_BYTES = 1 << 30


@dataclass
class WriteReport:
    """What a write did: arrays, chunks written and left out (fill value only), bytes."""

    arrays: list[str] = field(default_factory=list)
    encoder: str = ""
    chunks: int = 0
    empty: int = 0
    nbytes: int = 0
    stored: int = 0

    def __str__(self) -> str:
        return (
            f"write of {', '.join(self.arrays) or 'nothing'} ({self.encoder}): {self.chunks} chunks, "
            f"{self.empty} left out (fill value only), {self.nbytes / 2**20:.1f} MiB -> "
            f"{self.stored / 2**20:.1f} MiB"
        )


def chunk_shape(meta: Any) -> tuple[int, ...]:
    grid = getattr(meta, "chunk_grid", None)
    return tuple(grid.chunk_shape) if grid is not None else tuple(meta.chunks)


def _empty(xp: Any, block: Any, fill: Any) -> Any:
    """A 0-d boolean (on the block's device): does the block hold only the fill value?"""
    if block.dtype.kind in "fc" and np.isnan(fill):
        return xp.isnan(block).all()
    return (block == xp.asarray(fill, dtype=block.dtype)).all()


def _raw(xp: Any, block: Any, shape: tuple[int, ...], fill: Any, recipe: Recipe) -> Any:
    """A chunk's element bytes, 1-D uint8: edge chunks padded with the fill value to the whole
    chunk shape (as zarr-python writes them), in the recipe's element and byte order."""
    if not block.dtype.isnative:  # host data in the other byte order: swapped below if stored so
        block = block.astype(block.dtype.newbyteorder("="))
    if block.shape != shape:
        full = xp.full(shape, fill, dtype=block.dtype)
        full[tuple(slice(0, n) for n in block.shape)] = block
        block = full
    block = xp.ascontiguousarray(block.T if recipe.order == "F" else block)
    raw = block.reshape(-1).view(xp.uint8)
    size = block.dtype.itemsize
    if recipe.big_endian and size > 1:
        raw = xp.ascontiguousarray(raw.reshape(-1, size)[:, ::-1]).reshape(-1)
    return raw


_rename = os.replace


def _put(path: Path, data: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
        _rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_array(
    root: Path, array_path: str, data: Any, xp: Any, encoder: Any, threads: int, report: WriteReport
) -> None:
    """Write every chunk of the zarr array at ``root / array_path`` (created already, its
    shape that of ``data``) from ``data`` (a numpy or cupy array, as ``xp``)."""
    import zarr

    arr = zarr.open_array(store=str(root), path=array_path, mode="r")
    meta = arr.metadata
    if tuple(arr.shape) != tuple(data.shape):
        raise ValueError(f"{array_path}: the store's array has shape {arr.shape}, the data {data.shape}")
    recipe = recipe_of(meta)
    shape = chunk_shape(meta)
    fill = np.asarray(meta.fill_value, dtype=data.dtype)[()] if meta.fill_value is not None else None
    write_empty = bool(zarr.config.get("array.write_empty_chunks", False))
    grid = [range(-(-n // c)) for n, c in zip(data.shape, shape)]
    indexes = list(np.ndindex(*[len(g) for g in grid])) if data.ndim else [()]
    per_batch = max(1, BATCH_BYTES // max(int(np.prod(shape)) * data.dtype.itemsize, 1))
    report.arrays.append(array_path)
    report.encoder = encoder.name
    with cf.ThreadPoolExecutor(max(1, threads)) as pool:
        pending: list[cf.Future] = []
        for start in range(0, len(indexes), per_batch):
            batch = indexes[start : start + per_batch]
            blocks = [data[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, shape))] for idx in batch]
            if fill is not None and not write_empty:
                flags = [_empty(xp, b, fill) for b in blocks]
                empty = np.asarray(xp.stack(flags).get() if xp is not np else np.stack(flags))
                keep = [k for k, e in enumerate(empty) if not e]
                report.empty += len(batch) - len(keep)
                batch, blocks = [batch[k] for k in keep], [blocks[k] for k in keep]
            if not batch:
                continue
            raws = [_raw(xp, b, shape, fill if fill is not None else 0, recipe) for b in blocks]
            encoded = encoder.encode(recipe, raws)
            for w in pending:  # the batch before: written while this one encoded
                w.result()
            pending = []
            for idx, enc in zip(batch, encoded):
                key = meta.encode_chunk_key(idx)
                pending.append(pool.submit(_put, root / array_path / key, enc))
                report.stored += len(enc)
            report.chunks += len(batch)
            report.nbytes += sum(int(r.size) for r in raws)
        for w in pending:
            w.result()
