"""Point (vectorized) selections read only the chunks their points lie in, and equal
``engine="zarr"`` for every indexer xarray passes, on damaged stores too."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xarray as xr
import zarr

from cupy_xarray import record_reads
from cupy_xarray.errors import ChunkError

SHAPE, CHUNKS = (12, 40, 30), (4, 16, 8)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("points")
    data = np.arange(np.prod(SHAPE), dtype="float32").reshape(SHAPE)
    data[5:9, 20:, :10] = np.nan
    made = {}
    for name, enc in {
        "zstd": dict(chunks=CHUNKS, compressors=zarr.codecs.ZstdCodec(level=1)),
        "uncompressed": dict(chunks=CHUNKS, compressors=None),
        "sharded": dict(chunks=CHUNKS, shards=(4, 16, 16), compressors=zarr.codecs.ZstdCodec()),
    }.items():
        p = root / f"{name}.zarr"
        ds = xr.Dataset(
            {"v": (("t", "y", "x"), data)},
            coords={
                "t": np.arange(SHAPE[0]),
                "y": np.linspace(0, 1, SHAPE[1]),
                "x": np.arange(SHAPE[2]) * 2.0,
            },
        )
        ds.to_zarr(p, zarr_format=3, consolidated=False, encoding={"v": enc})
        made[name] = p
    # a store with missing chunks (never written: the fill value)
    p = root / "sparse.zarr"
    xr.Dataset({"v": (("t", "y", "x"), np.zeros(SHAPE, "int16"))}).to_zarr(
        p, zarr_format=3, consolidated=False, encoding={"v": dict(chunks=CHUNKS, fill_value=-7)}
    )
    a = zarr.open_array(p / "v", mode="r+")
    a[4:8, 16:32, 8:16] = 3
    for f in os.listdir(p / "v" / "c" / "0"):  # drop the t=0 chunks: read as the fill value
        import shutil

        shutil.rmtree(p / "v" / "c" / "0" / f)
    made["sparse"] = p
    return made


def _indexers(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    yield {d: xr.DataArray(rng.integers(-s, s, n), dims="p") for d, s in zip("tyx", SHAPE)}
    yield {
        "t": xr.DataArray(rng.integers(0, SHAPE[0], (3, 4)), dims=("a", "b")),
        "x": xr.DataArray(rng.integers(0, SHAPE[2], (4,)), dims="b"),
    }  # y whole: a slice between the points' dimensions
    yield {"y": xr.DataArray(rng.integers(0, SHAPE[1], n), dims="p"), "t": slice(None, None, -2)}
    yield {
        "x": xr.DataArray([[1, 2], [28, 3]], dims=("p", "q")),
        "y": xr.DataArray([0, 39], dims="q"),
        "t": 3,
    }
    yield {d: xr.DataArray(np.zeros(0, int), dims="p") for d in "ty"}


@pytest.mark.parametrize("name", ["zstd", "uncompressed", "sharded", "sparse"])
@pytest.mark.parametrize("seed", range(3))
def test_points_equal_zarr(stores, device, name, seed):
    ours = xr.open_dataset(stores[name], engine="kvikio", device=device, consolidated=False)
    ref = xr.open_dataset(stores[name], engine="zarr", consolidated=False)
    for idx in _indexers(seed):
        got = ours.isel(idx).load()
        if device == "gpu":
            got = got.cupy.as_numpy()
        xr.testing.assert_identical(got, ref.isel(idx).load())


def _holding(idx: dict) -> int:
    cells = np.stack([np.asarray(idx[d]) % s // c for d, s, c in zip("tyx", SHAPE, CHUNKS)], axis=1)
    return len(np.unique(cells, axis=0))


def test_only_the_chunks_holding_points_are_read(stores, device):
    rng = np.random.default_rng(7)
    idx = {d: xr.DataArray(rng.integers(0, s, 9), dims="p") for d, s in zip("tyx", SHAPE)}
    ds = xr.open_dataset(stores["zstd"], engine="kvikio", device=device, consolidated=False)
    with record_reads() as reports:
        ds.v.isel(idx).load()
    assert sum(r.chunks for r in reports) == _holding(idx)
    # the outer box of the same indices spans more chunks
    box = {d: np.unique(np.asarray(v)) for d, v in idx.items()}
    with record_reads() as reports:
        ds.v.isel(box).load()
    assert sum(r.chunks for r in reports) > _holding(idx)


def test_a_damaged_chunk_no_point_lies_in_is_not_read(stores, tmp_path, device):
    import shutil

    p = tmp_path / "damaged.zarr"
    shutil.copytree(stores["zstd"], p)
    with open(p / "v" / "c" / "1" / "1" / "1", "wb") as f:  # t 4-7, y 16-31, x 8-15
        f.write(b"\x00garbage" * 5)
    idx = {
        "t": xr.DataArray([5, 0], dims="p"),
        "y": xr.DataArray([0, 20], dims="p"),
        "x": xr.DataArray([0, 9], dims="p"),
    }  # chunks (1, 0, 0) and (0, 1, 1); the box of these indices holds the damaged (1, 1, 1)
    ours = xr.open_dataset(p, engine="kvikio", device=device, consolidated=False)
    ref = xr.open_dataset(p, engine="zarr", consolidated=False)
    got = ours.v.isel(idx).load()
    np.testing.assert_array_equal(
        got.cupy.as_numpy().values if device == "gpu" else got.values, ref.v.isel(idx).values
    )
    touching = {
        "t": xr.DataArray([0, 5], dims="p"),
        "y": xr.DataArray([0, 20], dims="p"),
        "x": xr.DataArray([0, 9], dims="p"),
    }
    with pytest.raises(ChunkError, match=r"c/1/1/1"):
        ours.v.isel(touching).load()


def test_points_are_read_in_waves_within_their_bound(stores, device, options):
    options(point_wave_bytes=1)  # every chunk's box a wave of its own
    rng = np.random.default_rng(3)
    idx = {d: xr.DataArray(rng.integers(0, s, 40), dims="p") for d, s in zip("tyx", SHAPE)}
    ours = xr.open_dataset(stores["zstd"], engine="kvikio", device=device, consolidated=False)
    with record_reads() as reports:
        got = ours.v.isel(idx).load()
    assert len(reports) == _holding(idx)
    ref = xr.open_dataset(stores["zstd"], engine="zarr", consolidated=False).v.isel(idx)
    xr.testing.assert_identical(got.cupy.as_numpy() if device == "gpu" else got, ref.load())
