"""A small sample store shipped with the package, shaped like xarray's air-temperature data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    return _air_dataset(time, lat, lon, air, "synthetic air temperature (cupy-xarray sample)")


def _air_dataset(time: Any, lat: np.ndarray, lon: np.ndarray, air: np.ndarray, title: str) -> xr.Dataset:
    """``air`` (float32, with CF attributes) over time, lat and lon."""
    return xr.Dataset(
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
        attrs={"title": title},
    )


def air_temperature(ntime: int = 2920, nlat: int = 25, nlon: int = 53, seed: int = 0) -> xr.Dataset:
    """A synthetic dataset shaped like xarray's air-temperature tutorial: 4x daily float32
    ``air`` over ``time``, ``lat`` and ``lon``, with a seasonal cycle and noise (no download).

    Parameters
    ----------
    ntime, nlat, nlon
        Its size (the defaults: two years, 15 MB).
    seed
        Seed of the noise: the same arguments give the same values.

    Examples
    --------
    >>> from cupy_xarray.sample import air_temperature
    >>> air_temperature(ntime=8).air.shape
    (8, 25, 53)
    """
    import pandas as pd

    time = pd.date_range("2013-01-01", periods=ntime, freq="6h")
    lat = np.linspace(75.0, 15.0, nlat, dtype="float32")
    lon = np.linspace(200.0, 330.0, nlon, dtype="float32")
    doy = time.day_of_year.to_numpy()[:, None, None]
    seasonal = 12 * np.cos(2 * np.pi * (doy - 200) / 365.25)
    latitude = 300 - 0.6 * (lat[None, :, None] - 15)
    rng = np.random.default_rng(seed)
    air = latitude - seasonal * (lat[None, :, None] / 75) + rng.normal(0, 1.5, (ntime, nlat, nlon))
    return _air_dataset(time, lat, lon, air, "synthetic 4x daily NMC reanalysis (air temperature)")


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
