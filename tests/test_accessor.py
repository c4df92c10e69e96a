"""The .cupy accessor: numpy and dask paths everywhere, cupy round trips on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
from conftest import HAS_GPU, host

import cupy_xarray  # noqa: F401


def make_da() -> xr.DataArray:
    da = xr.DataArray(
        np.arange(24, dtype="float32").reshape(4, 6),
        dims=("t", "x"),
        name="v",
        coords={"t": np.arange(4), "x": np.arange(6) * 2.0, "aux": (("t",), np.arange(4) * 10)},
        attrs={"units": "K"},
    )
    da.encoding = {"dtype": np.dtype("float32"), "chunks": (2, 6)}
    return da


def test_numpy_paths():
    da = make_da()
    assert not da.cupy.is_cupy
    back = da.cupy.as_numpy()
    assert back is not da and isinstance(back.data, np.ndarray)
    assert not np.shares_memory(back.data, da.data)
    np.testing.assert_array_equal(da.cupy.get(), da.values)
    ds = da.to_dataset()
    assert not ds.cupy.is_cupy
    xr.testing.assert_identical(ds.cupy.as_numpy(), ds)


def test_dask_numpy_paths():
    da = make_da().chunk({"t": 2})
    assert not da.cupy.is_cupy
    out = da.cupy.as_numpy()
    assert out.chunks == da.chunks  # still lazy
    np.testing.assert_array_equal(out.cupy.get(), make_da().values)


def test_as_cupy_without_gpu_is_clear():
    if HAS_GPU:
        pytest.skip("a GPU is present")
    with pytest.raises((RuntimeError, ImportError), match="device='cpu'|as_numpy|cuda1[23]"):
        make_da().cupy.as_cupy()


def test_import_without_cupy_and_info():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['kvikio'] = None; sys.modules['nvidia'] = None;"
        "import cupy_xarray, xarray as xr, numpy as np;"
        "from cupy_xarray.info import info_lines; print('\\n'.join(info_lines()));"
        "ds = cupy_xarray.read_zarr_gds(str(cupy_xarray.sample.sample_path()), device='cpu');"
        "print('air', type(ds.air.data).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import cupy_xarray.sample;" + code],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "CUPY_XARRAY_DEVICE"},
    ).stdout
    assert "cupy          not available" in out
    assert "GPU           none available: reads with device='gpu' raise NoGPUError" in out
    assert "device        gpu (CUPY_XARRAY_DEVICE" in out
    assert "nvCOMP C API  not used (" in out  # says why, and reading still works
    assert "air ndarray" in out


def _cli(*args: str, **env: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "cupy_xarray", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    ).stdout


def test_cli_info_and_demo(tmp_path):
    import json

    out = _cli("info", CUPY_XARRAY_CACHE=str(tmp_path))
    measure = "cupy_xarray.warm_up(measure=True) measures them"
    assert f"decode rates  none measured: built-in figures ({measure}): {tmp_path}" in out
    (tmp_path / "decode-rates.json").write_text(json.dumps({"H200|16 cores|nvcomp 6000|gzip": {}}))
    assert "decode rates  measured for gzip:" in _cli("info", CUPY_XARRAY_CACHE=str(tmp_path))
    assert out.startswith("cupy_xarray") and "xarray" in out and "zarr" in out
    assert "nvCOMP C API  off (CUPY_XARRAY_NVCOMP_C=0)" in _cli("info", CUPY_XARRAY_NVCOMP_C="0")
    assert "decode        auto (" in out
    assert "decode        gpu (" in _cli("info", CUPY_XARRAY_DECODE="gpu")
    demo = _cli("demo")
    assert "identical to engine='zarr': True" in demo
    assert ("device used: gpu" in demo) == HAS_GPU


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_round_trip_dataarray():
    import cupy

    da = make_da()
    g = da.cupy.as_cupy()
    assert g.cupy.is_cupy and isinstance(g.data, cupy.ndarray)
    assert g.name == da.name and g.attrs == da.attrs and g.encoding == da.encoding
    assert isinstance(g.coords["aux"].data, np.ndarray)  # non-index coords stay on the host
    assert g.indexes["t"].equals(da.indexes["t"])
    np.testing.assert_array_equal(g.cupy.get(), da.values)
    back = g.cupy.as_numpy()
    assert not back.cupy.is_cupy and isinstance(back.data, np.ndarray)
    xr.testing.assert_identical(back, da)
    gc = da.cupy.as_cupy(coords=True)
    assert isinstance(gc.coords["aux"].data, cupy.ndarray)


@pytest.mark.gpu
def test_round_trip_dataset():
    ds = make_da().to_dataset()
    ds["w"] = ds.v * 2
    ds.attrs["title"] = "x"
    g = ds.cupy.as_cupy()
    assert g.cupy.is_cupy and g.attrs == ds.attrs
    assert g.v.encoding == ds.v.encoding
    xr.testing.assert_identical(g.cupy.as_numpy(), ds)


@pytest.mark.gpu
def test_dask_as_cupy_stays_lazy():
    import cupy

    da = make_da().chunk({"t": 2})
    g = da.cupy.as_cupy()
    assert g.chunks == da.chunks and isinstance(g.data._meta, cupy.ndarray)
    assert g.cupy.is_cupy
    computed = g.compute()
    assert isinstance(computed.data, cupy.ndarray)
    np.testing.assert_array_equal(host(computed.data), make_da().values)
    np.testing.assert_array_equal(g.cupy.get(), make_da().values)
    back = g.cupy.as_numpy()
    assert isinstance(back.data._meta, np.ndarray)
    np.testing.assert_array_equal(back.compute().values, make_da().values)
