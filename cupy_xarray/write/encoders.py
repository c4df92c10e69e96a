"""Chunk encoders: a chunk's bytes in memory -> the bytes its file holds, many chunks a call.

One interface, three implementations: :class:`CPUEncoder` (numcodecs on CPU threads: the same
bytes zarr-python writes), :class:`GPUEncoder` (one nvCOMP call per batch of chunks in GPU
memory, crc32c computed there too, the compressed bytes copied to the host once) and
:class:`SharedEncoder` (a batch's chunks shared between the two, so that both work). ``start``
queues a batch and returns a :class:`Pending` at once, so that the files of one batch are
written while the next encodes.
What a chunk's codec chain asks for is a :class:`Recipe`; :func:`recipe_of` reads it from a
zarr array's metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..formats import blosc as blosc_format
from ..formats.sharding import ShardLayout, sharding
from ..formats.sharding import Unsupported as ReadUnsupported
from ..options import Options
from ..runtime.pools import kept_pool
from .nvcomp import MAX_CHUNK_BYTES, batched_encoder


class Unsupported(Exception):
    """A codec chain the engine's writer does not encode (zarr-python writes it instead)."""


@dataclass(frozen=True)
class ShardRecipe:
    """How a zarr v3 shard holds its inner chunks: their shape, the index's place and checksum
    (:class:`~cupy_xarray.formats.sharding.ShardLayout`), and the order the chunks are stored in
    (flat C-order positions in the shard's grid of inner chunks: zarr-python's order)."""

    layout: ShardLayout
    inner: tuple[int, ...]
    order: tuple[int, ...]


@dataclass(frozen=True)
class Recipe:
    """What turns a chunk's elements into its file: byte order and element order, an optional
    compressor (a zstd frame, or another numcodecs codec CPU threads run), an optional crc32c
    after it; for a sharded array, what makes each inner chunk's bytes, and ``shard``."""

    big_endian: bool = False
    order: str = "C"
    zstd_level: int | None = None  # None: no zstd
    zstd_checksum: bool = False
    crc32c: bool = False
    #: another compressor (Blosc, LZ4, gzip ...): the numcodecs codec zarr-python encodes with
    host_codec: Any = None
    #: zarr v2 hands its compressor the chunk as an array of its dtype (Blosc's typesize)
    typed: Any = None
    shard: ShardRecipe | None = None

    @property
    def compressed(self) -> bool:
        return self.zstd_level is not None or self.host_codec is not None


def _numcodecs_of(codec: Any) -> Any:
    """The numcodecs codec a zarr v3 bytes-to-bytes codec encodes with, or None."""
    for attr in ("_blosc_codec", "_gzip_codec", "_codec"):
        inner = getattr(codec, attr, None)
        if inner is not None and hasattr(inner, "encode"):
            return inner
    return None


def recipe_of(meta: Any) -> Recipe:
    """The recipe of a zarr v2 or v3 array's metadata; :class:`Unsupported` where its chain is
    not bytes -> [a compressor] -> [crc32c] (v3, or that chain inside sharding whose index is
    little-endian bytes [with crc32c]) or [a compressor], no filters (v2)."""
    import numcodecs

    chunk_shape(meta)  # a regular grid
    if getattr(meta, "zarr_format", 3) == 2:
        if meta.filters:
            raise Unsupported("v2 filters")
        comp = meta.compressor
        stored = np.dtype(
            meta.dtype.to_native_dtype() if hasattr(meta.dtype, "to_native_dtype") else meta.dtype
        )
        big = stored.byteorder == ">"
        if comp is None:
            return Recipe(big_endian=big, order=meta.order)
        if isinstance(comp, numcodecs.Zstd):
            cfg = comp.get_config()
            return Recipe(big, meta.order, int(cfg.get("level", 0)), bool(cfg.get("checksum", False)))
        if hasattr(comp, "encode"):
            return Recipe(big, meta.order, host_codec=comp, typed=stored)
        raise Unsupported(f"compressor {comp!r}")
    import zarr

    codecs = list(meta.codecs)
    if codecs and isinstance(codecs[0], zarr.codecs.ShardingCodec):
        if len(codecs) > 1:
            raise Unsupported("codecs after sharding")
        shard = _shard_recipe(codecs[0], chunk_shape(meta))
        inner = _chain_v3(list(codecs[0].codecs))
        return dataclasses.replace(inner, shard=shard)
    return _chain_v3(codecs)


def chunk_shape(meta: Any) -> tuple[int, ...]:
    """The shape of a zarr array's chunks (of its shards, where it is sharded);
    :class:`Unsupported` for a grid of chunks of several shapes (zarr's rectilinear grids)."""
    if getattr(meta, "zarr_format", 3) == 2:
        return tuple(meta.chunks)
    shape = getattr(meta.chunk_grid, "chunk_shape", None)
    if shape is None:
        raise Unsupported(f"chunk grid {type(meta.chunk_grid).__name__}")
    return tuple(shape)


def stream_shape(meta: Any, recipe: Recipe) -> tuple[int, ...]:
    """The shape of the chunks an encoder makes a stream of: the inner chunks of a sharded
    array, else its chunks."""
    return recipe.shard.inner if recipe.shard is not None else chunk_shape(meta)


def _shard_recipe(codec: Any, shard_shape: tuple[int, ...]) -> ShardRecipe:
    """What the reader knows of the shard (:func:`~cupy_xarray.formats.sharding.sharding`), and the
    order its chunks are stored in."""
    try:
        inner, _, layout = sharding((codec,), shard_shape)
    except ReadUnsupported as exc:
        raise Unsupported(str(exc)) from exc
    per_shard = tuple(s // c for s, c in zip(shard_shape, inner))
    return ShardRecipe(layout, inner, _stored_order(codec, per_shard))


def _stored_order(codec: Any, per_shard: tuple[int, ...]) -> tuple[int, ...]:
    """The order zarr-python stores a shard's inner chunks in (Morton order, or the codec's
    ``subchunk_write_order`` where this zarr has one), as flat C-order positions."""
    pick = getattr(codec, "_subchunk_order_iter", None)
    if pick is not None:
        coords = list(pick(per_shard, codec.subchunk_write_order))
    else:
        from zarr.core.indexing import morton_order_iter

        coords = list(morton_order_iter(per_shard))
    flat = np.ravel_multi_index(np.asarray(coords, dtype=np.intp).reshape(-1, len(per_shard)).T, per_shard)
    if sorted(flat.tolist()) != list(range(int(np.prod(per_shard)))):
        raise Unsupported(f"inner chunk order of {codec!r}")
    return tuple(int(i) for i in flat)


def _chain_v3(codecs: list) -> Recipe:
    """The recipe of a zarr v3 codec chain: bytes -> [a compressor] -> [crc32c]."""
    import zarr

    first = codecs.pop(0) if codecs else None
    if not isinstance(first, zarr.codecs.BytesCodec):
        raise Unsupported(f"first codec {first!r}")
    endian = getattr(first.endian, "value", first.endian)  # an Enum in zarr 3.1, a str in 3.4
    big = endian == "big"
    level, checksum, crc, other = None, False, False, None
    if codecs and isinstance(codecs[0], zarr.codecs.ZstdCodec):
        level, checksum = int(codecs[0].level), bool(codecs[0].checksum)
        codecs.pop(0)
    elif codecs and not isinstance(codecs[0], zarr.codecs.Crc32cCodec):
        other = _numcodecs_of(codecs[0])
        if other is None:
            raise Unsupported(f"codec {codecs[0]!r}")
        codecs.pop(0)
    if codecs and isinstance(codecs[0], zarr.codecs.Crc32cCodec):
        crc = True
        codecs.pop(0)
    if codecs:
        raise Unsupported(f"codecs {codecs!r}")
    return Recipe(big, "C", level, checksum, crc, other)


class EncodeError(RuntimeError):
    """Chunk ``index`` of a batch could not be encoded."""

    def __init__(self, index: int, text: str) -> None:
        super().__init__(text)
        self.index = index


@dataclass
class Encoded:
    """A batch's encoded chunks in host memory."""

    #: each chunk's file bytes (None: left out, it holds only the fill value)
    chunks: list
    #: each chunk's crc32c where the encoder computed it (None: the file threads compute it)
    crc32c: list | None = None
    #: device memory the chunks hold until their files are written (None: the whole batch's)
    device_bytes: int | None = None


class Pending:
    """An encode under way: :meth:`result` waits for it."""

    def __init__(self, finish: Callable[[], Encoded], device_bytes: int = 0) -> None:
        self._finish = finish
        #: device memory the batch holds until its result is taken
        self.device_bytes = device_bytes

    def result(self) -> Encoded:
        return self._finish()


def _rows(host: np.ndarray, nbytes: int, empty: np.ndarray | None) -> list:
    return [None if empty is not None and empty[k] else host[k, :nbytes] for k in range(host.shape[0])]


def _flags_to_host(empty: Any) -> tuple[np.ndarray | None, Any]:
    """Queue the copy of a GPU batch's fill-value flags into pinned host memory on the current
    stream: the host flags and an event that marks the batch (gathered, flagged) ready."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    flags = None
    if empty is not None:
        flags = pinned_host(len(empty)).view(np.bool_)
        _copy_to_host(flags.ctypes.data, empty.data.ptr, len(empty), stream)
    return flags, _record(stream)


class CPUEncoder:
    """numcodecs on CPU threads: the bytes zarr-python writes. Chunks on the GPU are copied to
    the host a batch at a time first."""

    name = "cpu"
    alignment = 1

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)

    def supports(self, recipe: Recipe, chunk_bytes: int = 0) -> bool:
        return True

    def batch_chunks(self, chunk_bytes: int, stride: int, host_bytes: int, recipe: Recipe) -> int:
        return max(1, host_bytes // max(stride, 1))

    def _codec(self, recipe: Recipe) -> Any:
        import numcodecs

        if recipe.zstd_level is not None:
            return numcodecs.Zstd(level=recipe.zstd_level, checksum=recipe.zstd_checksum)
        return recipe.host_codec

    def start(self, recipe: Recipe, buf: Any, nbytes: int, empty: Any) -> Pending:
        """Encode the first ``nbytes`` of each row of ``buf`` (a ``(chunks, stride)`` uint8
        array, host or GPU) but those ``empty`` marks. A thread copies a GPU row into a pinned
        buffer of its own once the batch is ready (nothing here waits for the GPU)."""
        from ..device import is_cupy_array

        ready = None
        on_gpu = is_cupy_array(buf)
        if on_gpu:
            empty, ready = _flags_to_host(empty)
        codec = self._codec(recipe)
        if codec is None:
            if ready is not None:
                ready.synchronize()
                chunks = [
                    None if empty is not None and empty[k] else DeviceChunk(buf, k * buf.strides[0], nbytes)
                    for k in range(buf.shape[0])
                ]
                return Pending(lambda: Encoded(chunks))
            rows = _rows(buf, nbytes, empty)
            return Pending(lambda: Encoded(rows))

        def one(k: int) -> np.ndarray | None:
            if ready is not None:
                ready.synchronize()
            if empty is not None and empty[k]:
                return None
            raw = DeviceChunk(buf, k * buf.strides[0], nbytes).to_host() if on_gpu else buf[k, :nbytes]
            typed = raw.view(recipe.typed) if recipe.typed is not None else raw
            return numcodecs_bytes(codec.encode(typed))  # new bytes: the thread's buffer is free

        pool = kept_pool("encode", self.threads)
        futures = [pool.submit(one, k) for k in range(buf.shape[0])]
        return Pending(lambda: Encoded([f.result() for f in futures]))


def numcodecs_bytes(encoded: Any) -> np.ndarray:
    import numcodecs

    return numcodecs.compat.ensure_ndarray(encoded).view(np.uint8).reshape(-1)


class GPUEncoder:
    """Chunks in GPU memory: zstd frames or LZ4 blocks by one nvCOMP call per batch, queued on
    the current stream; each chunk's bytes copied to the host once it finished.

    nvCOMP has no compression levels and writes no zstd content checksum: such chains go to
    :class:`CPUEncoder`, as do the other compressors.
    """

    name = "gpu"
    #: rows of a batch start at multiples of this (nvCOMP's alignment)
    alignment = 256

    def __init__(self, threads: int, options: Options) -> None:
        self.threads = max(1, threads)
        self.options = options

    @staticmethod
    def algorithm(recipe: Recipe) -> str | None:
        """The nvCOMP algorithm that makes the recipe's streams (Blosc's zstd streams too,
        :func:`blosc_zstd`), None for uncompressed chunks."""
        if recipe.zstd_level is not None or blosc_zstd(recipe) is not None:
            return "Zstd"
        if recipe.host_codec is not None and getattr(recipe.host_codec, "codec_id", "") == "lz4":
            return "LZ4"
        return None

    def supports(self, recipe: Recipe, chunk_bytes: int = 0) -> bool:
        if not recipe.compressed:
            return True
        algo = self.algorithm(recipe)
        if algo is None or recipe.zstd_checksum or chunk_bytes > MAX_CHUNK_BYTES[algo]:
            return False
        if algo == "LZ4" and chunk_bytes >= 2**31:  # numcodecs' LZ4 size prefix is an int32
            return False
        return batched_encoder(algo) is not None

    def batch_chunks(self, chunk_bytes: int, stride: int, host_bytes: int, recipe: Recipe) -> int:
        """Chunks per batch at most: enough frames for nvCOMP to fill the GPU (the
        ``write_gpu_batch_chunks`` option), the batches held at once (``write_in_flight``
        queued, one whose files are written) within a share of the free device memory (the
        ``memory_share`` option)."""
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        free += cupy.get_default_memory_pool().free_bytes()
        per_chunk = stride  # the row; compressed: its output slot and nvCOMP's scratch
        blosc = blosc_zstd(recipe)
        if blosc is not None and blosc[1]:
            per_chunk += stride  # the row shuffled
        algo = self.algorithm(recipe)
        if algo is not None:
            enc = batched_encoder(algo)
            per_chunk += enc.slot(enc.max_output(chunk_bytes)) + -(-enc.temp_bytes(64, chunk_bytes) // 64)
        options = self.options
        fit = int(options.memory_share * free) // ((options.write_in_flight + 1) * per_chunk)
        return max(1, min(options.write_gpu_batch_chunks, fit))

    def start(self, recipe: Recipe, buf: Any, nbytes: int, empty: Any) -> Pending:
        """Queue the batch on the current stream: nvCOMP's call, the crc32c of each chunk's
        file bytes, the copies of sizes, statuses and flags to the host. Its chunks stay in
        device memory (:class:`DeviceChunk`) until the file threads copy them out."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        n = buf.shape[0]
        flags = pinned_host(n).view(np.bool_) if empty is not None else None
        if flags is not None:
            _copy_to_host(flags.ctypes.data, empty.data.ptr, n, stream)
        algo = self.algorithm(recipe)
        row = buf.strides[0]
        if algo is None:
            crcs = None
            if recipe.crc32c:
                starts = buf.data.ptr + np.arange(n, dtype=np.uint64) * np.uint64(row)
                lens = np.full(n, nbytes, dtype=np.int64)
                crcs = _crc32c_to_host(cupy.asarray(starts), cupy.asarray(lens), n, lens, stream)
            done = _record(stream)

            def plain() -> Encoded:
                done.synchronize()
                keep = np.ones(n, bool) if flags is None else ~flags
                chunks = [DeviceChunk(buf, k * row, nbytes) if keep[k] else None for k in range(n)]
                return Encoded(chunks, _crc_list(crcs))

            return Pending(plain, buf.nbytes)
        blosc = blosc_zstd(recipe)
        src = buf
        if blosc is not None and blosc[1]:  # Blosc's byte shuffle, each chunk one block
            src = cupy.empty_like(buf)
            blosc_format.shuffle_rows(buf, src, nbytes, blosc[0])
        job = batched_encoder(algo).compress(src, nbytes, stream)
        prefix = int(nbytes).to_bytes(4, "little") if algo == "LZ4" else b""  # numcodecs' LZ4 frame
        crcs = None
        if recipe.crc32c and not prefix and blosc is None:  # (a crc32c covers the prefix too)
            crcs = _crc32c_to_host(job.ptrs, job.sizes, n, job.out.strides[0], stream)
        sizes = pinned_host(8 * n).view(np.uint64)
        statuses = pinned_host(4 * n).view(np.int32)
        _copy_to_host(sizes.ctypes.data, job.sizes.data.ptr, 8 * n, stream)
        _copy_to_host(statuses.ctypes.data, job.statuses.data.ptr, 4 * n, stream)
        done = _record(stream)
        held = [buf, empty, src, job]
        held_bytes = buf.nbytes + job.out.nbytes + job.keep[2].nbytes

        def compressed() -> Encoded:
            done.synchronize()
            out = held[-1].out
            held.clear()  # the input rows, nvCOMP's scratch: free once nvCOMP is done with them
            keep = np.ones(n, bool) if flags is None else ~flags
            bad = np.flatnonzero((statuses != 0) & keep)
            if len(bad):
                from ..runtime.nvcomp import status_text

                raise EncodeError(
                    int(bad[0]), f"nvCOMP {algo} could not compress it ({status_text(statuses[bad[0]])})"
                )
            slot = out.strides[0]
            if blosc is not None:
                chunks = [
                    _blosc_chunk(out, k * slot, int(sizes[k]), buf, k * row, nbytes, blosc) for k in range(n)
                ]
                return Encoded([c if keep[k] else None for k, c in enumerate(chunks)])
            if not self.options.write_pack_output:  # the chunks stay in their slots till written
                chunks = [
                    DeviceChunk(out, k * slot, int(sizes[k]), prefix) if keep[k] else None for k in range(n)
                ]
                return Encoded(chunks, _crc_list(crcs))
            dense, at, ready = _packed(out, sizes, keep, stream)
            chunks = [
                DeviceChunk(dense, at[k], int(sizes[k]), prefix, ready) if keep[k] else None for k in range(n)
            ]
            return Encoded(chunks, _crc_list(crcs), dense.nbytes)

        return Pending(compressed, held_bytes + (src.nbytes if src is not buf else 0))


def blosc_zstd(recipe: Recipe) -> tuple[int, bool] | None:
    """``(typesize, byte shuffle)`` where the recipe's compressor is Blosc with zstd streams
    whose chunks nvCOMP may make (written as one block each: a layout every Blosc reader
    decodes), without bit shuffle, the automatic shuffle or a block size asked for; else None."""
    codec = recipe.host_codec
    if codec is None or getattr(codec, "codec_id", "") != "blosc":
        return None
    cfg = codec.get_config()
    cname = cfg.get("cname")
    cname = cname.decode() if isinstance(cname, bytes) else cname
    if (
        cname != "zstd"
        or cfg.get("clevel", 0) < 1
        or cfg.get("blocksize", 0)
        or cfg.get("shuffle") not in (0, 1)
    ):
        return None
    # numcodecs takes the element size from the codec (zarr v3), else from the array it is given (v2)
    typesize = getattr(codec, "_typesize", None) or getattr(codec, "typesize", None)
    if not typesize:
        typesize = recipe.typed.itemsize if recipe.typed is not None else 1
    return int(typesize), cfg["shuffle"] == 1


def _packed(out: Any, sizes: np.ndarray, keep: np.ndarray, stream: Any) -> tuple[Any, list, Any]:
    """A batch's compressed chunks (each in a slot of the largest size it may take, most of it
    unused) copied one after another into a buffer of their size, queued on ``stream``: the
    buffer, each chunk's offset in it, and an event that marks it filled. The slots can go at
    once; the file threads copy out of the buffer, however far they are behind."""
    import cupy

    lens = np.where(keep, sizes.astype(np.int64), 0)
    at = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    with stream:  # its memory returns to the stream the copies into it were queued on
        dense = cupy.empty((max(int(lens.sum()), 1),), dtype=cupy.uint8)
    rt, slot = cupy.cuda.runtime, out.strides[0]
    for k in np.flatnonzero(lens).tolist():
        dst, src = dense.data.ptr + at[k], out.data.ptr + k * slot
        rt.memcpyAsync(dst, src, int(lens[k]), rt.memcpyDeviceToDevice, stream.ptr)
    return dense, at, _record(stream)


def _blosc_chunk(
    out: Any, at: int, csize: int, rows: Any, row_at: int, nbytes: int, blosc: tuple
) -> DeviceChunk:
    """A Blosc chunk of one zstd block, or of the chunk's bytes as they are where the stream
    is no smaller than them."""
    typesize, shuffled = blosc
    if blosc_format.one_block_fits(nbytes, csize):
        return DeviceChunk(out, at, csize, blosc_format.one_block_prefix(nbytes, typesize, shuffled, csize))
    return DeviceChunk(rows, row_at, nbytes, blosc_format.memcpyed_prefix(nbytes, typesize))


class DeviceChunk:
    """A chunk's file bytes in device memory: ``nbytes`` at ``offset`` of ``owner`` (a cupy
    array, kept alive), after ``prefix`` (host bytes). A file thread copies it into a pinned
    buffer of its own (:meth:`to_host`) once ``ready`` (a CUDA event, where given) happened:
    no batch-sized block of page-locked memory, whose first allocation costs more than the
    copies (about 0.45 s for 300 MB on an H200)."""

    __slots__ = ("owner", "offset", "nbytes", "prefix", "ready")

    def __init__(self, owner: Any, offset: int, nbytes: int, prefix: bytes = b"", ready: Any = None) -> None:
        self.owner, self.offset, self.nbytes, self.prefix, self.ready = owner, offset, nbytes, prefix, ready

    def __len__(self) -> int:
        return len(self.prefix) + self.nbytes

    def to_host(self) -> np.ndarray:
        """The file bytes in this thread's pinned buffer (valid until its next call here)."""
        import cupy

        from ..runtime.buffers import thread_buffer, thread_stream

        p = len(self.prefix)
        host = thread_buffer("write", p + self.nbytes, pinned=True)
        host[:p] = np.frombuffer(self.prefix, np.uint8)
        stream = thread_stream(cupy)
        if self.ready is not None:
            stream.wait_event(self.ready)
        _copy_to_host(host.ctypes.data + p, self.owner.data.ptr + self.offset, self.nbytes, stream)
        stream.synchronize()
        return host


def _crc32c_to_host(ptrs: Any, lens: Any, n: int, bound: Any, stream: Any) -> np.ndarray:
    """Queue the crc32c of ``n`` device streams and its copy into pinned host memory."""
    from ..runtime.checksums import crc_start

    values = crc_start("crc32c", ptrs, lens, n, bound)
    host = pinned_host(4 * n).view(np.uint32)
    _copy_to_host(host.ctypes.data, values.data.ptr, 4 * n, stream)
    return host


def _crc_list(crcs: np.ndarray | None) -> list | None:
    return None if crcs is None else crcs.tolist()


class SharedEncoder:
    """A batch shared between nvCOMP and CPU threads: its last rows (a share of
    :meth:`~cupy_xarray.options.Options.write_cpu_share` for the algorithm, between 0 and 1)
    copied out and compressed by numcodecs on CPU threads while nvCOMP compresses the others.
    CPU threads write libzstd's frames: the files read the same. (No algorithm's share is
    between 0 and 1 by default: on an H200 it was no faster.)"""

    name = "gpu+cpu"

    def __init__(self, gpu: Any, cpu: CPUEncoder, options: Options) -> None:
        self.gpu, self.cpu, self.options = gpu, cpu, options
        self.alignment = gpu.alignment

    def share(self, recipe: Recipe) -> float:
        """The share of a batch's chunks CPU threads compress."""
        return self.options.write_cpu_share(GPUEncoder.algorithm(recipe) or "")

    def supports(self, recipe: Recipe, chunk_bytes: int = 0) -> bool:
        return 0 < self.share(recipe) < 1 and self.gpu.supports(recipe, chunk_bytes)

    def batch_chunks(self, chunk_bytes: int, stride: int, host_bytes: int, recipe: Recipe) -> int:
        return self.gpu.batch_chunks(chunk_bytes, stride, host_bytes, recipe)

    def start(self, recipe: Recipe, buf: Any, nbytes: int, empty: Any) -> Pending:
        n = buf.shape[0]
        k = n - round(n * self.share(recipe))
        # the CPU rows' copy is queued first: nvCOMP's call after it on the stream
        cpu = self.cpu.start(recipe, buf[k:], nbytes, None if empty is None else empty[k:]) if k < n else None
        gpu = self.gpu.start(recipe, buf[:k], nbytes, None if empty is None else empty[:k]) if k else None

        def both() -> Encoded:
            first = gpu.result() if gpu is not None else Encoded([])
            if cpu is None:
                return first
            rest = cpu.result()
            crcs = None if first.crc32c is None else first.crc32c + [None] * len(rest.chunks)
            return Encoded(first.chunks + rest.chunks, crcs)

        return Pending(both, gpu.device_bytes if gpu is not None else buf.nbytes)


def pinned_host(nbytes: int) -> np.ndarray:
    """Page-locked host memory (a batch's sizes, statuses, flags and checksums)."""
    from ..runtime.buffers import pinned_buffer

    return pinned_buffer(nbytes)[:nbytes]


def _copy_to_host(dst: int, src: int, nbytes: int, stream: Any) -> None:
    import cupy

    if nbytes:
        rt = cupy.cuda.runtime
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToHost, stream.ptr)


def _record(stream: Any) -> Any:
    import cupy

    done = cupy.cuda.Event(block=True, disable_timing=True)
    done.record(stream)
    return done
