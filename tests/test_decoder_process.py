"""The decoder process (engine/sandbox): start, batches, answers, a process that dies or
stalls on purpose, the watchdog, the restart and the re-decode on CPU threads. On the CPU the
process decodes with the CPU decoders (``decoder_process="on"``), the machinery GPU reads use
with nvCOMP; the tests marked gpu run it with nvCOMP."""

from __future__ import annotations

import threading
import time

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host

from cupy_xarray import record_reads
from cupy_xarray.engine import Scheduler, array_spec, read_arrays
from cupy_xarray.engine.decoders.base import DecodeFailure
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.engine.sandbox import DecoderLost, decode_batch, decoder_processes
from cupy_xarray.errors import ChunkError
from cupy_xarray.options import get_options


def _decode(srcs, expected, into):
    """zstd streams decoded in the CPU decoder process, with the settings in effect."""
    return decode_batch("zstd", srcs, expected, into, False, 0.01, options=get_options())


def _streams(count=6, n=40000):
    # of different sizes: an answer given to the wrong batch fails its size checks
    ramps = [np.arange(i, i + n + 256 * i, dtype="f4") for i in range(count)]
    data = [np.sin(r / 50).astype("f4").tobytes() for r in ramps]
    codec = numcodecs.Zstd(1)
    return data, [np.frombuffer(codec.encode(d), np.uint8) for d in data]


def test_batches_decode_in_the_process_and_come_back_equal():
    data, srcs = _streams()
    procs = decoder_processes("host")
    before = procs.batches
    outs, _ = _decode(srcs, [len(d) for d in data], None)
    assert [o.tobytes() for o in outs] == data
    into = [np.empty(len(d), np.uint8) for d in data]
    outs, _ = _decode(srcs, [len(d) for d in data], into)
    assert all(o is t for o, t in zip(outs, into)) and [t.tobytes() for t in into] == data
    assert procs.batches == before + 2


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_a_lost_process_is_named_bounded_and_replaced(fault, options):
    options(decoder_timeout=1.0, decoder_min_wait=0.5)
    data, srcs = _streams()
    procs = decoder_processes("host")
    _decode(srcs, [len(d) for d in data], None)  # started, with a spare
    lost = procs.lost
    procs.fail_next(fault)
    t0 = time.perf_counter()
    with pytest.raises(DecoderLost, match="died" if fault == "die" else "did not answer within 0.5 s"):
        _decode(srcs, [len(d) for d in data], None)
    assert time.perf_counter() - t0 < 5 and procs.lost == lost + 1
    outs, _ = _decode(srcs, [len(d) for d in data], None)  # the spare took over
    assert [o.tobytes() for o in outs] == data


def _rotated(data, srcs, k):
    return data[k:] + data[:k], srcs[k:] + srcs[:k]


def test_batches_from_several_threads_are_in_flight_at_once():
    # each thread's answer must come back to it: the batches differ, so a mixed-up answer fails
    data, srcs = _streams(count=8)
    _decode(srcs, [len(d) for d in data], None)  # started
    results: dict = {}

    def one(k):
        want, got = _rotated(data, srcs, k)
        for _ in range(3):
            outs, _ = _decode(got, [len(d) for d in want], None)
            results.setdefault(k, []).append([o.tobytes() for o in outs] == want)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [True] * 3 for k in range(8)}


def test_a_stall_loses_every_batch_in_flight_once(options):
    options(decoder_timeout=1.0, decoder_min_wait=0.5)
    data, srcs = _streams(count=4)
    procs = decoder_processes("host")
    _decode(srcs, [len(d) for d in data], None)  # started, with a spare
    lost = procs.lost
    procs.fail_next("stall")
    outcomes: list = []

    def one(k):
        want, got = _rotated(data, srcs, k)
        try:
            outs, _ = _decode(got, [len(d) for d in want], None)
            outcomes.append([o.tobytes() for o in outs] == want)
        except DecoderLost as exc:
            outcomes.append(str(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 < 5
    lost_here = [o for o in outcomes if not isinstance(o, bool)]
    assert lost_here and all(o is True for o in outcomes if isinstance(o, bool)), outcomes
    assert any("did not answer within" in o for o in lost_here), outcomes
    assert procs.lost == lost + 1  # one process lost, however many batches it held
    outs, _ = _decode(srcs, [len(d) for d in data], None)  # the spare
    assert [o.tobytes() for o in outs] == data


def test_a_stream_that_does_not_decode_is_named_by_its_index():
    data, srcs = _streams()
    bad = list(srcs)
    bad[4] = bad[4].copy()
    bad[4][:4] = 0  # no zstd frame
    with pytest.raises(DecodeFailure) as info:
        _decode(bad, [len(d) for d in data], None)
    assert info.value.index == 4
    wrong = [len(d) for d in data]
    wrong[2] += 8  # a stream that decodes to less than the chunk must hold
    with pytest.raises(DecodeFailure, match=f"{wrong[2]} bytes") as info:
        _decode(srcs, wrong, None)
    assert info.value.index == 2


COMPRESSORS = {
    "zstd": zarr.codecs.ZstdCodec(level=1),
    "gzip": zarr.codecs.GzipCodec(level=1),
    "blosc-zstd": zarr.codecs.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=4),
}


def _store(tmp_path, name):
    data = (np.arange(8 * 64 * 64, dtype="f4") % 97).reshape(8, 64, 64)
    path = tmp_path / f"{name}.zarr"
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (2, 32, 32), "compressors": COMPRESSORS[name]}}
    )
    return path, zarr.open_array(path / "v", mode="r")


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_the_engine_reads_through_the_process_and_again_on_cpu_threads(tmp_path, options, name):
    options(decoder_process="on", decoder_timeout=1.0, decoder_min_wait=0.5)
    path, arr = _store(tmp_path, name)
    spec, dev = array_spec(arr, name="v"), resolve_device("cpu")
    procs = decoder_processes("host")
    batches = procs.batches
    sel = (slice(None), slice(5, 60), slice(None))
    (got,) = read_arrays([(spec, sel)], dev, scheduler=Scheduler(force="batch"))
    np.testing.assert_array_equal(got, arr[sel])
    assert procs.batches > batches  # decoded there
    for fault in ("die", "stall"):  # the batch is decoded again on CPU threads: the same values
        lost = procs.lost
        procs.fail_next(fault)
        with record_reads() as reports:
            (got,) = read_arrays([(spec, sel)], dev, scheduler=Scheduler(force="batch"))
        np.testing.assert_array_equal(got, arr[sel])
        assert procs.lost == lost + 1
        (report,) = reports  # and the read's report says so
        assert any("decoded again on CPU threads" in n for n in report.notes), str(report)
    want = xr.open_dataset(path, engine="zarr").load()  # the default route of a CPU read too
    xr.testing.assert_identical(xr.open_dataset(path, engine="kvikio", device="cpu").load(), want)


def test_a_damaged_chunk_is_named_through_the_process(tmp_path, options):
    options(decoder_process="on")
    path, arr = _store(tmp_path, "zstd")
    victim = path / "v" / "c" / "1" / "0" / "1"
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0xFF  # the frame's magic number
    victim.write_bytes(bytes(raw))
    spec = array_spec(arr, name="v")
    with pytest.raises(ChunkError, match=r"c/1/0/1"):
        read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"), scheduler=Scheduler(force="batch"))


# -- on the GPU: nvCOMP in the decoder process ------------------------------------------------


def _zstd_store(tmp_path, t=16, name="zstd"):
    data = (np.sin(np.arange(t * 256 * 256, dtype="f4") / 300) * 50).reshape(t, 256, 256).astype("f4")
    path = tmp_path / "z.zarr"
    xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (1, 256, 256), "compressors": COMPRESSORS[name]}}
    )
    return path, data


ZSTD_STREAMS = ["zstd", "blosc-zstd"]  # zstd frames as a chunk, and inside Blosc's blocks


@pytest.mark.gpu
@pytest.mark.parametrize("name", ZSTD_STREAMS)
def test_gpu_reads_decode_zstd_in_the_decoder_process(tmp_path, name):
    path, data = _zstd_store(tmp_path, name=name)
    procs = decoder_processes("nvcomp")
    batches = procs.batches
    ds = xr.open_dataset(path, engine="kvikio", decode="gpu")
    got = ds.v.data
    np.testing.assert_array_equal(host(got), data)
    assert procs.batches > batches
    xr.testing.assert_identical(ds.load().cupy.as_numpy(), xr.open_dataset(path, engine="zarr").load())


@pytest.mark.gpu
@pytest.mark.parametrize("fault", ["die", "stall"])
@pytest.mark.parametrize("name", ZSTD_STREAMS)
def test_a_lost_gpu_decoder_process_leaves_this_process_and_its_data_intact(tmp_path, options, fault, name):
    import cupy

    options(decoder_timeout=2.0)
    path, data = _zstd_store(tmp_path, name=name)
    kept = cupy.arange(1 << 20, dtype=cupy.float32)
    procs = decoder_processes("nvcomp")
    assert xr.open_dataset(path, engine="kvikio", decode="gpu").v.data.shape == data.shape  # started
    lost = procs.lost
    procs.fail_next(fault)
    got = xr.open_dataset(path, engine="kvikio", decode="gpu").v.data
    np.testing.assert_array_equal(host(got), data)  # decoded again on CPU threads
    assert procs.lost == lost + 1
    assert bool((kept == cupy.arange(1 << 20, dtype=cupy.float32)).all())
    np.testing.assert_array_equal(host(xr.open_dataset(path, engine="kvikio", decode="gpu").v.data), data)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ZSTD_STREAMS)
def test_damaged_zstd_frames_raise_and_the_gpu_lives_on(tmp_path, name):
    import cupy

    path, data = _zstd_store(tmp_path, name=name)
    kept = cupy.arange(1 << 20, dtype=cupy.float32)
    rng = np.random.default_rng(7)
    victims = sorted((path / "v" / "c").rglob("*"))
    victims = [v for v in victims if v.is_file()]
    for _ in range(6):
        victim = victims[int(rng.integers(len(victims)))]
        raw = bytearray(victim.read_bytes())
        for _ in range(8):
            raw[int(rng.integers(6, len(raw)))] = int(rng.integers(256))
        victim.write_bytes(bytes(raw))
        try:
            _ = xr.open_dataset(path, engine="zarr").v.values
        except Exception:  # noqa: BLE001 - zarr-python found the damage: so must the engine
            for decode in ("auto", "gpu"):
                with pytest.raises(ChunkError):
                    _ = xr.open_dataset(path, engine="kvikio", decode=decode).v.data
        # (where neither finds it, a frame without a checksum decodes to what each decoder makes
        # of it: the values need not agree)
        assert bool((kept == cupy.arange(1 << 20, dtype=cupy.float32)).all())
    (tmp_path / "again").mkdir()
    path, data = _zstd_store(tmp_path / "again", name=name)  # this process reads on
    np.testing.assert_array_equal(host(xr.open_dataset(path, engine="kvikio").v.data), data)


# -- arenas kept between batches ----------------------------------------------------------------


def _shm_files():
    import glob
    import os

    return set(glob.glob(f"/dev/shm/cupy-xarray-{os.getpid()}-*"))


def test_an_arena_is_kept_for_the_next_batch_then_freed(options):
    options(arena_linger=0.4)
    data, srcs = _streams()
    pool = decoder_processes("host").arenas
    pool.release()
    made = pool.made
    for _ in range(3):
        outs, _ = _decode(srcs, [len(d) for d in data], None)
        assert [o.tobytes() for o in outs] == data
        del outs, _
    assert pool.made == made + 1  # one arena, mapped once by the process, for the three batches
    assert len(_shm_files()) == 1
    deadline = time.monotonic() + 5
    while _shm_files() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _shm_files()  # freed once no batch took it for arena_linger seconds


def test_no_arena_is_kept_with_no_linger(options):
    options(arena_linger=0)
    data, srcs = _streams()
    decoder_processes("host").arenas.release()
    outs, owner = _decode(srcs, [len(d) for d in data], None)
    assert [o.tobytes() for o in outs] == data
    del outs, owner
    assert not _shm_files()


def test_decoded_bytes_held_by_the_caller_are_not_overwritten(options):
    options(arena_linger=5)
    data, srcs = _streams()
    first, owner = _decode(srcs, [len(d) for d in data], None)
    other_data, other = _rotated(data, srcs, 3)
    # the same sizes: a free arena would fit, so the first one must not be free while held
    for _ in range(2):
        second, _ = _decode(other, [len(d) for d in other_data], None)
        assert [o.tobytes() for o in second] == other_data
    assert [o.tobytes() for o in first] == data
    del first, owner


@pytest.mark.gpu
def test_an_arena_is_filled_in_one_launch_at_any_alignment():
    """The streams copied into an arena (one kernel for the batch) land at their offsets,
    whole and nothing beside them: aligned and unaligned ends, empty and long ranges."""
    import cupy

    from cupy_xarray.engine.sandbox.arena import DeviceArena

    rng = np.random.default_rng(5)
    src = cupy.asarray(rng.integers(0, 256, 3_000_000, dtype=np.uint8))
    starts = rng.integers(0, 1_900_000, 300)
    starts[::2] &= ~15
    lens = rng.integers(0, 70_000, 300)
    lens[:4] = [0, 1, 1_000_000, 17]
    offs, pos = [], 0
    for k, n in enumerate(lens.tolist()):
        pos += int(rng.integers(0, 40))
        pos = -(-pos // 16) * 16 if k % 3 else pos  # two in three start 16-aligned
        offs.append(pos)
        pos += n
    offs = np.array(offs)
    arena = DeviceArena(int((offs + lens).max()) + 64)
    arena.array[:] = 0xAB
    arena.fill([src[s : s + n] for s, n in zip(starts, lens)], offs)
    got = arena.array.get()
    expected = np.full(arena.nbytes, 0xAB, dtype=np.uint8)
    host_src = src.get()
    for s, n, o in zip(starts, lens, offs):
        expected[o : o + n] = host_src[s : s + n]
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="past the end"):
        arena.fill([src[:100]], np.array([arena.nbytes - 50]))


def test_the_wait_for_a_starting_process_is_known():
    """A batch sent while the process starts would wait for it: what is left of its start is
    known (from its spawn), and nothing once it has answered or where none was started."""
    import time

    from cupy_xarray.engine.sandbox.client import START_S, DecoderProcesses

    procs = DecoderProcesses("host")
    try:
        assert procs.start_wait() == 0.0  # none started: nothing known to wait for
        procs.start()
        assert 0.0 < procs.start_wait() <= START_S
        deadline = time.monotonic() + 60
        while procs.start_wait() > 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # it answered (its "ready" waits in the pipe) or START_S passed: nothing left to wait
        assert procs.start_wait() == 0.0
    finally:
        procs.close()
