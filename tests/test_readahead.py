"""Read-ahead of dask tasks' boxes (:mod:`cupy_xarray.xarray.readahead`): the window, its order, what
is never read twice or kept, failures, and dask reads through it equal to zarr-python's."""

from __future__ import annotations

import pickle
import threading
import time
import warnings

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host

import cupy_xarray
from cupy_xarray import record_reads
from cupy_xarray.errors import ChunkError
from cupy_xarray.xarray.readahead import ReadAhead

SHAPE, BOX = (64, 64, 64), (4, 32, 32)  # a grid of 16 x 2 x 2 boxes


class Reads:
    """A fake array reader: records each read's keys and returns each box's first index."""

    def __init__(self, bad=()):
        self.calls: list[list[tuple]] = []
        self.bad = set(bad)
        self.lock = threading.Lock()

    def __call__(self, keys):
        with self.lock:
            self.calls.append(keys)
        for k in keys:
            if (k[0].start, k[1].start, k[2].start) in self.bad:
                raise ChunkError("damaged", array="f", chunk=str(k), path="f/c")
        return [(k[0].start, k[1].start, k[2].start) for k in keys]


def _boxes(order=1):
    boxes = [
        (slice(t, t + 4), slice(y, y + 32), slice(x, x + 32))
        for t in range(0, 64, 4)
        for y in (0, 32)
        for x in (0, 32)
    ]
    return boxes if order == 1 else boxes[::-1]


def _ask(ahead, key, budget=2**30, linger=5.0):
    handled, value = ahead.get(key, lambda: budget, linger)
    assert handled
    return value


@pytest.mark.parametrize("order", [1, -1])
def test_the_window_doubles_in_order_and_reads_no_box_twice(order):
    """Boxes asked in order (onwards or backwards, as dask may run them) are read in windows
    of 1, 2, 4, ... boxes; every box is read once and each ask gets its own box."""
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    for key in _boxes(order):
        assert _ask(ahead, key) == (key[0].start, key[1].start, key[2].start)
    sizes = [len(c) for c in reads.calls]
    assert sizes[:4] == [1, 2, 4, 8], sizes
    read = [k for c in reads.calls for k in c]
    assert sorted(map(str, read)) == sorted(map(str, _boxes())) and ahead.held() == 0
    assert ahead.hits == 64 - len(reads.calls)


def test_a_selection_read_once_reads_only_itself_and_out_of_order_starts_again():
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    boxes = _boxes()
    _ask(ahead, boxes[10])
    assert reads.calls == [[boxes[10]]]
    _ask(ahead, boxes[11])  # in order: two boxes
    assert reads.calls[-1] == boxes[11:13]
    _ask(ahead, boxes[40])  # a jump: one box again
    assert reads.calls[-1] == [boxes[40]]
    handled, _ = ahead.get((slice(1, 5), slice(0, 32), slice(0, 32)), lambda: 2**30, 5.0)
    assert not handled  # not a box of the grid: the caller reads it
    handled, _ = ahead.get((1, slice(0, 32), slice(0, 32)), lambda: 2**30, 5.0)
    assert not handled


def test_the_budget_caps_the_window():
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    box_bytes = 4 * 32 * 32 * 4
    for key in _boxes():
        _ask(ahead, key, budget=3 * box_bytes)
    assert max(len(c) for c in reads.calls) == 3


def test_boxes_not_asked_for_are_dropped_after_they_linger():
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    for key in _boxes()[:4]:  # windows 1, 2 (boxes 1-2), 4 (boxes 3-6): 3 left unasked
        _ask(ahead, key, linger=0.05)
    assert ahead.held() == 3
    deadline = time.monotonic() + 5
    while ahead.held() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ahead.held() == 0 and ahead.dropped == 3
    _ask(ahead, _boxes()[4], linger=0.05)  # dropped: read again, when asked
    assert _boxes()[4] in reads.calls[-1]


def test_a_failed_window_leaves_each_box_to_its_own_read():
    """A damaged chunk in a window fails only the ask for its box, with its own error; the
    window's other boxes are read again by the asks that wanted them."""
    bad = (8, 0, 0)  # box 8
    reads = Reads(bad=[bad])
    ahead = ReadAhead(SHAPE, 4, reads)
    boxes = _boxes()
    for key in boxes[:8]:
        _ask(ahead, key)
    # boxes 7..14 are one window: its read fails; 7's ask reads it alone
    assert reads.calls[-2] == boxes[7:15] and reads.calls[-1] == [boxes[7]]
    with pytest.raises(ChunkError, match=r"slice\(8, 12"):
        _ask(ahead, boxes[8])
    assert _ask(ahead, boxes[9]) == (8, 0, 32)


def test_threads_asking_at_once_each_get_their_box():
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    boxes = _boxes()
    got, errors = {}, []

    def work(i):
        try:
            for j in range(i, 64, 8):
                got[j] = _ask(ahead, boxes[j])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(got[j] == (b[0].start, b[1].start, b[2].start) for j, b in enumerate(boxes))
    assert sum(len(c) for c in reads.calls) == 64  # none read twice


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ahead") / "f.zarr"
    data = np.random.default_rng(0).standard_normal(SHAPE).astype("f4")
    ds = xr.Dataset({"f": (("t", "y", "x"), data)}, coords={"t": np.arange(64)})
    enc = {"f": {"chunks": BOX, "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=enc)
    return str(path)


def _open(store, device, chunks, mode):
    with cupy_xarray.set_options(read_ahead=mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_dataset(store, engine="kvikio", device=device, chunks=chunks, consolidated=False)


@pytest.mark.parametrize("chunks", [{}, "auto", {"t": 8}])
def test_dask_reads_through_read_ahead_equal_zarr(store, device, chunks):
    """A dask load with read-ahead equals zarr-python's (values, indexes, encoding), reads
    every chunk once, in fewer engine reads than dask tasks."""
    ref = xr.open_dataset(store, engine="zarr", chunks=chunks, consolidated=False)
    ds = _open(store, device, chunks, "on")
    tasks = ds["f"].data.npartitions
    with record_reads() as reports:
        got = ds.load()
    f = got["f"]
    assert type(f.data).__module__.split(".")[0] == ("cupy" if device == "gpu" else "numpy")
    xr.testing.assert_identical(got.copy(data={"f": host(f.data)}) if device == "gpu" else got, ref.load())
    reads = list({id(r): r for r in reports}.values())  # reads gathered across threads share one
    assert sum(r.chunks for r in reads) == 64
    if tasks > 1:
        assert len(reads) < tasks


def test_read_ahead_off_reads_each_task_alone(store):
    ds = _open(store, "cpu", {}, "off")
    with record_reads() as reports:
        ds.load()
    assert len(reports) == 64


def test_an_array_with_read_ahead_pickles_without_it(store):
    ds = _open(store, "cpu", {}, "on")
    graph = dict(ds["f"].data.__dask_graph__())
    source = next(v for v in graph.values() if hasattr(v, "direct"))
    ds.load()
    assert source.direct._readahead  # made by the reads above
    copy = pickle.loads(pickle.dumps(source))
    assert copy.direct._readahead is None
    np.testing.assert_array_equal(
        copy[(slice(0, 4), slice(0, 32), slice(0, 32))], ds["f"].values[:4, :32, :32]
    )


def test_auto_reads_ahead_for_dask_blocks_on_a_gpu_alone():
    """``read_ahead="auto"`` (the default) reads ahead for a dask task's block on a GPU, not
    for lazy selections or CPU reads; ``"on"`` for every read; whether the read is on a GPU
    is asked only where it matters."""
    from cupy_xarray.xarray.readahead import dask_block, wanted

    asked = []

    def gpu() -> bool:
        asked.append(1)
        return True

    assert not wanted("auto", gpu) and not asked  # a lazy selection
    with dask_block():
        assert wanted("auto", gpu) and asked
        assert not wanted("auto", lambda: False)  # a CPU read
        assert not wanted("off", gpu)
    assert wanted("on", lambda: False)


def test_dask_tasks_read_their_blocks_marked(store, monkeypatch):
    """A dask task's read of its block is marked as one, through xarray's wrappers or
    straight to the engine; a lazy selection's read is not."""
    from cupy_xarray.xarray import readahead

    seen = []

    def record(mode, on_gpu):
        seen.append(readahead.in_dask_block())
        return False

    monkeypatch.setattr(readahead, "wanted", record)
    chunked = _open(store, "cpu", {}, "auto")
    seen.clear()  # (the index read at open)
    chunked["f"].load()
    assert seen and all(seen)
    lazy = _open(store, "cpu", None, "auto")
    seen.clear()
    lazy["f"].isel(t=slice(0, 3)).load()
    assert seen and not any(seen)


def test_an_array_makes_one_read_ahead_when_its_first_tasks_arrive_together(store, monkeypatch):
    """dask's first tasks ask on several threads at once: one read-ahead serves them all (two
    would read the same boxes twice)."""
    import dask

    from cupy_xarray.xarray import backend

    made = []
    real = backend.ReadAhead

    def slow(shape, *args):
        time.sleep(0.05)  # the window in which a second thread would make its own
        ahead = real(shape, *args)
        if tuple(shape) == SHAPE:  # (not the index's, read at open)
            made.append(ahead)
        return ahead

    monkeypatch.setattr(backend, "ReadAhead", slow)
    ds = _open(store, "cpu", {}, "on")
    with dask.config.set(scheduler="threads", num_workers=8):
        got = ds["f"].load()
    assert len(made) == 1, len(made)
    ref = xr.open_dataset(store, engine="zarr", consolidated=False)["f"].load()
    np.testing.assert_array_equal(got.values, ref.values)
