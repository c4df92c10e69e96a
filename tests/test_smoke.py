"""A read and a write round trip per device, on the embedded sample store: what the smoke run
(``tools/run_tests.sh --smoke``) checks of an install besides the docs examples."""

from __future__ import annotations

import xarray as xr

from cupy_xarray import record_reads, record_writes
from cupy_xarray.sample import sample_path


def _on_host(ds: xr.Dataset) -> xr.Dataset:
    return ds.cupy.as_numpy() if ds.cupy.is_cupy else ds


def test_a_read_equals_zarr_pythons(device):
    ours = xr.open_dataset(sample_path(), engine="kvikio", device=device)
    with record_reads() as reports:
        got = ours.load()
    assert got.cupy.is_cupy == (device == "gpu")
    assert reports and reports[-1].chunks > 0
    xr.testing.assert_identical(_on_host(got), xr.open_dataset(sample_path(), engine="zarr").load())


def test_a_write_reads_back(tmp_path, device):
    ds = xr.open_dataset(sample_path(), engine="kvikio", device=device).load()
    big = xr.concat([ds] * 16, dim="time")  # past the size xarray writes alone
    with record_writes() as reports:
        big.cupy.to_zarr(tmp_path / "out.zarr", mode="w")
    assert reports and reports[-1].arrays == ["air"], str(reports[-1])
    back = xr.open_dataset(tmp_path / "out.zarr", engine="zarr").load()
    xr.testing.assert_identical(back, _on_host(big))
