"""Blosc decoded by the engine (GPU: nvCOMP + unshuffle kernel) against numcodecs, exactly."""

from __future__ import annotations

from types import SimpleNamespace

import numcodecs
import numpy as np
import pytest
import zarr
from conftest import expected_type, host, module_of

from cupy_xarray.engine import array_spec, describe, read_arrays
from cupy_xarray.engine.decoders import blosc as eb
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.engine.read import Clock
from cupy_xarray.engine.route import Route
from cupy_xarray.errors import ChunkError
from cupy_xarray.formats import blosc as fb
from cupy_xarray.options import get_options

SHUFFLES = {
    "noshuffle": numcodecs.Blosc.NOSHUFFLE,
    "shuffle": numcodecs.Blosc.SHUFFLE,
    "bitshuffle": numcodecs.Blosc.BITSHUFFLE,
}
DTYPES = {1: "u1", 2: "i2", 4: "f4", 8: "f8", 16: "c16"}


def _field(dtype, shape):
    n = int(np.prod(shape))
    x = np.sin(np.arange(n) / 300.0) * 1000 + (np.arange(n) % 13)
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (x + 1j * x[::-1]).astype(dt).reshape(shape)
    if dt.kind == "u":
        return (x % 251).astype(dt).reshape(shape)
    return x.astype(dt).reshape(shape)


def _layout_of(encoded: bytes, expected: int, cname: str):
    buf = np.frombuffer(encoded, dtype=np.uint8)

    def read_u32(pos):
        raw = buf[pos[:, None] + np.arange(4)[None, :]].astype(np.uint32)
        return raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16 | raw[:, 3] << 24

    return buf, fb.layout(read_u32, np.array([0]), np.array([len(buf)]), expected, cname)


@pytest.mark.parametrize("cname", ["lz4", "lz4hc", "zstd"])
@pytest.mark.parametrize("shuffle", list(SHUFFLES))
@pytest.mark.parametrize("typesize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("clevel", [1, 5, 9])
@pytest.mark.parametrize("blocksize", [0, 256, 4096, 100_000])
def test_chunk_decoding_matches_numcodecs(device, cname, shuffle, typesize, clevel, blocksize):
    """Every cname x shuffle x typesize x clevel x block size, incl. leftover blocks and splits."""
    data = _field(DTYPES[typesize], (37, 101))
    codec = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=SHUFFLES[shuffle], blocksize=blocksize)
    encoded = codec.encode(data)
    expected = data.nbytes
    buf, lay = _layout_of(encoded, expected, cname)
    dev = resolve_device(device)
    buffer = dev.asarray(buf)
    route = Route("batch", "nvcomp" if device == "gpu" else "cpu")  # the batch decoders of each device
    read = SimpleNamespace(device=dev, clock=Clock(), options=get_options())
    _, views = eb.decode_chunks(buffer, lay, 1, expected, read, route)
    got = host(views[0])
    np.testing.assert_array_equal(got, np.frombuffer(codec.decode(encoded), dtype=np.uint8))


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("cname", ["lz4", "zstd", "blosclz"])
@pytest.mark.parametrize("shuffle", ["shuffle", "bitshuffle"])
def test_arrays(tmp_path, device, fmt, cname, shuffle):
    """Through zarr stores (v2 numcodecs Blosc, v3 blosc codec), with missing chunks."""
    if fmt == 2:
        comp = numcodecs.Blosc(cname=cname, clevel=5, shuffle=SHUFFLES[shuffle])
    else:
        comp = zarr.codecs.BloscCodec(cname=cname, clevel=5, shuffle=shuffle)
    arr = zarr.create_array(
        tmp_path / "a.zarr",
        shape=(50, 40, 3),
        chunks=(16, 16, 3),
        dtype="f4",
        zarr_format=fmt,
        compressors=comp,
    )
    arr[:] = _field("f4", (50, 40, 3))
    arr[16:32] = 0
    dev = resolve_device(device)
    spec = array_spec(arr)
    assert (spec.fallback is None) == (cname != "blosclz"), describe(spec, dev)
    for sel in [(slice(None),), (slice(3, 47, 5), np.array([39, 0, 17]), 1)]:
        (got,) = read_arrays([(spec, sel)], dev)
        assert module_of(got) == expected_type(device)
        want = arr[...][sel[0]] if len(sel) == 1 else arr[...][sel[0]][:, sel[1], sel[2]]
        np.testing.assert_array_equal(host(got), want)


@pytest.mark.parametrize("decode", ["auto", "gpu"])
@pytest.mark.parametrize(
    "dtype, cname, shuffle",
    [
        ("f4", "lz4", numcodecs.Blosc.SHUFFLE),
        ("f4", "zstd", numcodecs.Blosc.BITSHUFFLE),
        ("i2", "lz4", numcodecs.Blosc.BITSHUFFLE),
        ("i2", "lz4", numcodecs.Blosc.SHUFFLE),
        ("f8", "lz4", numcodecs.Blosc.SHUFFLE),
        ("u1", "lz4", numcodecs.Blosc.BITSHUFFLE),
        ("u1", "lz4", numcodecs.Blosc.SHUFFLE),  # a typesize of 1 is not shuffled: no box
        ("f4", "lz4", numcodecs.Blosc.NOSHUFFLE),  # blocks stored as they are: no box
    ],
)
def test_tiles_unshuffled_into_their_boxes(tmp_path, device, monkeypatch, dtype, cname, shuffle, decode):
    """Whole tiles (a chunk is not one run of the output) are unshuffled straight into their
    box of the output; the edge tiles, partial selections and chunks whose blocks do not
    allow it go through scratch and the scatter, in the same batches. Every read equals
    zarr-python's."""
    from cupy_xarray.engine.route import Scheduler

    comp = numcodecs.Blosc(cname=cname, clevel=5, shuffle=shuffle, blocksize=4096)
    arr = zarr.create_array(
        tmp_path / "t.zarr", shape=(7, 80, 200), chunks=(2, 32, 64), dtype=dtype, zarr_format=2,
        compressors=comp,
    )  # fmt: skip
    arr[:] = _field(dtype, arr.shape)
    boxed = []
    choose = eb._boxable

    def spy(lay, boxes, nchunks, dev):
        got = choose(lay, boxes, nchunks, dev)
        boxed.append(sum(b is not None for b in got))
        return got

    monkeypatch.setattr(eb, "_boxable", spy)
    dev = resolve_device(device)
    spec = array_spec(arr)
    sels = [(slice(None),), (slice(2, 6), slice(32, 80), slice(64, 192)), (1, slice(None), slice(3, 200))]
    for sel in sels:
        batch = Scheduler(force="batch")
        (got,) = read_arrays([(spec, sel)], dev, batch_bytes=20000, decode=decode, scheduler=batch)
        np.testing.assert_array_equal(host(got), arr[sel])
    fits = shuffle != numcodecs.Blosc.NOSHUFFLE and not (dtype == "u1" and shuffle == numcodecs.Blosc.SHUFFLE)
    if device == "cpu" or decode == "gpu" or cname == "lz4":  # zstd on "auto": c-blosc, no boxes
        assert (sum(boxed) > 0) == fits, boxed


def test_sharded_blosc(tmp_path, device):
    arr = zarr.create_array(
        tmp_path / "a.zarr", shape=(64, 64), chunks=(16, 16), shards=(32, 64), dtype="i4",
        compressors=zarr.codecs.BloscCodec(cname="zstd", shuffle="bitshuffle"),
    )  # fmt: skip
    arr[:] = _field("i4", (64, 64))
    (got,) = read_arrays([(array_spec(arr), (slice(None),))], resolve_device(device))
    np.testing.assert_array_equal(host(got), arr[...])


def _lz4_array(tmp_path):
    """A (64, 64) float32 array in two Blosc LZ4 chunks, and the file of its chunk c/1/0."""
    arr = zarr.create_array(
        tmp_path / "a.zarr", shape=(64, 64), chunks=(32, 64), dtype="f4",
        compressors=zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle"),
    )  # fmt: skip
    arr[:] = _field("f4", (64, 64))
    return arr, tmp_path / "a.zarr" / "c" / "1" / "0"


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[:40], "truncated"),
        (lambda b: b[:16] + bytes(len(b) - 16), "outside the chunk|claims"),
        (lambda b: bytes([9]) + b[1:], "not a Blosc 1 chunk"),
        (lambda b: b[:4] + (123).to_bytes(4, "little") + b[8:], "declares 123 decoded bytes"),
    ],
    ids=["truncated", "zeroed-body", "bad-version", "wrong-size"],
)
def test_corrupt_blosc_chunk(tmp_path, device, damage, match):
    arr, chunk = _lz4_array(tmp_path)
    chunk.write_bytes(damage(chunk.read_bytes()))
    with pytest.raises(ChunkError, match=match) as info:
        read_arrays([(array_spec(arr), (slice(None),))], resolve_device(device))
    assert info.value.chunk == "c/1/0"


def test_corrupt_blosc_stream_names_the_chunk(tmp_path, device):
    """A stream whose size prefix is right but whose LZ4 body is garbage: the decoder's
    per-stream status (GPU) or error (CPU) is reported against the chunk."""
    arr, chunk = _lz4_array(tmp_path)
    data = bytearray(chunk.read_bytes())
    _, lay = _layout_of(bytes(data), 32 * 64 * 4, "lz4")
    s = int(np.flatnonzero(~lay.raw)[0])
    start, n = int(lay.src[s]), int(lay.clen[s])
    data[start : start + n] = b"\xff" * n
    chunk.write_bytes(bytes(data))
    # the batches decode each stream (a status per stream); one CPU thread per chunk: c-blosc
    with pytest.raises(ChunkError, match="Blosc lz4 stream|c-blosc cannot decode it") as info:
        read_arrays([(array_spec(arr), (slice(None),))], resolve_device(device))
    assert info.value.chunk == "c/1/0"


def _many_chunks(tmp_path):
    """A (96, 64) float32 array in six Blosc LZ4 chunks of (16, 64)."""
    arr = zarr.create_array(
        tmp_path / "m.zarr", shape=(96, 64), chunks=(16, 64), dtype="f4",
        compressors=zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle", blocksize=1024),
    )  # fmt: skip
    arr[:] = _field("f4", (96, 64))
    return arr


@pytest.mark.parametrize("decode", ["auto", "gpu"])
def test_batches_checked_ahead(tmp_path, device, decode):
    """Batches of one chunk: each batch's layout and structure checks start while the batch
    before it decodes. Same values as zarr; a damaged chunk in a later batch is named, whether
    its layout (found ahead) or its stream (found when its check is waited for) is wrong."""
    from cupy_xarray.engine.route import Scheduler

    arr = _many_chunks(tmp_path)
    spec, dev = array_spec(arr), resolve_device(device)
    batch = Scheduler(force="batch")

    def read(sel=(slice(None),)):
        return read_arrays([(spec, sel)], dev, batch_bytes=16 * 64 * 4, decode=decode, scheduler=batch)[0]

    np.testing.assert_array_equal(host(read()), arr[...])
    np.testing.assert_array_equal(host(read((slice(5, 90, 3), slice(1, 60)))), arr[5:90:3, 1:60])
    chunk = tmp_path / "m.zarr" / "c" / "4" / "0"
    good = chunk.read_bytes()
    _, lay = _layout_of(good, 16 * 64 * 4, "lz4")
    s = int(np.flatnonzero(~lay.raw)[1])
    body = bytearray(good)
    body[int(lay.src[s]) : int(lay.src[s] + lay.clen[s])] = b"\xff" * int(lay.clen[s])
    for damaged, match in [(good[:40], "truncated"), (bytes(body), "Blosc lz4 stream")]:
        chunk.write_bytes(damaged)
        with pytest.raises(ChunkError, match=match) as info:
            read()
        assert info.value.chunk == "c/4/0"
    chunk.write_bytes(good)
    np.testing.assert_array_equal(host(read()), arr[...])


@pytest.mark.gpu
@pytest.mark.parametrize("cname, shuffle", [("lz4", "shuffle"), ("lz4", "bitshuffle")])
def test_nvcomp_c_and_python_apis_agree(tmp_path, options, cname, shuffle):
    """Blosc streams decoded through nvCOMP's C API (the default) and its Python API
    (``CUPY_XARRAY_NVCOMP_C=0``) give zarr's values exactly."""
    arr = zarr.create_array(
        tmp_path / "a.zarr", shape=(24, 96, 80), chunks=(4, 48, 80), dtype="f4",
        compressors=zarr.codecs.BloscCodec(cname=cname, shuffle=shuffle, blocksize=4096),
    )  # fmt: skip
    arr[:] = _field("f4", (24, 96, 80))
    dev = resolve_device("gpu")
    assert dev.codecs.batched(cname) is not None, "nvCOMP's C API is not usable here"
    (c_api,) = read_arrays([(array_spec(arr), (slice(None),))], dev)
    options(nvcomp_c=False)
    assert dev.codecs.batched(cname) is None
    (py_api,) = read_arrays([(array_spec(arr), (slice(None),))], dev)
    np.testing.assert_array_equal(host(c_api), arr[...])
    np.testing.assert_array_equal(host(py_api), arr[...])


def test_compressor_that_lies(tmp_path):
    """A chunk compressed with blosclz in an array whose metadata says lz4 is refused."""
    arr = zarr.create_array(
        tmp_path / "a.zarr", shape=(64,), chunks=(64,), dtype="f4",
        compressors=zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle"),
    )  # fmt: skip
    arr[:] = _field("f4", (64,))
    (tmp_path / "a.zarr" / "c" / "0").write_bytes(
        numcodecs.Blosc(cname="blosclz", shuffle=1).encode(_field("f4", (64,)))
    )
    with pytest.raises(ChunkError, match="compressed with blosclz, the metadata says lz4"):
        read_arrays([(array_spec(arr), (slice(None),))], resolve_device("cpu"))


def test_the_host_check_of_one_chunk_finds_what_the_layout_finds():
    """``check_one`` (plain Python, for CPU threads) raises exactly what ``layout`` raises, or
    nothing where it raises nothing, on valid and damaged chunks of every kind."""
    from cupy_xarray.formats.blosc import BloscLayoutError, check_one, check_vectorized

    rng = np.random.default_rng(11)
    kinds = [
        dict(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
        dict(cname="zstd", clevel=1, shuffle=numcodecs.Blosc.BITSHUFFLE),
        dict(cname="lz4hc", clevel=3, shuffle=numcodecs.Blosc.NOSHUFFLE),
        dict(cname="lz4", clevel=0, shuffle=numcodecs.Blosc.SHUFFLE),  # stored uncompressed
        dict(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=1 << 12),
    ]
    outcomes = set()
    for case in range(600):
        kind = kinds[case % len(kinds)]
        dtype = ["f4", "f8", "i2", "u1"][int(rng.integers(4))]
        n = int(rng.integers(1, 40000))
        data = (np.sin(np.arange(n) / 30) * 100).astype(dtype)
        chunk = bytearray(numcodecs.Blosc(**kind).encode(data))
        damage = int(rng.integers(5))
        if damage == 1:  # bit flips anywhere
            for _ in range(int(rng.integers(1, 4))):
                chunk[int(rng.integers(len(chunk)))] ^= 1 << int(rng.integers(8))
        elif damage == 2:  # header bytes
            chunk[int(rng.integers(16))] = int(rng.integers(256))
        elif damage == 3:  # truncated
            chunk = chunk[: int(rng.integers(len(chunk)))]
        elif damage == 4:  # block starts or stream sizes overwritten
            at = int(rng.integers(16, max(len(chunk) - 4, 17)))
            chunk[at : at + 4] = int(rng.integers(2**32)).to_bytes(4, "little")
        src = np.frombuffer(bytes(chunk), np.uint8)
        expected = data.nbytes
        cname = kind["cname"] if kind["cname"] != "lz4hc" else "lz4"
        found = []
        for check in (check_one, check_vectorized):
            try:
                check(src, expected, cname)
                found.append(None)
            except BloscLayoutError as exc:
                found.append(str(exc))
        assert found[0] == found[1], (case, kind, dtype, n, damage, found)
        outcomes.add(found[0] is None)
    assert outcomes == {True, False}  # both valid and refused chunks were seen
