"""Property-based parity: random arrays, codec chains, formats and selections vs zarr-python.

``CUPY_XARRAY_EXAMPLES`` sets the number of examples per device (default 60 in CI; the H200
run uses 2000 or more). Every example writes a fresh store with zarr-python, reads it with
zarr-python on the CPU (the reference) and with the engine, and requires exact equality.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import numcodecs
import numpy as np
import pytest
import zarr
from conftest import host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xarray.core import indexing

from cupy_xarray.engine import array_spec, describe, read_arrays
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.xarray.backend import KvikioBackendArray, ReadSettings

EXAMPLES = int(os.environ.get("CUPY_XARRAY_EXAMPLES", "60"))
DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "bool", "c8", "c16", "M8[s]"]

_BLOSC = st.builds(
    dict,
    cname=st.sampled_from(["lz4", "zstd", "blosclz", "zlib"]),
    clevel=st.integers(1, 9),
    shuffle=st.sampled_from(["noshuffle", "shuffle", "bitshuffle"]),
)


def _v3_compressors(draw):
    from zarr.codecs import numcodecs as zn

    kind = draw(
        st.sampled_from(
            ["none", "zstd", "gzip", "zlib", "lz4", "crc32c", "zstd+crc32c", "gzip+crc32c", "blosc"]
        )
    )
    if kind == "none":
        return None
    if kind == "zstd":
        return [zarr.codecs.ZstdCodec(level=draw(st.integers(-3, 9)), checksum=draw(st.booleans()))]
    if kind == "gzip":
        return [zarr.codecs.GzipCodec(level=draw(st.integers(0, 9)))]
    if kind == "zlib":
        return [zn.Zlib(level=draw(st.integers(0, 9)))]
    if kind == "lz4":
        return [zn.LZ4(acceleration=draw(st.integers(1, 4)))]
    if kind == "crc32c":
        return [zarr.codecs.Crc32cCodec()]
    if kind == "blosc":
        return [zarr.codecs.BloscCodec(**draw(_BLOSC))]
    first = zarr.codecs.ZstdCodec(level=1) if kind.startswith("zstd") else zarr.codecs.GzipCodec(level=1)
    return [first, zarr.codecs.Crc32cCodec()]


def _v2_compressor(draw):
    kind = draw(st.sampled_from(["none", "zstd", "gzip", "zlib", "lz4", "blosc"]))
    if kind == "blosc":
        b = draw(_BLOSC)
        shuffle = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE}.get(
            b["shuffle"], numcodecs.Blosc.BITSHUFFLE
        )
        return numcodecs.Blosc(cname=b["cname"], clevel=b["clevel"], shuffle=shuffle)
    return {
        "none": None,
        "zstd": numcodecs.Zstd(level=draw(st.integers(1, 9))),
        "gzip": numcodecs.GZip(level=draw(st.integers(0, 9))),
        "zlib": numcodecs.Zlib(level=draw(st.integers(0, 9))),
        "lz4": numcodecs.LZ4(),
    }[kind]


def _values(rng, dtype, shape):
    dtype = np.dtype(dtype).newbyteorder("=")
    n = int(np.prod(shape))
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    if dtype.kind == "M":
        return (rng.integers(-(10**9), 10**9, n)).astype(dtype).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # runs of repeated values compress; the extremes exercise every byte
        base = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        base[: n // 2] = (np.arange(n // 2) % 7).astype(dtype)
        return base.reshape(shape)
    x = rng.standard_normal(n) * 100
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(n)
    x = x.astype(dtype)
    if n:
        x[rng.random(n) < 0.1] = np.nan
        x[: n // 3] = 1.5
    return x.reshape(shape)


def _fill(draw, dtype):
    kind = np.dtype(dtype).kind
    if kind == "b":
        return draw(st.booleans())
    if kind == "M":
        return draw(st.sampled_from([0, 86400]))
    if kind in "fc":
        return draw(st.sampled_from([float("nan"), 0.0, -7.25]))
    return draw(st.sampled_from([0, 3, 100]))


def _orthogonal(draw, shape):
    sel = []
    for n in shape:
        kinds = ["slice", "array"] + (["int"] if n else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "int":
            sel.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
            start = draw(st.none() | st.integers(-n - 1, n + 1))
            stop = draw(st.none() | st.integers(-n - 1, n + 1))
            sel.append(slice(start, stop, step))
        else:
            k = draw(st.integers(0 if n == 0 else 1, 4)) if n else 0
            sel.append(
                np.array(draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=k, max_size=k)), dtype=int)
            )
    return tuple(sel)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from([2, 3]))
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0 if ndim else 1, 7), min_size=ndim, max_size=ndim)))
    chunks = tuple(draw(st.integers(1, max(1, n))) for n in shape)
    big = np.dtype(dtype).itemsize > 1 and np.dtype(dtype).kind != "b" and draw(st.booleans())
    kw = {"shape": shape, "chunks": chunks, "zarr_format": fmt, "fill_value": _fill(draw, dtype)}
    if fmt == 2:
        kw["dtype"] = (
            (">" if big else "<") + np.dtype(dtype).str[1:] if np.dtype(dtype).itemsize > 1 else dtype
        )
        kw["compressors"] = _v2_compressor(draw)
        kw["order"] = draw(st.sampled_from(["C", "F"]))
    else:
        kw["dtype"] = dtype
        kw["compressors"] = _v3_compressors(draw)
        if big:
            kw["serializer"] = zarr.codecs.BytesCodec(endian="big")
        if ndim >= 2 and draw(st.booleans()):
            kw["filters"] = [zarr.codecs.TransposeCodec(order=draw(st.permutations(range(ndim))))]
        if ndim >= 1 and all(shape) and draw(st.booleans()):
            kw["shards"] = tuple(c * draw(st.integers(1, 3)) for c in chunks)
    seed = draw(st.integers(0, 2**32 - 1))
    region = tuple(slice(0, draw(st.integers(0, n))) for n in shape) if draw(st.booleans()) else None
    selections = [_orthogonal(draw, shape) for _ in range(draw(st.integers(1, 3)))]
    vector = None
    if ndim and all(shape) and draw(st.booleans()):
        k = draw(st.integers(1, 5))
        vector = tuple(
            np.array(draw(st.lists(st.integers(-n, n - 1), min_size=k, max_size=k))) for n in shape
        )
        sliced = [draw(st.booleans()) for _ in shape]
        if not all(sliced):  # some dimensions whole or strided: points' dimensions come first
            vector = tuple(
                slice(None, None, draw(st.sampled_from([1, 2, -1]))) if cut else v
                for v, cut in zip(vector, sliced)
            )
    return kw, seed, region, selections, vector


def _run(device: str, case) -> None:
    kw, seed, region, selections, vector = case
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.create_array(os.path.join(tmp, "a.zarr"), **kw)
        data = _values(np.random.default_rng(seed), arr.dtype, arr.shape)
        if region is None:
            arr[...] = data
        else:  # only part written: the other chunks are missing and read as the fill value
            arr[region] = data[region]
        full = arr[...]
        spec = array_spec(arr)
        where = f"{kw} region={region} {describe(spec, dev)}"
        for sel in selections:
            ref = _oindex(full, sel)
            (got,) = read_arrays([(spec, sel)], dev, batch_bytes=4096)
            got = host(got)
            assert got.shape == np.shape(ref), (sel, where)
            assert got.dtype == np.asarray(ref).dtype.newbyteorder("="), (sel, where)
            np.testing.assert_array_equal(got, ref, err_msg=f"{sel} {where}")
        if vector is not None:
            backend = KvikioBackendArray(arr, "a", ReadSettings(device))
            got = host(backend[indexing.VectorizedIndexer(vector)])
            np.testing.assert_array_equal(got, _vindex(full, vector), err_msg=f"vindex {vector} {where}")


def _vindex(full: np.ndarray, key: tuple) -> np.ndarray:
    """NumPy's advanced indexing with the points' dimensions first (xarray's vectorized rule;
    NumPy leaves adjacent advanced indices in place)."""
    out = np.asarray(full)[key]
    adv = [d for d, k in enumerate(key) if not isinstance(k, slice)]
    nd = np.broadcast_shapes(*(np.shape(key[d]) for d in adv)).__len__()
    if adv and adv == list(range(adv[0], adv[-1] + 1)) and adv[0]:
        out = np.moveaxis(out, list(range(adv[0], adv[0] + nd)), list(range(nd)))
    return out


def _oindex(full: np.ndarray, sel: tuple) -> np.ndarray:
    """Orthogonal indexing of zarr-python's full read, in NumPy (zarr's own oindex refuses
    empty integer arrays and negative steps)."""
    out = np.asarray(full)
    drop = []
    for axis, s in enumerate(sel):
        n = out.shape[axis]
        if isinstance(s, int | np.integer):
            idx = np.array([s % n])
            drop.append(axis)
        elif isinstance(s, slice):
            idx = np.arange(n)[s]
        else:
            idx = np.asarray(s, dtype=int)
        out = np.take(out, idx, axis=axis)
    return out.squeeze(axis=tuple(drop)) if drop else out


_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CUPY_XARRAY_HYPOTHESIS_SEED") is None,
    database=None,
)


@_SETTINGS
@given(case=cases())
def test_random_parity_cpu(case):
    _run("cpu", case)


@pytest.mark.gpu
@_SETTINGS
@given(case=cases())
def test_random_parity_gpu(case):
    _run("gpu", case)
