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
    "codecs, why, decoder_process",
    [
        (("zstd",), "does not report damaged frames", "off"),  # no decoder process: kept off nvCOMP
        (("blosc-zstd",), "c-blosc", "auto"),  # faster there than its many streams in the decoder process
    ],
)
def test_auto_keeps_unsafe_or_slow_streams_on_cpu_threads(codecs, why, decoder_process, options):
    options(decoder_process=decoder_process)
    routes, d = Scheduler(RATES).routes(_tasks(codecs, 500), GPU, "auto")
    assert set(routes) == {"host"} and d.host == 500 and d.gpu == 0
    assert why in d.why


def test_unproven_zstd_goes_to_the_decoder_process_by_cost():
    """With the decoder process, decode='auto' gives nvCOMP zstd frames no check has proven
    where the cost model says it is faster, and the group decodes in that process."""
    s = Scheduler(RATES)
    many, d = s.routes(_tasks(("zstd",), 1024), GPU, "auto")
    assert d.gpu > 0 and "cost model" in d.why
    one, _ = s.routes(_tasks(("zstd",), 1), GPU, "auto")
    assert one == ["host"]  # a one-chunk selection keeps its CPU route
    assert sch.in_decoder_process(("zstd",), SimpleNamespace(name="cpu"), "auto") is False
    assert sch.isolable(("zstd",)) and sch.isolable(("gzip",))
    assert not sch.isolable(("crc32c", "zstd")) and not sch.isolable(("blosc-lz4",))


def test_blosc_zstd_streams_go_to_the_decoder_process_where_nvcomp_decodes_them(options):
    """Blosc's zstd blocks are frames nvCOMP may fault on, as a zstd chunk is: with
    decode='gpu' they decode in the decoder process (on the CPU, as CI runs it, with
    decoder_process='on'); decode='auto' keeps them on CPU threads, which are faster."""
    assert sch.isolable(("blosc-zstd",)) and not sch.isolable(("crc32c", "blosc-zstd"))
    options(decoder_process="on")
    assert sch.in_decoder_process(("blosc-zstd",), SimpleNamespace(name="cpu"), "gpu")
    routes, d = Scheduler(RATES).routes(_tasks(("blosc-zstd",), 500), GPU, "gpu")
    assert set(routes) == {"batch"} and d.gpu == 500


@pytest.mark.parametrize("codecs", [("gzip",), ("zlib",), ("lz4",), ("blosc-lz4",), ("crc32c", "zstd")])
def test_auto_chooses_safe_streams_by_cost(codecs):
    s = Scheduler(RATES)
    one, d1 = s.routes(_tasks(codecs, 1), GPU, "auto")
    assert one == ["host"], d1  # one chunk: nvCOMP's fixed cost and one-stream latency lose
    many, d = s.routes(_tasks(codecs, 1024), GPU, "auto")
    assert many == ["batch"] * d.gpu + ["host"] * d.host and "cost model" in d.why
    r = RATES[sch.stream_kind(codecs)]
    sizes = np.full(1024, 4.0 * 2**20)
    stream = sch.stream_bytes(codecs)
    alone = min(r.gpu_seconds(sizes, stream), r.host_seconds(sizes, 16))
    got = max(r.gpu_seconds(sizes[: d.gpu], stream), r.host_seconds(sizes[d.gpu :], 16))
    # the faster processor alone, or a split that saves at least 40 % of its time
    assert got == pytest.approx(alone) or got <= sch.SPLIT_GAIN * alone, d
    if codecs[-1] != "gzip" and codecs[0] != "zlib":
        assert d.gpu == 1024, d  # LZ4, Blosc LZ4 and proven zstd: nvCOMP is faster


def test_decode_choice_overrides_the_model():
    s = Scheduler(RATES)
    for codecs in [("zstd",), ("gzip",), ("blosc-zstd",)]:
        assert set(s.routes(_tasks(codecs, 64), GPU, "gpu")[0]) == {"batch"}
        assert set(s.routes(_tasks(codecs, 64), GPU, "cpu")[0]) == {"host"}
    # uncompressed tiles: a large read is staged with the batches (kvikio), a small one (a
    # dask task, a selection) goes to CPU threads; a CPU read uses its threads
    assert set(s.routes(_tasks((), 64), GPU, "auto")[0]) == {"batch"}
    assert set(s.routes(_tasks((), 2), GPU, "auto")[0]) == {"host"}
    # fetched bytes are in host memory already: copied from there, however many
    fetched = _tasks((), 64)
    for t in fetched:
        t.blob = np.zeros(1, np.uint8)
    assert set(s.routes(fetched, GPU, "auto")[0]) == {"host"}
    assert set(s.routes(_tasks(("gzip",), 64), CPU, "gpu")[0]) == {"host"}
    assert Scheduler(force="batch").routes(_tasks(("zstd",), 3), GPU, "cpu")[0] == ["batch"] * 3
    with pytest.raises(ValueError, match="force"):
        Scheduler(force="gpu")


def test_direct_reads_of_a_chunk_or_two_skip_kvikio():
    """Pieces read straight into the output: a GPU read of a few MiB of them (a dask task of
    one chunk) goes to the host route, a larger one to kvikio with the batches; a CPU read
    reads them with its batches; a forced route wins."""

    def direct(count, nbytes=2**20):
        tasks = _tasks((), count, nbytes)
        for t in tasks:
            t.direct = (0, nbytes, 0)
        return tasks

    s = Scheduler(RATES)
    assert s.direct_routes(direct(1, 4 * 2**20), GPU) == ["host"]
    assert s.direct_routes(direct(4), GPU) == ["host"] * 4
    assert s.direct_routes(direct(5), GPU) == ["batch"] * 5
    assert s.direct_routes(direct(1, 16 * 2**20), GPU) == ["batch"]
    assert s.direct_routes(direct(2), CPU) == ["batch"] * 2
    assert Scheduler(force="host").direct_routes(direct(64), CPU) == ["host"] * 64


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
    # threads that slow each other down (a pool at 2 GB/s, not 10) beside a GPU at 20: a
    # split would save under 40 %, so the GPU takes all
    crowded = Rates(host_thread=1e9, gpu=20e9, gpu_stream=1e9, gpu_call=1e-3, host_pool=2e9)
    assert split(sizes, crowded, 10)[0] == 1000
    assert r.host_seconds(np.array([8e9]), 16) == pytest.approx(8.0)  # one chunk: one thread


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch, options):
    options(cache_dir=str(tmp_path))
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
    options(calibrate=False)
    assert sch.rates("zstd", cpu) == sch.DEFAULT_RATES["zstd"] and calls == ["gzip"]


def test_calibration_keeps_the_nvcomp_figures_of_blosc_blocks():
    """Bare 64 KiB LZ4 blocks cannot show what whole Blosc reads get from nvCOMP: only the
    CPU thread is measured for them; bare streams of the other kinds measure the GPU too."""
    decoded = []

    class Codecs:
        available = True

        def decode(self, kind, srcs, expected, on_gpu=True):
            decoded.append((kind, len(srcs)))

    gpu = SimpleNamespace(name="gpu", xp=np, codecs=Codecs(), synchronize=lambda: None)
    r = sch.calibrate("lz4-block", gpu)
    base = sch.DEFAULT_RATES["lz4-block"]
    assert r.measured and (r.gpu, r.gpu_stream, r.gpu_call) == (base.gpu, base.gpu_stream, base.gpu_call)
    assert decoded == []
    r = sch.calibrate("gzip", gpu)
    assert decoded and decoded[0][0] == "gzip" and r.gpu != sch.DEFAULT_RATES["gzip"].gpu


def test_the_reason_names_both_processors():
    s = Scheduler(RATES)
    _, d = s.routes(_tasks(("gzip",), 1), GPU, "auto")
    assert d.gpu == 0 and "nvCOMP alone" in d.why and "CPU threads" in d.why


@pytest.mark.parametrize("kind", ["zstd", "gzip", "zlib", "lz4", "lz4-block"])
def test_sample_streams_decode_to_their_size(kind):
    from cupy_xarray.engine.decoders import stream

    (s,), n = sample_streams_one(kind)
    assert len(stream(kind).decode_host(s, n)) == n and len(s) < n


def sample_streams_one(kind):
    return sch.sample_streams(kind, 1, 2**16)


def test_a_read_reports_its_decisions(tmp_path):
    from cupy_xarray import record_reads

    a = _store(tmp_path, "zstd", (16, 64, 64), (4, 32, 32))
    spec = array_spec(a)
    with record_reads() as reports:
        read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"))
    # a CPU read has nothing to choose: no decision is recorded, every chunk on the host route
    (report,) = reports
    assert report.decisions == [] and report.batches == 0 and report.arrays == [spec.name]
    assert report.phases.get("host route", 0) > 0 and report.nbytes == a.nbytes


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


def test_reads_refine_the_rates(tmp_path, monkeypatch, options):
    """A read with one processor alone moves that processor's rate most of the way to what it
    measured (in memory and in the cache file); split reads, small chunks and schedulers given
    their rates leave the rates alone."""
    options(cache_dir=str(tmp_path))
    monkeypatch.setattr(sch, "_cache", {})
    monkeypatch.setattr(sch, "calibrate", lambda kind, dev: Rates(1e9, 10e9, 1e9, 1e-3, True, host_pool=8e9))
    cpu = SimpleNamespace(name="cpu", threads=16, xp=np)
    w = sch.LEARN_WEIGHT
    assert sch.rates("gzip", cpu).reads == 0

    def decision(gpu, host, learns=True):
        return sch.Decision("a", "gzip", gpu, host, "", "gzip", 1, learns)

    mb = 10**6
    sch.learn(decision(0, 100), cpu, mb, host_wall=0.1)  # the pool: 100 MB in 0.1 s
    r = sch.rates("gzip", cpu)
    assert r.host_pool == pytest.approx((1 - w) * 8e9 + w * 1e9) and r.reads == 1
    sch.learn(decision(0, 4), cpu, mb, host_job_seconds=0.04)  # one thread: 1 MB in 10 ms
    r = sch.rates("gzip", cpu)
    assert r.host_thread == pytest.approx((1 - w) * 1e9 + w * 1e8)
    fixed = 1e-3 + mb / 1e9
    sch.learn(decision(100, 0), cpu, mb, gpu_seconds=fixed + 0.1)  # nvCOMP: 100 MB in 0.1 s
    r = sch.rates("gzip", cpu)
    assert r.gpu == pytest.approx((1 - w) * 10e9 + w * 1e9) and r.reads == 3
    monkeypatch.setattr(sch, "_cache", {})
    assert sch.rates("gzip", cpu) == r  # kept in the cache file
    sch.learn(decision(50, 50), cpu, mb, 1.0, 1.0, 1.0)  # split: the processors slowed each other
    sch.learn(decision(0, 100), cpu, 1000, host_wall=9.0)  # tiny chunks
    sch.learn(decision(0, 100, learns=False), cpu, mb, host_wall=9.0)
    assert sch.rates("gzip", cpu) == r


@pytest.mark.parametrize("seed", range(20))
def test_byte_span_holds_the_selection(seed):
    """Small selections of uncompressed chunks read only the bytes from their first element
    to their last."""
    from cupy_xarray.engine.plan import byte_span

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


def test_the_model_counts_one_call_per_batch():
    """Batches cap what one nvCOMP call decodes: gzip's 4 MiB streams (each one group of GPU
    threads, about 170 ms) in many small batches lose to CPU threads, in one big call they
    would not."""
    s = Scheduler(RATES)
    _, small = s.routes(_tasks(("gzip",), 256), GPU, "auto", batch_bytes=64 * 2**20)
    _, big = s.routes(_tasks(("gzip",), 256), GPU, "auto", batch_bytes=2**31)
    assert small.gpu == 0 and big.gpu > 0, (small, big)
    _, blosc = s.routes(_tasks(("blosc-lz4",), 256), GPU, "auto", batch_bytes=128 * 2**20)
    assert blosc.gpu == 256, blosc


def test_reads_beside_other_reads_teach_nothing(monkeypatch):
    """Timings of a read that ran beside another (dask's threads, yours) are not its own: the
    threads slowed each other down, and the rates would learn that one thread is slow."""
    from cupy_xarray.engine import host as host_route
    from cupy_xarray.engine.read import RUNNING, Clock

    taught = []
    monkeypatch.setattr(sch, "learn", lambda *a, **k: taught.append(a))
    (t,) = _tasks(("gzip",), 1)
    d = sch.Decision("a", "gzip", 0, 1, "", "gzip", id(t.spec.recipe), learns=True)
    jobs = host_route.Jobs()
    cpu = resolve_device("cpu")
    clock = Clock(cpu)
    with RUNNING.running(clock):
        sch.learn_from([d], [t], GPU, clock, jobs)
    assert len(taught) == 1 and not clock.crowded
    first, second = Clock(cpu), Clock(cpu)
    with RUNNING.running(first):
        with RUNNING.running(second):  # a second read starts while the first runs
            pass
        sch.learn_from([d], [t], GPU, first, jobs)
    sch.learn_from([d], [t], GPU, second, jobs)
    assert first.crowded and second.crowded and len(taught) == 1
    alone = Clock(cpu)
    with RUNNING.running(alone):  # none is left running: a read alone again
        pass
    assert not alone.crowded
    # a remote read: the fetch threads shared the CPU with the decode
    fetched = SimpleNamespace(spec=t.spec, nbytes=t.nbytes, blob=np.zeros(4, np.uint8))
    with RUNNING.running(alone):
        sch.learn_from([d], [fetched], GPU, alone, jobs)
    assert len(taught) == 1


def test_batch_size_is_chosen_per_read_unless_given():
    from cupy_xarray import get_options
    from cupy_xarray.engine.batches import staging_limit

    o = get_options()
    most = o.default_batch_bytes
    gib = np.empty(0)  # outputs only count their bytes
    outs = [SimpleNamespace(nbytes=4 * 2**30), gib]
    assert staging_limit(outs, None, "auto", o) == 512 * 2**20  # an eighth of 4 GiB
    assert staging_limit([SimpleNamespace(nbytes=2**20)], None, "cpu", o) == 128 * 2**20
    assert staging_limit([SimpleNamespace(nbytes=2**40)], None, "auto", o) == most
    assert staging_limit(outs, None, "gpu", o) == most
    assert staging_limit(outs, 2**31, "auto", o) == 2**31  # what the user asked for
    assert staging_limit(outs, 1000, "gpu", o) == 1000
    # a GPU read nvCOMP decodes: a third of its share of the free memory, within bounds
    assert staging_limit(outs, None, "auto", o, free=60 * 2**30) == min(o.max_batch_bytes, 10 * 2**30)
    assert staging_limit(outs, None, "gpu", o, free=6 * 2**30) == 2**30
    assert staging_limit(outs, None, "auto", o, free=2**20) == 128 * 2**20
    assert staging_limit(outs, None, "cpu", o, free=60 * 2**30) == 512 * 2**20  # CPU threads decode
    assert staging_limit(outs, 2**31, "auto", o, free=60 * 2**30) == 2**31


def test_a_one_chunk_read_runs_on_the_calling_thread(tmp_path, monkeypatch):
    """Nothing else to wait for: the single job skips the pool's hand-off; more chunks use it."""
    import threading

    from cupy_xarray.engine import host as host_route

    seen = []
    real = host_route._timed_job

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(host_route, "_timed_job", spy)
    a = _store(tmp_path, "zstd", (8, 64, 64), (4, 32, 32))
    spec = array_spec(a)
    one = read_arrays([(spec, (slice(0, 4), slice(0, 32), slice(0, 32)))], resolve_device("cpu"))[0]
    np.testing.assert_array_equal(one, a[0:4, 0:32, 0:32])
    assert seen == [threading.current_thread().name]
    seen.clear()
    whole = read_arrays([(spec, (slice(None),) * 3)], resolve_device("cpu"))[0]
    np.testing.assert_array_equal(whole, a[:])
    assert len(seen) == 8 and all(name.startswith("cupy-xarray-decode") for name in seen)
    # a few small uncompressed chunks are read one after the other on the calling thread
    seen.clear()
    raw = array_spec(_store(tmp_path / "raw", "none", (8, 64, 64), (4, 32, 32)))
    small = read_arrays([(raw, (slice(2, 6), slice(20, 40), slice(None)))], resolve_device("cpu"))[0]
    np.testing.assert_array_equal(small, zarr.open_array(raw.directory)[2:6, 20:40, :])
    assert len(seen) == 8 and set(seen) == {threading.current_thread().name}
