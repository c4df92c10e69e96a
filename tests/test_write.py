"""Writing to Zarr: ``ds.cupy.to_zarr`` / ``da.cupy.to_zarr`` / ``tree.cupy.to_zarr``.

On the CPU the engine's writer (numcodecs on CPU threads) must write the very files xarray and
zarr-python write, byte for byte; on the GPU (nvCOMP frames differ from libzstd's) what
zarr-python reads back must equal what was written, bitwise."""

from __future__ import annotations

import filecmp
import sys
import zlib
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

from cupy_xarray import get_options, record_writes
from cupy_xarray.engine import array_spec, read_arrays
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.write import encoders
from cupy_xarray.write.context import Write


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _unstamped(path: Path) -> bytes:
    """A file's bytes, with what depends on the second a gzip member was written zeroed: each
    member's time stamp (bytes 4 to 8), and the crc32c right after a member where it is that
    member's (it covers the stamp). Members are found anywhere: a chunk, or a shard's inner
    chunks."""
    raw = bytearray(path.read_bytes())
    at = raw.find(b"\x1f\x8b\x08")
    while at >= 0:
        member = zlib.decompressobj(31)
        try:
            member.decompress(bytes(raw[at:]))
        except zlib.error:
            member = None
        if member is not None and member.eof:
            end = len(raw) - len(member.unused_data)
            crc = google_crc32c.value(bytes(raw[at:end])).to_bytes(4, "little")
            raw[at + 4 : at + 8] = b"\0\0\0\0"
            if raw[end : end + 4] == crc:
                raw[end : end + 4] = b"\0\0\0\0"
            at = end
        else:
            at += 1
        at = raw.find(b"\x1f\x8b\x08", at)
    return bytes(raw)


def assert_same_files(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb), (sorted(set(fa) ^ set(fb)))[:8]
    differ = [
        k
        for k in fa
        if not filecmp.cmp(fa[k], fb[k], shallow=False) and _unstamped(fa[k]) != _unstamped(fb[k])
    ]
    assert not differ, differ[:8]


def _dataset(dtype="f4", shape=(7, 30, 41), seed=0, holes=True) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    values = np.sin(np.arange(n) / 50).reshape(shape) * 100 + rng.normal(0, 1, shape)
    kind = np.dtype(dtype).kind
    if kind == "b":
        data = values > 0
    elif kind in "iu":
        data = np.clip(values, 0 if kind == "u" else -1000, 1000).astype(dtype)
    else:
        if kind == "c":  # parts that differ everywhere: a swap of real and imaginary shows
            values = values + 1j * (np.cos(np.arange(n) / 7).reshape(shape) * 50 + 0.5)
        data = values.astype(dtype)
        if holes:
            cut = (slice(None), slice(0, shape[1] // 3)) if len(shape) > 1 else slice(0, shape[0] // 3)
            data[cut] = np.nan  # whole chunks of the fill value: not written
    dims = ("t", "y", "x")[: len(shape)]
    return xr.Dataset(
        {"v": (dims, data, {"units": "K", "long_name": "field"})},
        coords={dims[0]: np.arange(shape[0])},
        attrs={"title": "write test"},
    )


def _chains(fmt: int) -> dict[str, object]:
    if fmt == 2:
        return {
            "none": None,
            "zstd-1": numcodecs.Zstd(1),
            "zstd-3": numcodecs.Zstd(3),
            "blosc-lz4": numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE),
            "blosc-zstd": numcodecs.Blosc("zstd", 3, numcodecs.Blosc.SHUFFLE),
            "gzip": numcodecs.GZip(1),
            "zlib": numcodecs.Zlib(1),
            "lz4": numcodecs.LZ4(),
        }
    from zarr.codecs import numcodecs as zn

    return {
        "none": None,
        "zstd-1": zarr.codecs.ZstdCodec(level=1),
        "zstd-0": zarr.codecs.ZstdCodec(level=0),
        "zstd-checksum": zarr.codecs.ZstdCodec(level=1, checksum=True),
        "zstd+crc32c": [zarr.codecs.ZstdCodec(level=1), zarr.codecs.Crc32cCodec()],
        "crc32c": [zarr.codecs.Crc32cCodec()],
        "lz4+crc32c": [zn.LZ4(), zarr.codecs.Crc32cCodec()],
        "blosc-lz4": zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle"),
        "blosc-zstd": [
            zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"),
            zarr.codecs.Crc32cCodec(),
        ],
        "blosc-zstd-bitshuffle": zarr.codecs.BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"),
        "gzip+crc32c": [zarr.codecs.GzipCodec(level=1), zarr.codecs.Crc32cCodec()],
    }


CASES = [(fmt, name) for fmt in (2, 3) for name in _chains(fmt)]
#: chains whose chunks nvCOMP encodes from GPU data (every other one: CPU threads, a batch copied
#: to the host at a time); their files differ from libzstd's and liblz4's but read the same
NVCOMP_CHAINS = {"zstd-1", "zstd-3", "zstd-0", "zstd+crc32c", "lz4", "lz4+crc32c", "blosc-zstd"}


@pytest.fixture(autouse=True)
def _nvcomp_for_small_writes(request, options):
    """The GPU tests write small arrays: through nvCOMP, as large writes are (a write of less
    than the ``write_gpu_min_bytes`` option is otherwise compressed on CPU threads)."""
    if request.node.get_closest_marker("gpu") and not request.node.get_closest_marker("small_writes"):
        options(write_gpu_min_bytes=0)


@pytest.fixture(autouse=True)
def _engine_for_small_datasets(request, options):
    """The tests write small Datasets: through the engine, as large ones are (a Dataset of
    fewer than the ``small_write_bytes`` option is otherwise written by xarray)."""
    if not request.node.get_closest_marker("small_datasets"):
        options(small_write_bytes=0)


def _gpu_encoder(chain: str) -> str:
    """The encoder of GPU data: nvCOMP sharing batches with CPU threads, nvCOMP (uncompressed
    and crc32c chunks), or CPU threads."""
    if chain in NVCOMP_CHAINS:
        share = get_options().write_cpu_share("LZ4" if chain.startswith("lz4") else "Zstd")
        return "gpu" if share == 0 else "gpu+cpu" if share < 1 else "cpu"
    return "gpu" if chain in ("none", "crc32c") else "cpu"


@pytest.mark.parametrize("fmt,chain", CASES, ids=[f"v{f}-{c}" for f, c in CASES])
@pytest.mark.parametrize("dtype", ["f4", "i2", "u1", "f8", "bool"])
def test_the_engine_writes_the_files_xarray_writes(tmp_path, fmt, chain, dtype):
    ds = _dataset(dtype)
    enc = {"v": {"chunks": (2, 8, 16), "compressors": _chains(fmt)[chain]}}
    ds.to_zarr(tmp_path / "xarray.zarr", zarr_format=fmt, encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "engine.zarr", zarr_format=fmt, encoding=enc)
    (report,) = reports
    assert report.arrays == ["v"] and report.encoder == "cpu" and report.chunks > 0
    # the rest of the dataset (its coordinates) xarray wrote, and the report says so
    assert sorted(report.by_xarray) == sorted(str(n) for n in ds.variables if n != "v")
    assert report.by_xarray and f"written by xarray: {', '.join(report.by_xarray)}" in str(report)
    assert_same_files(tmp_path / "xarray.zarr", tmp_path / "engine.zarr")
    want = xr.open_dataset(tmp_path / "xarray.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "engine.zarr", engine="zarr").load(), want)


def test_random_writes_match_xarray(tmp_path, options):
    """Random codecs, dtypes, shapes and chunks, eager or in dask blocks of whole chunks, then
    appended to along the first axis: the files xarray writes."""
    options(write_batch_bytes=3000)  # batches of a few chunks
    rng = np.random.default_rng(2026)
    for case in range(32):
        fmt = int(rng.choice([2, 3]))
        chains = _chains(fmt)
        chain = list(chains)[int(rng.integers(len(chains)))]
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.integers(1, 40)) for _ in range(ndim))
        chunks = tuple(int(rng.integers(1, n + 3)) for n in shape)
        dtype = str(rng.choice(["f4", "f8", "i4", "u2", "i1"]))
        ds = _dataset(dtype, shape, seed=case, holes=bool(rng.integers(2)))
        if rng.integers(2):  # dask blocks of one to three chunks along each axis
            ds = ds.chunk({d: c * int(rng.integers(1, 4)) for d, c in zip(ds.v.dims, chunks)})
        enc = {"v": {"chunks": chunks, "compressors": chains[chain]}}
        if fmt == 3 and rng.integers(3) == 0:  # sharded: shards of one to three chunks an axis
            shards = tuple(c * int(rng.integers(1, 4)) for c in chunks)
            enc["v"]["shards"] = shards
            if hasattr(ds.v.data, "chunks"):  # dask blocks of whole shards
                ds = ds.chunk({d: s * int(rng.integers(1, 3)) for d, s in zip(ds.v.dims, shards)})
        a, b = tmp_path / f"a{case}.zarr", tmp_path / f"b{case}.zarr"
        ds.to_zarr(a, zarr_format=fmt, encoding=enc)
        with record_writes() as reports:
            ds.cupy.to_zarr(b, zarr_format=fmt, encoding=enc)
        assert reports[0].chunks + reports[0].empty > 0, (fmt, chain, shape, chunks, dtype)
        assert reports[0].arrays == ["v"], str(reports[0])
        assert_same_files(a, b)
        if rng.integers(3) == 0:  # appended to: xarray's write, into the engine's store
            more = _dataset(dtype, shape, seed=case + 100).assign_coords(
                {ds.v.dims[0]: np.arange(shape[0]) + 99}
            )
            more.to_zarr(a, append_dim=ds.v.dims[0])
            more.cupy.to_zarr(b, append_dim=ds.v.dims[0])
            assert_same_files(a, b)


@pytest.mark.parametrize("batch_bytes", [1 << 30, 2 * 16 * 16 * 4])
def test_dask_blocks_are_written_with_the_calls_settings(tmp_path, batch_bytes):
    """The settings in effect where ``to_zarr`` is called hold for the dask blocks it writes on
    dask's threads: a batch of at most ``write_batch_bytes`` (here one chunk, or a block)."""
    import dask

    from cupy_xarray import set_options

    ds = _dataset("f4", (8, 32, 48), holes=False).chunk({"t": 4, "y": 32, "x": 48})  # 2 blocks
    enc = {"v": {"chunks": (2, 16, 16), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with dask.config.set(scheduler="threads"), record_writes() as reports:
        with set_options(write_batch_bytes=batch_bytes, small_write_bytes=0):
            ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    (report,) = reports
    # 24 chunks in two blocks: a batch a chunk, or one or two a block (the last row in two)
    assert report.batches == (24 if batch_bytes < 1 << 30 else 4), str(report)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize(
    "name,value",
    [
        ("write_cpu_share_zstd", 1.5),
        ("write_cpu_share_lz4", -0.1),
        ("write_batch_bytes", 0),
        ("write_in_flight", 0),
    ],
)
def test_write_settings_out_of_range_are_refused(name, value):
    from cupy_xarray import set_options

    with pytest.raises(ValueError, match=name):
        set_options(**{name: value})


@pytest.mark.parametrize("shape", [(8, 32, 48), (9, 32, 48), (8, 30, 48), (64,), (6, 32)])
@pytest.mark.parametrize("batch_bytes", [1 << 30, 6 * 2048, 2048])
def test_batches_of_grid_rows_and_of_single_chunks(tmp_path, shape, batch_bytes, options):
    """Batches of whole rows of the chunk grid are gathered in one copy, others chunk by
    chunk (edges padded): the files are xarray's either way."""

    options(write_batch_bytes=batch_bytes)
    ds = _dataset("f4", shape, holes=False)
    chunk = (2, 16, 16)[: len(shape)] if len(shape) > 1 else (8,)
    enc = {"v": {"chunks": chunk, "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert reports[0].batches >= (2 if batch_bytes < 1 << 30 else 1), str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("chain", ["zstd-1", "zstd+crc32c", "lz4+crc32c"])
def test_batches_shared_between_two_encoders(tmp_path, monkeypatch, share, chain, options):
    """A batch split between two encoders (nvCOMP and CPU threads on a GPU; here CPU threads
    on both sides) and merged back: chunk order, chunks of the fill value, crc32c."""
    from cupy_xarray.write import encoders

    options(write_cpu_share_zstd=share, write_cpu_share_lz4=share)
    options(write_batch_bytes=7 * 2 * 16 * 16 * 4)  # batches of 7 chunks
    shared = []

    def encoder_for(self, on_gpu, recipe, chunk_bytes, nbytes):
        shared.append(encoders.SharedEncoder(self.cpu, self.cpu, self.options))
        return shared[-1] if shared[-1].supports(recipe, chunk_bytes) else self.cpu

    monkeypatch.setattr(Write, "encoder_for", encoder_for)
    ds = _dataset("f4", (8, 48, 48))  # chunks of NaN only among them
    enc = {"v": {"chunks": (2, 16, 16), "compressors": _chains(3)[chain]}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    (report,) = reports
    assert report.encoder == ("gpu+cpu" if 0 < share < 1 else "cpu") and report.batches >= 3, str(report)
    assert report.empty > 0, str(report)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize(
    "chain,nbytes,want",
    [("zstd-1", 2**20, "cpu"), ("zstd-1", 2**30, "gpu"), ("none", 2**20, "gpu"), ("blosc-lz4", 2**30, "cpu")],
)
def test_small_compressed_writes_of_gpu_data_go_to_cpu_threads(
    tmp_path, monkeypatch, chain, nbytes, want, options
):
    """nvCOMP's call costs about 80 ms whatever its size: a compressed write of less than
    ``write_gpu_min_bytes`` is faster on CPU threads (the choice alone; on a GPU machine too,
    below)."""
    from cupy_xarray.write import encoders

    monkeypatch.setattr(encoders, "batched_encoder", lambda algo: object())  # as if nvCOMP were here
    options(write_cpu_share_zstd=0.0)
    codecs = _chains(3)[chain]
    meta = zarr.create_array(
        tmp_path / "a.zarr", shape=(4, 8), chunks=(2, 8), dtype="f4", compressors=codecs
    ).metadata
    writer = Write(tmp_path)
    encoder = writer.encoder_for(True, encoders.recipe_of(meta), 64, nbytes)
    assert encoder.name == want
    assert writer.encoder_for(False, encoders.recipe_of(meta), 64, nbytes).name == "cpu"


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_dask_coordinates_are_written(tmp_path, scheduler):
    """Dask variables the engine leaves to xarray (here a non-index coordinate) are written
    from host copies after the metadata: not left empty."""
    import dask
    import dask.array as da

    ds = _dataset("f4", (8, 32, 48))
    ds = ds.assign_coords(lat=("y", da.from_array(np.linspace(-40, 40, 32), chunks=10)))
    enc = {"v": {"chunks": (2, 16, 16)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with dask.config.set(scheduler=scheduler), record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert reports[0].arrays == ["v"], str(reports[0])
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "e.zarr", engine="zarr").load(), ds.compute())
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("dtype", ["f4", "i2", "c8", "c16"])
def test_big_endian_stores(tmp_path, fmt, dtype):
    """Big-endian stores: each element's bytes reversed, each part's for complex numbers (real
    and imaginary parts stay in place)."""
    ds = _dataset(dtype)
    enc = {"v": {"chunks": (2, 8, 16), "compressors": _chains(fmt)["zstd-1"]}}
    if fmt == 2:  # v2: the dtype says it; the data are big-endian in memory too
        ds["v"] = ds.v.astype(">" + dtype)
    else:  # v3: the bytes codec says it
        enc["v"]["serializer"] = zarr.codecs.BytesCodec(endian="big")
    ds.to_zarr(tmp_path / "x.zarr", zarr_format=fmt, encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", zarr_format=fmt, encoding=enc)
    assert reports[0].arrays == ["v"]
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    stored = zarr.open_array(tmp_path / "e.zarr" / "v", mode="r")[...]
    np.testing.assert_array_equal(stored, ds.v.values)  # not only as xarray writes: the values


@pytest.mark.parametrize("where", ["none", "variable", "argument"])
def test_chunks_zarr_chooses_and_chunks_given(tmp_path, where):
    """Without chunks zarr-python chooses them (a 16 MB array is split); chunks in the
    variable's encoding are used unless ``encoding=`` names the variable (it replaces them)."""
    ds = _dataset(shape=(64, 256, 256), holes=False)
    enc = None
    if where != "none":
        ds.v.encoding["chunks"] = (8, 128, 128)
    if where == "argument":
        enc = {"v": {"compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert reports[0].arrays == ["v"]
    chunks = zarr.open_array(tmp_path / "x.zarr" / "v").chunks
    assert (chunks == (8, 128, 128)) == (where == "variable") and chunks != ds.v.shape, chunks
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


def test_a_dataarray_and_its_name(tmp_path):
    da = _dataset().v
    da.to_zarr(tmp_path / "x.zarr")
    da.cupy.to_zarr(tmp_path / "e.zarr")
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    unnamed = da.rename(None)
    unnamed.cupy.to_zarr(tmp_path / "u.zarr")
    xr.testing.assert_identical(xr.open_dataarray(tmp_path / "u.zarr", engine="zarr").load(), unnamed)


def test_what_the_engine_does_not_encode_is_written_by_xarray(tmp_path):
    """CF-scaled values, datetimes: xarray's own write, the same files (beside Blosc and gzip
    chunks the engine encodes)."""
    ds = _dataset()
    ds["scaled"] = ds.v.fillna(0)
    ds["scaled"].encoding = {"scale_factor": 0.1, "dtype": "i2", "_FillValue": -1}
    ds["when"] = ("t", np.arange("2020-01-01", "2020-01-08", dtype="datetime64[D]").astype("M8[ns]"))
    enc = {
        "v": {"compressors": zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle")},
        "scaled": {"compressors": zarr.codecs.GzipCodec(level=1)},
    }
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert reports[0].arrays == ["v"]  # Blosc on CPU threads; "scaled" and "when" by xarray
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_dask_blocks_are_written_by_the_engine(tmp_path, scheduler):
    """Each dask block's chunks are written by a task of its own (from GPU blocks through
    nvCOMP): the files xarray writes from the same dask arrays, ``compute=False`` too."""
    import dask

    ds = _dataset(shape=(12, 30, 41))
    ds["w"] = ds.v * 2
    chunked = ds.chunk({"t": 4, "y": 16})
    enc = {"v": {"chunks": (2, 8, 41)}, "w": {"compressors": zarr.codecs.ZstdCodec(level=1)}}
    chunked.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with dask.config.set(scheduler=scheduler), record_writes() as reports:
        delayed = chunked.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc, compute=False)
        assert reports[0].chunks == 0  # nothing written before it is computed
        delayed.compute()
    (report,) = reports
    assert sorted(report.arrays) == ["v", "w"] and report.encoder == "cpu", str(report)
    assert report.chunks + report.empty == 6 * 4 + 3 * 2, str(report)  # v: 6x4x1 chunks, w: 3x2x1
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "e.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load(),
    )


def test_dask_under_other_schedulers_is_written_by_xarray(tmp_path):
    import dask

    ds = _dataset(shape=(6, 10, 12)).chunk({"t": 2})
    ds.to_zarr(tmp_path / "x.zarr")
    with dask.config.set(scheduler="processes", num_workers=2), record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr")
    assert reports[0].arrays == [], str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


def test_appends_regions_and_dask_blocks(tmp_path):
    ds = _dataset(shape=(6, 10, 12))
    first, second = ds.isel(t=slice(0, 4)), ds.isel(t=slice(4, None))
    first.to_zarr(tmp_path / "x.zarr")
    second.to_zarr(tmp_path / "x.zarr", append_dim="t")
    first.cupy.to_zarr(tmp_path / "e.zarr")
    with record_writes() as reports:  # after one whole chunk of 4 steps: the engine's
        second.cupy.to_zarr(tmp_path / "e.zarr", append_dim="t")
    assert reports[0].arrays == ["v"] and reports[0].chunks == 1, str(reports[0])
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "e.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load(),
    )
    chunked = ds.chunk({"t": 2})
    delayed = chunked.cupy.to_zarr(tmp_path / "lazy.zarr", compute=False)
    delayed.compute()
    ds.to_zarr(tmp_path / "eager.zarr", encoding={"v": {"chunks": (2, 10, 12)}})
    assert_same_files(tmp_path / "eager.zarr", tmp_path / "lazy.zarr")
    with record_writes() as reports:  # a region of whole chunks: the engine's, a task a block
        part = chunked.isel(t=slice(2, 4)).drop_vars("t")
        part.cupy.to_zarr(tmp_path / "lazy.zarr", region={"t": slice(2, 4)})
    assert reports[0].arrays == ["v"] and reports[0].chunks == 1, str(reports[0])
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "lazy.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "eager.zarr", engine="zarr").load(),
    )


@pytest.mark.parametrize("case", range(12))
def test_random_appends_and_regions_match_xarray(tmp_path, case):
    """Appends and region writes, of whole chunks (the engine writes them, a chunk that now
    holds only the fill value deleted) or not (xarray rewrites the chunks they share), eager
    or in dask blocks: the files xarray writes."""
    rng = np.random.default_rng(700 + case)
    fmt = int(rng.choice([2, 3]))
    chain = str(rng.choice(["none", "zstd-1", "blosc-lz4"]))
    n, c = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    first = n * c if rng.integers(2) else n * c + 1  # ends on a chunk boundary or not
    ds = _dataset("f4", (first, 9, 10), seed=case, holes=False)
    enc = {"v": {"chunks": (c, 5, 4), "compressors": _chains(fmt)[chain]}}
    if fmt == 3 and case % 3 == 0:  # sharded along y and x: shards are whole chunks along t
        enc["v"]["shards"] = (c, 10, 8)
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    ds.to_zarr(a, zarr_format=fmt, encoding=enc)
    ds.to_zarr(b, zarr_format=fmt, encoding=enc)
    more = _dataset("f4", (2 * c, 9, 10), seed=case + 50, holes=False)
    more.v[:, :5, :4] = np.nan  # chunks of the fill value only among them
    more = more.assign_coords(t=np.arange(2 * c) + first)
    if rng.integers(2) and first % c == 0:  # (xarray refuses dask blocks across stored chunks)
        more = more.chunk({"t": c})
    more.to_zarr(a, append_dim="t")
    with record_writes() as reports:
        more.cupy.to_zarr(b, append_dim="t")
    engine = bool(reports) and reports[0].arrays == ["v"]
    assert engine == (first % c == 0), (first, c, reports)
    assert_same_files(a, b)
    # a region of whole chunks along t, and one that is not
    start = c * int(rng.integers(0, n))
    for s in (slice(start, start + c), slice(start + 1, start + c + 1) if c > 1 else slice(start, start + 1)):
        patch = _dataset("f4", (s.stop - s.start, 9, 10), seed=case + 90, holes=False).drop_vars("t")
        patch.v[:, 5:, 4:8] = np.nan  # chunks that now hold only the fill value: deleted
        patch.to_zarr(a, region={"t": s})
        with record_writes() as reports:
            patch.cupy.to_zarr(b, region={"t": s})
        whole = s.start % c == 0 and (s.stop % c == 0 or s.stop == first + 2 * c)
        assert (bool(reports) and reports[0].arrays == ["v"]) == whole, (s, c, reports)
        assert_same_files(a, b)


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_group(tmp_path, fmt):
    """``group=``: a new group (eager and dask), an append to it and a region of it, by the
    engine: the files xarray writes."""
    ds = _dataset("f4", (4, 10, 8), holes=False)
    enc = {"v": {"chunks": (2, 5, 4), "compressors": _chains(fmt)["zstd-1"]}}
    more = _dataset("f4", (2, 10, 8), seed=1).assign_coords(t=[4, 5])
    patch = _dataset("f4", (2, 10, 8), seed=2).drop_vars("t")
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    ds.to_zarr(a, group="g/h", encoding=enc, zarr_format=fmt)
    more.chunk({"t": 2}).to_zarr(a, group="g/h", append_dim="t")
    patch.to_zarr(a, group="g/h", region={"t": slice(0, 2)})
    with record_writes() as reports:
        ds.cupy.to_zarr(b, group="g/h", encoding=enc, zarr_format=fmt)
        more.chunk({"t": 2}).cupy.to_zarr(b, group="g/h", append_dim="t")
        patch.cupy.to_zarr(b, group="g/h", region={"t": slice(0, 2)})
    assert [r.arrays for r in reports] == [["g/h/v"]] * 3, [str(r) for r in reports]
    assert_same_files(a, b)


def _sharded(chain: str, inner: tuple, shards: tuple, where: str = "end", crc: bool = True) -> dict:
    """A v3 encoding of sharded chunks: ``inner`` chunks with ``chain`` in ``shards``, the
    index at ``where``, with or without its crc32c."""
    codecs = _chains(3)[chain]
    codecs = [] if codecs is None else codecs if isinstance(codecs, list) else [codecs]
    index = [zarr.codecs.BytesCodec(), zarr.codecs.Crc32cCodec()] if crc else [zarr.codecs.BytesCodec()]
    sharding = zarr.codecs.ShardingCodec(
        chunk_shape=inner,
        codecs=[zarr.codecs.BytesCodec(), *codecs],
        index_codecs=index,
        index_location=where,
    )
    return {"chunks": shards, "compressors": None, "serializer": sharding}


SHARD_CHAINS = ["none", "zstd-1", "zstd+crc32c", "crc32c", "lz4+crc32c", "blosc-lz4", "gzip+crc32c"]


@pytest.mark.parametrize("chain", SHARD_CHAINS)
@pytest.mark.parametrize("where,crc", [("end", True), ("start", True), ("end", False)])
@pytest.mark.parametrize("batch_bytes", [1 << 30, 3000], ids=["one-batch", "a-shard-a-batch"])
def test_sharded_arrays_are_written_by_the_engine(tmp_path, chain, where, crc, batch_bytes, options):
    """Whole shards, edge shards (padded, their chunks outside the array left out), inner
    chunks and whole shards of the fill value left out, the index before or after the chunks,
    with or without its crc32c: the files zarr-python writes, byte for byte."""

    options(write_batch_bytes=batch_bytes)
    ds = _dataset("f4", (9, 34, 41))  # NaN in y < 11: whole inner chunks and shards of it
    enc = {"v": _sharded(chain, (2, 5, 8), (4, 10, 16), where, crc)}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    (report,) = reports
    assert report.arrays == ["v"] and report.chunks > 0 and report.empty > 0, str(report)
    assert report.chunks + report.empty == 3 * 4 * 3 * (2 * 2 * 2), str(report)  # shards x inner
    assert report.batches >= (2 if batch_bytes < 1 << 30 else 1), str(report)
    if chain.startswith("gzip"):  # gzip members inside a shard hold the second they were made
        assert _files(tmp_path / "x.zarr").keys() == _files(tmp_path / "e.zarr").keys()
    else:
        assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "e.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load(),
    )


def test_sharded_writes_in_grid_rows_dask_blocks_appends_and_regions(tmp_path, options):
    """Shards gathered a grid row at a time and one by one, dask blocks of whole shards
    (``encoding=`` with ``shards=``), an append of whole shards and a region of one, a shard
    that now holds only the fill value deleted: zarr-python's files."""
    import dask

    options(write_batch_bytes=2 * 4 * 16 * 24 * 4)  # two shards a batch
    ds = _dataset("f4", (8, 32, 48), holes=False)
    enc = {"v": {"chunks": (2, 8, 8), "shards": (4, 16, 24), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    ds.to_zarr(a, encoding=enc)
    with record_writes() as reports:
        ds.cupy.to_zarr(b, encoding=enc)
    assert reports[0].arrays == ["v"] and reports[0].batches >= 4, str(reports[0])
    assert_same_files(a, b)
    lazy = ds.chunk({"t": 4, "y": 16, "x": 48})
    lazy.to_zarr(tmp_path / "la.zarr", encoding=enc)
    with dask.config.set(scheduler="threads"), record_writes() as reports:
        lazy.cupy.to_zarr(tmp_path / "lb.zarr", encoding=enc)
    assert reports[0].arrays == ["v"], str(reports[0])
    assert_same_files(tmp_path / "la.zarr", tmp_path / "lb.zarr")
    more = _dataset("f4", (4, 32, 48), seed=5, holes=False).assign_coords(t=np.arange(8, 12))
    more.to_zarr(a, append_dim="t")
    with record_writes() as reports:
        more.cupy.to_zarr(b, append_dim="t")
    assert reports[0].arrays == ["v"] and reports[0].chunks == 2 * 4 * 6, str(reports[0])
    assert_same_files(a, b)
    patch = _dataset("f4", (4, 32, 48), seed=6, holes=False).drop_vars("t")
    patch.v[:, :16, :24] = np.nan  # a whole shard of the fill value: its file deleted
    patch.to_zarr(a, region={"t": slice(4, 8)})
    with record_writes() as reports:
        patch.cupy.to_zarr(b, region={"t": slice(4, 8)})
    assert reports[0].arrays == ["v"] and reports[0].empty == 2 * 2 * 3, str(reports[0])
    assert_same_files(a, b)
    xr.testing.assert_identical(
        xr.open_dataset(b, engine="zarr").load(), xr.open_dataset(a, engine="zarr").load()
    )


@pytest.mark.parametrize("empty", [True, False, None])
@pytest.mark.parametrize("shards", [None, (4, 16, 16)])
def test_write_empty_chunks_is_honoured(tmp_path, empty, shards):
    """``write_empty_chunks=True``: chunks (and inner chunks, and shards) of the fill value
    only are written, as xarray writes them; False or not given: left out. An append too."""
    ds = _dataset("f4", (8, 32, 48))  # NaN in y < 10: whole (inner) chunks of 2 x 8 x 8 of it
    enc = {"v": {"chunks": (2, 8, 8), "shards": shards}}
    kw = {} if empty is None else {"write_empty_chunks": empty}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc, **kw)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc, **kw)
    assert (reports[0].empty == 0) == bool(empty), str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    more = _dataset("f4", (4, 32, 48), seed=4).assign_coords(t=np.arange(8, 12))
    more.to_zarr(tmp_path / "x.zarr", append_dim="t", **kw)
    with record_writes() as reports:
        more.cupy.to_zarr(tmp_path / "e.zarr", append_dim="t", **kw)
    assert reports[0].arrays == ["v"], str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


def test_sharding_the_engine_does_not_write_is_xarrays(tmp_path):
    """A shard index the engine does not write (big-endian), sharding inside sharding: xarray
    writes those arrays, the same files."""
    ds = _dataset("f4", (4, 8, 8))
    big = zarr.codecs.ShardingCodec(
        chunk_shape=(2, 4, 4), index_codecs=[zarr.codecs.BytesCodec(endian="big"), zarr.codecs.Crc32cCodec()]
    )
    nested = zarr.codecs.ShardingCodec(
        chunk_shape=(2, 4, 8), codecs=[zarr.codecs.ShardingCodec(chunk_shape=(1, 4, 4))]
    )
    for name, serializer in (("big", big), ("nested", nested)):
        enc = {"v": {"chunks": (4, 8, 8), "compressors": None, "serializer": serializer}}
        ds.to_zarr(tmp_path / f"x-{name}.zarr", encoding=enc)
        with record_writes() as reports:
            ds.cupy.to_zarr(tmp_path / f"e-{name}.zarr", encoding=enc)
        assert reports[0].arrays == [], str(reports[0])
        assert_same_files(tmp_path / f"x-{name}.zarr", tmp_path / f"e-{name}.zarr")


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("dtype", ["f4", "i2", "f8", "u1"])
@pytest.mark.parametrize("shuffle", [0, 1])
def test_blosc_chunks_of_one_zstd_block_read_as_written(tmp_path, fmt, dtype, shuffle):
    """The Blosc chunks the GPU writes (one block each: the chunk byte-shuffled, one zstd
    stream, or the chunk as it is where that is no larger), made here with numcodecs' zstd:
    zarr-python, numcodecs and the engine read what was written."""
    from cupy_xarray.formats import blosc as eb

    values = (np.sin(np.arange(6 * 40 * 64) / 90).reshape(6, 40, 64) * 100).astype(dtype)
    noise = np.random.default_rng(0).integers(0, 256, 3 * 20 * 64 * values.itemsize, dtype=np.uint8)
    values[3:, 20:] = noise.view(dtype).reshape(3, 20, 64)  # a chunk no smaller compressed
    codec = numcodecs.Blosc("zstd", 3, shuffle) if fmt == 2 else None
    if fmt == 3:
        codec = zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle" if shuffle else "noshuffle")
    path = tmp_path / "a.zarr"
    chunks = (3, 20, 64)
    arr = zarr.create_array(
        path, shape=values.shape, chunks=chunks, dtype=dtype, compressors=codec, zarr_format=fmt
    )
    recipe = encoders.recipe_of(arr.metadata)
    typesize, shuffled = encoders.blosc_zstd(recipe)
    assert typesize == (np.dtype(dtype).itemsize if fmt == 2 or numcodecs.__version__ >= "0.16" else 1)
    assert shuffled == bool(shuffle)
    where = [(i, j) for i in (0, 1) for j in (0, 1)]
    rows = np.stack(
        [values[i * 3 : i * 3 + 3, j * 20 : j * 20 + 20].reshape(-1).view(np.uint8) for i, j in where]
    )
    nbytes = rows.shape[1]
    streams = rows.copy()
    if shuffled:
        eb.shuffle_rows(rows, streams, nbytes, typesize)
    kinds = set()
    for k, (i, j) in enumerate(where):
        stream = numcodecs.Zstd(1).encode(streams[k].tobytes())
        if eb.one_block_fits(nbytes, len(stream)):
            chunk = eb.one_block_prefix(nbytes, typesize, shuffled, len(stream)) + stream
        else:
            chunk = eb.memcpyed_prefix(nbytes, typesize) + rows[k].tobytes()
        kinds.add(eb.one_block_fits(nbytes, len(stream)))
        assert np.array_equal(np.frombuffer(numcodecs.Blosc().decode(chunk), np.uint8), rows[k])
        (path / arr.metadata.encode_chunk_key((i, j, 0))).parent.mkdir(parents=True, exist_ok=True)
        (path / arr.metadata.encode_chunk_key((i, j, 0))).write_bytes(chunk)
    assert kinds == {True, False}, kinds  # both kinds of chunk
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[...], values)
    spec = array_spec(zarr.open_array(path, mode="r"))
    (got,) = read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"))
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize(
    "make,want",
    [
        (lambda: numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE), (4, True)),
        (lambda: numcodecs.Blosc("zstd", 1, numcodecs.Blosc.NOSHUFFLE), (4, False)),
        (lambda: numcodecs.Blosc("zstd", 5, numcodecs.Blosc.BITSHUFFLE), None),
        (lambda: numcodecs.Blosc("zstd", 5, numcodecs.Blosc.AUTOSHUFFLE), None),
        (lambda: numcodecs.Blosc("zstd", 0, numcodecs.Blosc.SHUFFLE), None),
        (lambda: numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE, blocksize=65536), None),
        (lambda: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE), None),
        (lambda: numcodecs.Zlib(1), None),
    ],
)
def test_which_blosc_chunks_nvcomp_may_make(make, want):
    """Blosc with zstd streams, byte shuffle or none, at a level and block size of Blosc's
    choosing: nvCOMP's (one block a chunk); the rest CPU threads'."""
    recipe = encoders.Recipe(host_codec=make(), typed=np.dtype("f4"))
    assert encoders.blosc_zstd(recipe) == want
    assert (encoders.GPUEncoder.algorithm(recipe) == "Zstd") == (want is not None)


def test_an_append_encoded_by_the_stored_variable_is_xarrays(tmp_path):
    """xarray encodes appended values with the stored variable's encoding (here a scale and
    an integer dtype): the engine leaves such appends to it."""
    ds = _dataset("f4", (4, 6, 8), holes=False)
    enc = {"v": {"chunks": (2, 6, 8), "dtype": "i2", "scale_factor": 0.1, "_FillValue": -9999}}
    ds.to_zarr(tmp_path / "a.zarr", encoding=enc)
    ds.to_zarr(tmp_path / "b.zarr", encoding=enc)
    more = _dataset("f4", (2, 6, 8), seed=3).assign_coords(t=[4, 5])
    more.to_zarr(tmp_path / "a.zarr", append_dim="t")
    with record_writes() as reports:
        more.cupy.as_numpy().cupy.to_zarr(tmp_path / "b.zarr", append_dim="t")
    assert reports == [] or reports[0].arrays == [], str(reports[0])
    assert_same_files(tmp_path / "a.zarr", tmp_path / "b.zarr")


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_datatree(tmp_path, fmt):
    """Every group's chunks written by the engine (eager and dask), inherited coordinates and
    per-group encodings as xarray writes them: its files."""
    root = xr.Dataset({"r": ("x", np.arange(5.0))}, coords={"x": np.arange(5)})
    a = _dataset(shape=(4, 6, 5))  # its x: the root's coordinate, inherited
    c = _dataset("i2", shape=(3, 5)).chunk({"t": 1})
    c = c.assign(lat=("y", np.linspace(0, 1, 5)))
    tree = xr.DataTree.from_dict({"/": root, "/a": a, "/b/c": c})
    enc = {
        "/a": {"v": {"chunks": (2, 3, 2), "compressors": _chains(fmt)["zstd-1"]}},
        "/b/c": {"v": {"chunks": (1, 3)}},  # dask blocks: written a task per block
    }
    tree.to_zarr(tmp_path / "x.zarr", encoding=enc, zarr_format=fmt)
    with record_writes() as reports:
        tree.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc, zarr_format=fmt)
    assert sorted(reports[0].arrays) == ["a/v", "b/c/lat", "b/c/v", "r"], str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    xr.testing.assert_identical(
        xr.open_datatree(tmp_path / "e.zarr", engine="zarr").load(),
        xr.open_datatree(tmp_path / "x.zarr", engine="zarr").load(),
    )


def test_a_write_short_of_memory_goes_on_in_smaller_batches(tmp_path, monkeypatch):
    """A batch that does not fit (cupy's OutOfMemoryError is a MemoryError) is written again
    in halves, down to one chunk, and the report says so; one chunk that does not fit raises."""
    from cupy_xarray.write import encoders

    real = encoders.CPUEncoder.start
    sizes = []

    def short(self, recipe, buf, nbytes, empty):
        sizes.append(buf.shape[0])
        if buf.shape[0] > limit:
            raise MemoryError("out of memory allocating a batch")
        return real(self, recipe, buf, nbytes, empty)

    monkeypatch.setattr(encoders.CPUEncoder, "start", short)
    ds = _dataset(holes=False)
    enc = {"v": {"chunks": (2, 8, 16), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    limit = 5
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    (report,) = reports
    assert max(sizes) > limit and report.chunks == 4 * 4 * 3, (sizes, str(report))
    assert report.notes and "memory ran short" in str(report), str(report)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    limit = 0
    with pytest.raises(MemoryError):
        ds.cupy.to_zarr(tmp_path / "f.zarr", encoding=enc)


def test_a_write_that_fails_midway_leaves_no_partial_chunk(tmp_path, monkeypatch, options):
    from cupy_xarray.write import chunks

    ds = _dataset(holes=False)
    real, written = chunks._rename, []

    def failing(tmp, path):  # the disk fills up once five chunks are in place
        if len(written) >= 5:
            raise OSError(28, "No space left on device")
        real(tmp, path)
        written.append(Path(path))

    monkeypatch.setattr(chunks, "_rename", failing)
    options(write_batch_bytes=4096)  # several batches
    enc = {"v": {"chunks": (2, 8, 16), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    with pytest.raises(OSError, match="No space left"):
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert not [p for p in (tmp_path / "e.zarr").rglob("*") if p.name.endswith(".partial")]
    arr = zarr.open_array(tmp_path / "e.zarr" / "v", mode="r")
    assert written, "the failure came before any chunk was written"
    for path in written:  # every chunk that is there is whole: it decodes to its values
        key = tuple(int(k) for k in path.relative_to(tmp_path / "e.zarr" / "v" / "c").parts)
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(key, arr.chunks))
        np.testing.assert_array_equal(arr[sel], ds.v.values[sel])


@pytest.mark.filterwarnings("ignore:The specified chunks separate:UserWarning")  # chunks across, on purpose
def test_the_store_a_dataset_is_read_from_is_not_overwritten(tmp_path):
    ds = _dataset()
    ds.to_zarr(tmp_path / "s.zarr")
    for engine in ("kvikio", "zarr"):  # not loaded: read from the store mode="w" would delete
        lazy = (
            xr.open_dataset(tmp_path / "s.zarr", engine=engine, device="cpu")
            if engine == "kvikio"
            else (xr.open_dataset(tmp_path / "s.zarr", engine=engine))
        )
        with pytest.raises(ValueError, match="variable 'v' is still read from"):
            lazy.isel(t=slice(0, 3)).cupy.to_zarr(tmp_path / "s.zarr", mode="w")
    (lazy.load() * 2).cupy.to_zarr(tmp_path / "twice.zarr", mode="w")  # loaded: written anywhere
    for engine in ("kvikio", "zarr"):  # dask arrays read from it, as opened and derived
        kw = {"device": "cpu"} if engine == "kvikio" else {}
        for chunks in ({}, "auto", {"t": 2}):
            source = xr.open_dataset(tmp_path / "s.zarr", engine=engine, chunks=chunks, **kw)
            for derived in (source, source * 2, source.isel(t=[0, 2]).mean("t"), source.v.rename("w")):
                with pytest.raises(ValueError, match="still read from"):
                    derived.cupy.to_zarr(tmp_path / "s.zarr", mode="w")
                with pytest.raises(ValueError, match="still read from"):  # a group of the store too
                    derived.cupy.to_zarr(tmp_path / "s.zarr", mode="w", group="g")
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load(), ds)
    tree = xr.open_datatree(tmp_path / "s.zarr", engine="zarr", chunks={})
    with pytest.raises(ValueError, match="still read from"):
        tree.cupy.to_zarr(tmp_path / "s.zarr", mode="w")
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load(), ds)
    with pytest.raises(Exception) as xarray_says:  # noqa: PT011 - whatever xarray raises
        ds.to_zarr(tmp_path / "s.zarr")
    with pytest.raises(type(xarray_says.value)):
        ds.cupy.to_zarr(tmp_path / "s.zarr")  # mode "w-": an existing store is refused


# -- from the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,chain", CASES, ids=[f"v{f}-{c}" for f, c in CASES])
@pytest.mark.parametrize("dtype", ["f4", "i2", "f8"])
@pytest.mark.parametrize("batch", [2, 512], ids=["batches-of-2", "one-batch"])
def test_gpu_data_written_reads_back_bitwise(tmp_path, fmt, chain, dtype, batch, options):

    options(write_gpu_batch_chunks=batch)
    ds = _dataset(dtype, shape=(9, 64, 96))
    enc = {"v": {"chunks": (2, 32, 40), "compressors": _chains(fmt)[chain]}}
    gds = ds.cupy.as_cupy()
    with record_writes() as reports:
        gds.cupy.to_zarr(tmp_path / "g.zarr", zarr_format=fmt, encoding=enc)
    (report,) = reports
    on_gpu = _gpu_encoder(chain) != "cpu"
    assert report.arrays == ["v"] and report.encoder == _gpu_encoder(chain), str(report)
    assert report.batches >= (15 if on_gpu and batch == 2 else 1), str(report)  # 30 chunks
    assert report.device_bytes > 0 if on_gpu else True, str(report)
    ds.to_zarr(tmp_path / "x.zarr", zarr_format=fmt, encoding=enc)
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    got = xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load()
    xr.testing.assert_identical(got, want)
    assert _files(tmp_path / "g.zarr").keys() == _files(tmp_path / "x.zarr").keys()  # same chunks
    if chain not in NVCOMP_CHAINS:  # uncompressed, crc32c, and what CPU threads encode
        assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")
    back = xr.open_dataset(tmp_path / "g.zarr", engine="kvikio").load()
    xr.testing.assert_identical(back.cupy.as_numpy(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("chain", ["none", "crc32c", "zstd-1", "zstd+crc32c", "lz4", "lz4+crc32c"])
def test_gpu_batches_shared_with_cpu_threads(tmp_path, share, chain, options):
    """nvCOMP alone, nvCOMP and CPU threads sharing each batch, CPU threads alone (each
    batch's rows copied to the host); crc32c computed on the GPU: zarr-python reads the values
    written, and what CPU threads or the GPU's crc32c wrote is byte for byte zarr-python's."""

    options(write_cpu_share_zstd=share, write_cpu_share_lz4=share)
    options(write_gpu_batch_chunks=8)
    ds = _dataset("f4", (8, 48, 48))
    fmt = 2 if chain == "lz4" else 3
    enc = {"v": {"chunks": (2, 16, 16), "compressors": _chains(fmt)[chain]}}
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", encoding=enc, zarr_format=fmt)
    (report,) = reports
    assert report.encoder == _gpu_encoder(chain) and report.empty > 0, str(report)
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc, zarr_format=fmt)
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(), want)
    if chain in ("none", "crc32c") or share == 1.0:
        assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")
    elif chain.endswith("crc32c"):  # the GPU's crc32c over nvCOMP's frames: google-crc32c's
        import google_crc32c

        for path in _files(tmp_path / "g.zarr" / "v" / "c").values():
            raw = path.read_bytes()
            assert google_crc32c.value(raw[:-4]) == int.from_bytes(raw[-4:], "little"), path


@pytest.mark.gpu
@pytest.mark.parametrize("chain", ["none", "zstd+crc32c"])
def test_gpu_appends_and_regions(tmp_path, chain):
    """GPU data appended and written into a region of whole chunks, some of them now the fill
    value only (their files deleted): what xarray writes from the host."""
    ds = _dataset("f4", (4, 10, 8), holes=False)
    enc = {"v": {"chunks": (2, 5, 4), "compressors": _chains(3)[chain]}}
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    ds.to_zarr(a, encoding=enc)
    ds.to_zarr(b, encoding=enc)
    more = _dataset("f4", (4, 10, 8), seed=1, holes=False).assign_coords(t=[4, 5, 6, 7])
    more.v[:2, :5, :4] = np.nan
    patch = _dataset("f4", (2, 10, 8), seed=2, holes=False).drop_vars("t")
    patch.v[:, 5:, 4:] = np.nan
    more.to_zarr(a, append_dim="t")
    patch.to_zarr(a, region={"t": slice(2, 4)})
    with record_writes() as reports:
        more.cupy.as_cupy().cupy.to_zarr(b, append_dim="t")
        patch.cupy.as_cupy().cupy.to_zarr(b, region={"t": slice(2, 4)})
    assert [r.arrays for r in reports] == [["v"], ["v"]], [str(r) for r in reports]
    assert all(r.encoder == _gpu_encoder(chain) and r.empty > 0 for r in reports), [str(r) for r in reports]
    want = xr.open_dataset(a, engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(b, engine="zarr").load(), want)
    assert _files(a).keys() == _files(b).keys()
    if chain == "none":
        assert_same_files(a, b)


@pytest.mark.gpu
def test_gpu_datatree(tmp_path):
    """A DataTree of cupy arrays (eager and dask): every group's chunks by the engine."""
    a = _dataset(shape=(4, 6, 5))
    c = _dataset("i2", shape=(3, 5))
    tree = xr.DataTree.from_dict({"/a": a, "/b/c": c})
    gpu = xr.DataTree.from_dict({"/a": a.cupy.as_cupy(), "/b/c": c.cupy.as_cupy().chunk({"t": 1})})
    enc = {"/a": {"v": {"chunks": (2, 3, 2), "compressors": zarr.codecs.ZstdCodec(level=1)}}}
    tree.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        gpu.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    assert sorted(reports[0].arrays) == ["a/v", "b/c/v"] and "gpu" in reports[0].encoder, str(reports[0])
    xr.testing.assert_identical(
        xr.open_datatree(tmp_path / "e.zarr", engine="zarr").load(),
        xr.open_datatree(tmp_path / "x.zarr", engine="zarr").load(),
    )


@pytest.mark.gpu
def test_gpu_zstd_frames_are_what_zstd_readers_decode(tmp_path):
    import cupy

    ds = _dataset("f4", shape=(8, 256, 256), holes=False)
    enc = {"v": {"chunks": (1, 256, 256), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", encoding=enc)
    zstd = numcodecs.Zstd()
    for path in sorted((tmp_path / "g.zarr" / "v" / "c").rglob("*")):
        if path.is_file():
            t = int(path.relative_to(tmp_path / "g.zarr" / "v" / "c").parts[0])
            raw = np.frombuffer(zstd.decode(path.read_bytes()), "<f4").reshape(256, 256)
            np.testing.assert_array_equal(raw, ds.v.values[t])
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    stored = sum(p.stat().st_size for p in _files(tmp_path / "g.zarr" / "v").values())
    reference = sum(p.stat().st_size for p in _files(tmp_path / "x.zarr" / "v").values())
    assert stored < 1.5 * reference, (stored, reference)  # compressed, not stored raw
    assert cupy.cuda.runtime.getDeviceCount() >= 1


@pytest.mark.small_datasets
@pytest.mark.parametrize("where", ["host", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_small_dataset_is_written_by_xarray(tmp_path, where):
    """A Dataset of fewer than ``small_write_bytes`` (eager): xarray's write of host copies, its
    report says so; a larger one, or one in dask blocks, the engine's."""

    ds = _dataset("f4", (8, 32, 48))
    data = ds.cupy.as_cupy() if where == "gpu" else ds
    enc = {"v": {"chunks": (2, 16, 16), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    with record_writes() as reports:
        data.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc)
    (report,) = reports
    assert report.arrays == [] and report.notes[0].startswith("small: "), str(report)
    assert str(report).startswith("written by xarray from host copies: "), str(report)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    assert ds.nbytes < get_options().small_write_bytes
    big = _dataset("f4", (8, 512, 600), holes=False)  # 9.8 MB
    assert big.nbytes >= get_options().small_write_bytes
    if where == "gpu":
        big = big.cupy.as_cupy()
    for part, name in ((big, "big"), (ds.chunk({"t": 2}), "lazy")):
        with record_writes() as reports:
            part.cupy.to_zarr(tmp_path / f"{name}.zarr", encoding=enc)
        assert reports[0].arrays == ["v"], (name, str(reports[0]))


def test_a_dataset_read_from_a_store_is_written_by_the_engine(tmp_path):
    """What a store's read leaves in ``encoding`` (its dtype, chunks, codecs, shards=None, no
    filters) is written as xarray writes it, by the engine."""
    ds = _dataset()
    enc = {"v": {"chunks": (2, 8, 16), "compressors": zarr.codecs.ZstdCodec(level=2)}}
    ds.to_zarr(tmp_path / "in.zarr", encoding=enc)
    loaded = xr.open_dataset(tmp_path / "in.zarr", engine="kvikio", device="cpu").load()
    assert loaded.v.encoding.get("dtype") is not None and "shards" in loaded.v.encoding
    loaded.to_zarr(tmp_path / "x.zarr")
    with record_writes() as reports:
        loaded.cupy.to_zarr(tmp_path / "e.zarr")
    assert reports[0].arrays == ["v"]
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.gpu
@pytest.mark.small_writes
def test_gpu_small_writes_compress_on_cpu_threads(tmp_path):
    """A small zstd write of GPU data: CPU threads, zarr-python's bytes; a large one nvCOMP."""
    ds = _dataset("f4", shape=(9, 64, 96))
    enc = {"v": {"chunks": (2, 32, 40), "compressors": _chains(3)["zstd+crc32c"]}}
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", encoding=enc)
    assert reports[0].encoder == "cpu", str(reports[0])
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")
    big = _dataset("f4", shape=(64, 1024, 1024), holes=False)  # 256 MiB
    enc = {"v": {"chunks": (4, 512, 512), "compressors": _chains(3)["zstd-1"]}}
    with record_writes() as reports:
        big.cupy.as_cupy().cupy.to_zarr(tmp_path / "big.zarr", encoding=enc)
    assert reports[0].encoder == "gpu", str(reports[0])
    want = xr.open_dataset(tmp_path / "big.zarr", engine="zarr").load()
    xr.testing.assert_identical(want, big)


@pytest.mark.gpu
@pytest.mark.parametrize("chain", ["none", "zstd-1", "lz4+crc32c", "blosc-lz4"])
def test_gpu_dask_blocks_are_written_by_the_engine(tmp_path, chain):
    """dask blocks of cupy arrays: each block's chunks compressed by nvCOMP (zstd, LZ4) or,
    copied a batch at a time, by CPU threads (Blosc), in parallel tasks."""
    import dask

    ds = _dataset("f4", shape=(12, 64, 96))
    enc = {"v": {"chunks": (2, 32, 48), "compressors": _chains(3)[chain]}}
    gds = ds.chunk({"t": 4, "y": 32}).cupy.as_cupy()
    assert type(gds.v.data._meta).__module__.startswith("cupy")
    with dask.config.set(scheduler="threads"), record_writes() as reports:
        gds.cupy.to_zarr(tmp_path / "g.zarr", encoding=enc)
    (report,) = reports
    on_gpu = _gpu_encoder(chain) != "cpu"
    assert report.arrays == ["v"] and report.encoder == _gpu_encoder(chain), str(report)
    assert report.chunks + report.empty == 6 * 2 * 2, str(report)
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(), want)
    if not on_gpu or chain == "none":
        assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt,chain,endian",
    [
        (3, "none", "big"),
        (3, "zstd+crc32c", "big"),
        (3, "zstd-1", "little"),
        (2, "lz4", ""),
        (3, "blosc-zstd", "big"),
        (2, "blosc-zstd", ""),
    ],
)
@pytest.mark.parametrize("dtype", ["f4", "f8", "i2", "c8", "c16"])
def test_gpu_chunks_of_odd_sizes(tmp_path, fmt, chain, endian, dtype):
    """Chunks whose bytes are not a multiple of the rows' alignment (420 bytes of f4), edge
    chunks padded, big-endian v3 stores (their bytes codec says it)."""
    ds = _dataset(dtype, shape=(7, 15, 11))
    enc = {"v": {"chunks": (3, 7, 5), "compressors": _chains(fmt)[chain]}}
    if endian:
        enc["v"]["serializer"] = zarr.codecs.BytesCodec(endian=endian)
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", zarr_format=fmt, encoding=enc)
    assert reports[0].encoder == _gpu_encoder(chain) and reports[0].arrays == ["v"], str(reports[0])
    ds.to_zarr(tmp_path / "x.zarr", zarr_format=fmt, encoding=enc)
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(), want)
    if chain == "none":
        assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "chain", ["none", "crc32c", "zstd-1", "zstd+crc32c", "lz4+crc32c", "blosc-lz4", "blosc-zstd"]
)
@pytest.mark.parametrize("where", ["end", "start"])
@pytest.mark.parametrize("batch", [4, 512], ids=["a-shard-a-batch", "one-batch"])
def test_gpu_sharded_writes(tmp_path, chain, where, batch, options):
    """Shards of GPU data: inner chunks of 420 bytes (rows padded to nvCOMP's alignment),
    edge shards, inner chunks and shards of the fill value, crc32c computed on the GPU:
    zarr-python reads the values written, and what is not nvCOMP's is its own bytes."""

    options(write_gpu_batch_chunks=batch)
    ds = _dataset("f4", (9, 34, 23))
    enc = {"v": _sharded(chain, (3, 7, 5), (6, 14, 10), where)}
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", encoding=enc)
    (report,) = reports
    assert report.arrays == ["v"] and report.encoder == _gpu_encoder(chain), str(report)
    assert report.chunks > 0 and report.empty > 0, str(report)
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc)
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(), want)
    assert _files(tmp_path / "g.zarr").keys() == _files(tmp_path / "x.zarr").keys()
    if chain not in NVCOMP_CHAINS:
        assert_same_files(tmp_path / "x.zarr", tmp_path / "g.zarr")
    back = xr.open_dataset(tmp_path / "g.zarr", engine="kvikio").load()
    xr.testing.assert_identical(back.cupy.as_numpy(), want)


@pytest.mark.gpu
def test_gpu_shards_beyond_nvcomps_chunk_limit_are_compressed_by_nvcomp(tmp_path):
    """nvCOMP compresses streams of at most 16 MiB: a 32 MiB shard of 4 MiB zstd chunks is
    compressed by it all the same (its streams are the inner chunks)."""
    ds = _dataset("f4", (8, 1024, 1024), holes=False)
    enc = {"v": {"chunks": (4, 512, 512), "shards": (8, 1024, 1024), "compressors": _chains(3)["zstd-1"]}}
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", encoding=enc)
    assert reports[0].encoder == "gpu" and reports[0].chunks == 8, str(reports[0])
    want = ds.v.values
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "g.zarr", path="v")[...], want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [2, 3])
def test_gpu_blosc_zstd_chunks_say_what_zarr_pythons_say(tmp_path, fmt):
    """Blosc zstd chunks made by nvCOMP: the element size and shuffle zarr-python's chunks
    declare, one zstd block each, and values equal to what was written."""
    ds = _dataset("f4", (8, 64, 96), holes=False)
    enc = {"v": {"chunks": (4, 32, 96), "compressors": _chains(fmt)["blosc-zstd"]}}
    with record_writes() as reports:
        ds.cupy.as_cupy().cupy.to_zarr(tmp_path / "g.zarr", zarr_format=fmt, encoding=enc)
    assert reports[0].encoder == "gpu", str(reports[0])
    ds.to_zarr(tmp_path / "x.zarr", zarr_format=fmt, encoding=enc)
    mine, theirs = _files(tmp_path / "g.zarr"), _files(tmp_path / "x.zarr")
    key = next(k for k in theirs if k.startswith("v/") and "zarr" not in k and ".z" not in k)
    a, b = mine[key].read_bytes(), theirs[key].read_bytes()
    assert a[3] == b[3] == 4 and (a[2] & 1) == (b[2] & 1) == 1, (a[:16], b[:16])  # typesize, shuffle
    assert a[2] & 0x12 == 0x10 and a[2] >> 5 == 4  # one stream a block, not stored as is; zstd
    assert int.from_bytes(a[8:12], "little") == 4 * 32 * 96 * 4  # one block: the whole chunk
    want = xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load()
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(), want)


#: chains the other readers read (tensorstore has no numcodecs LZ4), by Zarr format;
#: sharded: v3 only
OTHER_READER_CHAINS = [
    (fmt, name, sharded)
    for fmt, names in [
        (2, ["none", "zstd-1", "blosc-lz4", "blosc-zstd", "gzip", "zlib"]),
        (3, ["none", "zstd-1", "zstd+crc32c", "crc32c", "blosc-zstd", "gzip+crc32c"]),
    ]
    for name in names
    for sharded in ([False, True] if fmt == 3 and name != "blosc-zstd" else [False])
]


def _zarrs(path: Path) -> np.ndarray:
    """The array at ``path`` read by zarr-python with the zarrs codec pipeline (strict: an
    error, not zarr-python's own codecs, where zarrs cannot decode it)."""
    pytest.importorskip("zarrs")
    with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "codec_pipeline.strict": True}):
        return zarr.open_array(path, mode="r")[...]


def _tensorstore(path: Path) -> np.ndarray:
    ts = pytest.importorskip("tensorstore")
    fmt = 3 if (path / "zarr.json").exists() else 2
    spec = {"driver": "zarr3" if fmt == 3 else "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open(spec, open=True).result().read().result()


@pytest.mark.parametrize("where", ["host", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "fmt,chain,sharded",
    OTHER_READER_CHAINS,
    ids=[f"v{f}-{c}{'-sharded' if s else ''}" for f, c, s in OTHER_READER_CHAINS],
)
@pytest.mark.parametrize("reader", [_tensorstore, _zarrs], ids=["tensorstore", "zarrs"])
def test_other_readers_read_what_the_engine_writes(tmp_path, reader, where, fmt, chain, sharded):
    """Other Zarr implementations (tensorstore; zarrs, where installed) read the engine's
    files as the values written: chunks of the fill value left out, edge chunks, shard
    indexes, and on the GPU nvCOMP's zstd frames and Blosc blocks."""
    ds = _dataset("f4", (9, 34, 41))
    if sharded:
        enc = {"v": _sharded(chain, (2, 5, 8), (4, 10, 16), "end", True)}
    else:
        enc = {"v": {"chunks": (2, 16, 16), "compressors": _chains(fmt)[chain]}}
    data = ds.cupy.as_cupy() if where == "gpu" else ds
    with record_writes() as reports:
        data.cupy.to_zarr(tmp_path / "e.zarr", zarr_format=fmt, encoding=enc)
    assert reports[0].arrays == ["v"], str(reports[0])
    if where == "gpu":
        gpu = chain in NVCOMP_CHAINS | {"none", "crc32c"}
        assert reports[0].encoder == ("gpu" if gpu else "cpu"), str(reports[0])
    got = reader(tmp_path / "e.zarr" / "v")
    assert got.dtype == np.float32 and got.shape == ds.v.shape
    np.testing.assert_array_equal(got, ds.v.values)


def test_batches_wait_for_files_only_past_their_memory_budget(tmp_path):
    """The writer hands a batch to the file threads at once while the batches still being
    written hold little device memory, waits for the oldest ones' files where the next would
    not fit, and for all of them before a batch of unknown memory (chunks on the host)."""
    import concurrent.futures as cf
    import threading

    from cupy_xarray.write.chunks import ChunkFiles

    gates = [threading.Event() for _ in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        files = ChunkFiles(tmp_path, pool, crc32c=False)
        for k in range(2):  # two batches of 40 bytes each, their files held until their gate opens
            files.wait_within(100, 40)
            files.begin(40)
            files.pending += [pool.submit(gates[k].wait, 10) for _ in range(2)]
        assert files.held(100) == 80

        def third():
            files.wait_within(100, 40)  # 80 + 40 > 100: the first batch's files first
            files.begin(40)

        waiting = pool.submit(third)
        with pytest.raises(cf.TimeoutError):
            waiting.result(timeout=0.2)
        gates[0].set()
        waiting.result(timeout=5)
        assert files.held(100) == 80  # the second batch's files, still written, and the third's
        unknown = pool.submit(files.wait_within, 100, None)
        with pytest.raises(cf.TimeoutError):
            unknown.result(timeout=0.2)
        gates[1].set()
        unknown.result(timeout=5)
        assert files.held(100) == 0 and not files.batches


@pytest.mark.parametrize("empty", [True, None])
@pytest.mark.parametrize("shape", [(9, 30, 41), (8, 32, 48)])
def test_edge_shards_hold_no_inner_chunk_outside_the_array(tmp_path, empty, shape):
    """An edge shard's inner chunks wholly outside the array are stored by nobody, written empty
    or not: the files are zarr-python's."""
    ds = _dataset("f4", shape)
    enc = {"v": {"chunks": (2, 8, 8), "shards": (4, 16, 32)}}
    kw = {} if empty is None else {"write_empty_chunks": empty}
    ds.to_zarr(tmp_path / "x.zarr", encoding=enc, **kw)
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc, **kw)
    assert reports[0].arrays == ["v"], str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")


@pytest.mark.parametrize("dtype", ["i4", "u1", "bool", "f4"])
def test_v2_null_fill_values_leave_out_chunks_of_zeros(tmp_path, dtype):
    """zarr v2 arrays of fill value null (xarray's default for integers and booleans): chunks
    of the dtype's zero are left out, as zarr-python leaves them out; a float chunk of -0.0
    is written (bit for bit not the zero), on a new store, an append and a region."""
    values = np.zeros((6, 8), dtype=dtype)
    values[2:4] = 1
    ds = xr.Dataset({"v": (("t", "x"), values)})
    enc = {"v": {"chunks": (2, 4), "_FillValue": None}} if dtype == "f4" else {"v": {"chunks": (2, 4)}}
    for name in ("x", "e"):
        write = ds.to_zarr if name == "x" else ds.cupy.to_zarr
        write(tmp_path / f"{name}.zarr", zarr_format=2, encoding=enc)
    assert zarr.open_array(tmp_path / "x.zarr" / "v", mode="r").metadata.fill_value is None
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    more = xr.Dataset({"v": (("t", "x"), np.zeros((2, 8), dtype=dtype))})
    if dtype == "f4":
        more.v[:, :4] = -0.0
    for name in ("x", "e"):
        write = more.to_zarr if name == "x" else more.cupy.to_zarr
        with record_writes() as reports:
            write(tmp_path / f"{name}.zarr", append_dim="t")
        write(tmp_path / f"{name}.zarr", region={"t": slice(2, 4)})
        if name == "e":
            assert reports[0].arrays == ["v"], str(reports[0])
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    want = np.concatenate([values, more.v.values])
    want[2:4] = more.v.values  # the region
    stored = zarr.open_array(tmp_path / "e.zarr" / "v", mode="r")[...]
    assert stored.tobytes() == want.tobytes()  # bit for bit: -0.0 stays -0.0


@pytest.mark.parametrize("empty", [True, False])
def test_dask_variables_xarray_writes_keep_the_calls_arguments(tmp_path, empty):
    """Dask variables whose blocks cross zarr chunks go to xarray after the metadata: with the
    call's ``write_empty_chunks`` (and its chunk checks), the files xarray writes."""
    import dask

    ds = _dataset("f4", (8, 32, 48)).chunk({"t": 3})  # blocks across chunks of 2
    enc = {"v": {"chunks": (2, 8, 8)}}
    with dask.config.set(scheduler="synchronous"):  # blocks sharing chunks: one after another
        ds.to_zarr(tmp_path / "x.zarr", encoding=enc, write_empty_chunks=empty, safe_chunks=False)
        ds.cupy.to_zarr(tmp_path / "e.zarr", encoding=enc, write_empty_chunks=empty, safe_chunks=False)
    assert_same_files(tmp_path / "x.zarr", tmp_path / "e.zarr")
    with pytest.raises(ValueError) as xarray_says:  # noqa: PT011 - unsafe chunks: what xarray raises
        ds.to_zarr(tmp_path / "x2.zarr", encoding=enc)
    with pytest.raises(type(xarray_says.value)):
        ds.cupy.to_zarr(tmp_path / "e2.zarr", encoding=enc)


def test_what_xarray_refuses_or_names_is_as_xarrays(tmp_path):
    """An encoding that is not a mapping: xarray's ValueError; a variable named None and a
    DataArray named like its coordinate: the stores xarray writes."""
    ds = xr.Dataset({"x": ("y", np.arange(10.0))})
    with pytest.raises(ValueError, match="must be castable"):
        ds.cupy.to_zarr(tmp_path / "bad.zarr", encoding={"x": "foo"})
    none = xr.Dataset({None: (("x", "y"), np.arange(40.0).reshape(5, 8))})
    da = xr.DataArray(np.arange(6.0), dims="x", coords={"x": np.arange(6.0)}, name="x").rename(None)
    named = xr.DataArray(np.arange(6.0) * 2, dims="t", coords={"c": ("t", np.arange(6))}, name="c")
    for k, obj in enumerate((none, da, named)):
        obj.to_zarr(tmp_path / f"x{k}.zarr")
        obj.cupy.to_zarr(tmp_path / f"e{k}.zarr")
        assert_same_files(tmp_path / f"x{k}.zarr", tmp_path / f"e{k}.zarr")
    back = xr.open_dataarray(tmp_path / "e2.zarr", engine="zarr").load()
    xr.testing.assert_identical(back, named)


def test_dask_inputs_shared_by_groups_are_computed_once(tmp_path):
    """A DataTree whose groups' dask arrays share an input: it is computed once, as xarray's
    own write computes it (one write of every group's variables)."""
    import dask.array as da

    calls = []

    def expensive(x):
        calls.append(1)
        return x + 1

    base = da.random.random((4, 8), chunks=(2, 8))
    first = base.map_blocks(expensive, meta=np.array((), np.float64))
    tree = xr.DataTree.from_dict(
        {
            "a": xr.Dataset({"v": (("t", "x"), first), "s": ((), da.ones((), chunks=()))}),
            "b": xr.Dataset({"w": (("t", "x"), first + 1), "s": ((), da.ones((), chunks=()))}),
        }
    )
    tree.cupy.to_zarr(tmp_path / "t.zarr")
    assert len(calls) == 2  # once a block
    back = xr.open_datatree(tmp_path / "t.zarr", engine="zarr").load()
    np.testing.assert_array_equal(back["b"]["w"].values, back["a"]["v"].values + 1)


def test_to_zarr_takes_xarrays_positional_arguments(tmp_path):
    ds = xr.Dataset({"v": (("y", "x"), np.arange(64 * 48, dtype="float32").reshape(64, 48))})
    enc = {"v": {"chunks": (16, 16), "compressors": zarr.codecs.ZstdCodec(level=1)}}
    ds.to_zarr(tmp_path / "xr.zarr", "w", "g", enc, consolidated=False)
    ds.cupy.to_zarr(tmp_path / "ours.zarr", "w", "g", enc, consolidated=False)
    assert _files(tmp_path / "xr.zarr").keys() == _files(tmp_path / "ours.zarr").keys()
    got = xr.open_dataset(tmp_path / "ours.zarr", group="g", engine="zarr", consolidated=False)
    xr.testing.assert_identical(got, ds)
    assert got.v.encoding["chunks"] == (16, 16)
    ds.v.cupy.to_zarr(tmp_path / "da.zarr", "w", None, None, consolidated=False)
    xr.testing.assert_identical(
        xr.open_dataarray(tmp_path / "da.zarr", engine="zarr", consolidated=False), ds.v
    )
    tree = xr.DataTree.from_dict({"/a": ds})
    tree.cupy.to_zarr(tmp_path / "tree.zarr", "w", consolidated=False)
    xr.testing.assert_identical(
        xr.open_datatree(tmp_path / "tree.zarr", engine="zarr", consolidated=False), tree
    )
    with pytest.raises(TypeError, match="multiple values for argument 'mode'"):
        ds.cupy.to_zarr(tmp_path / "x.zarr", "w", mode="w")
    with pytest.raises(TypeError, match="positional arguments"):
        ds.cupy.to_zarr(tmp_path / "x.zarr", "w", None, None, None, None, None, None, None)


_FIRST_WRITES = """
import os, sys, tempfile, threading
import numpy as np
import xarray as xr
import cupy_xarray  # noqa: F401

root = tempfile.mkdtemp(dir=sys.argv[1])
ds = xr.Dataset({"v": (("y", "x"), np.arange(4096 * 1024, dtype="float32").reshape(4096, 1024))})
if sys.argv[2] == "dask":
    ds = ds.chunk({"y": 1024})
errors, start = [], threading.Barrier(16)

def work(k):
    try:
        start.wait()
        ds.cupy.to_zarr(os.path.join(root, f"{k}.zarr"), mode="w", consolidated=False)
        xr.testing.assert_identical(xr.open_dataset(os.path.join(root, f"{k}.zarr"), engine="zarr"), ds)
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
sys.exit(1 if errors else 0)
"""


@pytest.mark.parametrize("data", ["eager", "dask"])
def test_sixteen_threads_making_a_process_first_writes_at_once(tmp_path, data):
    import os
    import subprocess
    import sys

    runs = int(os.environ.get("CUPY_XARRAY_FIRST_WRITE_RUNS", "3"))
    env = {**os.environ, "CUPY_XARRAY_DEVICE": "cpu"}
    for _ in range(runs):  # a fresh process each: the first writes of a process
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_WRITES, str(tmp_path), data],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_write_xarray_makes_has_a_report_that_says_why(tmp_path, monkeypatch):
    ds = _dataset("f4", (8, 512, 600), holes=False)  # larger than a small write
    with record_writes() as reports:
        ds.cupy.to_zarr(zarr.storage.MemoryStore(), zarr_format=3)
    (report,) = reports
    assert report.arrays == [] and "not a local path" in report.notes[0]
    assert str(report).startswith("written by xarray from host copies: ")
    monkeypatch.setitem(sys.modules, "dask.array", None)  # as where dask is not installed
    with record_writes() as reports:
        ds.cupy.to_zarr(tmp_path / "x.zarr", consolidated=False)
    (report,) = reports
    assert "dask is not installed" in report.notes[0] and sorted(report.by_xarray) == sorted(
        map(str, ds.variables)
    )
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "x.zarr", engine="zarr", consolidated=False), ds)


def test_the_package_writes_without_zarrs_consolidation_warning_and_leaves_the_filters(tmp_path):
    import warnings

    from conftest import run_in_threads

    ds = _dataset("f4", (8, 512, 600), holes=False)  # written by the engine
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ds.cupy.to_zarr(tmp_path / "ours.zarr", zarr_format=3)
        ours = [str(w.message) for w in seen if "Consolidated metadata" in str(w.message)]
        ds.to_zarr(tmp_path / "xarray.zarr", zarr_format=3)  # xarray's own write still says it
        theirs = [str(w.message) for w in seen if "Consolidated metadata" in str(w.message)]
    assert ours == [] and len(theirs) == 1
    errors = run_in_threads(lambda k: ds.cupy.to_zarr(tmp_path / f"t{k}.zarr", zarr_format=3), 8)
    assert errors == [] and warnings.filters == before
