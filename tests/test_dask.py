"""Dask: chunked reads through the engine, the device's meta, xarray operations, distributed."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from conftest import expected_type, host, module_of

import cupy_xarray
from cupy_xarray.xarray.chunked import EngineChunkSource

da = pytest.importorskip("dask.array")


def make_ds() -> xr.Dataset:
    rng = np.random.default_rng(3)
    time = pd.date_range("2001-01-01", periods=48, freq="12h")
    air = (250 + 30 * rng.random((48, 9, 7))).astype("float32")
    air[rng.random(air.shape) < 0.1] = np.nan
    air[:, 0, 0] = np.nan  # a column that is all NaN: sum(min_count=1) gives NaN there
    return xr.Dataset(
        {
            "air": (("time", "lat", "lon"), air, {"units": "K"}),
            "packed": (
                ("time", "lat", "lon"),
                rng.integers(0, 500, air.shape).astype("int16"),
                {"scale_factor": 0.5, "add_offset": 200.0, "_FillValue": -1},
            ),
        },
        coords={"time": time, "lat": np.linspace(80, 0, 9), "lon": np.arange(7.0) * 10},
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dask") / "air.zarr"
    enc = {"air": {"chunks": (8, 9, 7)}, "packed": {"chunks": (12, 5, 7)}}
    make_ds().to_zarr(path, zarr_format=3, encoding=enc)
    return str(path)


@pytest.fixture(scope="module")
def ref(store) -> xr.Dataset:
    return xr.open_dataset(store, engine="zarr").load()


def _open(store, device, chunks):
    return xr.open_dataset(store, engine="kvikio", device=device, chunks=chunks)


def _engine_graph(arr) -> bool:
    return any(isinstance(v, EngineChunkSource) for v in dict(arr.__dask_graph__()).values())


@pytest.mark.parametrize("chunks", [{}, "auto", {"time": 24}, {"time": 24, "lon": 7}])
def test_chunked_open_meta_and_values(store, ref, device, chunks):
    ds = _open(store, device, chunks)
    for name in ("air", "packed"):
        arr = ds[name].data
        assert isinstance(arr, da.Array), name
        assert module_of(arr._meta) == expected_type(device), name
        assert _engine_graph(arr), name
        block = arr.blocks[(0,) * arr.ndim].compute()
        assert module_of(block) == expected_type(device), name
        np.testing.assert_array_equal(host(arr.compute()), ref[name].values, err_msg=name)
    if chunks == {}:
        assert ds.air.data.chunks == ((8,) * 6, (9,), (7,))
    for name in ds.coords:
        assert not isinstance(ds[name].data, da.Array) or module_of(ds[name].data._meta) == "numpy"


def test_misaligned_chunks_warn(store, device):
    with pytest.warns(UserWarning, match="separate the stored chunks"):
        _open(store, device, {"time": 5})


def test_chunk_after_lazy_open(store, ref, device):
    ds = _open(store, device, None).chunk({"time": 24})
    assert module_of(ds.air.data._meta) == expected_type(device)
    np.testing.assert_array_equal(host(ds.air.values if device == "cpu" else ds.air.data.compute()), ref.air)


def _ops(ds: xr.Dataset) -> dict[str, xr.DataArray]:
    air = ds.air
    return {
        "mean": air.mean(),
        "mean_time": air.mean("time"),
        "sum_min_count": air.sum("time", min_count=1),
        "where": air.where(air > 265),
        "groupby": air.groupby("time.dayofyear").mean(),
        "resample": air.resample(time="1D").mean(),
        "rolling": air.rolling(time=3).mean(),
        "packed_max": ds.packed.max("lat"),
    }


def test_xarray_operations_stay_on_device(store, ref, device):
    ds = _open(store, device, {})
    got, want = _ops(ds), _ops(ref)
    for name, lazy in got.items():
        assert isinstance(lazy.data, da.Array), name
        if name != "rolling":  # xarray's rolling builds its dask meta with NumPy; blocks stay cupy
            assert module_of(lazy.data._meta) == expected_type(device), name
        computed = lazy.compute()
        assert module_of(computed.data) == expected_type(device), name
        np.testing.assert_allclose(host(computed.data), want[name].values, rtol=1e-6, err_msg=name)
    # sum(min_count=1) with NaNs on dask + cupy (cupy-xarray 0.1.x returned zeros there)
    s = got["sum_min_count"].compute()
    assert np.isnan(host(s.data)[0, 0]) and not np.isnan(host(s.data)[1, 1])


def test_persist_and_as_numpy(store, ref, device):
    ds = _open(store, device, {}).persist()
    assert module_of(ds.air.data._meta) == expected_type(device)
    np.testing.assert_array_equal(host(ds.air.data.compute()), ref.air.values)
    back = ds.cupy.as_numpy()
    assert module_of(back.air.data._meta) == "numpy"
    np.testing.assert_array_equal(back.air.values, ref.air.values)


def test_read_zarr_gds_chunks(store, ref, device):
    ds = cupy_xarray.read_zarr_gds(store, device=device, chunks={}, variables="air")
    assert list(ds.data_vars) == ["air"]
    assert module_of(ds.air.data._meta) == expected_type(device)
    np.testing.assert_array_equal(host(ds.air.data.compute()), ref.air.values)


def test_graph_pickles(store, ref):
    arr = _open(store, "cpu", {}).air.data
    again = pickle.loads(pickle.dumps(arr))
    np.testing.assert_array_equal(again.compute(scheduler="sync"), ref.air.values)


def test_distributed_local_cluster(store, ref):
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster),
    ):
        ds = _open(store, "cpu", {"time": 24})
        mean = ds.air.mean("time").compute()
        total = ds.packed.sum().compute()
        full = ds.air.compute()
    np.testing.assert_allclose(mean.values, ref.air.mean("time").values, rtol=1e-6)
    np.testing.assert_allclose(total.values, ref.packed.sum().values, rtol=1e-9)
    np.testing.assert_array_equal(full.values, ref.air.values)


@pytest.mark.gpu
def test_local_cuda_cluster(store, ref):
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    with (
        dask_cuda.LocalCUDACluster(n_workers=1, dashboard_address=None) as cluster,
        distributed.Client(cluster),
    ):
        ds = _open(store, "gpu", {"time": 24})
        mean = ds.air.mean("time").compute()
        full = ds.air.compute()
    assert module_of(mean.data) == "cupy"
    np.testing.assert_allclose(host(mean.data), ref.air.mean("time").values, rtol=1e-6)
    np.testing.assert_array_equal(host(full.data), ref.air.values)


@pytest.mark.parametrize("chunks", [{}, "auto", {"time": 24, "lon": 7}])
def test_chunked_open_is_identical_to_engine_zarr(store, device, chunks):
    """Whole objects, lazily and computed: chunks, indexes, coordinates, attributes."""
    got = _open(store, device, chunks)
    want = xr.open_dataset(store, engine="zarr", chunks=chunks)
    assert {k: v.chunks for k, v in got.variables.items()} == {k: v.chunks for k, v in want.variables.items()}
    assert set(got.indexes) == set(want.indexes)
    xr.testing.assert_identical(got.compute().cupy.as_numpy(), want.compute())


@pytest.mark.parametrize("chunks", [{}, {"time": 16}])
def test_reads_spread_evenly_over_workers_with_dasks_defaults(tmp_path, chunks):
    """With dask's own scheduler settings (worker-saturation 1.1: reads queued and handed out
    as threads free up), two one-thread workers warmed with ``warm_up`` each read about half
    of a store's chunks: nothing in the engine's graph (its shared chunk source) pins them to
    one worker."""
    distributed = pytest.importorskip("distributed")
    import dask

    rng = np.random.default_rng(0)
    data = rng.random((96, 64, 64)).astype("float32")
    path = tmp_path / "even.zarr"
    xr.Dataset({"v": (("time", "y", "x"), data)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (2, 64, 64)}}
    )
    assert dask.config.get("distributed.scheduler.worker-saturation") == 1.1
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as c,
        distributed.Client(c) as client,
    ):
        arr = xr.open_dataset(path, engine="kvikio", device="cpu", chunks=chunks).v.data
        # fresh workers: the first one ready would read nearly all (46 of 48 seen) without it
        cupy_xarray.warm_up(client, device="cpu")
        seen = []
        # a graph that pins the reads to one worker does so every time; dask's hand-out of
        # 48 reads of a few ms between two processes is a race, lopsided once in ten or so on
        # a 2-core machine: three computations, one of them balanced
        for _ in range(3):
            kept = arr.persist()  # each block stays on the worker that read it
            distributed.wait(kept)
            where = client.who_has(kept)
            np.testing.assert_array_equal(kept.compute(), data)
            per_worker: dict[str, int] = {}
            for workers in where.values():
                for worker in workers:
                    per_worker[worker] = per_worker.get(worker, 0) + 1
            assert sum(per_worker.values()) == arr.npartitions, per_worker
            seen.append(per_worker)
            if len(per_worker) == 2 and min(per_worker.values()) >= 0.3 * arr.npartitions:
                break
            del kept
            client.run(lambda: None)  # (a beat between computations)
    assert len(per_worker) == 2 and min(per_worker.values()) >= 0.3 * arr.npartitions, seen


def test_warm_up_starts_every_worker_and_this_process():
    distributed = pytest.importorskip("distributed")
    here = cupy_xarray.warm_up(device="cpu")
    assert here["device"] == "cpu" and here["threads"] >= 1
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as c,
        distributed.Client(c) as client,
    ):
        started = cupy_xarray.warm_up(client, device="cpu")
        loaded = client.run(lambda: __import__("sys").modules.get("cupy_xarray.engine.reader") is not None)
    assert set(started) == set(loaded) and len(started) == 2
    assert all(v["device"] == "cpu" for v in started.values()) and all(loaded.values())


def _source(arr) -> EngineChunkSource:
    (src,) = [v for v in dict(arr.__dask_graph__()).values() if isinstance(v, EngineChunkSource)]
    return src


def test_blocks_of_untransformed_arrays_are_read_by_the_engine_directly(store, ref, device, monkeypatch):
    """A block of an array xarray neither decodes nor selects goes straight to the engine;
    a CF-packed one, and one selected before chunking, go through xarray's wrappers. Each
    gets engine="zarr"'s values."""
    from cupy_xarray.xarray.backend import KvikioBackendArray

    direct = []
    real = KvikioBackendArray.read

    def counted(self, key):
        direct.append(key)
        return real(self, key)

    monkeypatch.setattr(KvikioBackendArray, "read", counted)
    ds = _open(store, device, {})
    assert _source(ds.air.data).direct is not None
    assert _source(ds.packed.data).direct is None  # scale_factor, add_offset, _FillValue
    np.testing.assert_array_equal(host(ds.air.data.compute()), ref.air.values)
    assert len(direct) == ds.air.data.npartitions
    direct.clear()
    np.testing.assert_array_equal(host(ds.packed.data.compute()), ref.packed.values)
    pick = {"time": slice(3, 40), "lon": [0, 2, 5]}
    picked = _open(store, device, None).isel(pick).chunk({"time": 8})
    assert _source(picked.air.data).direct is None
    np.testing.assert_array_equal(host(picked.air.data.compute()), ref.air.isel(pick).values)
    assert not direct
