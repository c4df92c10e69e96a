"""Stores in object storage: HTTP and S3 servers on loopback, read by the engine and compared
with engine="zarr" reading the same server; the failures a network brings."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pytest
import xarray as xr
import zarr
from conftest import expected_type, host, module_of, run_in_threads
from loopback import HTTPStores, S3Stores

import cupy_xarray
from cupy_xarray import get_options
from cupy_xarray.containment import UnsafeStoreError
from cupy_xarray.engine import remote
from cupy_xarray.engine import waves as waves_module
from cupy_xarray.engine.route import lands_pinned
from cupy_xarray.errors import ChunkError, StoreError

pytest.importorskip("aiohttp")


def _data(seed: int = 0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    smooth = np.cumsum(rng.normal(size=(24, 40, 36)), axis=2).astype("float32")
    return xr.Dataset(
        {
            "tiles": (("t", "y", "x"), smooth, {"units": "K"}),
            "zstd": (("t", "y", "x"), smooth * 2),
            "blosc": (("t", "y", "x"), smooth + 1),
            "gzip": (("t", "y", "x"), rng.integers(0, 50, smooth.shape).astype("int16")),
            "sharded": (("t", "y", "x"), smooth - 1),
            "sharded_start": (("t", "y", "x"), (smooth * 3).astype("float64")),
        },
        coords={"t": np.arange(24), "y": np.linspace(0, 1, 40), "x": np.arange(36) * 0.5},
        attrs={"title": "remote"},
    )


_ENC = {
    "tiles": {"chunks": (4, 16, 12), "compressors": None},
    "zstd": {"chunks": (4, 16, 12), "compressors": [zarr.codecs.ZstdCodec(level=1)]},
    "blosc": {"chunks": (6, 20, 36), "compressors": [zarr.codecs.BloscCodec(cname="lz4", shuffle="shuffle")]},
    "gzip": {"chunks": (8, 40, 18), "compressors": [zarr.codecs.GzipCodec()]},
    "sharded": {"chunks": (2, 10, 12), "shards": (8, 20, 36), "compressors": [zarr.codecs.ZstdCodec()]},
    "sharded_start": {
        "chunks": (4, 10, 9),
        "shards": (8, 40, 36),
        "serializer": zarr.codecs.ShardingCodec(
            chunk_shape=(4, 10, 9),
            codecs=[zarr.codecs.BytesCodec(), zarr.codecs.Crc32cCodec()],
            index_location="start",
        ),
    },
}


def _write(root) -> str:
    store = os.path.join(root, "s.zarr")
    ds = _data()
    enc = {k: dict(v) for k, v in _ENC.items()}
    serializer = enc["sharded_start"].pop("serializer")
    enc["sharded_start"].pop("shards")
    enc["sharded_start"].pop("chunks")
    ds.drop_vars("sharded_start").to_zarr(
        store,
        zarr_format=3,
        consolidated=True,
        encoding={k: v for k, v in enc.items() if k != "sharded_start"},
    )
    group = zarr.open_group(store, mode="a")
    a = group.create_array(
        "sharded_start",
        shape=(24, 40, 36),
        dtype="f8",
        chunks=(8, 40, 36),
        serializer=serializer,
        compressors=None,
        dimension_names=("t", "y", "x"),
    )
    a[:] = ds.sharded_start.values
    _data(1)[["tiles"]].to_zarr(store, group="child", zarr_format=3, consolidated=True, mode="a")
    zarr.consolidate_metadata(store)
    return store


@pytest.fixture(scope="module")
def local_store(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("remote"))


@pytest.fixture(scope="module")
def http(local_store):
    with HTTPStores(os.path.dirname(local_store)) as server:
        yield server


@pytest.fixture(scope="module")
def s3(local_store):
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    with S3Stores() as server:
        server.url = server.put(local_store, "s.zarr")
        yield server


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch, options):
    options(remote_backoff=0.01)


def _check_same(url, device, **options):
    want = xr.open_dataset(url, engine="zarr", **options).load()
    lazy = xr.open_dataset(url, engine="kvikio", device=device, **options)
    for name in lazy.data_vars:
        spec = lazy[name].variable._data
        while not hasattr(spec, "spec"):
            spec = getattr(spec, "array", None)
        assert spec.spec.source is not None and spec.spec.fallback is None, name  # the engine's own reads
    got = lazy.load()
    assert module_of(got.tiles.data) == expected_type(device)
    xr.testing.assert_identical(got.cupy.as_numpy(), want)
    sel = dict(t=slice(3, 17), y=[0, 7, 31], x=slice(5, 30, 3))
    xr.testing.assert_identical(
        lazy.isel(sel).load().cupy.as_numpy(), xr.open_dataset(url, engine="zarr", **options).isel(sel).load()
    )
    chunked = xr.open_dataset(url, engine="kvikio", device=device, chunks={}, **options)
    xr.testing.assert_identical(chunked.compute().cupy.as_numpy(), want)
    xr.testing.assert_identical(
        cupy_xarray.read_zarr_gds(url, device=device, **options).cupy.as_numpy(), want
    )
    tree = xr.open_datatree(url, engine="kvikio", device=device, **options).load()
    xr.testing.assert_identical(tree.cupy.as_numpy(), xr.open_datatree(url, engine="zarr", **options).load())


def test_http_store_identical_to_zarr(http, device):
    _check_same(f"{http.url}/s.zarr", device)


def test_http_store_through_the_stores_own_client(http, monkeypatch, device, options):
    """Plain HTTP(S) stores are fetched on threads; with that off, through fsspec's client."""
    from cupy_xarray.engine.http import HTTPFetcher

    url = f"{http.url}/s.zarr"
    ds = xr.open_dataset(url, engine="kvikio", device=device)
    assert isinstance(ds.zstd.variable._data.array.array.array.spec.source.http(get_options()), HTTPFetcher)
    options(threaded_http=False)
    ds = xr.open_dataset(url, engine="kvikio", device=device)
    assert ds.zstd.variable._data.array.array.array.spec.source.http(get_options()) is None
    xr.testing.assert_identical(ds.load().cupy.as_numpy(), xr.open_dataset(url, engine="zarr").load())
    # options only fsspec's client knows keep its fetches
    opts = {"client_kwargs": {"trust_env": False}}
    ds = xr.open_dataset(url, engine="kvikio", device=device, storage_options=opts)
    options(threaded_http=True)
    ds = xr.open_dataset(url, engine="kvikio", device=device, storage_options=opts)
    assert ds.zstd.variable._data.array.array.array.spec.source.http(get_options()) is None
    xr.testing.assert_identical(ds.load().cupy.as_numpy(), xr.open_dataset(url, engine="zarr").load())


def test_s3_store_identical_to_zarr(s3, device):
    _check_same(s3.url, device, storage_options=s3.options)


def test_s3_credentials_and_endpoint_from_the_environment(s3, monkeypatch, device):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    got = xr.open_dataset(s3.url, engine="kvikio", device=device).load()
    want = xr.open_dataset(s3.url, engine="zarr", storage_options=s3.options).load()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)


def test_s3_anonymous_access(s3, local_store, device):
    url = s3.put(local_store, "public.zarr", public=True, private=("zstd/c/0/0/1",))
    options = {"endpoint_url": s3.endpoint, "anon": True}
    ds = xr.open_dataset(url, engine="kvikio", device=device, storage_options=options)
    want = xr.open_dataset(url, engine="zarr", storage_options=s3.options).load()
    xr.testing.assert_identical(ds.tiles.load().cupy.as_numpy(), want.tiles)
    # one object the anonymous user may not read: named, with the fix
    with pytest.raises(
        ChunkError, match=r"zstd.*c/0/0/1.*public.zarr/zstd/c/0/0/1.*access denied.*credentials"
    ):
        ds.zstd.load()


def test_s3_private_store_without_credentials(s3):
    with pytest.raises(StoreError, match=r"s3://data/s.zarr.*access denied.*credentials"):
        xr.open_dataset(
            s3.url, engine="kvikio", device="cpu", storage_options={"endpoint_url": s3.endpoint, "anon": True}
        )


def test_zarr_store_objects(http, device):
    from zarr.storage import FsspecStore

    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr").load()
    store = FsspecStore.from_url(url, read_only=True)
    xr.testing.assert_identical(
        xr.open_dataset(store, engine="kvikio", device=device).load().cupy.as_numpy(), want
    )
    obstore = pytest.importorskip("obstore")
    from zarr.storage import ObjectStore

    obj = ObjectStore(
        obstore.store.HTTPStore.from_url(url, client_options={"allow_http": True}), read_only=True
    )
    xr.testing.assert_identical(
        xr.open_dataset(obj, engine="kvikio", device=device).load().cupy.as_numpy(), want
    )


def test_sharded_reads_fetch_the_index_then_coalesced_ranges(http):
    url = f"{http.url}/s.zarr"
    ds = xr.open_dataset(url, engine="kvikio", device="cpu")
    want = xr.open_dataset(url, engine="zarr").sharded.isel(t=slice(0, 8), y=slice(0, 20)).load()
    del http.requests[:]
    got = ds.sharded.isel(t=slice(0, 8), y=slice(0, 20)).load()
    xr.testing.assert_identical(got, want)
    # the index (the shard's last bytes), then one range for the 12 inner chunks side by side
    assert [(r[0], r[1]) for r in http.requests] == [("GET", "/s.zarr/sharded/c/0/0/0")] * 2, http.requests
    index, chunks = (r[2] for r in http.requests)
    assert index.startswith("bytes=-") and chunks.startswith("bytes=0-"), http.requests


def test_missing_objects_read_as_fill_value(tmp_path, device):
    store = _write(tmp_path)
    os.remove(os.path.join(store, "zstd", "c", "1", "0", "0"))
    os.remove(os.path.join(store, "sharded", "c", "1", "0", "0"))
    with HTTPStores(tmp_path) as server:
        url = f"{server.url}/s.zarr"
        got = xr.open_dataset(url, engine="kvikio", device=device)[["zstd", "sharded"]].load()
        want = xr.open_dataset(url, engine="zarr")[["zstd", "sharded"]].load()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)


@pytest.mark.parametrize("fault", ["503", "500", "429", "reset", "short"])
def test_transient_failures_are_retried(http, device, fault):
    faults = {"/zstd/c/0/0/0": [fault, fault], "/sharded/c/0/0/0": [fault, fault, None, fault]}
    _identical_despite(http, device, ["zstd", "sharded"], faults)  # sharded: the index, then the chunks
    assert sum(r[1].endswith("/zstd/c/0/0/0") for r in http.requests) == 3


def test_redirects_are_followed(http, device):
    faults = {"/tiles/c/1/1/1": ["redirect"], "/sharded/c/1/1/0": ["redirect", "redirect"]}
    _identical_despite(http, device, ["tiles", "sharded"], faults)
    assert sum(r[1].endswith("/tiles/c/1/1/1") for r in http.requests) == 2


def _identical_despite(http, device, names, faults):
    """Load ``names`` while the server has ``faults``: identical to engine="zarr"'s read."""
    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr")[names].load()
    ds = xr.open_dataset(url, engine="kvikio", device=device)[names]
    http.faults.update(faults)
    del http.requests[:]
    try:
        got = ds.load()
    finally:
        http.faults.clear()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)


def test_headers_are_sent_but_not_to_another_host(local_store, device):
    """storage_options headers reach the store's server; a redirect to another host gets none."""
    root = os.path.dirname(local_store)
    with HTTPStores(root) as home, HTTPStores(root) as elsewhere:
        url = f"{home.url}/s.zarr"
        options = {"headers": {"Authorization": "Bearer abc"}}
        want = xr.open_dataset(url, engine="zarr").zstd.load()
        ds = xr.open_dataset(url, engine="kvikio", device=device, storage_options=options)
        home.redirect_to = elsewhere.url
        home.faults["/zstd/c/1/1/1"] = ["redirect"]
        del home.requests[:]
        xr.testing.assert_identical(ds.zstd.load().cupy.as_numpy(), want)
        assert home.requests and all(r[3] == "Bearer abc" for r in home.requests)
        moved = [r for r in elsewhere.requests if r[1].endswith("/zstd/c/1/1/1")]
        assert len(moved) == 1 and moved[0][3] is None


_HTTPS_CHILD = """
import sys, xarray as xr, cupy_xarray
url, device = sys.argv[1], sys.argv[2]
ds = xr.open_dataset(url, engine="kvikio", device=device)
assert ds.zstd.variable._data.array.array.array.spec.source.http is not None  # the threaded fetcher
xr.testing.assert_identical(ds.load().cupy.as_numpy(), xr.open_dataset(url, engine="zarr").load())
print("identical")
"""


def test_https_with_the_systems_certificates(local_store, tmp_path, device):
    """HTTPS: a certificate the system does not trust is refused with a clear error; one it
    trusts (SSL_CERT_FILE, read when a process starts) reads identically, through the threads."""
    import subprocess
    import sys

    pytest.importorskip("cryptography")
    from loopback import self_signed

    cert, key = self_signed(tmp_path)
    with HTTPStores(os.path.dirname(local_store), tls=(cert, key)) as server:
        url = f"{server.url}/s.zarr"
        with pytest.raises(StoreError, match="certificate verify failed"):
            xr.open_dataset(url, engine="kvikio", device=device)
        env = dict(os.environ, SSL_CERT_FILE=cert, PYTHONWARNINGS="ignore")
        done = subprocess.run(
            [sys.executable, "-c", _HTTPS_CHILD, url, device],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0 and "identical" in done.stdout, done.stderr[-2000:]


def test_connections_the_server_closed_are_replaced_at_once(http, monkeypatch, options):
    """A kept-alive connection the server has closed costs a new connection, not a retry."""
    import time

    options(remote_backoff=2.0)  # a retry would show
    options(remote_retries=0)
    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr").tiles.load()
    ds = xr.open_dataset(url, engine="kvikio", device="cpu", cache=False)
    xr.testing.assert_identical(ds.tiles.compute(), want)
    for key in ("c/0/0/0", "c/0/0/1", "c/0/0/2", "c/0/1/0", "c/1/0/0"):
        http.faults[f"/tiles/{key}"] = ["close-after"]
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            xr.testing.assert_identical(ds.tiles.compute(), want)
            assert time.perf_counter() - t0 < 1.0
    finally:
        http.faults.clear()


def test_a_persistent_failure_names_the_object(http, monkeypatch, options):
    url = f"{http.url}/s.zarr"
    ds = xr.open_dataset(url, engine="kvikio", device="cpu")
    http.faults["/zstd/c/0/1/2"] = ["503"] * 20
    del http.requests[:]
    try:
        with pytest.raises(ChunkError, match=r"zstd.*c/0/1/2.*s\.zarr/zstd/c/0/1/2.*failed 5 times.*503"):
            ds.zstd.load()
    finally:
        http.faults.clear()
    assert sum(r[1].endswith("/zstd/c/0/1/2") for r in http.requests) == get_options().remote_retries + 1


def test_a_server_that_ignores_range_still_serves_shards(http, device, options):
    """A server that answers a Range request with the whole object (200), as
    ``python -m http.server`` does: the shard is read whole, within its bound, and the index
    and the inner chunks cut from it (the threaded fetcher knows the answer is whole)."""
    url = f"{http.url}/s.zarr"
    options(threaded_http=True)
    want = xr.open_dataset(url, engine="zarr").sharded.load()
    ds = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
    http.faults["/sharded/c/1/0/0"] = ["ignore-range"] * 8
    try:
        xr.testing.assert_identical(ds.sharded.load().cupy.as_numpy(), want)
        xr.testing.assert_identical(
            ds.sharded.isel(t=slice(9, 12)).load().cupy.as_numpy(), want.isel(t=slice(9, 12))
        )
    finally:
        http.faults.clear()


def test_a_coalesced_range_cut_short_names_the_chunk_it_lacks(tmp_path, options):
    """A shard cut short in its middle: the coalesced request's error names the first inner
    chunk the answer does not hold, not the first of the request."""
    from loopback import HTTPStores

    store = tmp_path / "s.zarr"
    a = zarr.create_array(
        store, name="v", shape=(64,), chunks=(8,), shards=(64,), dtype="f4", compressors=None,
        dimension_names=["x"],
    )  # fmt: skip
    a[:] = np.arange(64, dtype="f4")
    zarr.consolidate_metadata(store)
    shard = store / "v" / "c" / "0"
    raw = shard.read_bytes()
    index = np.frombuffer(raw[-(8 * 16 + 4) : -4], "<u8").reshape(8, 2)
    cut = int(index[1, 0]) + 4  # inside inner chunk 1: with the index after it, the file
    index_copy = raw[-(8 * 16 + 4) :]  # ends inside inner chunk 5 (every chunk is 32 bytes)
    shard.write_bytes(raw[:cut] + index_copy)  # the index still points past the file's end
    options(threaded_http=False)
    with HTTPStores(tmp_path) as server:
        ds = xr.open_dataset(f"{server.url}/s.zarr", engine="kvikio", device="cpu", cache=False)
        with pytest.raises(ChunkError) as info:
            ds.v.load()
    assert info.value.chunk == "c/0[inner 5]", str(info.value)  # the first it lacks, not inner 0


def test_a_range_the_server_ignores_is_never_used(http, options):
    """Through the store's own fetches (which cannot tell a whole answer from a wrong one):
    a clear error, not retried."""
    url = f"{http.url}/s.zarr"
    options(threaded_http=False)
    ds = xr.open_dataset(url, engine="kvikio", device="cpu")
    http.faults["/sharded/c/1/0/0"] = ["ignore-range"]
    del http.requests[:]
    try:
        with pytest.raises(
            ChunkError, match=r"sharded.*c/1/0/0.*asked the server for the last \d+ bytes.*got \d+"
        ):
            ds.sharded.load()
    finally:
        http.faults.clear()
    assert (
        sum(r[1].endswith("/sharded/c/1/0/0") for r in http.requests) == 1
    )  # the same every time: not retried


def test_timeouts_are_retried_then_named(http, monkeypatch, options):
    url = f"{http.url}/s.zarr"
    options(remote_timeout=0.3)
    options(remote_retries=1)
    http.stall_s = 1.0
    ds = xr.open_dataset(url, engine="kvikio", device="cpu", cache=False)
    want = xr.open_dataset(url, engine="zarr").tiles.load()
    http.faults["/tiles/c/0/0/0"] = ["stall"]
    try:
        xr.testing.assert_identical(ds.tiles.compute(), want)
        http.faults["/tiles/c/0/0/0"] = ["stall", "stall"]
        with pytest.raises(ChunkError, match=r"tiles/c/0/0/0.*timed out 2 times"):
            ds.tiles.compute()
    finally:
        http.faults.clear()


@pytest.mark.parametrize("status", ["403", "401"])
def test_access_denied_names_the_object_and_credentials(http, status):
    url = f"{http.url}/s.zarr"
    ds = xr.open_dataset(url, engine="kvikio", device="cpu")
    http.faults["/gzip/c/0/0/0"] = [status]
    del http.requests[:]
    try:
        with pytest.raises(ChunkError, match=r"gzip/c/0/0/0.*access denied.*credentials"):
            ds.gzip.load()
    finally:
        http.faults.clear()
    assert sum(r[1].endswith("/gzip/c/0/0/0") for r in http.requests) == 1  # not retried


def test_truncated_objects_are_refused(tmp_path, device):
    store = _write(tmp_path)
    for name in ("tiles", "zstd"):
        path = os.path.join(store, name, "c", "0", "0", "1")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    with HTTPStores(tmp_path) as server:
        ds = xr.open_dataset(f"{server.url}/s.zarr", engine="kvikio", device=device)
        with pytest.raises(ChunkError, match=r"tiles.*c/0/0/1.*expected"):
            ds.tiles.load()
        with pytest.raises(ChunkError, match=r"zstd.*c/0/0/1"):
            ds.zstd.load()


@pytest.mark.parametrize("threaded", [True, False])
def test_an_object_larger_than_any_chunk_is_refused(tmp_path, monkeypatch, device, threaded, options):
    """A server's answer cannot make the engine hold more than a chunk can be stored in."""
    options(threaded_http=threaded)
    store = _write(tmp_path)
    with open(os.path.join(store, "zstd", "c", "0", "0", "1"), "wb") as f:
        f.write(os.urandom(400_000))  # chunks of (4, 16, 12) float32: 3072 bytes decoded
    with HTTPStores(tmp_path) as server:
        ds = xr.open_dataset(f"{server.url}/s.zarr", engine="kvikio", device=device)
        with pytest.raises(ChunkError, match=r"zstd.*c/0/0/1.*400000 bytes, more than the \d+ any codec"):
            ds.zstd.load()


def test_keys_cannot_leave_the_store_prefix():
    for key in (
        "../x",
        "a/../../x",
        "c/0?x=1",
        "c/0#frag",
        "c/%2e%2e/x",
        "/abs",
        "a//b",
        "./c",
        "http://h/x",
    ):
        with pytest.raises(UnsafeStoreError, match="below the store's prefix"):
            remote.check_remote_key(key, "array 'a'")
    for key in ("c/0/1/2", "0.0.1", "température/c/0", "a-b_c.d/0"):
        remote.check_remote_key(key, "array 'a'")


@pytest.mark.parametrize("name", ["../escape", "a#b", "q?x=1", "%2e%2e"])
def test_consolidated_metadata_naming_an_outside_array_is_refused(tmp_path, name):
    """Member names from the store's metadata cannot address other objects on the server."""
    import json

    store = _write(tmp_path)
    meta_path = os.path.join(store, "zarr.json")
    with open(meta_path) as f:
        meta = json.load(f)
    members = meta["consolidated_metadata"]["metadata"]
    members[name] = members["tiles"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with HTTPStores(tmp_path) as server:
        # zarr-python itself refuses '..'; the engine refuses URL syntax before any fetch
        with pytest.raises(StoreError, match=r"below the store's prefix|No group found"):
            xr.open_dataset(f"{server.url}/s.zarr", engine="kvikio", device="cpu").load()
        assert not any("/c/" in r[1] for r in server.requests), server.requests


def test_objects_are_named_by_their_url_in_messages():
    obstore = pytest.importorskip("obstore")
    from zarr.storage import FsspecStore, ObjectStore

    assert remote.store_url(FsspecStore.from_url("memory://b/x.zarr")) in (
        "memory://b/x.zarr",
        "memory:///b/x.zarr",
    )
    s3 = obstore.store.S3Store("bucket", prefix="a/x.zarr", skip_signature=True, region="us-east-1")
    assert remote.store_url(ObjectStore(s3, read_only=True)) == "s3://bucket/a/x.zarr"
    http = obstore.store.HTTPStore.from_url("http://127.0.0.1:1/x.zarr", client_options={"allow_http": True})
    assert remote.store_url(ObjectStore(http, read_only=True)) == "http://127.0.0.1:1/x.zarr"


def test_transient_classification():
    from botocore.exceptions import ClientError

    slow = ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "GetObject"
    )
    assert remote.transient(slow)
    assert remote.transient(TimeoutError())
    assert remote.transient(ConnectionResetError())
    assert not remote.transient(ValueError("bad"))
    assert not remote.transient(FileNotFoundError("x"))


def test_concurrent_reads_in_threads(http, device):

    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr").load()
    ds = xr.open_dataset(url, engine="kvikio", device=device)
    names = list(want.data_vars)

    def work(k):
        name = names[k % len(names)]
        sel = dict(t=slice(k % 5, 20), x=slice(0, 36, 1 + k % 3))
        got = ds[name].isel(sel).load().cupy.as_numpy()
        xr.testing.assert_identical(got, want[name].isel(sel))

    assert run_in_threads(work, 12) == []


def test_fetched_bytes_are_read_where_they_landed(http, monkeypatch, device):
    """CPU threads decode and copy a fetched object from where it landed, never through a
    buffer of their own; read to a GPU, bytes that go there as they are land in pinned memory
    (copied to the device at full speed), in blocks cupy's pinned pool reuses."""
    from cupy_xarray.engine import host

    real_read, real_land = host.pread_into, remote.pinned_landing
    landed: list[int] = []

    def read(op):
        assert op.blob is None, f"fetched bytes of {op.chunk} copied before use"
        real_read(op)

    monkeypatch.setattr(host, "pread_into", read)
    monkeypatch.setattr(remote, "pinned_landing", lambda n: landed.append(n) or real_land(n))
    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr").load()
    ds = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
    sel = dict(t=slice(3, 9), y=slice(2, 30))
    for name in ("tiles", "zstd", "gzip", "sharded_start"):
        xr.testing.assert_identical(ds[name].compute().cupy.as_numpy(), want[name])
        xr.testing.assert_identical(ds[name].isel(sel).compute().cupy.as_numpy(), want[name].isel(sel))
        # to the GPU as they are: no bytes codecs, or streams nvCOMP may decode (zstd's in the
        # decoder process; sharded_start's raw bytes have a crc32c, checked on the host)
        pinned = device == "gpu" and name in ("tiles", "zstd", "gzip")
        assert bool(landed) == pinned, name
        if name == "tiles" and pinned:
            assert set(landed) == {4 * 16 * 12 * 4}  # whole chunks
        del landed[:]
    if device == "gpu":
        trusted = xr.open_dataset(url, engine="kvikio", device=device, cache=False, decode="gpu")
        xr.testing.assert_identical(trusted.zstd.compute().cupy.as_numpy(), want.zstd)
        assert landed, "decode='gpu' hands zstd frames to nvCOMP as they are"
        a = real_land(4_000_000)
        assert len(a) == 4_000_000
        where = a.ctypes.data
        del a
        b = real_land(4_100_000)  # a similar size: the same block of the pool
        assert len(b) == 4_100_000 and b.ctypes.data == where


@pytest.mark.parametrize("wave", [1, 40_000, 200_000])
def test_large_reads_fetch_in_waves(tmp_path, monkeypatch, device, wave, options):
    """Reads larger than a wave are fetched wave by wave while earlier waves decode: the same
    result, missing chunks filled, shard indexes fetched once, small outputs over many chunks."""

    options(wave_bytes=wave)
    store = _write(tmp_path)
    os.remove(os.path.join(store, "zstd", "c", "1", "0", "0"))
    os.remove(os.path.join(store, "sharded", "c", "1", "0", "0"))
    with HTTPStores(tmp_path) as server:
        url = f"{server.url}/s.zarr"
        want = xr.open_dataset(url, engine="zarr").load()
        ds = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
        del server.requests[:]
        xr.testing.assert_identical(ds.compute().cupy.as_numpy(), want)
        index_reads = [
            r for r in server.requests if "/sharded/" in r[1] and (r[2] or "").startswith("bytes=-")
        ]
        assert len(index_reads) == 6  # one per shard (3 x 2 x 1), whatever the waves
        del server.requests[:]
        xr.testing.assert_identical(ds.sharded.compute().cupy.as_numpy(), want.sharded)
        assert not [r for r in server.requests if (r[2] or "").startswith("bytes=-")]  # kept
        # a table of kept indexes smaller than the read's shards: refilled, never misread
        options(max_cached_indexes=2)
        fresh = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
        for _ in range(2):
            xr.testing.assert_identical(fresh.sharded.compute().cupy.as_numpy(), want.sharded)
        xr.testing.assert_identical(fresh.sharded.isel(t=9).compute().cupy.as_numpy(), want.sharded.isel(t=9))
        sel = dict(y=3, x=slice(4, 6))  # a small output from every chunk along t
        xr.testing.assert_identical(ds.isel(sel).compute().cupy.as_numpy(), want.isel(sel))


def test_decode_gpu_reads_fetch_in_larger_waves(http, monkeypatch, device, options):
    """decode="gpu" on a GPU gives nvCOMP waves of the batch size (more streams per call);
    a CPU read keeps the waves it has whatever ``decode`` says."""

    options(wave_bytes=40_000)
    options(gpu_wave_bytes=200_000)
    waves: list[int] = []
    fetch_wave = waves_module.fetch_wave
    monkeypatch.setattr(waves_module, "fetch_wave", lambda wave, *a: waves.append(1) or fetch_wave(wave, *a))
    url = f"{http.url}/s.zarr"
    want = xr.open_dataset(url, engine="zarr").zstd.load()
    counts = {}
    for decode in ("auto", "gpu"):
        del waves[:]
        ds = xr.open_dataset(url, engine="kvikio", device=device, decode=decode, cache=False)
        xr.testing.assert_identical(ds.zstd.compute().cupy.as_numpy(), want)
        counts[decode] = len(waves)
    assert counts["auto"] > 1
    if device == "gpu":
        assert counts["gpu"] < counts["auto"]
    else:
        assert counts["gpu"] == counts["auto"]


def test_a_failure_in_a_later_wave_is_raised(http, monkeypatch, device, options):

    options(wave_bytes=20_000)
    url = f"{http.url}/s.zarr"
    ds = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
    http.faults["/zstd/c/5/2/2"] = ["403"]
    try:
        with pytest.raises(ChunkError, match=r"zstd/c/5/2/2.*access denied"):
            ds.zstd.compute()
    finally:
        http.faults.clear()
    xr.testing.assert_identical(
        ds.zstd.compute().cupy.as_numpy(), xr.open_dataset(url, engine="zarr").zstd.load()
    )


@pytest.fixture(scope="module")
def large_bodies(tmp_path_factory):
    """A server of chunk objects of 128-512 KiB."""
    root = tmp_path_factory.mktemp("large")
    data = np.cumsum(np.random.default_rng(3).normal(size=(8, 256, 256)), axis=2).astype("float32")
    dims = ("t", "y", "x")
    xr.Dataset({"raw": (dims, data), "zstd": (dims, data * 2)}).to_zarr(
        root / "b.zarr",
        zarr_format=3,
        consolidated=True,
        encoding={
            "raw": {"chunks": (2, 128, 128), "compressors": None},
            "zstd": {"chunks": (2, 256, 256), "compressors": [zarr.codecs.ZstdCodec(level=1)]},
        },
    )
    with HTTPStores(root) as server:
        server.url_of = f"{server.url}/b.zarr"
        yield server


def test_large_objects_placed_in_boxes_identical_to_zarr(large_bodies, device):
    # uncompressed 128 KiB tiles: on a GPU, copied from where they landed into boxes of the
    # output (rows of 512 bytes), runs of it, or through the scatter kernel
    url = large_bodies.url_of
    lazy = xr.open_dataset(url, engine="kvikio", device=device)
    want = xr.open_dataset(url, engine="zarr")
    for sel in [{}, dict(t=slice(1, 7), y=slice(100, 250)), dict(t=3, y=7), dict(x=slice(0, 200, 3))]:
        got = lazy.isel(sel).load()
        assert module_of(got.raw.data) == expected_type(device)
        xr.testing.assert_identical(got.cupy.as_numpy(), want.isel(sel).load())


@pytest.mark.parametrize("fault", ["short", "stall-body", "reset"])
def test_large_bodies_cut_or_stalled_are_retried(large_bodies, monkeypatch, device, fault, options):
    options(remote_timeout=0.3)
    large_bodies.stall_s = 1.0
    url = large_bodies.url_of
    want = xr.open_dataset(url, engine="zarr").load()
    del large_bodies.requests[:]
    large_bodies.faults["/raw/c/1/0/0"] = [fault]
    large_bodies.faults["/zstd/c/2/0/0"] = [fault]
    try:
        got = xr.open_dataset(url, engine="kvikio", device=device).load()
    finally:
        large_bodies.faults.clear()
    xr.testing.assert_identical(got.cupy.as_numpy(), want)
    for key in ("/raw/c/1/0/0", "/zstd/c/2/0/0"):
        assert sum(r[1].endswith(key) for r in large_bodies.requests) == 2, key


def test_a_body_that_stalls_every_time_is_named(large_bodies, monkeypatch, options):
    options(remote_timeout=0.3)
    options(remote_retries=1)
    large_bodies.stall_s = 1.0
    ds = xr.open_dataset(large_bodies.url_of, engine="kvikio", device="cpu")
    large_bodies.faults["/raw/c/3/0/0"] = ["stall-body", "stall-body"]
    try:
        with pytest.raises(ChunkError, match=r"raw/c/3/0/0.*timed out 2 times.*TimeoutError"):
            ds.raw.load()
    finally:
        large_bodies.faults.clear()


@pytest.mark.parametrize(
    ("codecs", "decode", "pinned", "without_process"),
    [  # without_process: where the decoder process cannot run (nvCOMP without its C API, or off)
        ((), "auto", True, True),  # copied (or read in place by the placing kernel) as they are
        (("zstd",), "auto", True, False),  # nvCOMP may decode them, in the decoder process
        (("zstd",), "gpu", True, True),
        (("crc32c", "zstd"), "auto", True, True),  # a checksum proves the frames first: nvCOMP may
        (("blosc-lz4",), "auto", True, True),  # streams nvCOMP decodes safely in this process
        (("blosc-zstd",), "auto", True, False),  # shared: nvCOMP may take them, in the decoder process
        (("gzip",), "auto", True, True),
        (("lz4",), "auto", True, True),  # nvCOMP may decode them (a large read)
        (("zstd",), "cpu", False, False),
        (("crc32c",), "auto", False, False),  # raw bytes checked on the host
    ],
)
def test_what_lands_in_pinned_memory(codecs, decode, pinned, without_process, monkeypatch, options):
    """Fetched bytes land page-locked where they go to the GPU as they are, never for a read
    to the host; unproven streams only where the decoder process can take them."""
    from types import SimpleNamespace

    from cupy_xarray.runtime import nvcomp

    spec = SimpleNamespace(recipe=SimpleNamespace(bytes_codecs=codecs))
    gpu, cpu = SimpleNamespace(name="gpu"), SimpleNamespace(name="cpu")
    monkeypatch.setattr(nvcomp, "library", lambda: object())  # as where nvCOMP's C API loads

    def at(device):  # a read's device, decode choice and settings
        return SimpleNamespace(device=device, decode=decode, options=get_options())

    assert lands_pinned(spec, at(gpu)) is pinned
    assert lands_pinned(spec, at(cpu)) is False
    options(nvcomp_c=False)  # nvCOMP's Python API only: no decoder process
    assert lands_pinned(spec, at(gpu)) is (pinned and without_process)
    options(nvcomp_c=True, decoder_process="off")
    assert lands_pinned(spec, at(gpu)) is (pinned and without_process)


def test_only_the_threaded_fetcher_lands_bytes_pinned(http, tmp_path):
    from zarr.storage import FsspecStore, MemoryStore

    url = f"{http.url}/s.zarr"
    fetched = remote.RemoteSource(FsspecStore.from_url(url, read_only=True), "tiles", "tiles")
    assert fetched.lands_pinned(get_options())
    assert not remote.RemoteSource(MemoryStore(), "tiles", "tiles").lands_pinned(get_options())
    assert not fetched.lands_pinned(replace(get_options(), threaded_http=False))


def test_a_dripping_body_is_held_to_the_deadline(http, options):
    """One byte every 0.125 s: each wait is short, the whole answer long; the request's own
    deadline (remote_timeout) ends it, as it does a stall."""
    url = f"{http.url}/s.zarr"
    options(remote_timeout=1.0, remote_retries=1, threaded_http=True)
    http.stall_s = 1.0
    ds = xr.open_dataset(url, engine="kvikio", device="cpu", cache=False)
    http.faults["/tiles/c/0/0/0"] = ["drip", "drip"]
    t0 = time.monotonic()
    try:
        with pytest.raises(ChunkError, match=r"tiles/c/0/0/0.*timed out 2 times"):
            ds.tiles.compute()
    finally:
        http.faults.clear()
    assert time.monotonic() - t0 < 10


def test_a_gzip_encoded_answer_is_inflated(http, device, options):
    """A server that compresses bodies although asked not to (Content-Encoding: gzip)."""
    url = f"{http.url}/s.zarr"
    options(threaded_http=True)
    want = xr.open_dataset(url, engine="zarr").tiles.load()
    ds = xr.open_dataset(url, engine="kvikio", device=device, cache=False)
    http.faults["/tiles/c/0/0/0"] = ["gzip"]
    try:
        xr.testing.assert_identical(ds.tiles.load().cupy.as_numpy(), want)
    finally:
        http.faults.clear()


def test_metadata_reads_have_a_deadline_and_retries(http, options):
    """A server that stalls on metadata fails the open within its deadline and retries; one
    503 on metadata is retried, as a chunk's is."""
    url = f"{http.url}/s.zarr"
    options(remote_timeout=1.0, remote_retries=1)
    http.stall_s = 4.0
    http.faults["/s.zarr/zarr.json"] = ["stall", "stall"]
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreError, match="s.zarr"):
            xr.open_dataset(url, engine="kvikio", device="cpu", consolidated=True)
    finally:
        http.faults.clear()
    assert time.monotonic() - t0 < 8
    http.faults["/s.zarr/zarr.json"] = ["503"]
    try:
        ds = xr.open_dataset(url, engine="kvikio", device="cpu", consolidated=True)
    finally:
        http.faults.clear()
    xr.testing.assert_identical(ds.tiles.load(), xr.open_dataset(url, engine="zarr").tiles.load())


# -- what a store that does not open says -----------------------------------------------------


def test_a_missing_remote_store_reads_as_a_missing_local_one(http, tmp_path):
    """One wording for a store that is not there, local or remote: StoreNotFoundError (a
    FileNotFoundError) naming the path."""
    from cupy_xarray.errors import StoreNotFoundError

    for path in (f"{http.url}/missing.zarr", str(tmp_path / "missing.zarr")):
        with pytest.raises(
            StoreNotFoundError, match=r"^no such Zarr store: .*missing\.zarr.* does not exist"
        ):
            xr.open_dataset(path, engine="kvikio", device="cpu")
    assert issubclass(StoreNotFoundError, FileNotFoundError)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://no-such-host.invalid/s.zarr", r"host name 'no-such-host.invalid' does not resolve \(DNS\)"),
        ("http://127.0.0.1:1/s.zarr", r"connection to 127.0.0.1:1 was refused .*server runs"),
    ],
)
def test_connection_failures_say_what_failed(url, says, options):
    options(remote_retries=0)
    with pytest.raises(StoreError, match=says) as info:
        xr.open_dataset(url, engine="kvikio", device="cpu")
    assert "zarr_format" not in str(info.value)


def test_missing_credentials_say_so(s3, monkeypatch, tmp_path, options):
    options(remote_retries=0)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match=r"no credentials were found.*AWS_ACCESS_KEY_ID.*'anon': True"):
        xr.open_dataset(s3.url, engine="kvikio", device="cpu", storage_options={"endpoint_url": s3.endpoint})


def test_a_protocol_without_its_file_system_names_the_package():
    import importlib.util

    from cupy_xarray.xarray.opening import install_hint

    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(
            StoreError, match=r"gs:// stores open through fsspec's gcsfs: pip install fsspec gcsfs"
        ):
            xr.open_dataset("gs://bucket/data.zarr", engine="kvikio", device="cpu")
    assert "adlfs" in install_hint("abfs://c/x.zarr") and "s3fs" in install_hint("s3://b/x.zarr")


def test_outputs_of_remote_waves_are_handed_out_with_the_read_only(http, local_store, device, options):
    """``read_arrays(ready=...)`` hands out the outputs of local requests as they are placed,
    and those fetched in waves only with the read's end (a wave places part of an output):
    every output handed out is whole, and the read returns them all."""
    from cupy_xarray.engine import array_spec, read_arrays
    from cupy_xarray.engine.devices import resolve_device

    options(wave_bytes=1)  # every chunk a wave of its own
    options(host_assembly_bytes=0)  # (a small GPU read assembled on the host is handed out at its end)
    url = f"{http.url}/s.zarr"
    lazy = xr.open_dataset(url, engine="kvikio", device=device)["zstd"].variable._data
    while not hasattr(lazy, "spec"):
        lazy = lazy.array
    local = zarr.open_array(local_store, path="zstd")
    whole = (slice(None),) * 3
    requests = [(lazy.spec, whole), (array_spec(local, name="zstd"), whole)]
    handed = []

    def ready(i, out):
        handed.append((i, host(out).copy()))

    outs = read_arrays(requests, resolve_device(device), ready=ready)
    assert [i for i, _ in handed] == [1]  # the local request's, before the read ended
    np.testing.assert_array_equal(handed[0][1], local[:])
    for out in outs:
        np.testing.assert_array_equal(host(out), local[:])
