"""Untrusted stores: nothing outside the store root is opened, absurd metadata is refused."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host

import cupy_xarray
from cupy_xarray.containment import UnsafeStoreError
from cupy_xarray.errors import StoreError

_OPENED: list[str] = []


def _audit(event, args):
    if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it only records while a test looks


class Sentinel:
    """A file outside the store; proves it was never opened (audit hook and access time)."""

    def __init__(self, path):
        self.path = str(path)
        with open(self.path, "wb") as f:
            f.write(b"secret" * 100)
        old = time.time() - 3 * 86400
        os.utime(self.path, (old, old + 3600))  # atime < mtime: any read updates atime
        self.atime = os.stat(self.path).st_atime
        self.real = os.path.realpath(self.path)

    def __enter__(self):
        _OPENED.clear()
        return self

    def __exit__(self, *exc):
        opened = {os.path.realpath(p) for p in _OPENED if p}
        assert self.real not in opened, f"{self.path} was opened"
        assert os.stat(self.path).st_atime == self.atime, f"{self.path} was read"
        return False


def _write(path, fmt=3, consolidated=True, compressors="auto", shards=None):
    ds = xr.Dataset({"a": (("x", "y"), np.arange(64, dtype="float32").reshape(8, 8))})
    enc = {"a": {"chunks": (4, 4)}}
    if compressors != "auto":
        enc["a"]["compressors"] = compressors
    if shards:
        enc["a"]["shards"] = shards
    ds.to_zarr(path, zarr_format=fmt, consolidated=consolidated, encoding=enc)
    return ds


def _open(path, device, **kw):
    return xr.open_dataset(path, engine="kvikio", device=device, **kw)


def test_atime_detection_works(tmp_path):
    s = Sentinel(tmp_path / "probe")
    with open(s.path, "rb") as f:
        f.read()
    if os.stat(s.path).st_atime == s.atime:
        pytest.skip("this filesystem does not update access times (noatime)")


@pytest.mark.parametrize("fmt", [2, 3])
def test_consolidated_member_outside_root(tmp_path, device, fmt):
    store = tmp_path / "s.zarr"
    _write(store, fmt)
    meta_file = store / ("zarr.json" if fmt == 3 else ".zmetadata")
    doc = json.loads(meta_file.read_text())
    if fmt == 3:
        members = doc["consolidated_metadata"]["metadata"]
        members["../outside"] = members.pop("a")
    else:
        doc["metadata"] = {k.replace("a/", "../outside/"): v for k, v in doc["metadata"].items()}
    meta_file.write_text(json.dumps(doc))
    (tmp_path / "outside").mkdir()
    sentinel = Sentinel(tmp_path / "outside" / ("zarr.json" if fmt == 3 else ".zarray"))
    with sentinel, pytest.raises(UnsafeStoreError, match=r"consolidated member '\.\./outside"):
        _open(store, device)


@pytest.mark.parametrize("group", ["../other", "inner/../../other"])
def test_group_outside_root(tmp_path, device, group):
    store = tmp_path / "s.zarr"
    _write(store)
    _write(tmp_path / "other")
    sentinel = Sentinel(tmp_path / "other" / "secret")
    with sentinel, pytest.raises(UnsafeStoreError, match="group"):
        _open(store, device, group=group)


def test_linked_array_outside_root(tmp_path, device):
    store = tmp_path / "s.zarr"
    ref = _write(store, consolidated=False)
    elsewhere = tmp_path / "elsewhere.zarr"
    _write(elsewhere, consolidated=False)
    os.rename(store / "a", tmp_path / "a_moved")
    os.symlink(elsewhere / "a", store / "a")
    with (
        Sentinel(tmp_path / "sentinel"),
        pytest.raises(UnsafeStoreError, match="'a'.*outside the store root"),
    ):
        _open(store, device)
    # the option lets a trusted store's links through
    got = _open(store, device, allow_external_links=True).load()
    np.testing.assert_array_equal(host(got.a.data), ref.a.values)


def test_linked_metadata_file_outside_root(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store, consolidated=False)
    sentinel = Sentinel(tmp_path / "zarr.json")
    (store / "a" / "zarr.json").unlink()
    os.symlink(sentinel.path, store / "a" / "zarr.json")
    with sentinel, pytest.raises(UnsafeStoreError, match="metadata file 'a/zarr.json'"):
        _open(store, device)


@pytest.mark.parametrize(
    "compressors", [None, "auto", zarr.codecs.BloscCodec()], ids=["raw", "zstd", "blosc"]
)
def test_linked_chunk_outside_root(tmp_path, device, compressors):
    store = tmp_path / "s.zarr"
    _write(store, compressors=compressors)
    sentinel = Sentinel(tmp_path / "sentinel")
    chunk = store / "a" / "c" / "1" / "0"
    chunk.unlink()
    os.symlink(sentinel.path, chunk)
    ds = _open(store, device)  # lazy: nothing read yet
    with sentinel, pytest.raises(UnsafeStoreError, match="c/1/0.*outside the store root"):
        ds.a.load()
    ds = _open(store, device)
    if ds.a.encoding.get("compressors") and "Blosc" in repr(ds.a.encoding["compressors"]):
        return  # zarr-python reads this array: every link below it was checked before any read
    # reads that do not touch the linked chunk go on working
    np.testing.assert_array_equal(host(ds.a[:4].data), np.arange(32, dtype="float32").reshape(4, 8))


def test_linked_chunk_directory_outside_root(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store)
    outside = tmp_path / "outside_c"
    os.rename(store / "a" / "c" / "1", outside)
    os.symlink(outside, store / "a" / "c" / "1")
    sentinel = Sentinel(outside / "sentinel")
    with sentinel, pytest.raises(UnsafeStoreError, match="c/1/0.*outside the store root"):
        _open(store, device).a.load()


def test_linked_shard_outside_root(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store, shards=(8, 4))
    sentinel = Sentinel(tmp_path / "shard")
    shard = store / "a" / "c" / "0" / "1"
    os.rename(shard, sentinel.path)
    os.symlink(sentinel.path, shard)
    sentinel.atime = os.stat(sentinel.path).st_atime
    with sentinel, pytest.raises(UnsafeStoreError, match="c/0/1.*outside the store root"):
        _open(store, device).a.load()


def test_links_inside_root_are_fine(tmp_path, device):
    store = tmp_path / "s.zarr"
    ref = _write(store, consolidated=False)
    chunk = store / "a" / "c" / "1" / "0"
    os.rename(chunk, store / "a" / "moved_chunk")
    os.symlink(store / "a" / "moved_chunk", chunk)
    np.testing.assert_array_equal(host(_open(store, device).a.load().data), ref.a.values)


def _edit_array_meta(store, **changes):
    path = store / "a" / "zarr.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))
    (store / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))


def test_shape_that_overflows(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store)
    _edit_array_meta(store, shape=[2**40, 2**40])
    with pytest.raises(UnsafeStoreError, match=r"'a'.*overflows"):
        _open(store, device)


def test_chunk_of_billions_of_elements(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store)
    grid = {"name": "regular", "configuration": {"chunk_shape": [100_000, 100_000]}}
    _edit_array_meta(store, shape=[100_000, 100_000], chunk_grid=grid)
    with pytest.raises(UnsafeStoreError, match=r"'a'.*chunk shape \(100000, 100000\).*CUPY_XARRAY_MAX_CHUNK"):
        _open(store, device)


def test_shard_claiming_too_many_chunks(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store, shards=(8, 4))
    meta = json.loads((store / "a" / "zarr.json").read_text())
    meta["shape"] = [2**20, 2**20]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [2**20, 2**20]
    meta["codecs"][0]["configuration"]["chunk_shape"] = [1, 1]
    _edit_array_meta(store, **meta)
    with pytest.raises(UnsafeStoreError, match=r"'a'.*inner chunks per shard"):
        _open(store, device)


def test_shard_index_bigger_than_file_is_refused_before_allocating(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store, shards=(8, 4))
    meta = json.loads((store / "a" / "zarr.json").read_text())
    meta["shape"] = [4096, 4096]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [4096, 4096]
    meta["codecs"][0]["configuration"]["chunk_shape"] = [1, 1]
    _edit_array_meta(store, **meta)
    os.rename(store / "a" / "c" / "0" / "0", store / "a" / "c" / "keep")
    (store / "a" / "c" / "0" / "1").unlink()
    os.rename(store / "a" / "c" / "keep", store / "a" / "c" / "0" / "0")
    with pytest.raises(cupy_xarray.errors.ChunkError, match="shorter than its .*index"):
        _open(store, device).a[:2, :2].load()


def test_read_zarr_gds_refuses_too(tmp_path, device):
    store = tmp_path / "s.zarr"
    _write(store)
    with pytest.raises(UnsafeStoreError):
        cupy_xarray.read_zarr_gds(store, device=device, group="../x")
    assert issubclass(UnsafeStoreError, StoreError)


@pytest.mark.parametrize("fmt", [2, 3])
def test_chunk_key_separator_outside_the_spec(tmp_path, device, fmt):
    store = tmp_path / "s.zarr"
    _write(store, fmt, consolidated=False)
    meta_path = store / "a" / ("zarr.json" if fmt == 3 else ".zarray")
    meta = json.loads(meta_path.read_text())
    if fmt == 3:
        meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/../"}}
    else:
        meta["dimension_separator"] = "/../"
    meta_path.write_text(json.dumps(meta))
    with Sentinel(tmp_path / "sentinel"), pytest.raises(StoreError, match=r"separator") as info:
        _open(store, device).a.load()
    assert "s.zarr" in str(info.value)


def test_arrays_zarr_python_reads_check_the_chunks_they_touch(tmp_path, device, monkeypatch):
    """bz2 is read by zarr-python: a linked chunk outside the root is refused before the read,
    reads that do not touch it work, and no read walks the whole array (dask tasks would)."""
    import numcodecs

    from cupy_xarray.containment import Containment

    store = tmp_path / "s.zarr"
    _write(store, fmt=2, compressors=numcodecs.BZ2())
    sentinel = Sentinel(tmp_path / "sentinel")
    chunk = store / "a" / "1.0"
    chunk.unlink()
    os.symlink(sentinel.path, chunk)

    def walk(*args):
        raise AssertionError("check_tree walked the whole array")

    monkeypatch.setattr(Containment, "check_tree", walk)
    with sentinel, pytest.raises(UnsafeStoreError, match=r"1\.0.*outside the store root"):
        _open(store, device).a.load()
    with sentinel, pytest.raises(UnsafeStoreError, match=r"1\.0.*outside the store root"):
        _open(store, device, chunks={}).a[5:].compute()
    expected = np.arange(32, dtype="float32").reshape(4, 8)
    np.testing.assert_array_equal(host(_open(store, device).a[:4].data), expected)
    np.testing.assert_array_equal(host(_open(store, device, chunks={}).a[:4].compute().data), expected)


def _store_forms():
    return {
        "str": lambda p: str(p),
        "Path": lambda p: p,
        "file-url": lambda p: p.as_uri(),
        "LocalStore": lambda p: zarr.storage.LocalStore(str(p), read_only=True),
        "local-url": lambda p: "local://" + str(p),
        "simplecache": lambda p: "simplecache::" + p.as_uri(),
        "FsspecStore": lambda p: zarr.storage.FsspecStore.from_url(p.as_uri(), read_only=True),
    }


@pytest.mark.parametrize("form", list(_store_forms()))
@pytest.mark.parametrize("read", ["eager", "lazy", "dask"])
@pytest.mark.parametrize("compressors", ["auto", "bz2"], ids=["engine", "zarr-python"])
def test_every_store_form_keeps_reads_inside_the_root(tmp_path, device, form, read, compressors):
    """A path, a Path, a file:// URL and a LocalStore object get the same containment, on the
    engine's reads and on the arrays handed to zarr-python, eager, lazy and with dask."""
    import numcodecs

    store = tmp_path / "s.zarr"
    if compressors == "bz2":
        _write(store, fmt=2, compressors=numcodecs.BZ2())
        chunk = store / "a" / "1.0"
    else:
        _write(store)
        chunk = store / "a" / "c" / "1" / "0"
    sentinel = Sentinel(tmp_path / "sentinel")
    chunk.unlink()
    os.symlink(sentinel.path, chunk)
    target = _store_forms()[form](store)
    with sentinel, pytest.raises(UnsafeStoreError, match="outside the store root"):
        if read == "eager":
            cupy_xarray.read_zarr_gds(target, device=device)
        elif read == "lazy":
            _open(target, device).a.load()
        else:
            _open(target, device, chunks={}).a.compute()
    # the same store with the links allowed reads the outside file's bytes (as zarr-python would)
    if compressors == "auto" and read == "lazy":
        with pytest.raises(cupy_xarray.errors.ChunkError):  # "secret..." is not a zstd frame
            _open(target, device, allow_external_links=True).a.load()


def test_read_zarr_gds_chunked_keeps_its_options(tmp_path, device):
    """read_zarr_gds(chunks=...) keeps allow_external_links and batch_bytes, refuses progress."""
    from cupy_xarray.xarray.backend import KvikioBackendArray
    from cupy_xarray.xarray.cf import find_backend_array

    store = tmp_path / "s.zarr"
    _write(store)
    sentinel = Sentinel(tmp_path / "sentinel")
    chunk = store / "a" / "c" / "1" / "0"
    chunk.unlink()
    os.symlink(sentinel.path, chunk)
    with sentinel, pytest.raises(UnsafeStoreError, match="outside the store root"):
        cupy_xarray.read_zarr_gds(store, device=device, chunks={}).a.compute()
    with pytest.raises(cupy_xarray.errors.ChunkError, match="c/1/0"):
        cupy_xarray.read_zarr_gds(store, device=device, chunks={}, allow_external_links=True).a.compute()
    with pytest.raises(ValueError, match="dask's progress bar"):
        cupy_xarray.read_zarr_gds(store, device=device, chunks={}, progress=True)
    ds = cupy_xarray.read_zarr_gds(store, device=device, chunks={}, batch_bytes=12345)
    lazy = _open(store, device, batch_bytes=12345)
    assert find_backend_array(lazy.a.variable._data, KvikioBackendArray).reads.batch_bytes == 12345
    assert ds.a.chunks is not None
    with pytest.raises(ValueError, match="batch_bytes must be a positive"):
        _open(store, device, batch_bytes=0)


def test_directories_are_checked_once_while_open_chunk_files_every_read(tmp_path, device, monkeypatch):
    """An open dataset checks a chunk directory for links once; the chunk files are looked at
    on every read, so a chunk replaced by a link to outside the root after the first read is
    still refused (and a fresh open checks the directories again)."""
    from cupy_xarray import containment

    store = tmp_path / "s.zarr"
    ref = _write(store, compressors=None)
    ds = xr.open_dataset(store, engine="kvikio", device=device, cache=False)
    seen: list[str] = []
    real_lstat = os.lstat

    def counting(path, *args, **kw):
        seen.append(os.fspath(path))
        return real_lstat(path, *args, **kw)

    monkeypatch.setattr(containment.os, "lstat", counting)
    np.testing.assert_array_equal(host(ds.a[:4, :4].data), ref.a.values[:4, :4])
    first = list(seen)
    chunk_dir = str(store / "a" / "c" / "0")
    assert chunk_dir in first and str(store / "a" / "c" / "0" / "0") in first
    seen.clear()
    np.testing.assert_array_equal(host(ds.a[:4, :4].data), ref.a.values[:4, :4])
    assert seen == [str(store / "a" / "c" / "0" / "0")], seen  # the chunk file alone
    sentinel = Sentinel(tmp_path / "sentinel")
    chunk = store / "a" / "c" / "0" / "0"
    chunk.unlink()
    os.symlink(sentinel.path, chunk)
    with sentinel, pytest.raises(UnsafeStoreError, match="c/0/0.*outside the store root"):
        ds.a[:4, :4].load()
    seen.clear()
    with sentinel, pytest.raises(UnsafeStoreError, match="c/0/0.*outside the store root"):
        _open(store, device).a.load()
    assert chunk_dir in seen  # a new open walks the directories again


# -- hostile stores, second round ------------------------------------------------------------

#: every way a user reads array ``a`` of a store: each must meet the same checks
READS = {
    "eager": lambda t, d: cupy_xarray.read_zarr_gds(t, device=d),
    "lazy": lambda t, d: _open(t, d).a.load(),
    "dask": lambda t, d: _open(t, d, chunks={}).a.compute(),
    "tree": lambda t, d: xr.open_datatree(t, engine="kvikio", device=d).load(),
}


def _half_empty_index(store, field):
    """Damage the first inner chunk's shard index entry: only its ``field`` (0 offset, 1
    length) becomes 2**64-1, the index's crc32c recomputed so that only the entry is wrong."""
    import google_crc32c

    shard = store / "a" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    n = 2 * 2 * 16 + 4  # 2 x 2 inner chunks, (offset, length) each, then the crc32c
    index = np.frombuffer(bytes(raw[-n:-4]), "<u8").copy()
    index[field] = np.uint64(2**64 - 1)
    body = index.tobytes()
    raw[-n:] = body + google_crc32c.value(body).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # zarr's own check of the entry
@pytest.mark.parametrize("field", [0, 1], ids=["offset", "length"])
@pytest.mark.parametrize("where", ["local", "http"])
@pytest.mark.parametrize("read", list(READS))
def test_half_empty_shard_index_entry_is_an_error_not_fill(tmp_path, device, field, where, read):
    """The spec marks an empty inner chunk with both fields 2**64-1: one alone is damage."""
    from loopback import HTTPStores

    from cupy_xarray.errors import ChunkError

    store = tmp_path / "s.zarr"
    _write(store, compressors=None, shards=(8, 8))
    _half_empty_index(store, field)
    with pytest.raises(Exception) as zarr_says:  # zarr-python refuses it too
        xr.open_dataset(store, engine="zarr").a.load()
    del zarr_says
    with HTTPStores(tmp_path) as server:
        url = f"{server.url}/s.zarr" if where == "http" else store
        with pytest.raises(ChunkError, match=r"half empty.*corrupt shard") as info:
            READS[read](url, device)
    assert info.value.chunk == "c/0/0" and info.value.array == "a"


@pytest.mark.parametrize("read", list(READS))
def test_chunk_swapped_for_a_link_after_its_check_is_refused(tmp_path, device, monkeypatch, read):
    """Check, then open by name: a chunk swapped for a link out of the root between the two is
    caught at the open (what was opened is checked)."""
    from cupy_xarray.containment import Containment

    store = tmp_path / "s.zarr"
    _write(store, compressors=None)
    outside = Sentinel(tmp_path / "secret")
    real = Containment.stat_chunk

    def check_then_swap(self, path, key, checked, base=""):
        st = real(self, path, key, checked, base)
        if key == "c/1/1":
            os.unlink(path)
            os.symlink(outside.path, path)
        return st

    monkeypatch.setattr(Containment, "stat_chunk", check_then_swap)
    with pytest.raises(UnsafeStoreError, match=r"'c/1/1' .*outside the store root"):
        READS[read](store, device)
    # (its name was tried without following the link: the audit hook sees that attempt)
    assert os.stat(outside.path).st_atime == outside.atime, "the outside file was read"


@pytest.mark.parametrize("what", ["chunk", "shard", "array metadata", "group metadata"])
@pytest.mark.parametrize("read", list(READS))
def test_fifo_in_a_store_is_refused_not_waited_on(tmp_path, device, what, read):
    store = tmp_path / "s.zarr"
    _write(store, compressors=None, shards=(8, 8) if what == "shard" else None, consolidated=False)
    path = {
        "chunk": store / "a" / "c" / "0" / "0",
        "shard": store / "a" / "c" / "0" / "0",
        "array metadata": store / "a" / "zarr.json",
        "group metadata": store / "zarr.json",
    }[what]
    path.unlink()
    os.mkfifo(path)
    t0 = time.monotonic()
    with pytest.raises((StoreError, cupy_xarray.errors.ChunkError), match="FIFO"):
        READS[read](store, device)
    assert time.monotonic() - t0 < 30


def test_huge_array_metadata_is_refused_before_parsing(tmp_path, device):
    from cupy_xarray.containment import MAX_METADATA_BYTES

    store = tmp_path / "s.zarr"
    _write(store, consolidated=False)
    with open(store / "a" / "zarr.json", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: costs nothing on disk
    with pytest.raises(UnsafeStoreError, match=r"'a/zarr.json'.*more than"):
        _open(store, device, consolidated=False)


def test_large_cpu_decode_buffers_are_not_kept_by_threads(options):
    from cupy_xarray.runtime import buffers

    options(kept_buffer_bytes=2**20)
    small = buffers.thread_buffer("probe", 2**19)
    assert getattr(buffers._local, "probe", None) is not None and len(small) == 2**19
    big = buffers.thread_buffer("probe-big", 2**21)
    assert len(big) == 2**21 and getattr(buffers._local, "probe-big", None) is None
