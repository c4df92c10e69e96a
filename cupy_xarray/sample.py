"""A small sample store shipped with the package, shaped like xarray's air-temperature data."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xarray as xr

SAMPLE = Path(__file__).parent / "sample" / "air_temperature.zarr"


def make_dataset(ntime: int = 120, nlat: int = 25, nlon: int = 53) -> xr.Dataset:
    """A synthetic time x lat x lon float32 dataset with CF attributes (no download)."""
    time = np.array([np.datetime64("2013-01-01T00") + np.timedelta64(6 * i, "h") for i in range(ntime)])
    lat = np.linspace(75.0, 15.0, nlat, dtype="float32")
    lon = np.linspace(200.0, 330.0, nlon, dtype="float32")
    t = np.arange(ntime)[:, None, None]
    la = np.deg2rad(lat)[None, :, None]
    lo = np.deg2rad(lon)[None, None, :]
    air = 273.15 + 30 * np.cos(la) - 10 * np.cos(2 * np.pi * t / 4) * np.sin(la) + 5 * np.sin(3 * lo)
    ds = xr.Dataset(
        {
            "air": (
                ("time", "lat", "lon"),
                air.astype("float32"),
                {"long_name": "4xDaily Air temperature at sigma level 995", "units": "degK"},
            )
        },
        coords={
            "time": time,
            "lat": ("lat", lat, {"units": "degrees_north"}),
            "lon": ("lon", lon, {"units": "degrees_east"}),
        },
        attrs={"title": "synthetic air temperature (cupy-xarray sample)"},
    )
    return ds


def write_sample(path: str | os.PathLike = SAMPLE) -> Path:
    """Write the sample store (Zarr v3, zstd) to ``path``."""
    import zarr

    ds = make_dataset()
    enc = {"air": {"chunks": (30, 25, 53), "compressors": zarr.codecs.ZstdCodec(level=3)}}
    ds.to_zarr(path, mode="w", zarr_format=3, consolidated=True, encoding=enc)
    return Path(path)


def sample_path() -> Path:
    """Path of the embedded sample store."""
    return SAMPLE
