"""Stores written while they are read: a chunk file replaced (zarr-python writes a temporary
file and renames it over the chunk) between a read's plan and its reads is read again from the
new file, not reported as damage; damage in place is still damage."""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import host, run_in_threads

from cupy_xarray import record_reads
from cupy_xarray.engine import reader
from cupy_xarray.errors import ChunkChangedError, ChunkError

SHAPE, CHUNKS = (8, 64, 64), (1, 64, 64)


def _versions(tmp_path, shards=None):
    """Two stores alike but for their values (chunk files of different sizes), and a third,
    the one read, starting as a copy of the first."""
    rng = np.random.default_rng(0)
    a = np.zeros(SHAPE, "float32") + np.arange(SHAPE[0], dtype="float32")[:, None, None]
    b = rng.standard_normal(SHAPE).astype("float32")  # compresses far worse: other sizes
    paths = []
    for name, data in (("a", a), ("b", b)):
        p = tmp_path / f"{name}.zarr"
        enc = {"chunks": CHUNKS, "compressors": zarr.codecs.ZstdCodec(level=1)}
        if shards:
            enc["shards"] = shards
        xr.Dataset({"v": (("t", "y", "x"), data)}).to_zarr(
            p, zarr_format=3, consolidated=False, encoding={"v": enc}
        )
        paths.append(p)
    live = tmp_path / "live.zarr"
    shutil.copytree(paths[0], live)
    return a, b, paths[0], paths[1], live


def _files(store):
    root = store / "v" / "c"
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _replace(src_store, live, rel, tag="tmp"):
    """Write ``rel`` of ``src_store`` into ``live`` the way zarr-python does: a temporary file,
    renamed over the chunk."""
    dst = live / "v" / "c" / rel
    tmp = dst.with_name(f".{dst.name}.{tag}.partial")
    shutil.copyfile(src_store / "v" / "c" / rel, tmp)
    os.replace(tmp, dst)


@pytest.mark.parametrize("shards", [None, (4, 64, 64)], ids=["chunks", "shards"])
def test_a_chunk_replaced_after_the_plan_is_read_again(tmp_path, device, monkeypatch, shards):
    a, b, _, store_b, live = _versions(tmp_path, shards)
    planned = reader.locate
    calls = []

    def locate_then_write(*args, **kwargs):
        found = planned(*args, **kwargs)
        if not calls:  # a writer replaces the first chunk (or shard) between plan and read
            _replace(store_b, live, _files(live)[0])
        calls.append(1)
        return found

    monkeypatch.setattr(reader, "locate", locate_then_write)
    ds = xr.open_dataset(live, engine="kvikio", device=device, consolidated=False)
    with record_reads() as reports:
        got = host(ds.v.data)
    assert len(calls) == 2  # planned again once
    first = shards[0] if shards else 1  # the rows of the file replaced
    expected = a.copy()
    expected[:first] = b[:first]
    np.testing.assert_array_equal(got, expected)
    assert any("replaced by a writer" in n for n in reports[-1].notes)


def test_a_store_that_keeps_changing_raises_after_some_tries(tmp_path, device, monkeypatch):
    _, _, store_a, store_b, live = _versions(tmp_path)
    planned = reader.locate
    flip = [store_a, store_b]

    def locate_then_write(*args, **kwargs):
        found = planned(*args, **kwargs)
        flip.reverse()
        _replace(flip[0], live, _files(live)[0])
        return found

    monkeypatch.setattr(reader, "locate", locate_then_write)
    ds = xr.open_dataset(live, engine="kvikio", device=device, consolidated=False)
    with pytest.raises(ChunkChangedError, match=r"c/0/0/0.*replaced after the read was planned"):
        ds.v.load()


def test_a_chunk_truncated_in_place_is_damage(tmp_path, device, monkeypatch):
    _, _, _, _, live = _versions(tmp_path)
    planned = reader.locate

    def locate_then_truncate(*args, **kwargs):
        found = planned(*args, **kwargs)
        with open(live / "v" / "c" / _files(live)[0], "r+b") as f:  # the same file, cut short
            f.truncate(10)
        return found

    monkeypatch.setattr(reader, "locate", locate_then_truncate)
    ds = xr.open_dataset(live, engine="kvikio", device=device, consolidated=False)
    with pytest.raises(ChunkError, match="truncated") as info:
        ds.v.load()
    assert not isinstance(info.value, ChunkChangedError)


@pytest.mark.parametrize("shards", [None, (4, 64, 64)], ids=["chunks", "shards"])
def test_readers_beside_a_renaming_writer_see_whole_chunks(tmp_path, device, shards):
    a, b, store_a, store_b, live = _versions(tmp_path, shards)
    files = _files(live)
    stop = threading.Event()
    rows = shards[0] if shards else 1

    def write():
        k = 0
        while not stop.is_set():
            src = store_b if k % 2 else store_a
            for rel in files:
                _replace(src, live, rel, tag=str(k))
                time.sleep(0.002)  # a writer that also computes; each file rewritten every few ms
            k += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:

        def read(_):
            ds = xr.open_dataset(live, engine="kvikio", device=device, consolidated=False)
            for _ in range(15):
                got = host(ds.v.data)
                for i in range(0, SHAPE[0], rows):  # each chunk (shard) whole, from one version
                    part = got[i : i + rows]
                    assert np.array_equal(part, a[i : i + rows]) or np.array_equal(part, b[i : i + rows])

        errors = run_in_threads(read, 4)
    finally:
        stop.set()
        writer.join()
    assert errors == []
