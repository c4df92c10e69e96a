"""Reads gathered across threads (:mod:`cupy_xarray.engine.gather`): the service's logic with
a stand-in read, then real reads on the CPU (``gather="on"``; GPU reads gather by default)."""

from __future__ import annotations

import contextvars
import threading
import time

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host

from cupy_xarray import record_reads
from cupy_xarray.engine import array_spec, read_arrays, reader
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.engine.gather import SERVICE, ReadService


class _Reads:
    """A stand-in for the engine's read: each request is a number, its output its square;
    a request ``"bad"`` fails the read it is in. The first read can be held until released."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, requests: list) -> tuple[list, list]:
        self.calls.append(list(requests))
        if len(self.calls) == 1:
            self.hold.wait(10)
        if "bad" in requests:
            raise ValueError("a damaged chunk")
        return [r * r for r in requests], [type("Report", (), {"gathered": 1})()]


def _in_threads(service, reads, parts, wait_s=5.0, most=1 << 40):
    results: dict = {}

    def one(k, requests):
        try:
            results[k] = service.read(requests, 10, "key", reads, None, wait_s, most)
        except Exception as exc:  # noqa: BLE001 - compared below
            results[k] = exc

    threads = [threading.Thread(target=one, args=(k, p)) for k, p in enumerate(parts)]
    return threads, results


def test_reads_that_arrive_while_one_runs_are_read_as_one():
    service, reads = ReadService(), _Reads()
    reads.hold.clear()
    threads, results = _in_threads(service, reads, [[k, k + 100] for k in range(8)], wait_s=0.5)
    threads[0].start()
    while not reads.calls:  # the first read runs alone, at once, and is held
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    while sum(len(p.members) for p in service._open.values()) < 7:  # the others joined one party
        time.sleep(0.001)
    reads.hold.set()
    for t in threads:
        t.join(10)
    assert reads.calls[0] == [0, 100] and len(reads.calls) == 2
    assert sorted(reads.calls[1]) == sorted(r for k in range(1, 8) for r in (k, k + 100))
    for k in range(8):
        assert results[k] == [k * k, (k + 100) ** 2]  # each caller its own outputs, in order
    assert service.parties == 1 and service.gathered == 7 and not service._open


def test_a_failed_party_is_read_again_caller_by_caller():
    service, reads = ReadService(), _Reads()
    reads.hold.clear()
    threads, results = _in_threads(service, reads, [[0], [1], ["bad"], [3]], wait_s=0.5)
    threads[0].start()
    while not reads.calls:
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    while sum(len(p.members) for p in service._open.values()) < 3:
        time.sleep(0.001)
    reads.hold.set()
    for t in threads:
        t.join(10)
    assert results[0] == [0] and results[1] == [1] and results[3] == [9]
    assert isinstance(results[2], ValueError)  # only its own read fails
    assert len(reads.calls) == 1 + 1 + 3  # alone, the party, then each of its three again


def test_a_read_alone_does_not_wait_and_a_leader_waits_no_longer_than_told():
    service, reads = ReadService(), _Reads()
    t0 = time.perf_counter()
    assert service.read([2], 10, "k", reads, None, 5.0, 1 << 40) == [4]
    assert time.perf_counter() - t0 < 1.0 and service.parties == 0  # no party, no wait
    service._active = 1  # another read runs: this one leads a party of one
    t0 = time.perf_counter()
    assert service.read([3], 10, "k", reads, None, 0.05, 1 << 40) == [9]
    assert 0.04 < time.perf_counter() - t0 < 2.0 and service.parties == 1


def test_no_member_waits_for_ever_when_the_leader_is_interrupted():
    class Stop(BaseException):
        pass

    service = ReadService()
    service._active = 1
    joined = threading.Event()

    def read(requests):
        joined.wait(5)
        raise Stop

    got: list = []

    def member():
        while not service._open:
            time.sleep(0.001)
        try:
            service.read([1], 10, "k", read, None, 5.0, 1 << 40)
        except Stop:
            got.append("stopped")
        joined.set()

    t = threading.Thread(target=member)
    t.start()
    with pytest.raises(Stop):
        service.read([0], 10, "k", read, None, 0.3, 1 << 40)
    t.join(10)
    assert got == ["stopped"]


def test_a_party_closes_when_full():
    service, reads = ReadService(), _Reads()
    service._active = 1
    t0 = time.perf_counter()
    done = []
    t = threading.Thread(target=lambda: done.append(service.read([1], 10, "k", reads, None, 30.0, 20)))
    t.start()
    while not service._open:
        time.sleep(0.001)
    assert service.read([2], 10, "k", reads, None, 30.0, 20) == [4]  # fills it: no 30 s wait
    t.join(10)
    assert done == [[1]] and time.perf_counter() - t0 < 10


# -- real reads -------------------------------------------------------------------------------


def _store(tmp_path):
    data = (np.arange(32 * 64 * 64, dtype="f4").reshape(32, 64, 64) % 101) * 0.5
    a = zarr.create_array(
        str(tmp_path / "s.zarr"), shape=data.shape, chunks=(1, 64, 64), dtype="f4",
        compressors=zarr.codecs.ZstdCodec(level=1),
    )  # fmt: skip
    a[:] = data
    return zarr.open_array(str(tmp_path / "s.zarr"), mode="r")


def test_concurrent_small_reads_are_gathered_and_each_gets_its_own(tmp_path, monkeypatch, options):
    options(gather="on", gather_wait=0.2)
    a = _store(tmp_path)
    spec = array_spec(a)
    want = a[...]
    real = reader._read_now
    first = threading.Event()

    def slow_first(*args, **kwargs):  # the read alone runs long enough for the others to arrive
        if not first.is_set():
            first.set()
            time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "_read_now", slow_first)
    before = SERVICE.gathered
    cpu = resolve_device("cpu")
    barrier = threading.Barrier(12)
    got, reports = {}, {}

    def work(k):
        barrier.wait()
        with record_reads() as mine:
            (out,) = read_arrays([(spec, (slice(k, k + 2), slice(None), slice(k, k + 30)))], cpu)
        got[k], reports[k] = out, mine

    # (each thread with the settings of the test: set_options is per context)
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work, k)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(12):
        np.testing.assert_array_equal(host(got[k]), want[k : k + 2, :, k : k + 30])
        assert len(reports[k]) == 1, reports[k]  # each caller's record_reads: the read it was in
    assert SERVICE.gathered - before >= 2
    assert any(r[0].gathered > 1 and "reads gathered into one" in str(r[0]) for r in reports.values())


def test_a_damaged_chunk_fails_only_the_reads_that_need_it(tmp_path, monkeypatch, options):
    from cupy_xarray.errors import ChunkError

    options(gather="on", gather_wait=0.2)
    a = _store(tmp_path)
    path = tmp_path / "s.zarr" / "c" / "5" / "0" / "0"
    path.write_bytes(path.read_bytes()[:-30] + bytes(30))
    spec = array_spec(a)
    real = reader._read_now
    first = threading.Event()

    def slow_first(*args, **kwargs):
        if not first.is_set():
            first.set()
            time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "_read_now", slow_first)
    cpu = resolve_device("cpu")
    barrier = threading.Barrier(6)
    got: dict = {}
    before = SERVICE.gathered

    def work(k):
        barrier.wait()
        try:
            got[k] = read_arrays([(spec, (slice(k, k + 1),))], cpu)[0]
        except ChunkError as exc:
            got[k] = exc

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work, k)) for k in range(2, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = zarr.open_array(str(tmp_path / "s.zarr"), mode="r")
    for k in range(2, 8):
        if k == 5:
            assert isinstance(got[k], ChunkError) and "c/5/0/0" in str(got[k])
        else:
            np.testing.assert_array_equal(host(got[k]), want[k : k + 1])
    assert SERVICE.gathered - before >= 2  # the damaged read was in a party


def test_dask_reads_through_the_service_are_engine_zarrs(tmp_path, options):
    options(gather="on")
    ds = xr.Dataset({"v": (("t", "y", "x"), _store(tmp_path)[...])})
    ds.to_zarr(tmp_path / "d.zarr", encoding={"v": {"chunks": (1, 64, 64)}}, zarr_format=3)
    before = SERVICE.reads
    got = xr.open_dataset(tmp_path / "d.zarr", engine="kvikio", device="cpu", chunks={}).compute()
    want = xr.open_dataset(tmp_path / "d.zarr", engine="zarr").compute()
    xr.testing.assert_identical(got, want)
    assert SERVICE.reads - before >= 32  # every dask task's read went through the service


def test_cpu_reads_do_not_gather_unless_asked(options):
    from cupy_xarray.options import get_options

    cpu = resolve_device("cpu")
    assert not reader._gathers(cpu, 1000, False, get_options())
    options(gather="on")
    assert reader._gathers(cpu, 1000, False, get_options())
    assert not reader._gathers(cpu, get_options().gather_read_bytes + 1, False, get_options())
    assert not reader._gathers(cpu, 1000, True, get_options())  # a progress bar: its own read
    with pytest.raises(ValueError, match="gather must be"):
        options(gather="always")
