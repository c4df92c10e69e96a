"""Broken input, memory and threads: clear errors, memory given back, nothing process-wide changed."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import tempfile
import threading
import time
import warnings

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host, run_in_threads

import cupy_xarray  # noqa: F401
from cupy_xarray.errors import ChunkError, OutOfMemoryError


def _ds(seed=0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    data = (np.sin(np.arange(16 * 12 * 10) / 50.0) * 20 + 280).astype("float32").reshape(16, 12, 10)
    return xr.Dataset({"air": (("t", "y", "x"), data + rng.integers(0, 3, data.shape).astype("float32"))})


def _write(path, compressors, shards=None, seed=0):
    enc = {"air": {"chunks": (4, 6, 10), "compressors": compressors}}
    if shards:
        enc["air"]["shards"] = shards
    ds = _ds(seed)
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=enc)
    return ds


def _meta(path):
    return json.loads((path / "air" / "zarr.json").read_text())


def _set_meta(path, meta):
    (path / "air" / "zarr.json").write_text(json.dumps(meta))


CHUNK = ("c", "1", "0", "0")


def _truncate(path):
    f = path.joinpath("air", *CHUNK)
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])


def _garbage(path):
    f = path.joinpath("air", *CHUNK)
    f.write_bytes(random.Random(0).randbytes(len(f.read_bytes())))


def _flip_crc(path):
    f = path.joinpath("air", *CHUNK)
    b = bytearray(f.read_bytes())
    b[-1] ^= 0xFF
    f.write_bytes(bytes(b))


def _shard_index_past_end(path):
    f = path.joinpath("air", "c", "0", "0", "0")
    b = bytearray(f.read_bytes())
    b[-16:-8] = (2**40).to_bytes(8, "little")  # last entry's offset (index at the end, no crc)
    f.write_bytes(bytes(b))


def _dtype_lie(path):
    meta = _meta(path)
    meta["data_type"] = "float64"
    _set_meta(path, meta)


def _shape_lie(path):
    meta = _meta(path)
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [4, 6, 20]
    meta["shape"] = [16, 12, 20]
    _set_meta(path, meta)


def _directory(path):
    f = path.joinpath("air", *CHUNK)
    f.unlink()
    f.mkdir()


ZSTD = zarr.codecs.ZstdCodec(level=1)
BLOSC_LZ4 = zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle")
BROKEN = {
    "truncated-zstd": (ZSTD, None, _truncate),
    "truncated-raw": (None, None, _truncate),
    "garbage-zstd": (ZSTD, None, _garbage),
    "garbage-gzip": (zarr.codecs.GzipCodec(), None, _garbage),
    "garbage-lz4": ("lz4", None, _garbage),
    "wrong-crc32c": ([ZSTD, zarr.codecs.Crc32cCodec()], None, _flip_crc),
    "shard-index-past-end": (ZSTD, (8, 12, 10), _shard_index_past_end),
    "dtype-lie-zstd": (ZSTD, None, _dtype_lie),
    "dtype-lie-raw": (None, None, _dtype_lie),
    "shape-lie": (ZSTD, None, _shape_lie),
    "chunk-is-directory": (ZSTD, None, _directory),
}


def _compressors(c):
    if c == "lz4":
        from zarr.codecs import numcodecs as zn

        return zn.LZ4()
    return c


@contextlib.contextmanager
def gpu_memory_returns(device):
    """Assert the cupy pool holds no more memory after the block than before it."""
    if device != "gpu":
        yield
        return
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    yield
    gc.collect()
    cupy.cuda.Device().synchronize()
    assert pool.used_bytes() <= before, f"{pool.used_bytes() - before} bytes of GPU memory still held"


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_input(tmp_path, device, case):
    compressors, shards, damage = BROKEN[case]
    good = tmp_path / "good.zarr"
    ref = _write(good, _compressors(compressors), shards, seed=1)
    bad = tmp_path / "bad.zarr"
    _write(bad, _compressors(compressors), shards)
    # warm up (nvCOMP, kvikio, pools) so what a failed read leaves behind can be measured
    xr.open_dataset(good, engine="kvikio", device=device).load()
    damage(bad)
    with gpu_memory_returns(device):
        with pytest.raises(ChunkError) as info:
            xr.open_dataset(bad, engine="kvikio", device=device).air.load()
        err = info.value
        assert err.array == "air"
        assert err.chunk.startswith("c/"), err.chunk
        assert str(bad) in err.path
        del info, err
    got = xr.open_dataset(good, engine="kvikio", device=device).load()
    np.testing.assert_array_equal(host(got.air.data), ref.air.values)


def test_permission_denied(device):
    root = tempfile.mkdtemp(prefix="cupy-xarray-perm-", dir="/tmp")
    try:
        os.chmod(root, 0o755)
        path = __import__("pathlib").Path(root) / "s.zarr"
        _write(path, ZSTD)
        os.chmod(path.joinpath("air", *CHUNK), 0o000)
        ds = xr.open_dataset(path, engine="kvikio", device=device)
        # root reads every file: drop to 'nobody' for the read itself, as CI runs as root
        drop = os.geteuid() == 0
        with gpu_memory_returns(device), pytest.raises(ChunkError, match="(?i)permission denied") as info:
            if drop:
                os.seteuid(65534)
            try:
                ds.air.load()
            finally:
                if drop:
                    os.seteuid(0)
        assert info.value.chunk == "c/1/0/0"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_out_of_memory_is_refused_before_allocating(tmp_path, device):
    path = tmp_path / "huge.zarr"
    # 1 TiB of float32 that is all fill value: metadata only, no chunk written
    zarr.create_array(
        path, name="air", shape=(2**19, 2**19), chunks=(4096, 4096), dtype="f4", dimension_names=["y", "x"]
    )
    ds = xr.open_dataset(path, engine="kvikio", device=device, consolidated=False)
    with gpu_memory_returns(device), pytest.raises(OutOfMemoryError, match=r"1024\.\d+ GiB.*chunks=") as info:
        ds.air.load()
    assert "'air'" in str(info.value)
    del info
    small = ds.air[:2, :3].load()  # a subset still reads
    assert (host(small.data) == 0).all()  # the fill value


def _short_store(path, compressors):
    # tiles: staged, then scattered (not read straight into the output)
    arr = zarr.create_array(
        path, shape=(32, 256, 1024), chunks=(2, 128, 512), dtype="f4", compressors=compressors
    )
    arr[:] = np.random.default_rng(3).standard_normal(arr.shape, dtype="f4").cumsum(axis=2)
    return arr


@pytest.mark.parametrize("compressors", [None, ZSTD], ids=["uncompressed", "zstd"])
def test_read_short_of_memory_takes_smaller_batches(tmp_path, device, options, monkeypatch, compressors):
    """A read whose output fits but whose batches do not: read again in smaller batches,
    the same values, and the report says so."""
    from cupy_xarray import record_reads
    from cupy_xarray.device import Device
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.engine.route import Scheduler

    arr = _short_store(tmp_path / "a.zarr", compressors)
    options(min_batch_bytes=2 * 2**20)
    real, refused = Device.empty, []

    def empty(self, shape, dtype):  # staging (flat bytes) above 5 MiB does not fit
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if len(shape) == 1 and np.dtype(dtype) == np.uint8 and n > 5 * 2**20:
            refused.append(n)
            raise MemoryError(f"no room for {n} bytes")
        return real(self, shape, dtype)

    monkeypatch.setattr(Device, "empty", empty)
    dev = resolve_device(device)
    with gpu_memory_returns(device), record_reads() as reports:
        (got,) = read_arrays(
            [(array_spec(arr), (slice(None),))],
            dev,
            batch_bytes=64 * 2**20,
            scheduler=Scheduler(force="batch"),
        )
        got = host(got)  # (the output on the device goes: only the failed attempts' memory counts)
    np.testing.assert_array_equal(got, arr[...])
    assert refused, "no allocation was refused: the test proves nothing"
    (report,) = reports
    assert report.notes and "memory ran short" in report.notes[0], report
    assert "note: memory ran short" in str(report)
    assert report.batches > 1 and report.staging_bytes <= 5 * 2**20


def test_read_short_of_memory_at_the_smallest_batches_raises(tmp_path, device, options, monkeypatch):
    from cupy_xarray.device import Device
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.engine.route import Scheduler

    arr = _short_store(tmp_path / "a.zarr", None)
    options(min_batch_bytes=2 * 2**20)
    real, tries = Device.empty, []

    def empty(self, shape, dtype):
        if len(shape) == 1 and np.dtype(dtype) == np.uint8:
            tries.append(int(np.prod(shape)))
            raise MemoryError("no room at all")
        return real(self, shape, dtype)

    monkeypatch.setattr(Device, "empty", empty)
    with pytest.raises(OutOfMemoryError, match="'a'|chunks="):
        read_arrays(
            [(array_spec(arr), (slice(None),))],
            resolve_device(device),
            batch_bytes=32 * 2**20,
            scheduler=Scheduler(force="batch"),
        )
    assert len(tries) >= 2 and min(tries) <= 2 * 2**20, tries  # it tried smaller ones first


@pytest.mark.gpu
def test_read_short_of_device_memory_succeeds(tmp_path, options):
    """Real device memory: all but a little beyond the output taken by another array; a read
    asked for batches that cannot fit still reads, slower, and says so."""
    import cupy

    from cupy_xarray import record_reads

    path = tmp_path / "big.zarr"
    arr = zarr.create_array(
        path, name="a", shape=(64, 2048, 2048), chunks=(4, 512, 512), dtype="f4", compressors=ZSTD,
        dimension_names=["t", "y", "x"],
    )  # fmt: skip
    ref = np.random.default_rng(4).standard_normal((64, 2048, 2048), dtype="f4").cumsum(axis=2)
    arr[:] = ref
    ds = xr.open_dataset(path, engine="kvikio", consolidated=False, batch_bytes=8 * 2**30, decode="gpu")
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    hog = cupy.empty(free - arr.nbytes - 700 * 2**20, dtype=cupy.uint8)  # 700 MiB left beyond the output
    try:
        with record_reads() as reports:
            got = ds.a.load().data
        assert reports[-1].notes, str(reports[-1])
        print(reports[-1])
        np.testing.assert_array_equal(got.get(), ref)
        del got
    finally:
        del hog
        pool.free_all_blocks()


@pytest.mark.gpu
def test_threads_mixing_gpu_and_cpu(tmp_path):
    import kvikio.defaults

    from cupy_xarray.engine.io import LINGER_S, restore_kvikio_threads

    paths, refs = [], []
    codecs = [ZSTD, None, zarr.codecs.GzipCodec(), [ZSTD, zarr.codecs.Crc32cCodec()]]
    for i, c in enumerate(codecs):
        p = tmp_path / f"s{i}.zarr"
        refs.append(_write(p, c, seed=i).air.values)
        paths.append(p)
    before_config = repr(zarr.config.config)
    restore_kvikio_threads()  # earlier tests' reads may still hold kvikio's count raised
    before_threads = kvikio.defaults.get("num_threads")
    reads = [0]
    stop = time.monotonic() + 20

    def work(k):
        rng = random.Random(k)
        while time.monotonic() < stop:
            i = rng.randrange(len(paths))
            device = "gpu" if (k + reads[0]) % 2 else "cpu"
            ds = xr.open_dataset(paths[i], engine="kvikio", device=device)
            sel = slice(rng.randrange(0, 8), rng.randrange(8, 16))
            got = ds.air[sel].load().data
            assert type(got).__module__.split(".")[0] == ("cupy" if device == "gpu" else "numpy"), (
                device,
                type(got),
            )
            np.testing.assert_array_equal(host(got), refs[i][sel], err_msg=f"{device} store {i} {sel}")
            reads[0] += 1

    errors = run_in_threads(work, 8)
    assert not errors, errors[:3]
    assert reads[0] > 100, reads[0]
    assert repr(zarr.config.config) == before_config
    time.sleep(LINGER_S + 0.5)  # kvikio's thread count goes back once our reads stop
    assert kvikio.defaults.get("num_threads") == before_threads, (
        kvikio.defaults.get("num_threads"),
        before_threads,
    )
    restore_kvikio_threads()
    print(f"{reads[0]} mixed reads by 8 threads, zero mismatches")


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["zstd", "blosc"])
def test_concurrent_reads_in_many_batches_are_exact(tmp_path, codec):
    """Threads reading at once, each in many batches whose staging memory is reused: no
    thread may see another's buffers."""
    from cupy_xarray import read_zarr_gds

    compressor = ZSTD if codec == "zstd" else zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle")
    rng = np.random.default_rng(1)
    refs = []
    for i in range(4):
        data = (np.cumsum(rng.normal(size=(32, 128, 256)), axis=2) + 100 * i).astype("float32")
        xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
            tmp_path / f"s{i}.zarr",
            zarr_format=3,
            encoding={"v": {"chunks": (2, 128, 256), "compressors": compressor}},
        )
        refs.append(data)

    def work(k):
        for r in range(4):
            i = (k + r) % 4
            got = read_zarr_gds(tmp_path / f"s{i}.zarr", batch_bytes=1 << 20).v.data
            np.testing.assert_array_equal(host(got), refs[i], err_msg=f"thread {k} store {i}")

    errors = run_in_threads(work, 4)
    assert not errors, errors[:2]


@pytest.mark.parametrize("choice", ["auto", "gpu", "cpu"])
def test_reads_in_threads_overlap(tmp_path, monkeypatch, device, choice):
    """Reads in two threads sharing one device run at the same time (no turn-taking, on the
    GPU each on its own stream), and each gets its own values."""
    from cupy_xarray import read_zarr_gds
    from cupy_xarray.engine.devices import cpu_device, gpu_device

    dev = gpu_device(4) if device == "gpu" else cpu_device(4)
    both_inside = threading.Barrier(2, timeout=20)
    inner = dev.io.session

    @contextlib.contextmanager
    def meeting_session(*args):
        with inner(*args) as s:
            both_inside.wait()  # broken (an error) unless the other read is inside too
            yield s

    monkeypatch.setattr(dev.io, "session", meeting_session)
    refs = [_write(tmp_path / f"s{i}.zarr", [ZSTD], seed=i).air.values for i in range(2)]

    def work(i):
        got = read_zarr_gds(tmp_path / f"s{i}.zarr", device=dev, decode=choice).air.data
        np.testing.assert_array_equal(host(got), refs[i])

    errors = run_in_threads(work, 2)
    assert not errors, errors[:2]


def test_opening_on_the_gpu_starts_cuda_once_per_device(monkeypatch):
    """The CUDA context is made on a background thread when a store is opened, once."""
    import threading

    from cupy_xarray import device as dev

    calls = []
    done = threading.Event()

    class Runtime:
        @staticmethod
        def getDevice():
            return 7

        @staticmethod
        def setDevice(i):
            calls.append(("set", i))

        @staticmethod
        def free(ptr):
            calls.append(("free", ptr))
            done.set()

    fake = type("cupy", (), {"cuda": type("cuda", (), {"runtime": Runtime})})
    monkeypatch.setattr(dev, "_started", set())
    dev.start_gpu(fake)
    assert done.wait(5)
    dev.start_gpu(fake)
    assert calls == [("set", 7), ("free", 0)]


@pytest.mark.parametrize("crowded", [False, True], ids=["alone", "beside-another-read"])
@pytest.mark.parametrize("compressors", [None, ZSTD], ids=["uncompressed", "zstd"])
def test_staging_alive_at_once_is_two_batches_worth(tmp_path, device, compressors, crowded):
    """A read in many batches holds at most two batches' worth of staging at a time: a
    compressed read the one decoding and the next one's reads, never a third; an uncompressed
    one alone more batches of half the size (the bound the documented peak memory rests on),
    but two where another read runs beside it (its reads keep the I/O threads busy)."""
    import contextlib
    import weakref

    from cupy_xarray import get_options
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import cpu_device, gpu_device
    from cupy_xarray.engine.read import RUNNING, Clock
    from cupy_xarray.engine.route import Scheduler

    dev = gpu_device(2) if device == "gpu" else cpu_device(2)
    data = (np.arange(16 * 64 * 64, dtype="float32") % 977).reshape(16, 64, 64)
    a = zarr.create_array(tmp_path / "s.zarr", data=data, chunks=(1, 32, 32), compressors=compressors)
    alive: list = []
    most = [0, 0]  # batches, bytes
    allocate = dev.empty

    def tracked(shape, dtype):
        buf = allocate(shape, dtype)
        if np.dtype(dtype) == np.uint8 and len(shape) == 1:  # a batch's staging
            alive.append(weakref.ref(buf))
            gc.collect()
            held = [r() for r in alive if r() is not None]
            most[0] = max(most[0], len(held))
            most[1] = max(most[1], sum(b.nbytes for b in held))
            del held
        return buf

    dev.empty = tracked
    request = (array_spec(a, name="v"), (slice(None),) * 3)
    batch = 16 * 1024
    # another read counted as running (as dask's tasks are, side by side)
    beside = RUNNING.running(Clock()) if crowded else contextlib.nullcontext()
    with beside:
        (got,) = read_arrays([request], dev, batch_bytes=batch, scheduler=Scheduler(force="batch"))
    np.testing.assert_array_equal(host(got), data)
    assert len(alive) >= 8, len(alive)  # many batches, each with its own staging
    depth = 2 if compressors or crowded else get_options().uncompressed_depth
    assert most[0] <= depth, f"{most[0]} batches' staging alive at once"
    chunk = 32 * 32 * 4  # a batch may pass its share by up to one chunk
    assert most[1] <= 2 * batch + depth * chunk, f"{most[1]} bytes of staging alive at once"


@pytest.mark.parametrize("compressors", [ZSTD, BLOSC_LZ4], ids=["zstd", "blosc"])
def test_a_reads_staging_buffers_are_one_size(tmp_path, monkeypatch, device, compressors):
    """Every batch of a read gets a staging buffer of one size, the largest batch's, though
    its chunks compress to different sizes: a buffer a little larger than the one freed
    before it would be carved out of the block a decode's output was freed from, which then
    no longer fits the next output, and the memory pool would grow by it."""
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.batches import BatchSource
    from cupy_xarray.engine.devices import cpu_device, gpu_device
    from cupy_xarray.engine.route import Scheduler

    dev = gpu_device(2) if device == "gpu" else cpu_device(2)
    rng = np.random.default_rng(3)
    data = np.zeros((16, 64, 64), dtype="float32")
    for i in range(16):  # each plane compresses to its own size: a different share is noise
        n = int(rng.integers(1, 4000))
        data[i].flat[rng.choice(64 * 64, n, replace=False)] = rng.random(n)
    a = zarr.create_array(tmp_path / "s.zarr", data=data, chunks=(1, 32, 32), compressors=compressors)
    seen: list[tuple[int, int]] = []  # per batch: its stored bytes, its staging buffer's size
    submit = BatchSource.submit

    def tracked(source, k, session):
        submit(source, k, session)
        batch = source.items[k]
        seen.append((sum(t.nbytes for t in batch), len(batch[0].staging)))

    monkeypatch.setattr(BatchSource, "submit", tracked)
    request = (array_spec(a, name="v"), (slice(None),) * 3)
    (got,) = read_arrays([request], dev, batch_bytes=12 * 1024, scheduler=Scheduler(force="batch"))
    np.testing.assert_array_equal(host(got), data)
    stored = [n for n, _ in seen]
    assert len(seen) >= 6 and len(set(stored)) > 1, stored  # batches of different sizes
    assert len({size for _, size in seen}) == 1, seen
    assert seen[0][1] < max(stored) + 256 * 6, seen  # the largest batch's, with its slots' alignment


def test_host_route_groups_small_chunks_into_jobs_and_reports_the_first_error(tmp_path):
    """Small chunks go to the pool a few at a time (every chunk once, in order, at least four
    jobs per thread), and a damaged chunk in the middle of a job is the error raised, naming it."""
    from types import SimpleNamespace

    from cupy_xarray import read_zarr_gds
    from cupy_xarray.engine import host
    from cupy_xarray.engine.devices import cpu_device

    def task(n):
        return SimpleNamespace(spec=SimpleNamespace(recipe=SimpleNamespace(nbytes=n)))

    from cupy_xarray import get_options

    small = [task(2**20) for _ in range(256)]
    jobs = host.groups(small, 16, get_options())
    assert [t for g in jobs for t in g] == small
    assert len(jobs) >= 64 and max(len(g) for g in jobs) == 4  # 4 MiB each
    assert len(host.groups(small[:20], 16, get_options())) == 20  # too few to share: one chunk per job
    big = [task(64 * 2**20) for _ in range(8)]
    assert host.groups(big, 4, get_options()) == [[t] for t in big]

    data = (np.arange(64 * 32 * 32, dtype="float32") % 101).reshape(64, 32, 32)
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
        tmp_path / "s.zarr", zarr_format=3, encoding={"v": {"chunks": (1, 32, 32), "compressors": ZSTD}}
    )
    dev = cpu_device(2)
    assert len(host.groups([task(4096)] * 64, dev.threads, get_options())) < 64  # jobs of several chunks
    np.testing.assert_array_equal(read_zarr_gds(tmp_path / "s.zarr", device=dev).v.values, data)
    for k in (9, 41):  # the first damaged chunk of each read is the one named
        victim = tmp_path / "s.zarr" / "v" / "c" / str(k) / "0" / "0"
        victim.write_bytes(victim.read_bytes()[:-7])
        with pytest.raises(ChunkError, match=r"v.*\b9/0/0\b"):
            read_zarr_gds(tmp_path / "s.zarr", device=dev)


def _reading_threads(monkeypatch, module) -> list:
    """The threads ``module.pread_into`` runs on from now on, in order (filled as it runs)."""
    threads = []
    real = module.pread_into

    def recorded(op):
        threads.append(threading.current_thread())
        real(op)

    monkeypatch.setattr(module, "pread_into", recorded)
    return threads


def test_small_cpu_reads_run_on_the_calling_thread(tmp_path, monkeypatch):
    """A CPU read of one chunk (or of little in all) reads on the calling thread, without a
    hand-off to the pool and back; larger reads go to the pool. Both get zarr's values."""
    from cupy_xarray import read_zarr_gds
    from cupy_xarray.engine import io

    data = (np.arange(8 * 256 * 256, dtype="float32") % 97).reshape(8, 256, 256)
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
        tmp_path / "s.zarr", zarr_format=3, encoding={"v": {"chunks": (1, 256, 256), "compressors": None}}
    )
    threads = _reading_threads(monkeypatch, io)
    ds = xr.open_dataset(tmp_path / "s.zarr", engine="kvikio", device="cpu")
    np.testing.assert_array_equal(ds.v[3].values, data[3])  # one chunk of 256 KiB
    assert threads == [threading.main_thread()]
    threads.clear()
    np.testing.assert_array_equal(read_zarr_gds(tmp_path / "s.zarr", device="cpu").v.values, data)
    assert len(threads) == 8 and threading.main_thread() not in threads  # 2 MiB: the pool's threads


def test_small_selections_of_large_chunks_are_read_on_the_calling_thread(tmp_path, monkeypatch, options):
    """What a host-route read with nothing else to wait for keeps on the calling thread is
    counted by the bytes it reads of each chunk (a small window of a 4 MiB chunk reads a
    span of it), not by the chunks' sizes; a window spanning more goes to the pool."""
    from cupy_xarray.engine import host

    data = (np.arange(2 * 2048 * 2048, dtype="float32") % 83).reshape(2, 2048, 2048)
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
        tmp_path / "s.zarr", zarr_format=3, encoding={"v": {"chunks": (1, 1024, 1024), "compressors": None}}
    )
    threads = _reading_threads(monkeypatch, host)
    ds = xr.open_dataset(tmp_path / "s.zarr", engine="kvikio", device="cpu")
    small = (1, slice(1020, 1040), slice(1020, 1050))  # 16 MiB of four chunks, 20 rows in all
    np.testing.assert_array_equal(ds.v[small].values, data[small])
    assert threads == [threading.main_thread()] * 4
    threads.clear()
    options(inline_bytes=64 * 1024)  # less than the four spans together
    ds = xr.open_dataset(tmp_path / "s.zarr", engine="kvikio", device="cpu")  # reads with it
    np.testing.assert_array_equal(ds.v[small].values, data[small])
    assert len(threads) == 4 and threading.main_thread() not in threads


@pytest.mark.parametrize("codec", ["zstd", "lz4", "gzip"])
def test_host_route_checks_framing_in_the_decoder_and_names_what_a_failed_decode_found(
    tmp_path, monkeypatch, codec
):
    """On CPU threads the host's library checks a stream as it decodes it: the engine's own
    framing walk runs only for a stream that failed, to say what is wrong with it."""
    from zarr.codecs import numcodecs as zn

    from cupy_xarray import read_zarr_gds
    from cupy_xarray.engine.decoders import chain
    from cupy_xarray.engine.devices import cpu_device

    data = (np.arange(16 * 64 * 64, dtype="float32") % 89).reshape(16, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numcodecs' LZ4 is not in zarr's v3 spec
        compressors = {"zstd": ZSTD, "lz4": zn.LZ4(), "gzip": zarr.codecs.GzipCodec(level=1)}[codec]
        enc = {"v": {"chunks": (2, 64, 64), "compressors": compressors}}
        xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(tmp_path / "s.zarr", zarr_format=3, encoding=enc)
    walked = []
    real = chain.stream_problem
    monkeypatch.setattr(chain, "stream_problem", lambda *a: walked.append(a[0]) or real(*a))
    dev = cpu_device(2)
    np.testing.assert_array_equal(read_zarr_gds(tmp_path / "s.zarr", device=dev).v.values, data)
    assert walked == []  # every stream decoded: nothing walked
    victim = tmp_path / "s.zarr" / "v" / "c" / "3" / "0" / "0"
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.raises(ChunkError, match=r"v.*\b3/0/0\b.*(truncated|corrupt)") as info:
        read_zarr_gds(tmp_path / "s.zarr", device=dev)
    assert walked == [codec]
    if codec == "zstd":  # the walk's words, not only the library's
        assert "runs past the end of the stored stream" in str(info.value)
