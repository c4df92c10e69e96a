"""Damaged and hostile chunks: a clear error or zarr-python's own values, never silent garbage.

The seeded campaign of :mod:`damage` runs here on the CPU and, in child processes, on the GPU;
the regression tests below pin each defect the campaign or a reader found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import google_crc32c
import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host

import cupy_xarray  # noqa: F401
from cupy_xarray.containment import UnsafeStoreError
from cupy_xarray.engine.decoders import stream
from cupy_xarray.errors import ChunkError
from cupy_xarray.runtime import checksums

HERE = os.path.dirname(os.path.abspath(__file__))
CAMPAIGN_CASES = int(os.environ.get("CUPY_XARRAY_DAMAGE_CASES", "1200"))


def _campaign_report(results, all_cases):
    import damage

    report = damage.summary(results, all_cases)
    covered = {(all_cases[r["index"]].layout, all_cases[r["index"]].kind) for r in results}
    return report, covered


@pytest.mark.parametrize("route", ["host", "batch", "share"])
def test_damage_campaign_cpu(tmp_path, route):
    """Every route a chunk can take: one CPU thread per chunk, the batches (staging, one
    decode call per codec, scatter) that GPU reads decode in with nvCOMP, and both taking
    from one shared queue (the default of a large GPU read)."""
    import damage

    from cupy_xarray.engine.route import Scheduler

    all_cases = damage.cases(CAMPAIGN_CASES, seed=0)
    runner = damage.Runner(str(tmp_path), "cpu", Scheduler(force=route))
    results = [dict(index=c.index, outcome=o, detail=d) for c in all_cases for o, d in [runner.run(c)]]
    report, covered = _campaign_report(results, all_cases)
    assert not report["failures"], "\n".join(report["failures"][:20])
    assert report["cases"] == CAMPAIGN_CASES >= 1000
    # every layout met every kind of damage, and both detectable and invisible damage occurred
    assert len(covered) == sum(len(damage.KINDS) - ("sharded" not in layout) for layout in damage.LAYOUTS)
    assert report["counts"].get("error", 0) > 0 and report["counts"].get("same", 0) > 0


def test_the_campaign_script_reads_as_a_large_read_does(tmp_path):
    """``--route batch``: the children read every case on the batch route (on a GPU the
    default's route for large reads, nvCOMP in the decoder process); here with the decoder
    process on CPU decoders."""
    out = tmp_path / "campaign.json"
    cmd = [sys.executable, os.path.join(HERE, "damage.py"), "--device", "cpu", "--route", "batch"]
    cmd += ["--cases", "40", "--json", str(out)]
    env = dict(os.environ, CUPY_XARRAY_DECODER_PROCESS="on")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    report = json.loads(out.read_text())["report"]
    assert proc.returncode == 0 and not report["failures"], proc.stdout[-2000:]
    assert report["route"] == "batch" and report["cases"] == 40


@pytest.mark.gpu
def test_damage_campaign_gpu(tmp_path):
    """Child processes, each checking after every case that its GPU still computes: no case may
    kill the CUDA context, hang, or return values zarr-python would not."""
    out = tmp_path / "campaign.json"
    cmd = [sys.executable, os.path.join(HERE, "damage.py"), "--device", "gpu"]
    cmd += ["--cases", str(CAMPAIGN_CASES), "--json", str(out), "--timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-4000:])
    report = json.loads(out.read_text())["report"]
    if os.environ.get("CUPY_XARRAY_DAMAGE_JSON"):  # keep the report (the GPU machine's run)
        with open(os.environ["CUPY_XARRAY_DAMAGE_JSON"], "w") as f:
            json.dump(report, f, indent=1)
    assert not report["failures"], "\n".join(report["failures"][:20])
    assert report["cases"] == CAMPAIGN_CASES
    assert set(report["counts"]) <= {"error", "same", "intact"}


# ---------------------------------------------------------------- regression tests


def _one_chunk_store(path, fmt, compressor, data):
    kw = {"compressors": compressor} if compressor is not None else {"compressors": None}
    a = zarr.create_array(
        str(path), shape=data.shape, chunks=data.shape, dtype=data.dtype, zarr_format=fmt, **kw
    )
    a[:] = data
    import damage

    (chunk,) = damage.chunk_files(str(path))
    return chunk


def _read(path, device, choice=None):
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device

    spec = array_spec(zarr.open_array(str(path), mode="r"), name="a")
    return read_arrays([(spec, (slice(None),) * len(spec.shape))], resolve_device(device), decode=choice)[0]


CHOICES = pytest.mark.parametrize("choice", ["auto", "gpu", "cpu"])


def _one_choice_on_cpu(device, choice):
    if device == "cpu" and choice != "auto":
        pytest.skip("decode= chooses where a GPU read decodes; a CPU read decodes on the CPU")


def _flip(path, pos, bit=0):
    raw = bytearray(open(path, "rb").read())
    raw[pos if pos >= 0 else len(raw) + pos] ^= 1 << bit
    open(path, "wb").write(bytes(raw))


def _smooth(n=4096):
    return (np.sin(np.arange(n) / 40.0) * 100).astype("float32")


V3_ZSTD_CHECKSUM = [zarr.codecs.ZstdCodec(level=3, checksum=True)]


@CHOICES
@pytest.mark.parametrize("fmt", [2, 3])
def test_zstd_content_checksum_is_verified(tmp_path, device, fmt, choice):
    _one_choice_on_cpu(device, choice)
    comp = numcodecs.Zstd(level=3, checksum=True) if fmt == 2 else V3_ZSTD_CHECKSUM
    store = tmp_path / "s.zarr"
    chunk = _one_chunk_store(store, fmt, comp, _smooth())
    np.testing.assert_array_equal(host(_read(store, device, choice)), _smooth())
    # a literal byte in the middle of the frame: still a valid frame, wrong content
    _flip(chunk, len(open(chunk, "rb").read()) // 2, 3)
    with pytest.raises(Exception):  # noqa: B017 - zarr-python refuses it too
        zarr.open_array(str(store))[:]
    with pytest.raises(ChunkError, match=r"chunk '(c/)?0'.*(checksum|zstd)"):
        _read(store, device, choice)


@CHOICES
@pytest.mark.parametrize("fmt", [2, 3])
def test_gzip_crc32_is_verified(tmp_path, device, fmt, choice):
    _one_choice_on_cpu(device, choice)
    comp = numcodecs.GZip(level=1) if fmt == 2 else [zarr.codecs.GzipCodec(level=1)]
    store = tmp_path / "s.zarr"
    chunk = _one_chunk_store(store, fmt, comp, _smooth())
    _flip(chunk, -8)  # the CRC-32 itself: the body still decodes, to the right size
    with pytest.raises(ChunkError, match="(CRC|crc|check)"):
        _read(store, device, choice)
    _flip(chunk, -8)
    np.testing.assert_array_equal(host(_read(store, device, choice)), _smooth())
    _flip(chunk, 40, 2)  # inside the deflate body
    with pytest.raises(ChunkError):
        _read(store, device, choice)


@CHOICES
@pytest.mark.parametrize("fmt", [2, 3])
def test_zlib_adler32_is_verified(tmp_path, device, fmt, choice):
    _one_choice_on_cpu(device, choice)
    """The minimal case: Zlib(level=0), 12 float32 values, one bit of byte 11 flipped."""
    comp = numcodecs.Zlib(level=0) if fmt == 2 else [zarr.codecs.numcodecs.Zlib(level=0)]
    store = tmp_path / "s.zarr"
    data = np.arange(12, dtype="float32")
    chunk = _one_chunk_store(store, fmt, comp, data)
    _flip(chunk, 11)
    with pytest.raises(Exception, match="incorrect data check"):
        zarr.open_array(str(store))[:]
    with pytest.raises(ChunkError, match="(Adler|incorrect data check)"):
        _read(store, device, choice)


@CHOICES
@pytest.mark.parametrize("fmt", [2, 3])
def test_lz4_truncated_to_half(tmp_path, device, fmt, choice):
    _one_choice_on_cpu(device, choice)
    comp = numcodecs.LZ4() if fmt == 2 else [zarr.codecs.numcodecs.LZ4()]
    store = tmp_path / "s.zarr"
    chunk = _one_chunk_store(store, fmt, comp, np.random.default_rng(0).random(4096).astype("float32"))
    raw = open(chunk, "rb").read()
    open(chunk, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(ChunkError, match="lz4"):
        _read(store, device, choice)


def _bomb(kind: str, size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31 if kind == "gzip" else 15)
    block = bytes(1 << 20)
    return b"".join([c.compress(block) for _ in range(size >> 20)] + [c.flush()])


_BOMB_READ = """
import resource, sys, zarr
sys.path.insert(0, {here!r})
from test_damage import _read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    _read({store!r}, {device!r})
except Exception as exc:
    print(type(exc).__name__, str(exc)[:200])
print("peak MiB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("kind", ["gzip", "zlib"])
def test_decompression_stops_at_the_chunk_size(tmp_path, device, kind):
    """A 1 MiB chunk replaced by ~0.5 MiB that inflates to 512 MiB: refused without inflating
    it (the read's memory stays far below the bomb's size)."""
    comp = {"gzip": numcodecs.GZip(level=1), "zlib": numcodecs.Zlib(level=1)}[kind]
    store = tmp_path / "s.zarr"
    chunk = _one_chunk_store(store, 2, comp, np.arange(2**18, dtype="float32"))
    bomb = bytearray(_bomb(kind, 512 << 20))
    assert len(bomb) < 2**20  # within the file's bound: the decoder must stop it
    if kind == "gzip":  # a trailer that claims the chunk's own size
        bomb[-4:] = (2**20).to_bytes(4, "little")
    open(chunk, "wb").write(bytes(bomb))
    script = _BOMB_READ.format(here=HERE, store=str(store), device=device)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ChunkError") and "chunk '0'" in out, out
    if device == "cpu":
        assert "more than the 1048576 bytes" in out, out
    assert int(out.split("peak MiB")[1]) < 128, out


def test_chunk_file_larger_than_any_codec_writes_is_not_read(tmp_path, device):
    """A 48-byte chunk in a 2 GiB sparse file: refused before any of it is read."""
    store = tmp_path / "s.zarr"
    chunk = _one_chunk_store(store, 3, [zarr.codecs.ZstdCodec()], np.arange(12, dtype="float32"))
    with open(chunk, "r+b") as f:
        f.truncate(2**31)
    script = _BOMB_READ.format(here=HERE, store=str(store), device=device)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ChunkError") and "more than any codec stores a 48-byte chunk" in out, out
    assert int(out.split("peak MiB")[1]) < 64, out


def test_shard_inner_chunk_larger_than_any_codec_writes_is_not_read(tmp_path, device):
    """A shard of a 2 GiB sparse file whose index gives one 48-byte inner chunk all of it:
    refused, naming the inner chunk, before any of it is read (as a chunk file is)."""
    store = tmp_path / "s.zarr"
    a = zarr.create_array(
        str(store), shape=(24,), chunks=(12,), shards=(24,), dtype="float32", zarr_format=3,
        compressors=[zarr.codecs.ZstdCodec()],
    )  # fmt: skip
    a[:] = np.arange(24, dtype="float32")
    shard = store / "c" / "0"
    raw = bytearray(shard.read_bytes())
    index = raw[-(2 * 16 + 4) :]
    size = 2**31
    index[16:32] = (0).to_bytes(8, "little") + (size - len(index)).to_bytes(8, "little")
    import google_crc32c

    index[-4:] = int(google_crc32c.value(bytes(index[:-4]))).to_bytes(4, "little")
    with open(shard, "r+b") as f:
        f.truncate(size)  # sparse: costs nothing on disk
        f.seek(size - len(index))
        f.write(bytes(index))
    script = _BOMB_READ.format(here=HERE, store=str(store), device=device)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ChunkError") and "inner chunk (1,)" in out, out
    assert "more than any codec stores a 48-byte chunk" in out, out
    assert int(out.split("peak MiB")[1]) < 64, out


def test_shard_index_entry_that_overflows_64_bits(tmp_path, device):
    store = tmp_path / "s.zarr"
    a = zarr.create_array(
        str(store), shape=(8,), chunks=(4,), shards=(8,), dtype="float32", compressors=None, zarr_format=3
    )
    a[:] = np.arange(8, dtype="float32")
    shard = store / "c" / "0"
    raw = bytearray(shard.read_bytes())
    index = len(raw) - 2 * 16 - 4
    raw[index : index + 16] = (2**64 - 16).to_bytes(8, "little") + (32).to_bytes(8, "little")
    import google_crc32c

    raw[-4:] = int(google_crc32c.value(bytes(raw[index:-4]))).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChunkError, match=r"c/0.*points past the end"):
        _read(store, device)


@pytest.mark.parametrize("fmt", [2, 3])
def test_chunk_shape_with_zero_is_refused_at_open(tmp_path, device, fmt):
    store = tmp_path / "s.zarr"
    xr.Dataset({"a": ("x", np.arange(10.0))}).to_zarr(store, zarr_format=fmt, consolidated=False)
    meta_path = store / "a" / ("zarr.json" if fmt == 3 else ".zarray")
    meta = json.loads(meta_path.read_text())
    if fmt == 3:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [0]
    else:
        meta["chunks"] = [0]
    meta_path.write_text(json.dumps(meta))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        repaired = zarr.open_array(str(store / "a")).chunks
    if 0 not in repaired:
        # zarr >= 3.4 reads a chunk length of 0 as 1 (with a warning), and so does the engine: the
        # chunk written under the old shape no longer fits, which is a clear error naming it
        ds = xr.open_dataset(store, engine="kvikio", device=device, consolidated=False)
        with pytest.raises(ChunkError, match=r"chunk 'c/0'|chunk '0'"):
            ds.a.load()
        return
    with pytest.raises(UnsafeStoreError, match=r"array 'a'.*chunk shape \(0,\)"):
        xr.open_dataset(store, engine="kvikio", device=device, consolidated=False)


def test_arrays_read_by_zarr_python_name_the_corrupt_chunk(tmp_path, device):
    store = tmp_path / "s.zarr"
    comp = numcodecs.BZ2()  # decoded by zarr-python
    data = np.random.default_rng(1).random((8, 8)).astype("float32")
    a = zarr.create_array(
        str(store), shape=(8, 8), chunks=(4, 4), dtype="float32", zarr_format=2, compressors=comp
    )
    a[:] = data
    chunk = store / "1.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChunkError, match=r"chunk '1\.0'.*zarr-python cannot decode it"):
        _read(store, device)
    # a directory where a chunk file should be is not a missing chunk
    chunk.unlink()
    chunk.mkdir()
    with pytest.raises(ChunkError, match=r"chunk '1\.0'.*is a directory"):
        _read(store, device)


def _blosc_store(path, fmt, shuffle):
    data = (np.sin(np.arange(64 * 64) / 30.0) * 50).astype("float32").reshape(64, 64)
    if fmt == 2:
        comp = numcodecs.Blosc(cname="lz4", shuffle=shuffle)
    else:
        comp = [
            zarr.codecs.BloscCodec(
                cname="lz4", shuffle={0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}[shuffle]
            )
        ]
    a = zarr.create_array(
        str(path), shape=(64, 64), chunks=(32, 32), dtype="float32", zarr_format=fmt, compressors=comp
    )
    a[:] = data
    return data


@CHOICES
@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
def test_padded_blosc_chunks_are_read(tmp_path, device, fmt, shuffle, choice):
    _one_choice_on_cpu(device, choice)
    """Writers such as z5py leave bytes after a Blosc chunk's cbytes; c-blosc ignores them."""
    import damage

    store = tmp_path / "s.zarr"
    data = _blosc_store(store, fmt, shuffle)
    for f in damage.chunk_files(str(store)):
        with open(f, "ab") as fh:
            fh.write(b"\x00" * 16)
    np.testing.assert_array_equal(np.asarray(zarr.open_array(str(store))[:]), data)
    np.testing.assert_array_equal(host(_read(store, device, choice)), data)
    # shorter than cbytes is still refused
    f = damage.chunk_files(str(store))[0]
    raw = open(f, "rb").read()
    open(f, "wb").write(raw[: len(raw) - 40])
    with pytest.raises(ChunkError, match="Blosc header declares"):
        _read(store, device, choice)


# ---------------------------------------------------------------- checksum arithmetic


@pytest.mark.parametrize("n", [0, 1, 3, 31, 2047, 2048, 2049, 4096 + 5, 100_003])
def test_segmented_checksums_equal_zlib(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert checksums.crc32_segmented(data) == zlib.crc32(data)
    assert checksums.crc32_segmented(data, "crc32c") == google_crc32c.value(data)
    assert checksums.adler32_segmented(data) == zlib.adler32(data)
    ones = b"\xff" * n  # the largest sums Adler-32 meets
    assert checksums.adler32_segmented(ones) == zlib.adler32(ones)


def _xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 in Python, for the kernel's reference (small inputs only)."""
    M = 2**64 - 1
    P1, P2, P3 = 11400714785074694791, 14029467366897019727, 1609587929392839161
    P4, P5 = 9650029242287828579, 2870177450012600261

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & M

    def rnd(acc, x):
        return rotl((acc + x * P2) & M, 31) * P1 & M

    n, p = len(data), 0
    if n >= 32:
        v = [(seed + P1 + P2) & M, (seed + P2) & M, seed, (seed - P1) & M]
        while p + 32 <= n:
            for k in range(4):
                v[k] = rnd(v[k], int.from_bytes(data[p + 8 * k : p + 8 * k + 8], "little"))
            p += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M
        for k in range(4):
            h = ((h ^ rnd(0, v[k])) * P1 + P4) & M
    else:
        h = (seed + P5) & M
    h = (h + n) & M
    while p + 8 <= n:
        h = (rotl(h ^ rnd(0, int.from_bytes(data[p : p + 8], "little")), 27) * P1 + P4) & M
        p += 8
    if p + 4 <= n:
        h = (rotl(h ^ (int.from_bytes(data[p : p + 4], "little") * P1 & M), 23) * P2 + P3) & M
        p += 4
    while p < n:
        h = rotl(h ^ (data[p] * P5 & M), 11) * P1 & M
        p += 1
    h ^= h >> 33
    h = h * P2 & M
    h ^= h >> 29
    h = h * P3 & M
    return h ^ (h >> 32)


@pytest.mark.parametrize("n", [0, 5, 31, 32, 100, 4096, 5000])
def test_reference_xxh64_is_what_zstd_stores(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frame = numcodecs.Zstd(level=1, checksum=True).encode(data)
    assert _xxh64(data) & 0xFFFFFFFF == int.from_bytes(frame[-4:], "little")


@pytest.mark.gpu
def test_checksum_kernels_equal_the_host():
    import cupy

    rng = np.random.default_rng(5)
    lengths = [0, 1, 7, 31, 32, 33, 2047, 2048, 2049, 4095, 4096, 4097, 65536 + 13, 4 << 20]
    streams = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    buf = cupy.zeros(sum(n + 64 for n in lengths), dtype=cupy.uint8)
    ptrs, views, pos = [], [], 3  # odd addresses too: the kernels' unaligned paths
    for s in streams:
        buf[pos : pos + len(s)] = cupy.asarray(s)
        views.append(buf[pos : pos + len(s)])
        ptrs.append(buf.data.ptr + pos)
        pos += len(s) + 61
    ptrs = np.array(ptrs, dtype=np.uint64)
    lens = np.array(lengths, dtype=np.int64)
    crc = checksums.compute("crc32", ptrs, lens)
    crcc = checksums.compute("crc32c", ptrs, lens)
    # the writer's form: lengths on the device, segments laid out for a bound on all of them
    d_ptrs, d_lens = cupy.asarray(ptrs), cupy.asarray(lens.astype(np.uint64))
    bounded = checksums.crc_start("crc32c", d_ptrs, d_lens, len(lens), max(lengths) + 5000).get()
    adler = checksums.compute("adler32", ptrs, lens)
    xxh = checksums.compute("xxh64", ptrs, lens)
    for i, s in enumerate(streams):
        b = s.tobytes()
        assert int(crc[i]) == zlib.crc32(b), lengths[i]
        assert int(crcc[i]) == int(bounded[i]) == google_crc32c.value(b), lengths[i]
        assert int(adler[i]) == zlib.adler32(b), lengths[i]
        if lengths[i] <= 65536 + 13:
            assert int(xxh[i]) == _xxh64(b), lengths[i]
        else:  # too long for the Python reference: zstd's stored checksum instead
            frame = numcodecs.Zstd(level=1, checksum=True).encode(b)
            assert int(xxh[i]) & 0xFFFFFFFF == int.from_bytes(frame[-4:], "little")
    ends = checksums.stream_ends(cupy.asarray(ptrs), cupy.asarray(lens), len(lengths))
    for i, s in enumerate(streams):
        b = s.tobytes()
        assert ends[i, : min(8, len(b))].tobytes() == b[:8]
        assert ends[i, 16 - min(8, len(b)) :].tobytes() == b[-8:] if b else True


# ---------------------------------------------------------------- LZ4 structure walk


def _lz4_blocks(count=1500, seed=0, longest=5000):
    """(block, expected size, liblz4 accepts) for valid and damaged LZ4 blocks."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        n = int(rng.integers(1, longest))
        data = [
            rng.integers(0, 256, n, dtype=np.uint8).tobytes(),
            (np.sin(np.arange(n // 4 + 1) / 30) * 100).astype("float32").tobytes()[:n],
            bytes(n),
        ][k % 3]
        block = bytearray(numcodecs.LZ4(acceleration=int(rng.integers(1, 5))).encode(data)[4:])
        kind = (k // 3) % 5
        if kind == 1:
            block = block[: int(rng.integers(0, len(block)))]
        elif kind == 2:
            block[int(rng.integers(len(block)))] ^= 1 << int(rng.integers(8))
        elif kind == 3:
            pos = int(rng.integers(len(block)))
            block[pos : pos + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        elif kind == 4:
            block += b"x"
        try:
            ok = len(numcodecs.LZ4().decode(np.uint32(n).tobytes() + bytes(block))) == n
        except Exception:  # noqa: BLE001
            ok = False
        out.append((bytes(block), n, ok))
    return out


def test_lz4_walk_refuses_what_liblz4_refuses():
    blocks = _lz4_blocks()
    walked = [checksums.lz4_walk_host(b, n) == 0 for b, n, _ in blocks]
    # every block liblz4 refuses is refused; every undamaged block is accepted
    assert all(not w for (_, _, ok), w in zip(blocks, walked) if not ok)
    assert all(walked[k] for k in range(len(blocks)) if (k // 3) % 5 == 0)
    # the walk is stricter in one place only: a match offset of 0 (liblz4 copies from the
    # output's own unwritten bytes)
    extra = [k for k, ((_, _, ok), w) in enumerate(zip(blocks, walked)) if ok and not w]
    assert len(extra) < len(blocks) // 100
    assert sum(ok for _, _, ok in blocks) > 300 and sum(not ok for _, _, ok in blocks) > 300


@pytest.mark.gpu
@pytest.mark.parametrize("count, longest", [(600, 5000), (120, 70_000), (9, 2_000_000)])
def test_lz4_walk_kernel_equals_the_host(count, longest):
    """Short blocks, blocks as long as Blosc's streams and as numcodecs' LZ4 of a 4 MiB chunk
    (the kernel's window read again many times), at every alignment."""
    import cupy

    blocks = _lz4_blocks(count, seed=3, longest=longest)
    buf = cupy.asarray(np.frombuffer(b"".join(b for b, _, _ in blocks) + b"\0", dtype=np.uint8))
    lens = np.array([len(b) for b, _, _ in blocks], dtype=np.int64)
    ptrs = np.uint64(buf.data.ptr) + (np.cumsum(lens) - lens).astype(np.uint64)
    want = np.array([n for _, n, _ in blocks], dtype=np.int64)
    got = checksums.lz4_check(ptrs, lens, want)
    assert got.tolist() == [checksums.lz4_walk_host(b, n) for b, n, _ in blocks]


# ---------------------------------------------------------------- where chunks are decoded


def test_decode_choice_rules(options):
    from cupy_xarray import set_options
    from cupy_xarray.engine.decoders import decode_choice
    from cupy_xarray.engine.route import safe_on_gpu
    from cupy_xarray.options import from_environment, get_options

    assert decode_choice(None, get_options()) == "auto"
    options(decode="cpu")
    assert decode_choice(None, get_options()) == "cpu" and decode_choice("gpu", get_options()) == "gpu"
    assert from_environment({"CUPY_XARRAY_DECODE": "gpu"}).decode == "gpu"
    with pytest.raises(ValueError, match="CUPY_XARRAY_DECODE"):
        from_environment({"CUPY_XARRAY_DECODE": "fast"})
    with pytest.raises(ValueError, match="'auto', 'gpu' or 'cpu'"):
        set_options(decode="fast")
    with pytest.raises(ValueError, match="'auto', 'gpu' or 'cpu'"):
        decode_choice("nvcomp", get_options())
    # auto: nvCOMP only where its output is checked or its input proven
    assert safe_on_gpu("gzip") and safe_on_gpu("zlib") and safe_on_gpu("lz4-block")
    assert not safe_on_gpu("zstd") and safe_on_gpu("zstd", proven=True)
    assert safe_on_gpu("lz4")  # (by cost: small reads stay on CPU threads)


def test_wrong_decode_choice_fails_at_open(tmp_path):
    store = tmp_path / "s.zarr"
    xr.Dataset({"a": ("x", np.arange(10.0))}).to_zarr(store, consolidated=False)
    with pytest.raises(ValueError, match="decode must be"):
        xr.open_dataset(store, engine="kvikio", device="cpu", decode="nvcomp")


_DECODE_LAYOUTS = ["v3-zstd", "v3-zstd-checksum", "v3-zstd-crc32c", "v3-gzip", "v2-zlib", "v3-lz4"]
_DECODE_LAYOUTS += [
    "v3-blosc-lz4-shuffle",
    "v3-blosc-zstd-shuffle",
    "v2-blosc-lz4-bitshuffle",
    "v3-sharded-zstd",
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", _DECODE_LAYOUTS)
def test_every_decode_choice_reads_the_same(tmp_path, layout):
    """decode="gpu", "cpu" and "auto" give zarr-python's values, eager, lazy, dask and in threads."""
    import damage
    from conftest import run_in_threads

    path = damage.build(str(tmp_path), layout)
    ref = np.asarray(zarr.open_array(path)[...])
    for choice in ("auto", "gpu", "cpu"):
        got = host(_read_choice(path, choice))
        np.testing.assert_array_equal(got, ref)
    fmt, kw = damage._layouts()[layout]
    store = tmp_path / "ds.zarr"
    enc = {"a": {"chunks": (32, 32), **kw}}
    xr.Dataset({"a": (("y", "x"), ref)}).to_zarr(store, zarr_format=fmt, consolidated=False, encoding=enc)
    ds = {
        c: xr.open_dataset(store, engine="kvikio", decode=c, consolidated=False)
        for c in ("auto", "gpu", "cpu")
    }
    for c, d in ds.items():
        np.testing.assert_array_equal(host(d.a[5:70, 3:99].data), ref[5:70, 3:99], err_msg=c)
        np.testing.assert_array_equal(host(d.a.chunk({}).data.compute()), ref, err_msg=c)
    errors = run_in_threads(
        lambda k: np.testing.assert_array_equal(host(_read_choice(path, ("auto", "gpu", "cpu")[k % 3])), ref),
        9,
    )
    assert not errors, errors


def _read_choice(path, choice):
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device

    spec = array_spec(zarr.open_array(str(path), mode="r"), name="a")
    return read_arrays([(spec, (slice(None), slice(None)))], resolve_device("gpu"), decode=choice)[0]


def test_stored_checksums_are_read_from_the_framing():
    """What the GPU compares its checksums with: parsed from each framed stream's first and last
    8 bytes (checksums.stream_ends on the GPU; here built on the host)."""
    import zlib as _zlib

    payloads = [
        np.random.default_rng(k).integers(0, 256, 3000 + k, dtype=np.uint8).tobytes() for k in range(3)
    ]

    def ends(frames):
        out = np.zeros((len(frames), 16), dtype=np.uint8)
        for i, f in enumerate(frames):
            out[i, : min(8, len(f))] = np.frombuffer(f[:8], np.uint8)
            out[i, 16 - min(8, len(f)) :] = np.frombuffer(f[-8:], np.uint8)
        return out

    def _stored(kind, ends):
        decoder = stream(kind)
        return (decoder.checksum, *decoder.stored_checksums(ends))

    zstd = [numcodecs.Zstd(level=1, checksum=k != 1).encode(p) for k, p in enumerate(payloads)]
    kind, has, values = _stored("zstd", ends(zstd))
    assert kind == "xxh64" and has.tolist() == [True, False, True]
    assert [int(v) for v in values[has]] == [_xxh64(p) & 0xFFFFFFFF for k, p in enumerate(payloads) if k != 1]
    gzip = [numcodecs.GZip(level=1).encode(p) for p in payloads]
    kind, has, values = _stored("gzip", ends(gzip))
    assert kind == "crc32" and has.all() and [int(v) for v in values] == [_zlib.crc32(p) for p in payloads]
    zl = [numcodecs.Zlib(level=1).encode(p) for p in payloads]
    kind, has, values = _stored("zlib", ends(zl))
    assert (
        kind == "adler32" and has.all() and [int(v) for v in values] == [_zlib.adler32(p) for p in payloads]
    )
    assert _stored("lz4", ends(zl))[0] is None


@pytest.mark.parametrize(
    "layout",
    ["v3-zstd", "v3-zstd-crc32c", "v3-gzip", "v3-lz4", "v3-blosc-zstd-shuffle", "v3-blosc-lz4-shuffle"],
)
def test_describe_says_where_a_gpu_read_decodes(tmp_path, layout, c_api, options):
    """The debug line of a GPU read names CPU threads for what decode= keeps from nvCOMP, and
    both processors where decode='auto' shares the chunks; without the decoder process,
    CPU threads for the frames no check proves."""
    from types import SimpleNamespace

    import damage

    from cupy_xarray.device import Device
    from cupy_xarray.engine import array_spec, describe

    spec = array_spec(zarr.open_array(damage.build(str(tmp_path), layout), mode="r"), name="a")
    gpu = Device("gpu", np, SimpleNamespace(name="kvikio"), SimpleNamespace(name="nvcomp"), 4)
    assert "CPU threads (decode='auto')" not in describe(spec, gpu)
    assert "nvCOMP and CPU threads, sharing one queue" in describe(spec, gpu)
    # frames no check proves: nvCOMP decodes them in a process of its own
    unproven = ("v3-zstd", "v3-gzip", "v3-blosc-zstd-shuffle")
    assert ("decoder process" in describe(spec, gpu)) == (layout in unproven)
    assert "CPU threads" not in describe(spec, gpu, "gpu")
    assert "CPU threads (decode='cpu')" in describe(spec, gpu, "cpu")
    options(nvcomp_c=False)  # nvCOMP's Python API alone: no decoder process
    kept = ("v3-zstd", "v3-blosc-zstd-shuffle")  # gzip's streams: nvCOMP in this process
    assert ("CPU threads (decode='auto')" in describe(spec, gpu)) == (layout in kept)
    assert "decoder process" not in describe(spec, gpu)


@pytest.mark.parametrize("kind", ["zstd", "gzip"])
@pytest.mark.parametrize("route", ["batch", "host", "share"])
def test_chunks_of_several_frames_or_members_read_as_zarr_reads_them(tmp_path, device, kind, route):
    """A zstd chunk of several frames, a gzip chunk of several members: valid, read by
    zarr-python; read the same by every route (the batched route's one-stream checks hand
    them to the host's decoder, which checks them all). Damage in the second one is caught."""
    import gzip as gz

    from numcodecs import zstd as nz

    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device
    from cupy_xarray.engine.route import Scheduler

    comp = [zarr.codecs.ZstdCodec()] if kind == "zstd" else [zarr.codecs.GzipCodec()]
    store = tmp_path / "s.zarr"
    data = np.arange(4096, dtype="float32")
    a = zarr.create_array(str(store), shape=(2, 4096), chunks=(1, 4096), dtype="float32", compressors=comp)
    a[:] = np.stack([data, data[::-1]])
    raw = data.tobytes()
    halves = (raw[:5000], raw[5000:])
    pack = (lambda b: nz.compress(b, 1, True)) if kind == "zstd" else gz.compress  # checksums
    chunk = store / "c" / "0" / "0"
    chunk.write_bytes(pack(halves[0]) + pack(halves[1]))
    want = zarr.open_array(str(store), mode="r")[...]
    np.testing.assert_array_equal(want[0], data)  # zarr-python reads it
    spec = array_spec(zarr.open_array(str(store), mode="r"))
    dev = resolve_device(device)
    (got,) = read_arrays([(spec, (slice(None), slice(None)))], dev, scheduler=Scheduler(force=route))
    np.testing.assert_array_equal(host(got), want)
    damaged = bytearray(pack(halves[0]) + pack(halves[1]))
    damaged[-6] ^= 0xFF  # inside the second frame's / member's checksum or body
    chunk.write_bytes(bytes(damaged))
    with pytest.raises(ChunkError, match=r"c/0/0"):
        read_arrays([(spec, (slice(None), slice(None)))], dev, scheduler=Scheduler(force=route))
