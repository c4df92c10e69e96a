"""The scheduler: which route each chunk takes, the cost model, its calibration, and the same
values whichever way a chunk went (tiles, slabs, selections, threads)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from conftest import host, run_in_threads

from cupy_xarray.device import resolve_device
from cupy_xarray.engine import array_spec, read_arrays
from cupy_xarray.engine import schedule as sch
from cupy_xarray.engine.schedule import Rates, Scheduler, split
from cupy_xarray.engine.spec import ChunkRecipe


def _tasks(codecs: tuple[str, ...], count: int, nbytes: int = 4 * 2**20):
    recipe = ChunkRecipe((nbytes // 4,), np.dtype("f4"), bytes_codecs=codecs)
    spec = SimpleNamespace(recipe=recipe, name="field")
    return [SimpleNamespace(spec=spec, nbytes=nbytes) for _ in range(count)]


GPU = SimpleNamespace(name="gpu", threads=16)
CPU = SimpleNamespace(name="cpu", threads=16)
RATES = {k: v for k, v in sch.DEFAULT_RATES.items()}


@pytest.mark.parametrize(
    "codecs, why",
    [(("zstd",), "does not report damaged frames"), (("lz4",), "liblz4"), (("blosc-zstd",), "damaged")],
)
def test_auto_keeps_unsafe_or_slow_streams_on_cpu_threads(codecs, why):
    routes, d = Scheduler(RATES).routes(_tasks(codecs, 500), GPU, "auto")
    assert set(routes) == {"host"} and d.host == 500 and d.gpu == 0
    assert why in d.why


@pytest.mark.parametrize("codecs", [("gzip",), ("zlib",), ("blosc-lz4",), ("crc32c", "zstd")])
def test_auto_splits_safe_streams_by_cost(codecs):
    s = Scheduler(RATES)
    one, d1 = s.routes(_tasks(codecs, 1), GPU, "auto")
    assert one == ["host"], d1  # one chunk: nvCOMP's fixed cost and one-stream latency lose
    many, d = s.routes(_tasks(codecs, 1024), GPU, "auto")
    assert d.gpu > 0 and d.host > 0, d  # a large read keeps both processors busy
    assert many == ["batch"] * d.gpu + ["host"] * d.host
    assert "cost model" in d.why


def test_decode_choice_overrides_the_model():
    s = Scheduler(RATES)
    for codecs in [("zstd",), ("gzip",), ("blosc-zstd",)]:
        assert set(s.routes(_tasks(codecs, 64), GPU, "gpu")[0]) == {"batch"}
        assert set(s.routes(_tasks(codecs, 64), GPU, "cpu")[0]) == {"host"}
    # uncompressed tiles go to CPU threads (a chunk per thread in flight, not a batch's
    # staging on the GPU), but for large reads with decode="gpu"; a CPU read uses its threads
    assert set(s.routes(_tasks((), 64), GPU, "auto")[0]) == {"host"}
    assert set(s.routes(_tasks((), 64), GPU, "gpu")[0]) == {"batch"}
    assert set(s.routes(_tasks((), 2), GPU, "gpu")[0]) == {"host"}
    assert set(s.routes(_tasks(("gzip",), 64), CPU, "gpu")[0]) == {"host"}
    assert Scheduler(force="batch").routes(_tasks(("zstd",), 3), GPU, "cpu")[0] == ["batch"] * 3
    with pytest.raises(ValueError, match="force"):
        Scheduler(force="gpu")


def test_split_balances_the_processors():
    r = Rates(host_thread=1e9, gpu=10e9, gpu_stream=1e9, gpu_call=1e-3)
    sizes = np.full(1000, 2**20, dtype=np.float64)
    k, tg, th = split(sizes, r, threads=10)
    # both processors as fast in aggregate (10 GB/s): about half each, ending together
    assert 400 <= k <= 600 and abs(tg - th) < 0.25 * max(tg, th)
    fast_gpu = Rates(host_thread=1e6, gpu=1e12, gpu_stream=1e12, gpu_call=1e-6)
    assert split(sizes, fast_gpu, 10)[0] == 1000
    slow_gpu = Rates(host_thread=1e9, gpu=1e6, gpu_stream=1e6, gpu_call=1.0)
    assert split(sizes, slow_gpu, 10)[0] == 0
    assert r.host_seconds(np.array([8e9]), 16) == pytest.approx(8.0)  # one chunk: one thread


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_XARRAY_CACHE", str(tmp_path))
    monkeypatch.setattr(sch, "_cache", {})
    calls = []
    real = sch.calibrate
    monkeypatch.setattr(sch, "calibrate", lambda kind, dev: calls.append(kind) or real(kind, dev))
    cpu = resolve_device("cpu")
    r = sch.rates("gzip", cpu)
    assert r.measured and r.host_thread > 1e6 and calls == ["gzip"]
    stored = json.loads((tmp_path / "decode-rates.json").read_text())
    (key,) = stored
    assert key.endswith("|gzip") and stored[key]["host_thread"] == r.host_thread
    monkeypatch.setattr(sch, "_cache", {})  # a new process: the file answers
    assert sch.rates("gzip", cpu) == r and calls == ["gzip"]
    monkeypatch.setenv("CUPY_XARRAY_CALIBRATE", "0")
    assert sch.rates("zstd", cpu) == sch.DEFAULT_RATES["zstd"] and calls == ["gzip"]


@pytest.mark.parametrize("kind", ["zstd", "gzip", "zlib", "lz4", "lz4-block"])
def test_sample_streams_decode_to_their_size(kind):
    from cupy_xarray.engine.codecs import _cpu_decode_one

    (s,), n = sample_streams_one(kind)
    assert len(_cpu_decode_one(kind, s, n)) == n and len(s) < n


def sample_streams_one(kind):
    return sch.sample_streams(kind, 1, 2**16)


def test_a_read_reports_its_decisions(tmp_path):
    from cupy_xarray.engine import reader

    a = _store(tmp_path, "zstd", (16, 64, 64), (4, 32, 32))
    read_arrays([(array_spec(a), (slice(None),) * 3)], resolve_device("cpu"))
    # a CPU read has nothing to choose: no decision is recorded, every chunk on the host route
    assert reader.last_read_decisions == []
    assert reader.last_read_stats.get("host route", 0) > 0


# ------------------------------------------------- same values whichever route a chunk took

COMPRESSORS = {
    "none": None,
    "zstd": zarr.codecs.ZstdCodec(level=1),
    "zstd-checksum": zarr.codecs.ZstdCodec(level=1, checksum=True),
    "gzip": zarr.codecs.GzipCodec(level=1),
    "zlib": ("numcodecs", "Zlib", {"level": 1}),
    "lz4": ("numcodecs", "LZ4", {}),
    "blosc-lz4": zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    "blosc-zstd": zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"),
}


def _store(tmp_path, comp, shape, chunks, shards=None, crc=False):
    path = (
        tmp_path / f"{comp}-{'x'.join(map(str, chunks))}{'-sh' if shards else ''}{'-crc' if crc else ''}.zarr"
    )
    c = COMPRESSORS[comp]
    if isinstance(c, tuple):  # numcodecs' own codecs, as zarr 3 stores them
        import warnings

        from zarr.codecs import numcodecs as zn

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = getattr(zn, c[1])(**c[2])
    kw = {"compressors": [zarr.codecs.Crc32cCodec(), c] if crc else c}
    a = zarr.create_array(
        str(path), shape=shape, chunks=chunks, shards=shards, dtype="f4", fill_value=-1, **kw
    )  # fmt: skip
    rng = np.random.default_rng(len(str(path)))
    t = np.arange(shape[0], dtype="f4")[:, None, None]
    y = np.linspace(0, 3, shape[1], dtype="f4")[None, :, None]
    x = np.linspace(0, 5, shape[2], dtype="f4")[None, None, :]
    data = np.round((np.sin(y + t / 7) * np.cos(x) * 20 + 280) * 64) / 64
    data = (data + (rng.random(shape) < 0.01)).astype("f4")
    a[:] = data
    return zarr.open_array(str(path), mode="r")


SELECTIONS = {
    "all": (slice(None), slice(None), slice(None)),
    "one chunk": (slice(4, 8), slice(32, 64), slice(0, 32)),
    "1 %": (slice(3, 5), slice(10, 30), slice(7, 40)),
    "one point": (5, 40, 3),
    "points": (np.array([0, 9, 15]), slice(None), np.array([1, 63, 2, 40])),
    "strided": (slice(1, None, 3), slice(None, None, 5), slice(2, 60, 7)),
}
LAYOUTS = {
    "tiles": dict(chunks=(4, 32, 32)),
    "slabs": dict(chunks=(1, 64, 64)),
    "sharded tiles": dict(chunks=(4, 32, 32), shards=(8, 64, 64)),
}


def _check_all_routes(tmp_path, device, choices, schedulers):
    dev = resolve_device(device)
    tmp_path = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    tmp_path.mkdir()
    for comp in COMPRESSORS:
        for lname, layout in LAYOUTS.items():
            if layout.get("shards") and comp in ("zlib", "lz4"):
                continue  # numcodecs' codecs inside zarr 3 shards: not what users write
            a = _store(tmp_path, comp, (16, 64, 64), **layout, crc=comp == "zstd" and lname == "tiles")
            spec = array_spec(a, name=f"{comp}/{lname}")
            assert not spec.fallback, spec.fallback
            for sname, sel in SELECTIONS.items():
                want = a.get_orthogonal_selection(
                    tuple(s.tolist() if isinstance(s, np.ndarray) else s for s in sel)
                )
                for choice in choices:
                    for sched in schedulers:
                        (got,) = read_arrays([(spec, sel)], dev, decode=choice, scheduler=sched)
                        np.testing.assert_array_equal(
                            host(got), want, err_msg=f"{comp} {lname} {sname} decode={choice} {sched}"
                        )


def test_every_route_reads_the_same_cpu(tmp_path):
    """The CPU read's host route and the batched route (what nvCOMP decodes in on the GPU):
    zarr-python's values for every codec, layout and selection kind."""
    _check_all_routes(tmp_path, "cpu", ["auto"], [None, Scheduler(force="batch"), Scheduler(force="host")])


@pytest.mark.gpu
def test_every_route_reads_the_same_gpu(tmp_path):
    """decode="gpu", "cpu" and "auto" (and each route forced) on the GPU: bitwise zarr-python's."""
    _check_all_routes(tmp_path, "gpu", ["auto", "gpu", "cpu"], [None])
    _check_all_routes(tmp_path, "gpu", ["auto"], [Scheduler(force="batch"), Scheduler(force="host")])


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_concurrent_mixed_reads(tmp_path, device):
    """16 threads, each reading random selections of stores of every codec with every decode
    choice at once: every result equals zarr-python's."""
    dev = resolve_device(device)
    arrays = [_store(tmp_path, c, (16, 64, 64), (4, 32, 32)) for c in COMPRESSORS]
    specs = [array_spec(a, name=c) for a, c in zip(arrays, COMPRESSORS)]
    full = [a[:] for a in arrays]

    def work(k):
        rng = np.random.default_rng(k)
        for i in range(12):
            j = int(rng.integers(len(specs)))
            lo = rng.integers(0, [16, 64, 64])
            hi = lo + rng.integers(1, [8, 40, 40])
            sel = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
            choice = ["auto", "gpu", "cpu"][(k + i) % 3]
            (got,) = read_arrays([(specs[j], sel)], dev, decode=choice)
            np.testing.assert_array_equal(host(got), full[j][sel], err_msg=f"{specs[j].name} {sel} {choice}")

    errors = run_in_threads(work, 16)
    assert not errors, errors[:3]


def test_reads_refine_the_rates(tmp_path, monkeypatch):
    """A read's own timings move the rates halfway to what it measured (file and memory);
    routes with few chunks, and schedulers given their rates, leave them alone."""
    monkeypatch.setenv("CUPY_XARRAY_CACHE", str(tmp_path))
    monkeypatch.setattr(sch, "_cache", {})
    monkeypatch.setattr(sch, "calibrate", lambda kind, dev: Rates(1e9, 10e9, 1e9, 1e-3, True))
    cpu = resolve_device("cpu")
    assert sch.rates("gzip", cpu).reads == 0
    d = sch.Decision("a", "gzip", gpu=100, host=100, why="", kind="gzip", key=1, learns=True)
    fixed = 1e-3 + 1e6 / 1e9
    sch.learn(d, cpu, gpu_seconds=fixed + 0.1, host_thread_seconds=1.0, nbytes=10**6)
    r = sch.rates("gzip", cpu)
    assert r.host_thread == pytest.approx(0.5e9 + 0.5e8) and r.gpu == pytest.approx(0.5 * 10e9 + 0.5 * 1e9)
    assert r.reads == 1
    monkeypatch.setattr(sch, "_cache", {})
    assert sch.rates("gzip", cpu) == r  # kept in the cache file
    few = sch.Decision("a", "gzip", gpu=3, host=3, why="", kind="gzip", key=1, learns=True)
    sch.learn(few, cpu, 1.0, 1.0, 10**6)
    sch.learn(sch.Decision("a", "gzip", 100, 100, "", "gzip", 1, learns=False), cpu, 9.0, 9.0, 10**6)
    assert sch.rates("gzip", cpu) == r


@pytest.mark.parametrize("seed", range(20))
def test_byte_span_holds_the_selection(seed):
    """Small selections of uncompressed chunks read only the bytes from their first element
    to their last."""
    from cupy_xarray.engine.host import byte_span

    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 9, size=int(rng.integers(1, 4))))
    recipe = ChunkRecipe(shape, np.dtype("f8"))
    sel = []
    for n in shape:
        k = int(rng.integers(3))
        if k == 0:
            sel.append(int(rng.integers(n)))
        elif k == 1:
            a = int(rng.integers(n))
            sel.append(slice(a, int(rng.integers(a, n + 1)), int(rng.integers(1, 3))))
        else:
            sel.append(np.unique(rng.integers(0, n, size=int(rng.integers(1, 4)))))
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    picked = (
        flat[tuple(s if not isinstance(s, np.ndarray) else s for s in sel)]
        if all(not isinstance(s, np.ndarray) for s in sel)
        else flat[np.ix_(*[np.atleast_1d(np.arange(n)[s]) for s, n in zip(sel, shape)])]
    )
    lo, hi = byte_span(recipe, tuple(sel))
    if picked.size == 0:
        assert hi <= lo
    else:
        assert (lo, hi) == (int(picked.min()) * 8, (int(picked.max()) + 1) * 8)
    assert byte_span(ChunkRecipe(shape, np.dtype("f8"), bytes_codecs=("zstd",)), tuple(sel)) == (
        0,
        recipe.nbytes,
    )
