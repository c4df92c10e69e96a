"""Stores written by other software (tensorstore), read by the engine and compared exactly."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import expected_type, host, module_of

from cupy_xarray.engine import array_spec, describe, read_arrays
from cupy_xarray.engine.devices import resolve_device

ts = pytest.importorskip("tensorstore")

SHAPE = (37, 29, 11)


def _data(dtype):
    x = np.sin(np.arange(np.prod(SHAPE)) / 40.0).reshape(SHAPE) * 1000
    return x.astype(dtype)


def _zarr3(codecs, dtype, shards=False):
    chunk = [8, 16, 11]
    meta = {"shape": list(SHAPE), "data_type": dtype, "dimension_names": ["t", "y", "x"]}
    if shards:
        meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [16, 16, 11]}}
        meta["codecs"] = [
            {
                "name": "sharding_indexed",
                "configuration": {"chunk_shape": chunk, "codecs": [{"name": "bytes"}, *codecs]},
            }
        ]
    else:
        meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": chunk}}
        meta["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, *codecs]
    return {"driver": "zarr3", "metadata": meta}


def _zarr2(compressor, dtype):
    return {
        "driver": "zarr",
        "metadata": {"shape": list(SHAPE), "chunks": [8, 16, 11], "dtype": dtype, "compressor": compressor},
    }


ZSTD3 = [{"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
STORES = {
    "zarr3-raw": lambda: _zarr3([], "float32"),
    "zarr3-zstd": lambda: _zarr3(ZSTD3, "float32"),
    "zarr3-gzip": lambda: _zarr3([{"name": "gzip", "configuration": {"level": 5}}], "int16"),
    "zarr3-crc32c": lambda: _zarr3([{"name": "crc32c"}], "float64"),
    "zarr3-blosc": lambda: _zarr3(
        [
            {
                "name": "blosc",
                "configuration": {
                    "cname": "lz4",
                    "clevel": 5,
                    "shuffle": "shuffle",
                    "typesize": 4,
                    "blocksize": 0,
                },
            }
        ],
        "float32",
    ),
    "zarr3-sharded-zstd": lambda: _zarr3(ZSTD3, "uint16", shards=True),
    "zarr2-zlib": lambda: _zarr2({"id": "zlib", "level": 4}, "<f4"),
    "zarr2-zstd": lambda: _zarr2({"id": "zstd", "level": 3}, "<i4"),
    "zarr2-blosc": lambda: _zarr2({"id": "blosc", "cname": "zstd", "clevel": 3, "shuffle": 2}, "<f8"),
    "zarr2-raw-big-endian": lambda: _zarr2(None, ">i8"),
}


@pytest.mark.parametrize("kind", list(STORES))
def test_tensorstore_written(tmp_path, device, kind):
    spec = STORES[kind]()
    root = tmp_path / "ds.zarr"
    spec["kvstore"] = {"driver": "file", "path": str(root / "air")}
    dtype = np.dtype(spec["metadata"].get("data_type") or spec["metadata"]["dtype"])
    store = ts.open(spec, create=True).result()
    data = _data(dtype)
    store[...] = data
    store[20:30] = 0  # tensorstore leaves chunks out as well: some read as the fill value
    expect = store.read().result()

    arr = zarr.open_array(root / "air")
    np.testing.assert_array_equal(arr[...], expect)  # zarr-python agrees with the writer
    dev = resolve_device(device)
    aspec = array_spec(arr)
    for sel in [(slice(None),), (slice(3, 35, 4), np.array([28, 0, 5]), 7)]:
        (got,) = read_arrays([(aspec, sel)], dev)
        assert module_of(got) == expected_type(device)
        want = expect[sel[0]] if len(sel) == 1 else expect[sel[0]][:, sel[1], sel[2]]
        np.testing.assert_array_equal(host(got), want, err_msg=f"{kind} {describe(aspec, dev)}")
    if spec["driver"] == "zarr3":  # and through xarray, once a group is around the array
        (root / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
        ds = xr.open_dataset(root, engine="kvikio", device=device, consolidated=False)
        assert ds.air.dims == ("t", "y", "x")
        np.testing.assert_array_equal(host(ds.air.data), expect)
