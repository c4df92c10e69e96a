"""Random write parity: ``.cupy.to_zarr`` against xarray's own ``to_zarr``, case by case.

Each case draws a Zarr format, codec chain, dtype (complex and big-endian included), shape,
chunks, sharding, eager or dask data (blocks on chunk boundaries or across them), then a new
store, an append or a region write (of whole chunks or not), or a ``mode="w"`` over a store
the data is still read from. Both writers write the same operations into stores of their own:
the files must be byte for byte the same, the values zarr-python reads back must be the values
written, and no write may lose data. The counts of every block are checked and printed.
"""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr
from test_write import _chains, _dataset, assert_same_files

BLOCKS = 20  # tests
CASES = 100  # cases each: 2,000 in all
DTYPES = ["f4", "f8", "i4", "u2", "i1", "bool", "c8", "c16", ">f4", ">i2", ">c8", ">c16"]


@pytest.fixture(autouse=True)
def _engine_for_small_datasets(options):
    options(small_write_bytes=0)  # every case through the engine's writer
    options(write_batch_bytes=4096)  # batches of a few chunks


def _case(rng: np.random.Generator, case: int) -> dict:
    fmt = int(rng.choice([2, 3]))
    chains = _chains(fmt)
    chain = list(chains)[int(rng.integers(len(chains)))]
    dtype = str(rng.choice(DTYPES))
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(rng.integers(1, 13)) for _ in range(ndim))
    chunks = tuple(int(rng.integers(1, n + 2)) for n in shape)
    enc: dict = {"chunks": chunks, "compressors": chains[chain]}
    big = dtype.startswith(">")
    native = dtype.lstrip(">")
    if big and fmt == 3:  # v3: the bytes codec says it
        enc["serializer"] = zarr.codecs.BytesCodec(endian="big")
    if fmt == 3 and not big and rng.integers(4) == 0:
        enc["shards"] = tuple(c * int(rng.integers(1, 3)) for c in chunks)
    ds = _dataset(native, shape, seed=case, holes=bool(rng.integers(2)))
    if big and fmt == 2:  # v2: the dtype says it
        ds["v"] = ds.v.astype(dtype)
    unit = enc.get("shards", chunks)
    dask = int(rng.integers(3))  # 0 eager, 1 dask blocks of whole units, 2 blocks across chunks
    if dask == 1:
        ds = ds.chunk({d: u * int(rng.integers(1, 3)) for d, u in zip(ds.v.dims, unit)})
    elif dask == 2:
        ds = ds.chunk({d: max(1, n // 2) for d, n in zip(ds.v.dims, shape)})
    op = str(rng.choice(["new", "append", "region", "overwrite-source"]))
    return dict(fmt=fmt, chain=chain, dtype=dtype, enc=enc, ds=ds, op=op, unit=unit, dask=dask)


def _write(write, *args, **kwargs):
    """What a write did: None, or the type of the exception it raised."""
    try:
        write(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - both writers must raise the same kind
        return type(exc)
    return None


def _both(a, b, data, **kwargs):
    """The same write by xarray into ``a`` and by the engine into ``b``; the same outcome."""
    import dask

    with dask.config.set(scheduler="synchronous"):  # blocks across chunks: one after another
        want = _write(data.to_zarr, a, **kwargs)
        got = _write(data.cupy.to_zarr, b, **kwargs)
    assert got == want, (got, want, kwargs)
    return want


def _run(tmp_path, rng, case: int, counts: dict) -> None:
    c = _case(rng, case)
    ds, enc, fmt = c["ds"], {"v": c["enc"]}, c["fmt"]
    a, b = tmp_path / f"a{case}.zarr", tmp_path / f"b{case}.zarr"
    label = {k: c[k] for k in ("fmt", "chain", "dtype", "op", "dask")} | {
        "shape": ds.v.shape,
        "enc": c["enc"],
    }
    failed = _both(a, b, ds, zarr_format=fmt, encoding=enc)
    if failed is not None:
        counts["raised"] += 1
        counts["cases"] += 1
        return
    assert_same_files(a, b)
    dim = ds.v.dims[0]
    n, u = ds.v.shape[0], c["unit"][0]
    expected = ds.v.values
    if c["op"] == "append":
        more = _dataset(c["dtype"].lstrip(">"), ds.v.shape, seed=case + 5000).assign_coords(
            {dim: np.arange(n) + n}
        )
        more["v"] = more.v.astype(ds.v.dtype)
        if c["dask"]:
            more = more.chunk({dim: max(1, u)})
        if _both(a, b, more, append_dim=dim) is None:
            expected = np.concatenate([expected, more.v.values])
        else:  # refused by both (blocks across the stored chunks): what xarray left
            expected, counts["raised"] = zarr.open_array(a / "v", mode="r")[...], counts["raised"] + 1
    elif c["op"] == "region":
        start = u * int(rng.integers(0, max(1, -(-n // u))))
        stop = min(n, start + u * int(rng.integers(1, 3)) - int(rng.integers(2)))
        if stop > start:
            patch = _dataset(c["dtype"].lstrip(">"), (stop - start, *ds.v.shape[1:]), seed=case + 7000)
            patch = patch.drop_vars(dim)
            patch["v"] = patch.v.astype(ds.v.dtype)
            if _both(a, b, patch, region={dim: slice(start, stop)}) is None:
                expected = expected.copy()
                expected[start:stop] = patch.v.values
            else:
                counts["raised"] += 1
    elif c["op"] == "overwrite-source":  # the store read from, written over: refused, nothing lost
        import dask

        source = xr.open_dataset(b, engine="kvikio", device="cpu", chunks={})
        derived = source if rng.integers(2) else source * 1
        with dask.config.set(scheduler="synchronous"), pytest.raises(ValueError, match="still read from"):
            derived.cupy.to_zarr(b, mode="w", zarr_format=fmt)
        counts["refused"] += 1
    assert_same_files(a, b)
    stored = zarr.open_array(b / "v", mode="r")[...]
    # bit for bit (NaN payloads and -0.0 included), in the written byte order
    assert stored.astype(expected.dtype).tobytes() == expected.tobytes(), label
    counts["compared"] += 1
    counts["cases"] += 1


@pytest.mark.parametrize("block", range(BLOCKS))
def test_random_writes_are_xarrays_files_and_lose_nothing(tmp_path, block):
    rng = np.random.default_rng(52_000 + block)
    counts = {"cases": 0, "compared": 0, "raised": 0, "refused": 0}
    for k in range(CASES):
        _run(tmp_path, rng, block * CASES + k, counts)
    print(f"block {block}: {CASES} cases, {counts}")
    assert counts["cases"] == CASES
    assert counts["compared"] >= CASES * 3 // 5, counts  # most cases write, not only raise
