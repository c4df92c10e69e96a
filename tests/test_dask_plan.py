"""The read-ahead planned from dask's graph (:mod:`cupy_xarray.xarray.dask_plan`): a compute's
blocks read in windows of what its tasks will ask, selections read nothing more, the plan ends
with the compute, failures stay each block's own; results equal zarr-python's."""

from __future__ import annotations

import warnings
from pathlib import Path

import dask
import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host, run_in_threads

import cupy_xarray
from cupy_xarray import record_reads
from cupy_xarray.errors import ChunkError
from cupy_xarray.xarray import dask_plan
from cupy_xarray.xarray.chunked import EngineChunkSource
from cupy_xarray.xarray.readahead import ReadAhead

SHAPE, BOX = (64, 64, 64), (4, 32, 32)  # 16 x 2 x 2 chunks of 16 KiB
CHUNKS = 64


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "f.zarr"
    rng = np.random.default_rng(1)
    ds = xr.Dataset(
        {
            "f": (("t", "y", "x"), rng.standard_normal(SHAPE).astype("f4")),
            "g": (("t", "y", "x"), rng.integers(0, 100, SHAPE).astype("i2")),
        },
        coords={"t": np.arange(64)},
    )
    ds["g"].encoding.update(scale_factor=0.5, _FillValue=-1)
    enc = {v: {"chunks": BOX, "compressors": zarr.codecs.ZstdCodec(level=1)} for v in ("f", "g")}
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=enc)
    return str(path)


def _open(store, chunks, device="cpu", **settings):
    settings.setdefault("read_ahead", "on")
    with cupy_xarray.set_options(**settings), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_dataset(store, engine="kvikio", device=device, chunks=chunks, consolidated=False)


def _ref(store, chunks=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_dataset(store, engine="zarr", chunks=chunks, consolidated=False)


def _reads(reports) -> list:
    return list({id(r): r for r in reports}.values())  # (reads gathered across threads share one)


def _ahead(ds, name="f") -> ReadAhead | None:
    """The read-ahead of a dask-backed variable (made where the settings have one)."""
    graph = dict(ds[name].data.__dask_graph__())
    source = next(v for v in graph.values() if isinstance(v, EngineChunkSource))
    return source.engine._ahead(planning=True)


@pytest.mark.parametrize("chunks", [{}, "auto", {"t": 8}, {"t": 12, "y": 48}])
def test_a_dask_load_reads_its_chunks_in_one_window(store, device, chunks):
    """With the plan, a load of a variable is one engine read of its 64 chunks, whatever the
    dask chunks (cut short at the array's end included), and equals zarr-python's (values,
    indexes, encoding); CF-decoded variables too."""
    ds = _open(store, chunks, device)
    ahead, tasks = _ahead(ds), ds["f"].data.npartitions
    with record_reads() as reports, dask.config.set(scheduler="threads", num_workers=8):
        got = ds.load()
    reads = _reads(reports)
    assert sorted(r.arrays[0] for r in reads) == ["f", "g"], [r.chunks for r in reads]
    if chunks != {"t": 12, "y": 48}:  # (whose dask chunks share zarr chunks)
        assert [r.chunks for r in reads] == [CHUNKS, CHUNKS]
    if device == "gpu":
        got = got.copy(data={k: host(v.data) for k, v in got.data_vars.items()})
    xr.testing.assert_identical(got, _ref(store, chunks).load())
    assert not ahead._plans and not ahead.held()  # the plan ended with the compute
    assert ahead.hits or tasks == 1


@pytest.mark.parametrize("route", ["batch", "auto"])
@pytest.mark.parametrize("chunks", [{}, {"t": 8}])
def test_blocks_handed_out_as_they_are_placed_equal_zarr(store, device, chunks, route, monkeypatch):
    """With ``read_ahead_early``, a window's blocks go to their tasks as the batches or the
    CPU threads place them (many hand-outs in one read), and the load equals
    zarr-python's."""
    from cupy_xarray.engine.read import Read

    handed = []
    real = Read.hand_out

    def hand_out(self, placed):  # (the batches' outputs, where handed out early)
        if self.ready is not None:
            handed.append(len(placed))
        real(self, placed)

    monkeypatch.setattr(Read, "hand_out", hand_out)
    early = dict(read_ahead_early=True, force_route=route, batch_bytes=64 * 2**10)
    # (a small GPU read assembled on the host first is handed out at its end)
    ds = _open(store, chunks, device, host_assembly_bytes=0, **early)
    with record_reads() as reports, dask.config.set(scheduler="threads", num_workers=8):
        got = ds.load()
    assert [r.chunks for r in _reads(reports)] == [CHUNKS, CHUNKS]
    assert len(handed) >= 8, handed  # (a batch holds at most four 16 KiB chunks' stored bytes)
    if device == "gpu":
        got = got.copy(data={k: host(v.data) for k, v in got.data_vars.items()})
    xr.testing.assert_identical(got, _ref(store, chunks).load())


def test_the_budget_splits_the_windows_and_every_chunk_is_read_once(store):
    """``read_ahead_bytes`` of a quarter of the array: windows of at most a quarter, every
    chunk read once."""
    nbytes = 64 * 64 * 64 * 4
    ds = _open(store, {}, read_ahead_bytes=nbytes // 4)
    with record_reads() as reports, dask.config.set(scheduler="threads", num_workers=4):
        got = ds["f"].load()
    reads = _reads(reports)
    assert sum(r.chunks for r in reads) == CHUNKS
    assert max(r.chunks for r in reads) <= CHUNKS // 4 and len(reads) >= 4
    np.testing.assert_array_equal(got.values, _ref(store)["f"].values)


@pytest.mark.parametrize(
    ("select", "needs"),
    [
        (lambda a: a.isel(t=5), 4),
        (lambda a: a.isel(t=slice(10, 14), x=slice(0, 16)), 4),
        (lambda a: a.isel(t=[3, 40]), 8),
        (lambda a: a.isel(t=slice(0, 16)).mean("t"), 16),
    ],
)
def test_a_selection_reads_only_its_chunks(store, select, needs):
    """A selection of a dask-backed variable (fused into each block's read by dask) reads
    the chunks it lies in, once, and equals zarr-python's with the same dask chunks."""
    ds = _open(store, {})
    with record_reads() as reports:
        got = select(ds["f"]).compute()
    xr.testing.assert_identical(got, select(_ref(store, {})["f"]).compute())
    assert sum(r.chunks for r in _reads(reports)) == needs


def test_a_reduction_finds_the_block_reads_in_fused_tasks(store):
    """dask fuses each block's read with the reduction's first step; the plan finds the reads
    there: the mean's chunks are read in one window."""
    ds = _open(store, {"t": 8})
    with record_reads() as reports:
        got = (ds["f"] * 2).mean(("y", "x")).compute()
    assert [r.chunks for r in _reads(reports)] == [CHUNKS]
    xr.testing.assert_identical(got, (_ref(store, {"t": 8})["f"] * 2).mean(("y", "x")).compute())


def test_without_the_plan_the_read_ahead_guesses_as_before(store, monkeypatch):
    """A compute whose graph shows no plan (dask.distributed's workers, a dask without the task
    spec) reads ahead from the order of the asks: fewer reads than tasks, equal values."""
    monkeypatch.setattr(dask_plan.ComputePlan, "block_reads", lambda *args: iter(()))
    ds = _open(store, {})
    with record_reads() as reports, dask.config.set(scheduler="threads", num_workers=4):
        got = ds["f"].load()
    reads = _reads(reports)
    assert sum(r.chunks for r in reads) == CHUNKS and 1 < len(reads) < CHUNKS
    np.testing.assert_array_equal(got.values, _ref(store)["f"].values)


def test_read_ahead_plan_false_guesses(store):
    """``read_ahead_plan=False``: the read-ahead guesses from the order of the asks."""
    ds = _open(store, {}, read_ahead_plan=False)
    ahead = _ahead(ds)
    with record_reads() as reports, dask.config.set(scheduler="threads", num_workers=4):
        ds["f"].load()
    assert 1 < len(_reads(reports)) < CHUNKS
    assert ahead.hits and not ahead._plans


def test_read_ahead_off_plans_nothing(store):
    ds = _open(store, {}, read_ahead="off")
    assert _ahead(ds) is None
    with record_reads() as reports:
        ds["f"].load()
    assert len(_reads(reports)) == CHUNKS


def test_a_compute_without_engine_arrays_is_left_alone():
    """The plan looks only at graphs holding the engine's arrays."""
    import dask.array as da

    seen = []
    real = ReadAhead.expect
    x = da.ones((64, 64), chunks=8)
    try:
        ReadAhead.expect = lambda self, *a: seen.append(a) or real(self, *a)
        assert float(x.sum().compute()) == 64 * 64
    finally:
        ReadAhead.expect = real
    assert not seen


def test_a_damaged_chunk_fails_its_own_task_and_names_it(store, tmp_path):
    """A damaged chunk in a planned window: the compute raises the chunk's own ChunkError
    (naming its array and file), and the plan ends (nothing held)."""
    import shutil

    path = tmp_path / "bad.zarr"
    shutil.copytree(store, path)
    chunk = Path(path) / "f" / "c" / "3" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-20])  # a zstd frame cut short
    ds = _open(str(path), {})
    ahead = _ahead(ds)
    with dask.config.set(scheduler="threads", num_workers=4):
        with pytest.raises(ChunkError, match=r"c/3/1/0") as err:
            ds["f"].load()
    assert err.value.array == "f"
    assert not ahead._plans
    # the other chunks still read, each task its own where its window failed
    good = ds["f"].isel(t=slice(0, 12)).compute()
    np.testing.assert_array_equal(good.values, _ref(store)["f"].values[:12])


def test_computes_in_threads_each_get_their_own_values(store):
    """Two threads computing selections of one dataset at once (each compute its own plan, or
    none where dask's callbacks serve the first) get their own values."""
    ds = _open(store, {})
    ref = _ref(store)["f"].values
    got: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        with dask.config.set(scheduler="threads", num_workers=4):
            got[i] = ds["f"].isel(t=slice(16 * i, 16 * i + 16)).values

    assert not run_in_threads(work, 4, timeout=60)
    for i in range(4):
        np.testing.assert_array_equal(got[i], ref[16 * i : 16 * i + 16])


def test_cover_finds_the_box_that_boxes_tile_exactly():
    from cupy_xarray.xarray.readahead import cover

    shape = (8, 8)
    tiles = [(slice(a, a + 4), slice(b, b + 4)) for a in (4, 0) for b in (0, 4)]
    whole, places = cover(tiles, shape)
    assert whole == (slice(0, 8), slice(0, 8))
    assert places[0] == (slice(4, 8), slice(0, 4)) and places[3] == (slice(0, 4), slice(4, 8))
    rows = [(slice(2, 3), slice(0, 8)), (slice(3, 6), slice(0, 8))]
    assert cover(rows, shape) == (
        (slice(2, 6), slice(0, 8)),
        [(slice(0, 1), slice(0, 8)), (slice(1, 4), slice(0, 8))],
    )
    assert cover(tiles[:3], shape) is None  # a gap
    overlap = [(slice(0, 4), slice(0, 8)), (slice(2, 6), slice(0, 8)), (slice(6, 8), slice(0, 8))]
    assert cover(overlap, shape) is None  # volumes add up to the box's, but two overlap
    assert cover([(1, slice(0, 8)), (slice(2, 3), slice(0, 8))], shape) is None  # an int
    assert cover(tiles[:1], shape) is None  # one box: nothing to merge


@pytest.mark.parametrize("how", ["each", "one", "box"])
def test_a_planned_window_that_tiles_a_box_is_one_request_of_it(store, how):
    """With ``read_ahead_outputs="box"``, the blocks of a window that tile one box are read as
    one request of that box (as an eager read of it), each task taking its block's place of
    it; otherwise as a request per block."""
    ds = _open(store, {"t": 8}, read_ahead_outputs=how)
    with record_reads() as reports:
        got = ds["f"].load()
    (read,) = _reads(reports)
    assert (read.arrays == ["f"]) == (how == "box") and read.chunks == CHUNKS
    np.testing.assert_array_equal(got.values, _ref(store)["f"].values)


@pytest.mark.parametrize("how", ["one", "box"])
def test_blocks_of_a_tiled_window_are_contiguous_arrays_of_their_own(store, device, monkeypatch, how):
    """Each task's block taken from a window read as one box or into one buffer is
    C-contiguous (kernels on strided views run slower) and equals zarr-python's block."""
    from cupy_xarray.xarray import backend

    handed = []
    real = backend.KvikioBackendArray._read_boxes

    def read_boxes(self, keys, ready=None):
        out = real(self, keys, ready)
        handed.extend((k, o) for k, o in zip(keys, out) if len(k) == 3)  # (not the index's)
        return out

    monkeypatch.setattr(backend.KvikioBackendArray, "_read_boxes", read_boxes)
    ds = _open(store, {}, device, read_ahead_outputs=how)
    data = ds["f"].data
    ref = _ref(store)["f"].values
    with record_reads() as reports:
        dask.compute(*[data.blocks[5, i, j] for i in (0, 1) for j in (0, 1)])
    assert len(_reads(reports)) == 1 and len(handed) == 4  # the tiles of t 20:24, one box
    for key, block in handed:
        assert block.flags.c_contiguous
        np.testing.assert_array_equal(host(block), ref[key])


def test_a_plan_that_fails_leaves_the_compute_alone(store, monkeypatch):
    """Whatever goes wrong in reading dask's graph, the compute runs (its tasks read ahead by
    the order they ask in) and its values are right."""

    def broken(self, node, names=None, depth=0):
        raise RuntimeError("a task spec this plan does not know")

    monkeypatch.setattr(dask_plan.ComputePlan, "block_reads", broken)
    ds = _open(store, {})
    with dask.config.set(scheduler="threads", num_workers=4):
        got = ds["f"].load()
    np.testing.assert_array_equal(got.values, _ref(store)["f"].values)


def test_read_ahead_outputs_takes_its_three_values():
    with pytest.raises(ValueError, match="read_ahead_outputs must be 'each', 'one' or 'box', got 'all'"):
        cupy_xarray.set_options(read_ahead_outputs="all")
