"""What a user of xarray reaches for: DataTree, indexes, every option of engine="zarr", paths
as people type them, clear errors at the edges."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import HAS_GPU, expected_type, host, module_of

import cupy_xarray
from cupy_xarray.errors import NoGPUError, StoreError
from cupy_xarray.xarray.backend import KvikioBackendEntrypoint


def _ds(seed=0, start="2020-01-01"):
    rng = np.random.default_rng(seed)
    time = np.array(np.datetime64(start) + np.arange(4) * np.timedelta64(1, "D"), dtype="datetime64[ns]")
    return xr.Dataset(
        {"air": (("time", "lat"), rng.random((4, 3)).astype("float32"), {"units": "K"})},
        coords={"time": time, "lat": np.array([10.0, 20.0, 30.0], dtype="float32")},
        attrs={"title": "sample"},
    )


def _same_encoding(a: dict, b: dict) -> bool:
    def same(x, y):
        if (
            isinstance(x, float | np.floating)
            and isinstance(y, float | np.floating)
            and np.isnan(x)
            and np.isnan(y)
        ):
            return True
        return bool(x == y) if not isinstance(x, np.ndarray) else np.array_equal(x, y)

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- read_zarr_gds: indexes, encoding


@pytest.mark.parametrize("fmt", [2, 3])
def test_read_zarr_gds_has_engine_zarrs_indexes_and_encoding(tmp_path, device, fmt):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store, zarr_format=fmt)
    got = cupy_xarray.read_zarr_gds(store, device=device)
    ref = xr.open_dataset(store, engine="zarr").load()
    assert module_of(got.air.data) == ("cupy" if device == "gpu" else "numpy")
    xr.testing.assert_identical(got.cupy.as_numpy(), ref)
    assert set(got.indexes) == set(ref.indexes) == {"time", "lat"}
    assert got.encoding["source"] == ref.encoding["source"]
    for name in ref.variables:
        assert _same_encoding(got[name].encoding, ref[name].encoding), name


def test_read_zarr_gds_results_align_by_label(tmp_path, device):
    """Two stores of different dates: subtraction aligns on time (nothing in common)."""
    _ds(0, "2020-01-01").to_zarr(tmp_path / "a.zarr")
    _ds(1, "2021-01-01").to_zarr(tmp_path / "b.zarr")
    a = cupy_xarray.read_zarr_gds(tmp_path / "a.zarr", device=device)
    b = cupy_xarray.read_zarr_gds(tmp_path / "b.zarr", device=device)
    za, zb = (xr.open_dataset(tmp_path / f"{n}.zarr", engine="zarr") for n in "ab")
    assert dict((a.air - b.air).sizes) == dict((za.air - zb.air).sizes) == {"time": 0, "lat": 3}
    merged = xr.merge([a.cupy.as_numpy(), b.cupy.as_numpy().rename(air="air2")], join="outer")
    assert merged.sizes["time"] == 8
    combined = xr.combine_by_coords([a.cupy.as_numpy(), b.cupy.as_numpy()])
    assert combined.sizes["time"] == 8
    a.cupy.as_numpy().reindex(time=b.time)  # needs an index


# ---------------------------------------------------------------- .cupy.is_cupy


def test_is_cupy_needs_data_variables():
    assert not xr.Dataset().cupy.is_cupy
    assert not xr.Dataset(coords={"x": [1, 2]}).cupy.is_cupy
    assert not xr.DataTree().cupy.is_cupy
    assert not xr.DataTree.from_dict({"/": xr.Dataset(), "/a": xr.Dataset(coords={"x": [1]})}).cupy.is_cupy


# ---------------------------------------------------------------- DataTree


def _tree():
    return xr.DataTree.from_dict(
        {
            "/": xr.Dataset({"top": ("x", np.arange(3.0))}, coords={"x": [10, 20, 30]}, attrs={"title": "t"}),
            "/a": xr.Dataset({"v": (("x", "y"), np.ones((3, 2), "f4"))}, coords={"y": [1.5, 2.5]}),
            "/a/b": xr.Dataset({"w": ("t", np.arange(4, dtype="i2"))}, coords={"t": np.arange(4)}),
            "/c": xr.Dataset(attrs={"empty": 1}),
        }
    )


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("consolidated", [True, False])
def test_open_datatree_and_groups_equal_engine_zarr(tmp_path, device, fmt, consolidated):
    store = tmp_path / "t.zarr"
    _tree().to_zarr(store, zarr_format=fmt, consolidated=consolidated)
    ref = xr.open_datatree(store, engine="zarr").load()
    got = xr.open_datatree(store, engine="kvikio", device=device).load()
    assert got["a/v"].cupy.is_cupy == (device == "gpu") and got.cupy.is_cupy == (device == "gpu")
    xr.testing.assert_identical(got.cupy.as_numpy(), ref)
    groups = xr.open_groups(store, engine="kvikio", device=device)
    zgroups = xr.open_groups(store, engine="zarr")
    assert sorted(groups) == sorted(zgroups)  # zarr lists groups in no fixed order
    for key, ds in groups.items():
        xr.testing.assert_identical(ds.load().cupy.as_numpy(), zgroups[key].load())
    sub = xr.open_datatree(store, engine="kvikio", device=device, group="a").load()
    xr.testing.assert_identical(sub.cupy.as_numpy(), xr.open_datatree(store, engine="zarr", group="a").load())
    lazy = xr.open_datatree(store, engine="kvikio", device=device, chunks={})
    assert lazy["a/v"].chunks is not None
    xr.testing.assert_identical(lazy.compute().cupy.as_numpy(), ref)
    eager = cupy_xarray.read_datatree_gds(store, device=device)
    xr.testing.assert_identical(eager.cupy.as_numpy(), ref)


def test_datatree_takes_every_option_of_open_dataset(tmp_path):
    store = tmp_path / "t.zarr"
    _tree().to_zarr(store)
    tree = xr.open_datatree(
        store, engine="kvikio", device="cpu", threads=2, batch_bytes=2**20, decode="cpu",
        decode_times=False, mask_and_scale=False, consolidated=True, zarr_format=3,
        allow_external_links=False, drop_variables=["w"],
    )  # fmt: skip
    assert "w" not in tree["a/b"].data_vars
    with pytest.raises(ValueError, match="threads must be"):
        xr.open_datatree(store, engine="kvikio", device="cpu", threads=0)


def test_read_datatree_gds_reads_in_one_engine_call(tmp_path, monkeypatch):
    from cupy_xarray.xarray import loader

    store = tmp_path / "t.zarr"
    _tree().to_zarr(store)
    calls = []
    real = loader.read_arrays
    monkeypatch.setattr(
        loader, "read_arrays", lambda reqs, *a, **k: calls.append(len(reqs)) or real(reqs, *a, **k)
    )
    cupy_xarray.read_datatree_gds(store, device="cpu")
    assert calls == [3]  # top, a/v, a/b/w


def test_datatree_accessor_as_numpy():
    tree = _tree()
    back = tree.cupy.as_numpy()
    xr.testing.assert_identical(back, tree)
    assert not back.cupy.is_cupy


@pytest.mark.gpu
def test_datatree_accessor_round_trip_on_the_gpu(tmp_path):
    tree = _tree()
    g = tree.cupy.as_cupy()
    assert g.cupy.is_cupy and module_of(g["a/v"].data) == "cupy"
    xr.testing.assert_identical(g.cupy.as_numpy(), tree)
    xr.testing.assert_identical(tree.as_cupy().cupy.as_numpy(), tree)


# ---------------------------------------------------------------- as_cupy() on the objects


@pytest.mark.skipif(HAS_GPU, reason="checks the error where no GPU can be used")
def test_top_level_as_cupy_without_a_gpu():
    for obj in (_ds(), _ds().air, _tree()):
        with pytest.raises(NoGPUError):
            obj.as_cupy()


@pytest.mark.gpu
def test_top_level_as_cupy_is_the_accessors():
    ds = _ds()
    for obj in (ds, ds.air):
        top, acc = obj.as_cupy(), obj.cupy.as_cupy()
        assert top.cupy.is_cupy and acc.cupy.is_cupy
        xr.testing.assert_identical(top.cupy.as_numpy(), acc.cupy.as_numpy())
        xr.testing.assert_identical(top.as_numpy(), obj)  # xarray's own as_numpy takes it back


def test_no_gpu_error_catches_a_missing_package():
    from cupy_xarray.errors import MissingGPUPackageError

    assert issubclass(MissingGPUPackageError, NoGPUError) and issubclass(MissingGPUPackageError, ImportError)


# ---------------------------------------------------------------- engine="zarr"'s options


def test_every_keyword_of_the_zarr_engine_is_accepted():
    from xarray.backends.zarr import ZarrBackendEntrypoint

    from cupy_xarray.xarray.backend import KEYWORDS

    theirs = set(inspect.signature(ZarrBackendEntrypoint.open_dataset).parameters) - {"self"}
    ours = set(KvikioBackendEntrypoint.open_dataset_parameters)
    assert theirs <= ours, theirs - ours
    assert ours == {"filename_or_obj", "engine", *KEYWORDS}  # the one keyword table
    for name in KEYWORDS:  # each one documented
        assert name in KvikioBackendEntrypoint.open_dataset.__doc__, name
    with pytest.raises(TypeError, match="'chunk_size'"):
        KvikioBackendEntrypoint().open_dataset("x.zarr", chunk_size=3)


@pytest.mark.parametrize("mask", [None, True, False])
def test_use_zarr_fill_value_as_mask_and_cache_members(tmp_path, device, mask):
    store = tmp_path / "s.zarr"
    data = np.array([1, 2, -9, 4], dtype="i4")
    group = zarr.open_group(str(store), mode="w", zarr_format=2)
    a = group.create_array("v", shape=(4,), chunks=(2,), dtype="i4", fill_value=-9)
    a[:] = data
    a.attrs["_ARRAY_DIMENSIONS"] = ["x"]
    zarr.consolidate_metadata(str(store))
    kw = dict(use_zarr_fill_value_as_mask=mask, cache_members=False)
    got = xr.open_dataset(store, engine="kvikio", device=device, **kw).load()
    if mask is False:
        # the fill value is ignored, as xarray documents the option (xarray 2026.9's zarr engine
        # passes None to its store whatever is asked, and masks anyway)
        assert got.v.dtype == np.dtype("i4") and "_FillValue" not in got.v.attrs
        np.testing.assert_array_equal(host(got.v.data), data)
        return
    ref = xr.open_dataset(store, engine="zarr", **kw).load()
    xr.testing.assert_identical(got.cupy.as_numpy(), ref)


def test_write_modes_and_store_objects_are_refused(tmp_path):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store)
    with pytest.raises(
        ValueError, match=r"only reads: mode must be 'r', got 'a' \(write with ds.cupy.to_zarr"
    ):
        xr.open_dataset(store, engine="kvikio", device="cpu", mode="a")
    with pytest.raises(ValueError, match="opens its own stores"):
        xr.open_dataset(store, engine="kvikio", device="cpu", store=object())
    assert xr.open_dataset(store, engine="kvikio", device="cpu", mode="r").air.shape == (4, 3)


@pytest.fixture
def remote_store():
    """A store behind fsspec (its in-memory filesystem: what s3:// or https:// stores go
    through), removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    import uuid

    url = f"memory://cupy-xarray-{uuid.uuid4().hex}/s.zarr"
    ds = _ds()
    ds.to_zarr(url, zarr_format=3, consolidated=True)
    _ds(seed=1).to_zarr(url, group="child", zarr_format=3, consolidated=True, mode="a")
    yield url
    fsspec.filesystem("memory").rm(url.split("://", 1)[1].rsplit("/", 1)[0], recursive=True)


def test_fsspec_urls_read_through_the_engine(remote_store, device):
    """s3://, https:// and other fsspec URLs open through zarr's own store; the engine fetches
    the chunks through it, identical to engine="zarr", lazily, chunked, eagerly and as trees
    (tests/test_remote.py does the same over HTTP and S3 servers)."""
    want = xr.open_dataset(remote_store, engine="zarr").load()
    lazy = xr.open_dataset(remote_store, engine="kvikio", device=device)
    assert module_of(lazy.air.load().data) == expected_type(device)
    xr.testing.assert_identical(lazy.load().cupy.as_numpy(), want)
    chunked = xr.open_dataset(remote_store, engine="kvikio", device=device, chunks={})
    xr.testing.assert_identical(chunked.compute().cupy.as_numpy(), want)
    eager = cupy_xarray.read_zarr_gds(remote_store, device=device)
    xr.testing.assert_identical(eager.cupy.as_numpy(), want)
    tree = xr.open_datatree(remote_store, engine="kvikio", device=device).load()
    xr.testing.assert_identical(tree.cupy.as_numpy(), xr.open_datatree(remote_store, engine="zarr").load())


def test_a_remote_protocol_without_its_filesystem_says_what_to_install():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(StoreError, match="gs://b/x.zarr.*gcsfs"):
        xr.open_dataset("gs://b/x.zarr", engine="kvikio", device="cpu")


def test_storage_options_with_a_local_store(tmp_path):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store)
    with pytest.raises(StoreError, match="storage_options apply to remote stores"):
        xr.open_dataset(store, engine="kvikio", device="cpu", storage_options={"anon": True})


# ---------------------------------------------------------------- paths and arguments


def test_home_directory_paths(tmp_path, monkeypatch, device):
    monkeypatch.setenv("HOME", str(tmp_path))
    _ds().to_zarr(tmp_path / "s.zarr")
    got = xr.open_dataset("~/s.zarr", engine="kvikio", device=device).load()
    xr.testing.assert_identical(
        got.cupy.as_numpy(), xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load()
    )
    eager = cupy_xarray.read_zarr_gds("~/s.zarr", device=device)
    assert eager.air.shape == (4, 3)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"threads": -1}, "threads must be a positive number"),
        ({"threads": 0}, "threads must be a positive number"),
        ({"threads": 2.5}, "threads must be a positive number"),
        ({"batch_bytes": 0}, "batch_bytes must be a positive"),
        ({"batch_bytes": -5}, "batch_bytes must be a positive"),
    ],
)
def test_wrong_threads_and_batch_bytes_fail_at_open(tmp_path, kw, message):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store)
    with pytest.raises(ValueError, match=message):
        xr.open_dataset(store, engine="kvikio", device="cpu", **kw)
    with pytest.raises(ValueError, match=message):
        cupy_xarray.read_zarr_gds(store, device="cpu", **kw)


def test_warnings_point_at_the_users_line(tmp_path):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store, consolidated=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xr.open_dataset(store, engine="kvikio", device="cpu")  # no consolidated metadata: a warning
    ours = [w for w in caught if "consolidated" in str(w.message).lower()]
    assert ours, [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]


# ---------------------------------------------------------------- the command line and the entry point


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_demo_on_the_gpu_without_one():
    proc = subprocess.run(
        [sys.executable, "-m", "cupy_xarray", "demo", "--device", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_entry_point_describes_itself():
    ep = KvikioBackendEntrypoint
    assert ep.open_dataset.__doc__ and "device" in ep.open_dataset.__doc__
    assert "device" in ep.description
    assert ep.url == ""  # no page of another project's stands in for ours
    assert ep.supports_groups


def test_values_still_equal_after_all_this(tmp_path, device):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store)
    np.testing.assert_array_equal(
        host(xr.open_dataset(store, engine="kvikio", device=device).air.data), _ds().air
    )


def test_datatree_keeps_reads_inside_the_root(tmp_path):
    from cupy_xarray.containment import UnsafeStoreError

    store = tmp_path / "t.zarr"
    _tree().to_zarr(store)
    outside = tmp_path / "outside"
    os.rename(store / "a" / "b", outside)
    os.symlink(outside, store / "a" / "b")
    with pytest.raises(UnsafeStoreError, match="outside the store root"):
        xr.open_datatree(store, engine="kvikio", device="cpu")
    tree = xr.open_datatree(store, engine="kvikio", device="cpu", allow_external_links=True).load()
    assert tree["a/b/w"].shape == (4,)


def test_opening_in_threads_leaves_the_warning_filters_as_they_were(tmp_path):
    from conftest import run_in_threads

    store = tmp_path / "s.zarr"
    _ds().to_zarr(store, consolidated=False)
    before = list(warnings.filters)
    errors = run_in_threads(lambda k: xr.open_dataset(store, engine="kvikio", device="cpu").load(), 8)
    assert not errors, errors
    assert warnings.filters == before


@pytest.mark.parametrize("fmt", [2, 3])
def test_use_zarr_fill_value_as_mask_true_reads_as_the_zarr_engine(tmp_path, device, fmt):
    """True on a store to_zarr wrote: the values engine='zarr' gives (real zeros and a first
    time stamp of 0 stay as they are), indexes and encoding included."""
    import pandas as pd

    store = tmp_path / "s.zarr"
    values = np.zeros((4, 3), "f4")
    values[1:] = np.arange(9, dtype="f4").reshape(3, 3)
    time = pd.to_datetime(["1970-01-01", "2000-01-01", "2000-01-02", "2000-01-03"])
    ds = xr.Dataset({"v": (("time", "x"), values)}, coords={"time": time, "x": [0, 1, 2]})
    ds.to_zarr(store, zarr_format=fmt, consolidated=True)
    kw = dict(use_zarr_fill_value_as_mask=True, consolidated=True)
    want = xr.open_dataset(store, engine="zarr", **kw).load()
    got = xr.open_dataset(store, engine="kvikio", device=device, **kw).load()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)
    fills = [got.v.encoding.get("_FillValue"), want.v.encoding.get("_FillValue")]
    assert np.array_equal(np.array(fills[:1], "f8"), np.array(fills[1:], "f8"), equal_nan=True), fills
    assert int((got.cupy.as_numpy().v == 0).sum()) == int((want.v == 0).sum()) >= 4


@pytest.mark.parametrize("fill", [None, -1])
def test_v2_big_endian_unsigned_reads_as_the_zarr_engine(tmp_path, device, fill):
    """A v2 big-endian signed integer variable with CF's ``_Unsigned`` (and a ``_FillValue``):
    the values, dtype and encoding engine='zarr' gives."""
    store = tmp_path / "u.zarr"
    g = zarr.open_group(store, mode="w", zarr_format=2)
    a = g.create_array("v", shape=(4,), chunks=(4,), dtype=">i2", compressors=None)
    a[:] = np.array([1, -1, 3, -2], ">i2")
    attrs = {"_ARRAY_DIMENSIONS": ["x"], "_Unsigned": "true"}
    if fill is not None:
        attrs["_FillValue"] = fill
    a.attrs.update(attrs)
    zarr.consolidate_metadata(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = xr.open_dataset(store, engine="zarr").load()
        got = xr.open_dataset(store, engine="kvikio", device=device).load()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)
    assert got.v.dtype == want.v.dtype


def test_no_gpu_advice_fits_where_it_is_given(monkeypatch):
    """A move to the GPU has no device= to pass: its advice is to stay on the host; a read's
    is device='cpu'."""
    from cupy_xarray import device as dev

    monkeypatch.setattr(dev, "import_cupy", lambda: object())
    monkeypatch.setattr(dev, "gpu_available", lambda: False)
    with pytest.raises(NoGPUError) as moved:
        _ds().cupy.as_cupy()
    assert "device=" not in str(moved.value) and "as_numpy" in str(moved.value)
    with pytest.raises(NoGPUError, match="pass device='cpu'"):
        dev.require_gpu()


def test_string_and_bytes_stores_warn_as_engine_zarr_does(tmp_path):
    """v3 stores of strings and fixed-length bytes: the engine's open and load give the
    warnings engine="zarr" gives (none), and its values."""
    import warnings

    ds = xr.Dataset({"s": ("x", np.array(["a", "bc", "def"])), "b": ("x", np.array([b"a", b"bc", b"d"]))})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr's own warnings about writing these types
        ds.to_zarr(tmp_path / "s.zarr", zarr_format=3)
    seen = {}
    for engine, kw in [("zarr", {}), ("kvikio", {"device": "cpu"})]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = xr.open_dataset(tmp_path / "s.zarr", engine=engine, **kw).load()
        seen[engine] = sorted((w.category.__name__, str(w.message)) for w in caught)
        xr.testing.assert_identical(got, ds)
    assert seen["kvikio"] == seen["zarr"], seen


def test_an_unknown_keyword_gets_did_you_mean(tmp_path):
    store = tmp_path / "s.zarr"
    _ds().to_zarr(store)
    with pytest.raises(TypeError, match=r"'devise' \(did you mean 'device'\?\), 'zzz'"):
        xr.open_dataset(store, engine="kvikio", devise="cpu", zzz=1)


def test_every_setting_has_an_environment_variable():
    import dataclasses

    from cupy_xarray.options import ENVIRONMENT, Options, from_environment

    for f in dataclasses.fields(Options):
        assert ENVIRONMENT[f"CUPY_XARRAY_{f.name.upper()}"] == f.name
    got = from_environment({"CUPY_XARRAY_MEMORY_SHARE": "0.3", "CUPY_XARRAY_GATHER_WAIT": "0.01"})
    assert got.memory_share == 0.3 and got.gather_wait == 0.01
    with pytest.warns(
        UserWarning, match=r"CUPY_XARRAY_MEMORY_SHAR \(did you mean CUPY_XARRAY_MEMORY_SHARE\?\)"
    ):
        assert from_environment({"CUPY_XARRAY_MEMORY_SHAR": "0.3"}).memory_share == 0.5


def test_a_bad_variable_is_named_at_first_use_not_at_import():
    import subprocess
    import sys

    code = (
        "import cupy_xarray, xarray as xr\n"
        "from cupy_xarray.sample import sample_path\n"
        "print('imported')\n"
        "xr.open_dataset(sample_path(), engine='kvikio', device='cpu')\n"
    )
    env = {**os.environ, "CUPY_XARRAY_THREADS": "many"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and done.stdout.startswith("imported")
    assert "threads must be int or None, got 'many' (CUPY_XARRAY_THREADS)" in done.stderr
