"""One array's chunks from memory into a local Zarr store: the array's metadata (written by
xarray and zarr-python) decides the chunk grid, keys, fill value and codecs; chunks that hold
only the fill value are not written (zarr-python's default); every file is written under a
temporary name and renamed into place, so that a write that fails midway leaves no chunk that
reads as what it was not."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..device import array_namespace
from ..formats.sharding import EMPTY, encode_index
from ..runtime.buffers import release_idle_memory
from .encoders import DeviceChunk, EncodeError, Pending, Recipe, ShardRecipe, chunk_shape, stream_shape


@dataclass(frozen=True)
class Target:
    """One zarr array a write fills: its path in the store, its metadata (written already)
    and its codec chain."""

    name: str
    meta: Any
    recipe: Recipe


@dataclass
class WriteReport:
    """What a write did: arrays, chunks written and left out (fill value only), bytes, the
    batches, the device memory they held at most, and where the time went."""

    arrays: list[str] = field(default_factory=list)
    encoder: str = ""
    chunks: int = 0
    empty: int = 0
    nbytes: int = 0
    stored: int = 0
    batches: int = 0
    #: device memory the batches in flight held at most (chunks, compressed slots, scratch)
    device_bytes: int = 0
    #: seconds writing chunks; of them, waiting for encoders and for files being written
    seconds: float = 0.0
    encode_wait_s: float = 0.0
    file_wait_s: float = 0.0
    #: what the write had to do differently (smaller batches where memory ran short)
    notes: list[str] = field(default_factory=list)
    #: variables xarray wrote (coordinates, host data, small writes, dask chunks across stored ones)
    by_xarray: list[str] = field(default_factory=list)

    def add(self, other: WriteReport) -> None:
        """Count ``other`` (a dask block's write) in this report."""
        self.arrays += [a for a in other.arrays if a not in self.arrays]
        names = {n for n in (*self.encoder.split(", "), other.encoder) if n}
        self.encoder = ", ".join(sorted(names))
        for name in (
            "chunks",
            "empty",
            "nbytes",
            "stored",
            "batches",
            "seconds",
            "encode_wait_s",
            "file_wait_s",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.device_bytes = max(self.device_bytes, other.device_bytes)
        self.notes += [n for n in other.notes if n not in self.notes]
        self.by_xarray += [n for n in other.by_xarray if n not in self.by_xarray]

    def __str__(self) -> str:
        if not self.arrays and self.by_xarray:
            notes = "".join(f"; {n}" for n in self.notes)
            return f"written by xarray from host copies: {', '.join(self.by_xarray)}{notes}"
        return (
            f"write of {', '.join(self.arrays) or 'nothing'} ({self.encoder}): {self.chunks} chunks, "
            f"{self.empty} left out (fill value only), {self.nbytes / 2**20:.1f} MiB -> "
            f"{self.stored / 2**20:.1f} MiB in {self.batches} batch(es), {self.seconds:.3f} s "
            f"(waited {self.encode_wait_s:.3f} s for encoders, {self.file_wait_s:.3f} s for files), "
            f"device memory {self.device_bytes / 2**20:.0f} MiB"
            + (f"; written by xarray: {', '.join(self.by_xarray)}" if self.by_xarray else "")
            + "".join(f"; {n}" for n in self.notes)
        )


def _elements(rows: Any, inner: tuple[int, ...], native: np.dtype, lead: tuple[int, ...]) -> Any:
    """``rows`` (uint8, a chunk of ``inner`` elements at the start of each) as an array of shape
    ``lead + inner``: a view (axes are only split), whatever the rows' padding."""
    n = int(np.prod(inner))
    return rows.view(native)[:, :n].reshape(lead + tuple(inner))


def _gather(rows: Any, block: Any, unit: tuple, inner: tuple, fill: Any, native: np.dtype, xp: Any) -> None:
    """Put one unit's elements (a chunk, or a shard of ``inner`` chunks) into ``rows``, a row
    per chunk in C order, each in C order: edge units padded with the fill value to the whole
    unit, as zarr-python writes them."""
    if unit == inner:  # one chunk: padded in place
        slot = _elements(rows, inner, native, (1,))[0]
        if block.shape != unit:
            slot[...] = fill
            slot = slot[tuple(slice(0, n) for n in block.shape)]
        slot[...] = block
        return
    if block.shape != unit:
        whole = xp.full(unit, fill, dtype=native)
        whole[tuple(slice(0, n) for n in block.shape)] = block
        block = whole
    _tile(rows, block, unit, inner, native)


def _tile(rows: Any, block: Any, unit: tuple, inner: tuple, native: np.dtype) -> None:
    """Put ``block`` (whole units along every axis) into ``rows`` with one copy: its units in
    C order, each unit's chunks in C order, each chunk's elements in C order (every axis split
    into units, chunks in a unit and elements, then units first, chunks next, elements last)."""
    d = len(unit)
    g = [n // u for n, u in zip(block.shape, unit)]
    k = [u // c for u, c in zip(unit, inner)]
    split = tuple(x for gg, kk, c in zip(g, k, inner) for x in (gg, kk, c))
    order = [3 * i + j for j in range(3) for i in range(d)]
    _elements(rows, inner, native, (*g, *k))[...] = block.reshape(split).transpose(order)


def _gather_rows(
    rows: Any, data: Any, batch: list, unit: tuple[int, ...], inner: tuple[int, ...], native: np.dtype
) -> bool:
    """Put a batch of whole grid rows of interior units (chunks, or shards of ``inner``
    chunks) into ``rows`` with one copy (a view of ``data`` with the chunks' axes last, each
    shard's chunks together); False where the batch is not such a block."""
    grid = [n // u for n, u in zip(data.shape[1:], unit[1:])]
    per_row = int(np.prod(grid)) if grid else 1
    if any(n % u for n, u in zip(data.shape[1:], unit[1:])) or len(batch) % per_row or any(batch[0][1:]):
        return False
    first, m = batch[0][0], len(batch) // per_row
    if (first + m) * unit[0] > data.shape[0]:
        return False  # the last units along the first axis are cut short
    _tile(rows, data[first * unit[0] : (first + m) * unit[0]], unit, inner, native)
    return True


def _empties(xp: Any, rows: Any, nbytes: int, native: np.dtype, fill: Any) -> Any:
    """Per row (a chunk's elements in its first ``nbytes``), whether it holds only the fill
    value (NaN for NaN)."""
    values = rows.view(native)[:, : nbytes // native.itemsize]
    if native.kind in "fc" and np.isnan(fill):
        return xp.isnan(values).all(axis=1)
    if native.kind == "f" and fill == 0:  # bit for bit, as zarr-python: -0.0 is not the fill 0.0
        bits = np.dtype(f"u{native.itemsize}")
        return (values.view(bits) == xp.asarray(fill, dtype=native).view(bits)).all(axis=1)
    return (values == xp.asarray(fill, dtype=native)).all(axis=1)


def _stored_order(xp: Any, rows: Any, shape: tuple[int, ...], native: np.dtype, recipe: Recipe) -> None:
    """Rearrange rows of C-ordered native elements as the recipe stores them: Fortran order,
    big-endian bytes (of each component of a complex number, as NumPy's ``>c8`` stores them)."""
    n = rows.shape[0]
    if recipe.order == "F" and len(shape) > 1:
        for k in range(n):
            c = rows[k].view(native).reshape(shape)
            rows[k] = xp.ascontiguousarray(c.T).reshape(-1).view(xp.uint8)
    # each element's bytes reversed (each component's, for complex numbers)
    size = native.itemsize // 2 if native.kind == "c" else native.itemsize
    if recipe.big_endian and size > 1:
        rows[...] = xp.ascontiguousarray(rows.reshape(n, -1, size)[:, :, ::-1]).reshape(rows.shape)


_rename = os.replace


class ChunkFiles:
    """Chunk files written by threads, each under a temporary name renamed into place."""

    def __init__(self, root: Path, pool: cf.Executor, crc32c: bool, overwrite: bool = False) -> None:
        self.root = root
        self.crc32c = crc32c
        self.overwrite = overwrite
        self.tag = uuid.uuid4().hex
        self.pool = pool
        self.dirs: set[Path] = set()
        self.pending: list[cf.Future] = []
        #: each batch whose files are being written: where its files start in ``pending``, and
        #: the device memory they hold until written (None: a whole batch's)
        self.batches: list[tuple[int, int | None]] = []

    def begin(self, device_bytes: int | None) -> None:
        """The files put from now on are one batch's, holding ``device_bytes`` of device memory."""
        self.batches.append((len(self.pending), device_bytes))

    def held(self, budget: int) -> int:
        """Device memory the batches whose files are not all written hold (a batch of unknown
        memory counts as ``budget``)."""
        while self.batches and all(f.done() for f in self._oldest()):
            self.batches.pop(0)
        return sum(budget if b is None else b for _, b in self.batches)

    def wait_within(self, budget: int, more: int | None) -> None:
        """Wait for the oldest batches' files until another ``more`` bytes fit in ``budget``
        beside those still being written (None: until all are written)."""
        while (more is None or self.held(budget) + more > budget) and self.batches:
            self._results(self._oldest())
            self.batches.pop(0)

    def _oldest(self) -> list[cf.Future]:
        """The files of the oldest batch still being written."""
        end = self.batches[1][0] if len(self.batches) > 1 else len(self.pending)
        return self.pending[self.batches[0][0] : end]

    def put(self, key: str, data: np.ndarray | DeviceChunk, crc: int | None = None) -> None:
        """Write ``data`` (host bytes, or bytes in device memory the thread copies out) as
        chunk ``key``, then its crc32c (``crc`` where already computed)."""
        self.pending.append(self.pool.submit(self._put, key, [(data, crc, self.crc32c)]))

    def put_shard(self, key: str, pieces: list, crcs: list, shard: ShardRecipe) -> int:
        """Write shard ``key`` of ``pieces`` (its inner chunks' bytes in C order of its grid,
        None for those left out, ``crcs`` their crc32c where computed): the chunks in the
        order zarr-python stores them, the index before or after them. Returns its size."""
        layout = shard.layout
        extra = 4 if self.crc32c else 0
        index = np.full((len(pieces), 2), EMPTY, dtype=np.uint64)
        start = pos = layout.index_nbytes(shard.inner) if layout.index_at_start else 0
        for j in shard.order:
            if pieces[j] is not None:
                index[j] = pos, len(pieces[j]) + extra
                pos += len(pieces[j]) + extra
        head = encode_index(index, layout)
        parts = [(pieces[j], crcs[j], self.crc32c) for j in shard.order if pieces[j] is not None]
        parts = [(head, None, False), *parts] if start else [*parts, (head, None, False)]
        self.pending.append(self.pool.submit(self._put, key, parts))
        return pos + (0 if start else len(head))

    def remove(self, key: str) -> None:
        """Delete chunk ``key``'s file where there is one."""
        self.pending.append(self.pool.submit((self.root / key).unlink, missing_ok=True))

    def _put(self, key: str, parts: list) -> None:
        """Write ``parts`` ((bytes, crc32c or None, whether a crc32c follows) each) as ``key``."""
        path = self.root / key
        parent = path.parent
        if parent not in self.dirs:
            parent.mkdir(parents=True, exist_ok=True)
            self.dirs.add(parent)
        tmp = parent / f".{path.name}.{self.tag}.partial"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                for data, crc, checked in parts:
                    if isinstance(data, DeviceChunk):
                        data = data.to_host()  # this thread's buffer: written before the next
                    _write_all(fd, memoryview(data).cast("B"))
                    if checked:
                        if crc is None:
                            from ..formats import crc32c

                            crc = crc32c.value(data)
                        _write_all(fd, memoryview(crc.to_bytes(4, "little")))
            finally:
                os.close(fd)
            _rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def wait(self) -> None:
        self._results(self.pending)
        self.pending, self.batches = [], []

    def _results(self, futures: list) -> None:
        try:
            for f in futures:
                f.result()
        except BaseException:
            self.close()  # no file is written after the error is raised
            raise

    def close(self) -> None:
        """Cancel the files not begun, wait for those under way (after an error)."""
        for f in self.pending:
            f.cancel()
        cf.wait(self.pending)
        self.pending, self.batches = [], []


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


def write_array(write: Any, target: Target, data: Any, origin: tuple[int, ...] | None = None) -> WriteReport:
    """Write the chunks of ``target`` (its directory under ``write.root`` made already; ``write``:
    the call's :class:`.context.Write`) that
    ``data`` (a numpy or cupy array) covers: all of them, or from chunk ``origin`` of its grid
    on (a dask block: its ends on chunk boundaries or the array's); what it did. Where
    ``write.overwrite``, chunks may be there already (an append, a region): the file of a chunk
    that now holds only the fill value is deleted, as zarr-python does. Where
    ``write.write_empty`` (``to_zarr``'s ``write_empty_chunks``; None: zarr's
    ``array.write_empty_chunks``, False by default), chunks of the fill value only are
    written too. A sharded array is written a whole shard at a time (``origin`` counts
    shards): its inner chunks are the rows, gathered, checked and encoded as chunks are, then
    written as one file with their index.

    Batches of chunks (at most the ``write_batch_bytes`` option in host memory) are gathered
    into rows of one buffer, checked for chunks of the fill value only, handed to the encoder
    (:meth:`.context.Write.encoder_for`, which returns at once) and written by the write's
    file threads while the next ones are gathered and encoded (``write_in_flight`` batches
    queued at once, each on a stream of its own on the GPU).
    """
    import zarr

    meta, recipe, directory, options = target.meta, target.recipe, write.root / target.name, write.options
    xp = array_namespace(data)
    report = WriteReport(arrays=[target.name])  # its path in the store
    unit = chunk_shape(meta)  # a chunk, or a shard
    shape = stream_shape(meta, recipe)  # a row's chunk
    per_unit = int(np.prod([u // c for u, c in zip(unit, shape)]))
    origin = origin or (0,) * data.ndim
    ends = [(o * c + n) for o, c, n in zip(origin, unit, data.shape)]
    if len(ends) != len(meta.shape) or any(e > n for e, n in zip(ends, meta.shape)):
        raise ValueError(f"{directory}: data of shape {data.shape} from chunk {origin} outside {meta.shape}")
    native = data.dtype.newbyteorder("=")
    # a v2 fill value of null: zarr-python pads with, and leaves out chunks of, the dtype's zero
    fill = np.asarray(0 if meta.fill_value is None else meta.fill_value, dtype=native)[()]
    write_empty = write.write_empty
    if write_empty is None:
        write_empty = bool(zarr.config.get("array.write_empty_chunks", False))
    check_empty = not write_empty
    pad = fill
    grid = [range(-(-n // c)) for n, c in zip(data.shape, unit)]
    indexes = list(np.ndindex(*[len(g) for g in grid])) if data.ndim else [()]
    nbytes = int(np.prod(shape)) * native.itemsize
    encoder = write.encoder_for(xp is not np, recipe, nbytes, int(data.nbytes))
    a = encoder.alignment
    stride = -(-max(nbytes, 1) // a) * a
    per_row = int(np.prod([len(g) for g in grid[1:]])) if data.ndim > 1 else 1
    cap = max(1, encoder.batch_chunks(nbytes, stride, options.write_batch_bytes, recipe) // per_unit)
    sizes = _plan(len(indexes), cap, per_row)
    depth = max(1, options.write_in_flight)
    streams = _streams(xp, depth)
    report.encoder = encoder.name
    files = ChunkFiles(directory, write.pool, recipe.crc32c, write.overwrite)
    t0 = time.perf_counter()
    queued: list[tuple[list, Pending]] = []  # oldest first
    budget = 0  # device memory for the files being written: the most a batch held while queued
    ok = False
    try:
        first, b = 0, 0
        while first < len(indexes):
            batch = indexes[first : first + sizes[0]]
            try:
                with streams[b % len(streams)]:
                    rows = xp.empty((len(batch) * per_unit, stride), dtype=xp.uint8)
                    if not _gather_rows(rows, data, batch, unit, shape, native):
                        for k, idx in enumerate(batch):
                            block = data[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, unit))]
                            own = rows[k * per_unit : (k + 1) * per_unit]
                            _gather(own, block, unit, shape, pad, native, xp)
                    empty = _empties(xp, rows, nbytes, native, fill) if check_empty else None
                    _stored_order(xp, rows[:, :nbytes], shape, native, recipe)
                    pending = encoder.start(recipe, rows, nbytes, empty)
            except MemoryError:  # cupy's OutOfMemoryError too: the rest in smaller batches
                rows = empty = None
                if len(batch) == 1 and not queued:
                    raise
                while queued:  # their memory back first
                    _finish(*queued.pop(0), meta, origin, nbytes, files, report, recipe.shard, budget)
                files.wait()
                if xp is not np:
                    release_idle_memory()  # the decoder process's idle memory, for a write after a read
                    xp.get_default_memory_pool().free_all_blocks()
                smaller = max(1, len(batch) // 2)
                report.notes.append(f"memory ran short: batches of {smaller} chunks from chunk {first}")
                sizes = _plan(len(indexes) - first, smaller, per_row)
                continue
            del rows, empty
            first, b, sizes = first + len(batch), b + 1, sizes[1:]
            queued.append((batch, pending))
            budget = max(budget, pending.device_bytes)
            held = sum(q[1].device_bytes for q in queued) + files.held(budget)
            report.device_bytes = max(report.device_bytes, held)
            report.batches += 1
            if len(queued) >= depth:
                _finish(*queued.pop(0), meta, origin, nbytes, files, report, recipe.shard, budget)
        while queued:
            _finish(*queued.pop(0), meta, origin, nbytes, files, report, recipe.shard, budget)
        w = time.perf_counter()
        files.wait()
        report.file_wait_s += time.perf_counter() - w
        ok = True
    finally:
        if not ok and xp is not np:  # let the GPU finish what it was given before its memory goes
            with contextlib.suppress(Exception):
                xp.cuda.Device().synchronize()
        files.close()
        report.seconds += time.perf_counter() - t0
    return report


def _plan(total: int, cap: int, row: int) -> list[int]:
    """Chunks per batch: batches of ``cap`` (whole grid rows of ``row`` chunks where it holds
    some), the rest in two, three quarters then a quarter: the files of the last batch are
    written with nothing to overlap them, so it is small."""
    if cap >= row > 1:
        cap -= cap % row
    sizes = []
    left = total
    while left > cap:
        sizes.append(cap)
        left -= cap
    first = -(-3 * left // 4)
    if row > 1 and left > row:
        first = max(row, min(left - row, round(first / row) * row))
    return sizes + ([first, left - first] if 0 < first < left else [left])


def _finish(
    batch: list,
    pending: Pending,
    meta: Any,
    origin: tuple,
    nbytes: int,
    files: ChunkFiles,
    report: WriteReport,
    shard: ShardRecipe | None = None,
    budget: int = 0,
) -> None:
    """Take a batch's encoded chunks and hand them to the file threads, once the batches whose
    files are still being written hold no more than ``budget`` bytes of device memory with
    this one (a batch of unknown memory, once the files before it are written); ``shard``: the
    batch's units are shards, each written as one file."""
    t = time.perf_counter()
    per = len(shard.order) if shard is not None else 1
    try:
        encoded = pending.result()
    except EncodeError as exc:
        key = meta.encode_chunk_key(tuple(o + i for o, i in zip(origin, batch[exc.index // per])))
        inner = ""
        if shard is not None:
            grid = tuple(u // c for u, c in zip(shard.layout.shard_shape, shard.inner))
            inner = f" (inner chunk {tuple(int(i) for i in np.unravel_index(exc.index % per, grid))})"
        raise RuntimeError(f"{files.root}: chunk {key!r}{inner} was not written: {exc}") from exc
    w = time.perf_counter()
    report.encode_wait_s += w - t
    files.wait_within(budget, encoded.device_bytes)
    files.begin(encoded.device_bytes)
    report.file_wait_s += time.perf_counter() - w
    crcs = encoded.crc32c or [None] * len(encoded.chunks)
    if shard is not None:
        for u, idx in enumerate(batch):
            unit = tuple(o + i for o, i in zip(origin, idx))
            key = meta.encode_chunk_key(unit)
            pieces = encoded.chunks[u * per : (u + 1) * per]
            for j in _beyond(shard, unit, meta.shape):  # zarr-python stores none of them, empty or not
                pieces[j] = None
            written = sum(p is not None for p in pieces)
            report.empty += per - written
            if not written:  # every inner chunk holds only the fill value: no shard
                if files.overwrite:
                    files.remove(key)
                continue
            report.stored += files.put_shard(key, pieces, crcs[u * per : (u + 1) * per], shard)
            report.chunks += written
            report.nbytes += nbytes * written
        return
    for idx, enc, crc in zip(batch, encoded.chunks, crcs):
        key = meta.encode_chunk_key(tuple(o + i for o, i in zip(origin, idx)))
        if enc is None:
            report.empty += 1
            if files.overwrite:
                files.remove(key)
            continue
        files.put(key, enc, crc)
        report.chunks += 1
        report.stored += len(enc) + (4 if files.crc32c else 0)
        report.nbytes += nbytes


def _beyond(shard: ShardRecipe, unit: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    """The inner chunks (C order) of shard ``unit`` that lie wholly outside an array of
    ``shape`` (an edge shard's padding): never stored."""
    size = shard.layout.shard_shape
    grid = tuple(u // c for u, c in zip(size, shard.inner))
    if all((i + 1) * u <= n for i, u, n in zip(unit, size, shape)):
        return []
    return [
        j
        for j, pos in enumerate(np.ndindex(*grid))
        if any(i * u + p * c >= n for i, u, p, c, n in zip(unit, size, pos, shard.inner, shape))
    ]


def _streams(xp: Any, n: int) -> list:
    """``n`` CUDA streams of this thread for data on the GPU (a batch gathers and encodes on
    one while those before finish on the others), no stream on the host."""
    if xp is np:
        return [contextlib.nullcontext()]
    from ..runtime.buffers import side_stream, thread_stream, write_stream

    return [thread_stream(xp), side_stream(xp), *(write_stream(xp, k) for k in range(2, max(n, 2)))]
