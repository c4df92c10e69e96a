"""engine="kvikio" against engine="zarr": decoding options, groups, formats, laziness, errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from conftest import HAS_GPU, expected_type, host, module_of, run_in_threads

import cupy_xarray  # noqa: F401
from cupy_xarray.errors import ChunkError, StoreError
from cupy_xarray.xarray.backend import KvikioBackendArray
from cupy_xarray.xarray.cf import find_backend_array


def make_ds(seed: int = 0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    time = pd.date_range("2000-01-01", periods=12, freq="6h")
    packed = rng.integers(0, 1000, (12, 6, 5)).astype("int16")
    packed[0, 0, :] = -999
    masked = rng.standard_normal((12, 6, 5)).astype("float32")
    masked[1, 2, :] = -1.0
    ds = xr.Dataset(
        {
            "packed": (
                ("time", "y", "x"),
                packed,
                {"scale_factor": 0.01, "add_offset": 270.0, "_FillValue": -999, "units": "K"},
            ),
            "masked": (("time", "y", "x"), masked, {"missing_value": -1.0}),
            "plain": (("y", "x"), rng.standard_normal((6, 5))),
            "counts": (("time",), np.arange(12, dtype="uint8")),
            "elapsed": (("time",), (np.arange(12) * 3600).astype("int64"), {"units": "seconds"}),
        },
        coords={
            "time": time,
            "y": np.arange(6.0),
            "x": np.arange(5) * 10,
            "lat2d": (("y", "x"), rng.standard_normal((6, 5))),
        },
        attrs={"title": "test"},
    )
    return ds


@pytest.fixture(params=[(3, True), (3, False), (2, True), (2, False)], ids=lambda p: f"v{p[0]}-cons{p[1]}")
def store(request, tmp_path):
    fmt, consolidated = request.param
    path = tmp_path / "ds.zarr"
    ds = make_ds()
    enc = {"packed": {"chunks": (5, 4, 5)}, "masked": {"chunks": (4, 6, 2)}}
    ds.to_zarr(path, zarr_format=fmt, consolidated=consolidated, encoding=enc)
    make_ds(1).to_zarr(path, group="inner/deeper", zarr_format=fmt, consolidated=consolidated)
    return str(path), fmt, consolidated


def _assert_same(got: xr.Dataset, ref: xr.Dataset, device: str):
    assert set(got.variables) == set(ref.variables)
    for name, var in got.data_vars.items():
        data = var.variable._data
        if var.dtype.kind in "biufc":
            assert module_of(data) == expected_type(device), name
        np.testing.assert_array_equal(host(data), ref[name].values, err_msg=name)
        assert var.dtype == ref[name].dtype, name
        np.testing.assert_equal(dict(var.attrs), dict(ref[name].attrs), err_msg=name)
    for name in got.coords:
        assert module_of(got[name].variable._data) in ("numpy", "pandas", "xarray"), name
        np.testing.assert_array_equal(got[name].values, ref[name].values)
    assert got.attrs == ref.attrs
    # and the whole objects: indexes, coordinates, attributes, variables' encodings
    xr.testing.assert_identical(got.cupy.as_numpy(), ref)
    assert set(got.indexes) == set(ref.indexes)  # zarr lists members in no fixed order
    for name in ref.variables:
        assert set(got[name].encoding) == set(ref[name].encoding), name


def test_engine_is_listed():
    assert "kvikio" in xr.backends.list_engines()


DECODE_OPTIONS = [
    {},
    {"mask_and_scale": False},
    {"decode_times": False},
    {"decode_timedelta": True},
    {"decode_coords": False, "concat_characters": False},
    {"drop_variables": ["plain"]},
    {"use_cftime": True},
]


@pytest.mark.parametrize("opts", DECODE_OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_open_dataset_matches_zarr_engine(store, device, opts):
    path, fmt, consolidated = store
    kw = {"consolidated": consolidated, **opts}
    if "use_cftime" in opts:
        pytest.importorskip("cftime")
    ref = xr.open_dataset(path, engine="zarr", **kw).load()
    ds = xr.open_dataset(path, engine="kvikio", device=device, **kw)
    assert all(
        find_backend_array(v.variable._data, KvikioBackendArray) is not None for v in ds.data_vars.values()
    ), "variables must be lazy"
    _assert_same(ds.load(), ref, device)
    for name in ref.data_vars:
        assert ds[name].encoding.get("dtype", None) == ref[name].encoding.get("dtype", None)


def test_load_async_reads_what_load_reads(store, device):
    """``load_async`` (xarray's asynchronous loading) reads through the engine, off the event
    loop, the values ``load`` reads: variables at once and an indexed selection."""
    import asyncio

    path, fmt, consolidated = store
    ref = xr.open_dataset(path, engine="zarr", consolidated=consolidated).load()
    ds = xr.open_dataset(path, engine="kvikio", device=device, consolidated=consolidated)

    async def both():
        whole = ds.load_async()
        part = ds.packed.isel(time=slice(2, 7), x=[0, 3]).load_async()
        return await asyncio.gather(whole, part)

    whole, part = asyncio.run(both())
    _assert_same(whole, ref, device)
    np.testing.assert_array_equal(host(part.data), ref.packed.isel(time=slice(2, 7), x=[0, 3]).values)
    memory: dict = {}  # a store in memory, which the engine reads through zarr's store
    ref.drop_encoding().to_zarr(memory, zarr_format=fmt, consolidated=False)
    lazy = xr.open_dataset(memory, engine="kvikio", device=device, consolidated=False)
    got = asyncio.run(lazy.load_async())
    _assert_same(got, xr.open_dataset(memory, engine="zarr", consolidated=False).load(), device)


def test_groups(store, device):
    path, fmt, consolidated = store
    ref = xr.open_dataset(path, engine="zarr", group="inner/deeper", consolidated=consolidated).load()
    ds = xr.open_dataset(
        path, engine="kvikio", group="inner/deeper", device=device, consolidated=consolidated, zarr_format=fmt
    )
    _assert_same(ds.load(), ref, device)


@pytest.mark.parametrize(
    "key",
    [
        {"time": slice(None)},
        {"time": slice(2, 4)},
        {"time": 2},
        {"time": [2, 3, 5]},
        {"time": slice(1, 11, 3), "x": [4, 0]},
        {"y": slice(None, None, -1)},
    ],
    ids=str,
)
def test_lazy_indexing(store, device, key):
    path, _, consolidated = store
    ref = xr.open_dataset(path, engine="zarr", consolidated=consolidated)
    ds = xr.open_dataset(path, engine="kvikio", device=device, consolidated=consolidated)
    for name in ["packed", "masked"]:
        sub = ds[name].isel(key)
        assert find_backend_array(sub.variable._data, KvikioBackendArray) is not None  # still lazy
        got = sub.compute()
        assert module_of(got.data) == expected_type(device)
        np.testing.assert_array_equal(host(got.data), ref[name].isel(key).values)


def test_vectorized_indexing(store, device):
    path, _, consolidated = store
    ref = xr.open_dataset(path, engine="zarr", consolidated=consolidated)
    ds = xr.open_dataset(path, engine="kvikio", device=device, consolidated=consolidated)
    idx = {"time": xr.DataArray([0, 5, 11, 5], dims="p"), "x": xr.DataArray([4, 0, 2, 2], dims="p")}
    got = ds.packed.isel(idx).compute()
    np.testing.assert_array_equal(host(got.data), ref.packed.isel(idx).values)


def test_zarr_config_untouched_and_threads(tmp_path):
    paths = []
    for i in range(4):
        p = tmp_path / f"s{i}.zarr"
        make_ds(i).to_zarr(p, encoding={"masked": {"compressors": zarr.codecs.ZstdCodec()}})
        paths.append(str(p))
    refs = [xr.open_dataset(p, engine="zarr").load() for p in paths]
    before = repr(zarr.config.config)

    def work(k):
        for j in range(6):
            i = (k + j) % 4
            ds = xr.open_dataset(paths[i], engine="kvikio", device="cpu").load()
            for name in ("packed", "masked"):
                np.testing.assert_array_equal(host(ds[name].data), refs[i][name].values)

    errors = run_in_threads(work, 8)
    assert not errors, errors
    assert repr(zarr.config.config) == before


def test_errors(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        xr.open_dataset(tmp_path / "nope.zarr", engine="kvikio", device="cpu")
    with pytest.raises(FileNotFoundError) as zarr_says:  # caught as engine="zarr"'s is
        xr.open_dataset(tmp_path / "nope.zarr", engine="zarr")
    with pytest.raises(FileNotFoundError, match="does not exist") as ours:
        xr.open_dataset(tmp_path / "nope.zarr", engine="kvikio", device="cpu")
    assert isinstance(zarr_says.value, FileNotFoundError) and isinstance(ours.value, StoreError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="empty"):
        xr.open_dataset(tmp_path / "empty", engine="kvikio", device="cpu")
    make_ds().to_zarr(tmp_path / "ds.zarr")
    with pytest.raises(StoreError, match="missing"):
        xr.open_dataset(tmp_path / "ds.zarr", engine="kvikio", device="cpu", group="missing")
    with pytest.raises(ValueError, match="device"):
        xr.open_dataset(tmp_path / "ds.zarr", engine="kvikio", device="tpu")


def test_corrupt_chunk_via_xarray(tmp_path, device):
    path = tmp_path / "ds.zarr"
    enc = {"masked": {"compressors": zarr.codecs.ZstdCodec(), "chunks": (4, 6, 5)}}
    make_ds().to_zarr(path, encoding=enc)
    chunk = path / "masked" / "c" / "1" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    ds = xr.open_dataset(path, engine="kvikio", device=device)
    with pytest.raises(ChunkError, match="masked.*c/1/0/0"):
        ds.masked.load()


def test_no_gpu_error_says_how_to_stay_on_cpu(tmp_path):
    from conftest import HAS_GPU

    if HAS_GPU:
        pytest.skip("a GPU is present")
    make_ds().to_zarr(tmp_path / "ds.zarr")
    with pytest.raises((RuntimeError, ImportError), match="device='cpu'|cuda1[23]"):
        xr.open_dataset(tmp_path / "ds.zarr", engine="kvikio")


def test_read_zarr_gds(store, device):
    path, fmt, consolidated = store
    ref = xr.open_dataset(path, engine="zarr", consolidated=consolidated).load()
    got = cupy_xarray.read_zarr_gds(path, device=device, consolidated=consolidated)
    _assert_same(got, ref, device)
    sub = xr.Dataset.cupy.read_zarr_gds(path, variables=["packed", "plain"], device=device)
    assert set(sub.data_vars) == {"packed", "plain"}
    np.testing.assert_array_equal(host(sub.packed.data), ref.packed.values)
    with pytest.raises(StoreError, match="unknown variable.*nope"):
        cupy_xarray.read_zarr_gds(path, variables=["nope"], device=device)


def test_read_zarr_gds_reads_all_variables_in_one_engine_call(tmp_path, monkeypatch):
    from cupy_xarray.xarray import loader

    make_ds().to_zarr(tmp_path / "ds.zarr")
    calls = []
    real = loader.read_arrays

    def spy(reqs, *a, **k):
        calls.append(len(reqs))
        return real(reqs, *a, **k)

    monkeypatch.setattr(loader, "read_arrays", spy)
    loader.read_zarr_gds(tmp_path / "ds.zarr", device="cpu")
    assert calls == [5]


def test_a_typo_in_a_loader_keyword_is_named_with_the_nearest(tmp_path):
    from cupy_xarray.sample import write_sample

    store = write_sample(tmp_path / "s.zarr")
    for fn in (cupy_xarray.read_zarr_gds, cupy_xarray.read_datatree_gds):
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'devise'; did you mean 'device'"):
            fn(store, devise="cpu")


@pytest.mark.parametrize("device", [None, 0, False, 1.5])
def test_a_device_that_is_not_one_fails_at_open(device):
    from cupy_xarray.sample import sample_path

    with pytest.raises(TypeError, match="device must be 'gpu', 'cpu' or a zarr BufferPrototype"):
        xr.open_dataset(sample_path(), engine="kvikio", device=device)


def test_the_install_hint_names_this_package_not_an_index_name():
    from cupy_xarray.errors import EXTRA_HINT

    assert "'.[cuda13]'" in EXTRA_HINT and "cupy-cuda13x kvikio-cu13 nvidia-nvcomp-cu13" in EXTRA_HINT
    assert "cupy-xarray[" not in EXTRA_HINT


def test_what_is_not_a_zarr_group_is_named(tmp_path):
    """A file, a NetCDF file, an empty or foreign directory, an array, the wrong zarr_format:
    the message says what the path is and what to do, not "check the path"."""
    from cupy_xarray.errors import StoreError

    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "n3.nc").write_bytes(b"CDF\x01" + bytes(28))
    (tmp_path / "n4.nc").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(24))
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f").write_text("x")
    ds = xr.Dataset({"a": ("x", np.arange(3.0))})
    ds.to_zarr(tmp_path / "s3.zarr", zarr_format=3)
    ds.to_zarr(tmp_path / "s2.zarr", zarr_format=2)
    cases = [
        ("t.txt", {}, "a file, not a directory"),
        ("n3.nc", {}, "NetCDF-3 file.*engine='scipy'"),
        ("n4.nc", {}, "NetCDF-4 file.*engine='h5netcdf'"),
        ("empty", {}, "an empty directory"),
        ("other", {}, "no Zarr metadata"),
        ("s3.zarr/a", {}, r"a Zarr array, not a group: open its group .*s3\.zarr"),
        ("s2.zarr/a", {}, r"a Zarr array, not a group"),
        ("s3.zarr", {"zarr_format": 2}, "Zarr v3 store.*zarr_format=2"),
        ("s2.zarr", {"zarr_format": 3}, "Zarr v2 store.*zarr_format=3"),
    ]
    for name, kw, says in cases:
        with pytest.raises(StoreError, match=says):
            xr.open_dataset(tmp_path / name, engine="kvikio", device="cpu", **kw)


@pytest.mark.skipif(HAS_GPU, reason="checks the error where no GPU can be used")
def test_a_gpu_prototype_without_a_gpu_blames_the_machine_not_the_data():
    from zarr.core.buffer import gpu

    from cupy_xarray.errors import NoGPUError
    from cupy_xarray.sample import sample_path

    with pytest.raises(NoGPUError) as info:
        xr.open_dataset(sample_path(), engine="kvikio", device=gpu.buffer_prototype).load()
    assert "corrupt" not in str(info.value)
    if importlib.util.find_spec("cupy") is None:  # said at open, not at the first load
        with pytest.raises(NoGPUError, match="cupy is not installed"):
            xr.open_dataset(sample_path(), engine="kvikio", device=gpu.buffer_prototype)
