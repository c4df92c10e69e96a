"""Work shared as the read goes (:mod:`cupy_xarray.engine.share`): the batches take from the
front of one queue, CPU threads from its back. On the CPU the batches decode with the CPU
decoders (what nvCOMP does on a GPU), so CI runs the whole orchestration; the GPU run
repeats the reads with nvCOMP."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host, run_in_threads
from test_xarray_surface import _same_encoding

from cupy_xarray import record_reads
from cupy_xarray.engine import array_spec, read_arrays
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.engine.route import Scheduler
from cupy_xarray.engine.share import WorkQueue
from cupy_xarray.errors import ChunkError


def _tasks(sizes):
    out = []
    for i, n in enumerate(sizes):
        spec = SimpleNamespace(recipe=SimpleNamespace(nbytes=int(n), key=0))
        out.append(SimpleNamespace(spec=spec, index=i))
    return out


def test_the_batches_take_their_share_from_the_front_and_threads_from_the_back():
    q = WorkQueue(_tasks([100] * 10), front_bytes=500)
    assert [t.index for t in q.take_front(300)] == [0, 1, 2]  # the budget caps a batch
    assert [t.index for t in q.take_front(10_000)] == [3, 4]  # the rest of the planned share
    assert q.take_front(10_000) == []  # the CPU threads have not shown their pace yet
    assert [t.index for t in q.take_back(250)] == [9, 8]  # a job: up to 250 bytes of work
    assert [t.index for t in q.take_back(1, done=200)] == [7]  # one task at least
    assert q.back_done == 200 and q.back_rate() > 0
    # fixed_s 0: any work left is worth another batch once the CPU threads have started
    assert [t.index for t in q.take_front(10_000)] == [5, 6]
    assert q.take_back(1) == [] and q.take_front(1) == [] and q.left == 0 and q.back_ended


def test_the_batches_take_more_only_where_the_cpu_threads_lag():
    """After the planned share, a batch takes the rest only where the CPU threads, at the
    pace they showed in this read, need longer than one nvCOMP call for it."""
    q = WorkQueue(_tasks([100] * 10), front_bytes=200, fixed_s=3600.0)
    assert len(q.take_front(10_000)) == 2
    q.take_back(100)
    q.take_back(100, done=100)
    assert q.take_front(10_000) == []  # at their pace, an hour's call would not pay
    q.fixed_s = 1e-9
    assert len(q.take_front(10_000)) == 6 and q.left == 0
    q = WorkQueue(_tasks([100] * 4))  # no plan: half
    assert len(q.take_front(10_000)) == 2
    q.close()
    assert q.take_back(100) == [] and q.take_front(100) == []


@pytest.mark.parametrize("seed", range(5))
def test_every_task_is_taken_once_by_ends_racing(seed):
    """Batches and eight threads take from a queue at once: every task is taken exactly
    once, the batches' tasks come in stored order, and the counts add up."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5000, size=2000)
    q = WorkQueue(_tasks(sizes), front_bytes=int(rng.integers(0, 2_000_000)), max_ops=64)
    taken: list[list] = []
    lock = threading.Lock()

    def back(_):
        done = 0
        while got := q.take_back(int(rng.integers(1, 8000)), done):
            with lock:
                taken.append([t.index for t in got])
            done = sum(t.spec.recipe.nbytes for t in got)

    front = []
    threads = [threading.Thread(target=back, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        while th.is_alive() or len(q):
            got = q.take_front(int(rng.integers(1, 200_000)))
            assert len(got) <= 64
            front.extend(t.index for t in got)
            if not got and not th.is_alive():
                break
    for th in threads:
        th.join()
    everything = sorted(front + [i for job in taken for i in job])
    assert everything == list(range(2000))
    assert front == list(range(len(front)))  # a prefix, in order
    assert sum(q.front.values()) == len(front) and sum(q.back.values()) == 2000 - len(front)
    assert q.left == 0


# -- reads ------------------------------------------------------------------------------------


def _store(tmp_path, shape=(64, 128, 128), chunks=(2, 64, 64), name="s.zarr"):
    data = (np.arange(np.prod(shape), dtype="f4").reshape(shape) % 977) * 0.25
    zstd = zarr.codecs.ZstdCodec(level=1)
    a = zarr.create_array(str(tmp_path / name), shape=shape, chunks=chunks, dtype="f4", compressors=zstd)
    a[:] = data
    return zarr.open_array(str(tmp_path / name), mode="r")


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_shared_read_is_zarrs_and_both_ends_took_work(tmp_path, device):
    a = _store(tmp_path)
    spec = array_spec(a)
    n = int(np.prod(a.cdata_shape))
    both = []
    for _ in range(5):  # which end takes how much depends on the machine: both, in one read at least
        with record_reads() as reports:
            (got,) = read_arrays(
                [(spec, (slice(None),) * 3)], resolve_device(device), scheduler=Scheduler(force="share")
            )
        np.testing.assert_array_equal(host(got), a[...])
        (d,) = reports[-1].decisions
        assert d.shared and d.gpu + d.host == n and d.gpu > 0, d  # the batches draw first
        assert reports[-1].batches >= 1
        assert f"{d.gpu} chunks to nvCOMP, {d.host} to CPU threads" in str(reports[-1])
        both.append(d.host > 0)
    assert any(both), "the CPU threads took nothing in five reads"


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_damaged_chunk_in_a_shared_read_is_named(tmp_path, where):
    """Damage at the front (a batch takes it) or at the back (a CPU thread does): the read
    raises the chunk's error, ends, and the same read without the damage succeeds."""
    a = _store(tmp_path)
    spec = array_spec(a)
    key = "c/0/0/0" if where == "first" else "c/31/1/1"
    path = tmp_path / "s.zarr" / key
    good = path.read_bytes()
    path.write_bytes(good[:-40] + bytes(40))
    sched = Scheduler(force="share")
    with pytest.raises(ChunkError, match=key):
        read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"), scheduler=sched)
    path.write_bytes(good)
    (got,) = read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"), scheduler=sched)
    np.testing.assert_array_equal(got, a[...])


def test_shared_reads_in_threads_and_of_many_arrays(tmp_path):
    """Eight threads each read two arrays at once (two groups in one queue), selections of
    every size: every value is zarr-python's."""
    arrays = [_store(tmp_path, name=f"{k}.zarr", chunks=c) for k, c in enumerate([(2, 64, 64), (4, 32, 128)])]
    specs = [array_spec(a) for a in arrays]
    full = [a[...] for a in arrays]
    sched = Scheduler(force="share")
    cpu = resolve_device("cpu")

    def work(k):
        rng = np.random.default_rng(k)
        for _ in range(6):
            lo = rng.integers(0, [64, 128, 128])
            hi = lo + rng.integers(1, [64, 128, 128])
            sel = tuple(slice(int(x), int(y)) for x, y in zip(lo, hi))
            got = read_arrays([(s, sel) for s in specs], cpu, scheduler=sched)
            for g, f in zip(got, full):
                np.testing.assert_array_equal(g, f[sel])

    assert not run_in_threads(work, 8)


def test_the_dataset_read_under_a_shared_route_is_identical(tmp_path, options):
    """Through xarray: every chunk shared on the CPU (the ``force_route`` setting, kept by the
    lazily opened dataset) gives what engine='zarr' gives, encoding included."""
    ds = xr.Dataset(
        {"t": (("time", "y", "x"), np.random.default_rng(0).random((24, 64, 96), dtype="f4"))},
        coords={"time": np.arange(24)},
    )
    ds.to_zarr(tmp_path / "d.zarr", encoding={"t": {"chunks": (2, 32, 32)}}, zarr_format=3)
    options(force_route="share")
    lazy = xr.open_dataset(tmp_path / "d.zarr", engine="kvikio", device="cpu")
    options(force_route="auto")  # (the dataset reads with the settings it was opened with)
    with record_reads() as reports:
        got = lazy.load()
    want = xr.open_dataset(tmp_path / "d.zarr", engine="zarr").load()
    xr.testing.assert_identical(got, want)
    assert _same_encoding(got.t.encoding, want.t.encoding), (got.t.encoding, want.t.encoding)
    shared = [d for r in reports for d in r.decisions if d.shared]
    assert shared and all(d.gpu for d in shared)  # through the queue (its batch end draws first)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_missing_chunks_in_a_shared_read_are_the_fill_value(tmp_path, device):
    """The output is filled first, then both ends write their chunks: none is overwritten by
    the fill, and the missing ones read as zarr-python reads them."""
    a = _store(tmp_path)
    for key in ("c/0/0/0", "c/10/1/0", "c/31/1/1"):
        (tmp_path / "s.zarr" / key).unlink()
    spec = array_spec(a)
    want = zarr.open_array(str(tmp_path / "s.zarr"), mode="r")[...]
    sched = Scheduler(force="share")
    (got,) = read_arrays([(spec, (slice(None),) * 3)], resolve_device(device), scheduler=sched)
    np.testing.assert_array_equal(host(got), want)


def test_the_progress_bar_counts_what_both_ends_read(tmp_path, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total=0, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def refresh(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    a = _store(tmp_path)
    spec = array_spec(a)
    for _ in range(5):
        bars.clear()
        with record_reads() as reports:
            read_arrays(
                [(spec, (slice(None),) * 3)],
                resolve_device("cpu"),
                progress=True,
                scheduler=Scheduler(force="share"),
            )
        (d,) = reports[-1].decisions
        (bar,) = bars
        assert d.gpu and bar.n == bar.total > 0, (d, bar.n, bar.total)
        if d.host:  # the bar counted what the CPU threads took too
            return
    pytest.fail("the CPU threads took nothing in five reads")
