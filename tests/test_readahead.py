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
from conftest import host, run_in_threads

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


def _ask(ahead, key, budget=2**30, linger=5.0, reads=None):
    handled, value = ahead.get(key, lambda: budget, linger)
    if not handled and reads is not None:  # read by the asker, as the backend does
        return reads([key])[0]
    assert handled
    return value


@pytest.mark.parametrize("order", [1, -1])
def test_the_window_doubles_in_order_and_reads_no_box_twice(order):
    """Boxes asked in order (onwards or backwards, as dask may run them) are read in windows
    of 1, 2, 4, ... boxes; every box is read once and each ask gets its own box. Backwards,
    the last boxes (which end at the array's end, and do not show a whole box's extent) are
    read by their askers until a box that does sets the grid."""
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    for key in _boxes(order):
        assert _ask(ahead, key, reads=reads) == (key[0].start, key[1].start, key[2].start)
    sizes = [len(c) for c in reads.calls]
    alone = 0 if order == 1 else 7  # (56:60, 0:32, 0:32), the 8th backwards, is a whole box
    assert sizes[: alone + 4] == [1] * alone + [1, 2, 4, 8], sizes
    read = [k for c in reads.calls for k in c]
    assert sorted(map(str, read)) == sorted(map(str, _boxes())) and ahead.held() == 0
    assert ahead.hits == 64 - len(reads.calls)


def test_a_selection_read_once_reads_only_itself_and_out_of_order_starts_again():
    reads = Reads()
    ahead = ReadAhead(SHAPE, 4, reads)
    boxes = _boxes()
    _ask(ahead, boxes[8])
    assert reads.calls == [[boxes[8]]]
    _ask(ahead, boxes[9])  # in order: two boxes
    assert reads.calls[-1] == boxes[9:11]
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
    got = {}

    def work(i):
        for j in range(i, 64, 8):
            got[j] = _ask(ahead, boxes[j])

    assert not run_in_threads(work, 8)
    assert all(got[j] == (b[0].start, b[1].start, b[2].start) for j, b in enumerate(boxes))
    assert sum(len(c) for c in reads.calls) == 64  # none read twice


def _asks_during_a_first_read(others: int, budget) -> tuple[Reads, ReadAhead, dict, list, list]:
    """Box 0 asked first, its read held until boxes 1..``others`` are asked on threads of
    their own (each waiting up to 0.3 s for the others): the reads made, the read-ahead, what
    each ask got, the errors raised and the threads (all ended, none waiting for ever)."""
    release, started = threading.Event(), threading.Event()
    reads = Reads()

    def slow(keys):
        if not started.is_set():
            started.set()
            release.wait(10)  # the first read runs while the other asks arrive
        return reads(keys)

    ahead = ReadAhead(SHAPE, 4, slow)
    boxes = _boxes()
    got, errors = {}, []

    def ask(j):
        try:
            got[j] = ahead.get(boxes[j], budget, 5.0, 0.3)[1]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    assert started.wait(5)
    threads = [first] + [threading.Thread(target=ask, args=(j,)) for j in range(1, others + 1)]
    for t in threads[1:]:
        t.start()
    time.sleep(0.1)
    release.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return reads, ahead, got, errors, threads


def _starts(j: int) -> tuple[int, int, int]:
    return 4 * (j // 4), 32 * (j // 2 % 2), 32 * (j % 2)


def test_asks_made_while_a_window_is_read_are_read_together_with_the_boxes_after_them():
    """dask starts a task on each thread at once: the asks that arrive while the first box is
    read gather (``wait_s``) into one window, which also reads as many boxes again after them;
    each ask gets its own box, none is read twice."""
    reads, ahead, got, errors, _ = _asks_during_a_first_read(5, lambda: 2**30)
    boxes = _boxes()
    assert not errors
    assert sorted(got) == list(range(6)) and all(got[j] == _starts(j) for j in got)
    assert len(reads.calls) == 2 and reads.calls[0] == [boxes[0]]
    assert sorted(map(str, reads.calls[1])) == sorted(map(str, boxes[1:11]))  # 5 asked, 5 after
    assert ahead.held() == 5


def test_a_party_whose_window_cannot_be_planned_answers_every_ask():
    """Where planning a gathered window fails (here its budget), its opener gets the error
    and the asks that joined it read their own boxes: none waits for ever."""

    def budget():
        raise RuntimeError("no memory figure")

    _, _, got, errors, _ = _asks_during_a_first_read(4, budget)
    assert len(errors) == 1 and "no memory figure" in str(errors[0])
    assert 0 in got and len(got) == 4  # the opener of the party (one of 1-4) got the error
    assert all(got[j] == _starts(j) for j in got)


def _dask_like_boxes(extent=(12, 48, 48)):
    """The boxes of a dask grid of ``extent`` over SHAPE, the last of each axis cut short."""
    axes = [[slice(a, min(a + e, n)) for a in range(0, n, e)] for e, n in zip(extent, SHAPE)]
    return [(t, y, x) for t in axes[0] for y in axes[1] for x in axes[2]]


def test_a_short_last_box_asked_first_does_not_set_the_grid():
    """dask's last box (cut short by the array's end) asked first is read by its asker; the
    grid comes from the next whole box, and every ask gets exactly its own box."""
    keys_read = []
    ahead = ReadAhead(SHAPE, 4, lambda keys: keys_read.extend(keys) or list(keys))
    boxes = _dask_like_boxes()
    handled, _ = ahead.get(boxes[-1], lambda: 2**30, 5.0)
    assert not handled
    for key in boxes[:-1]:
        assert _ask(ahead, key) == key
    assert sorted(map(str, keys_read)) == sorted(map(str, boxes[:-1]))  # none twice, the last not again


def test_threads_asking_in_any_order_each_get_their_own_box():
    """Asks of dask's threads in a shuffled order, gathering into windows: each gets its own
    box (its own shape), whatever box came first."""
    rng = np.random.default_rng(1)
    boxes = _dask_like_boxes()
    for _ in range(5):
        ahead = ReadAhead(SHAPE, 4, lambda keys: (time.sleep(0.002), list(keys))[1])
        order = rng.permutation(len(boxes))
        got, errors = {}, []

        def work(part, ahead=ahead, got=got, errors=errors):
            try:
                for i in part:
                    handled, value = ahead.get(boxes[i], lambda: 2**30, 5.0, 0.002)
                    got[i] = value if handled else boxes[i]
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(order[k::8],)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert all(got[i] == boxes[i] for i in range(len(boxes)))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ahead") / "f.zarr"
    data = np.random.default_rng(0).standard_normal(SHAPE).astype("f4")
    ds = xr.Dataset({"f": (("t", "y", "x"), data)}, coords={"t": np.arange(64)})
    enc = {"f": {"chunks": BOX, "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=enc)
    return str(path)


def _open(store, device, chunks, mode, wait=0.0, plan=True):
    settings = dict(read_ahead=mode, read_ahead_wait=wait, read_ahead_plan=plan)
    with cupy_xarray.set_options(**settings), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_dataset(store, engine="kvikio", device=device, chunks=chunks, consolidated=False)


@pytest.mark.parametrize(("wait", "plan"), [(0.0, True), (0.0, False), (0.002, False)])
@pytest.mark.parametrize("chunks", [{}, "auto", {"t": 8}, {"t": 12}])
def test_dask_reads_through_read_ahead_equal_zarr(store, device, chunks, wait, plan):
    """A dask load with read-ahead (planned from dask's graph, or guessed from the order of
    the asks, gathered into windows where ``read_ahead_wait`` is set; dask chunks cut short at
    the array's end) equals zarr-python's (values, indexes, encoding), reads every chunk
    once, in fewer engine reads than dask tasks."""
    ref = xr.open_dataset(store, engine="zarr", chunks=chunks, consolidated=False)
    ds = _open(store, device, chunks, "on", wait, plan)
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

    def record(mode, on_gpu, dask=False):
        if not dask:  # (a compute's plan asks before its tasks run)
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
