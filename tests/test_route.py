"""The scheduler: which route each chunk takes, the times that choose between the GPU, the
CPU threads and both (and their calibration), and the same values whichever way a chunk went (tiles, slabs,
selections, threads, every route forced)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from conftest import host, run_in_threads

from cupy_xarray.engine import array_spec, observed, read_arrays
from cupy_xarray.engine import rates as cal
from cupy_xarray.engine import route as sch
from cupy_xarray.engine.devices import resolve_device
from cupy_xarray.engine.route import Scheduler
from cupy_xarray.engine.spec import ChunkRecipe
from cupy_xarray.options import get_options


def _tasks(codecs: tuple[str, ...], count: int, nbytes: int = 4 * 2**20):
    recipe = ChunkRecipe((nbytes // 4,), np.dtype("f4"), bytes_codecs=codecs)
    spec = SimpleNamespace(recipe=recipe, name="field")
    return [SimpleNamespace(spec=spec, nbytes=nbytes) for _ in range(count)]


GPU = SimpleNamespace(name="gpu", threads=16)
CPU = SimpleNamespace(name="cpu", threads=16)
RATES = {k: v for k, v in sch.DEFAULT_RATES.items()}


def at(device, decode="auto"):
    """What the scheduler asks of a read (:class:`~cupy_xarray.engine.read.Read`): where it
    goes, its decode choice and the settings in effect now, and that it ran alone."""
    alone = SimpleNamespace(crowded=False)
    return SimpleNamespace(device=device, decode=decode, options=get_options(), clock=alone)


@pytest.mark.parametrize("without", [{"decoder_process": "off"}, {"nvcomp_c": False}, {}])
def test_auto_keeps_unsafe_streams_on_cpu_threads(without, options, monkeypatch):
    """Without the decoder process (off, nvCOMP's Python API only, or no C API to load),
    zstd frames no check proves stay off nvCOMP, and the decision says so."""
    from cupy_xarray.runtime import nvcomp

    monkeypatch.setattr(nvcomp, "library", lambda: object() if without else None)
    options(**{"decoder_process": "auto", **without})
    routes, d = Scheduler(RATES).routes(_tasks(("zstd",), 500), at(GPU, "auto"))
    assert set(routes) == {"host"} and d.host == 500 and d.gpu == 0 and not d.shared
    assert "does not report damaged frames" in d.why
    assert not sch.chain_route(("zstd",), at(GPU)).nvcomp


def test_unproven_streams_are_shared_and_decode_in_the_decoder_process(options, c_api):
    """With the decoder process, decode='auto' shares zstd frames (and Blosc's blocks) no
    check has proven between both processors, and nvCOMP decodes its part in that process."""
    options(decoder_process="auto")
    s = Scheduler(RATES)
    for codecs in [("zstd",), ("blosc-zstd",)]:
        many, d = s.routes(_tasks(codecs, 1024), at(GPU, "auto"))
        assert set(many) != {"host"} and d.gpu + d.shared > 0, d  # nvCOMP takes part
    one, d = s.routes(_tasks(("zstd",), 1), at(GPU, "auto"))
    assert one == ["host"] and not d.shared  # a one-chunk selection keeps its CPU route
    assert sch.chain_route(("zstd",), at(CPU)).isolated is False
    assert sch.isolable(("zstd",)) and sch.isolable(("gzip",))
    assert not sch.isolable(("crc32c", "zstd")) and not sch.isolable(("blosc-lz4",))


def test_blosc_zstd_streams_go_to_the_decoder_process_where_nvcomp_decodes_them(options):
    """Blosc's zstd blocks are frames nvCOMP may fault on, as a zstd chunk is: with
    decode='gpu' they decode in the decoder process (on the CPU, as CI runs it, with
    decoder_process='on')."""
    assert sch.isolable(("blosc-zstd",)) and not sch.isolable(("crc32c", "blosc-zstd"))
    options(decoder_process="on")
    assert sch.chain_route(("blosc-zstd",), at(CPU, "gpu")).isolated
    routes, d = Scheduler(RATES).routes(_tasks(("blosc-zstd",), 500), at(GPU, "gpu"))
    assert set(routes) == {"batch"} and d.gpu == 500


@pytest.fixture
def paces():
    observed.forget()
    yield
    observed.forget()


@pytest.mark.parametrize("codecs", [("gzip",), ("lz4",), ("blosc-lz4",), ("zstd",)])
def test_a_split_is_chosen_by_the_time_each_end_takes(codecs, paces, c_api):
    """A selection of a chunk goes to CPU threads (an nvCOMP call costs more than decoding
    it); whichever route is chosen, it is the one the figures say ends first, and a split
    ends sooner than either processor alone by the margin."""
    s = Scheduler(RATES)
    one, d = s.routes(_tasks(codecs, 1), at(GPU, "auto"))
    assert one == ["host"] and "CPU threads alone" in d.why, d
    for count in (2, 16, 64, 256, 1024, 4096):
        tasks = _tasks(codecs, count)
        split = s.split(tasks, at(GPU), sch.stream_kind(codecs))
        gpu_ms, cpu_ms = (
            float(x) for x in re.findall(r"nvCOMP call (\d+) ms, CPU threads (\d+) ms", split.why)[0]
        )
        if split.route == "share":
            both = float(re.findall(r"both (\d+) ms", split.why)[0])
            assert both <= 0.9 * min(gpu_ms, cpu_ms) + 1, split
            assert 0 < split.front_bytes < count * 4 * 2**20 and split.fixed_s > 0
        else:
            assert (split.route == "host") == (cpu_ms <= gpu_ms), split


def _saw(what, key, kind, *args):
    """An observation after the warm-up one (which is not learned from)."""
    getattr(observed, f"saw_{what}")(key, kind, *args)
    getattr(observed, f"saw_{what}")(key, kind, *args)


def test_the_pace_seen_moves_the_route(paces, monkeypatch):
    """What reads saw decides: a GPU seen slow sends a large zstd read to CPU threads, CPU
    threads seen slow send it to nvCOMP; between them both share it."""
    s = Scheduler(RATES)
    key = sch.seen_on(at(GPU))
    tasks = _tasks(("zstd",), 1024)
    monkeypatch.setattr(observed, "saw_gpu", lambda *a, f=observed.saw_gpu: f(*a) or f(*a))
    monkeypatch.setattr(observed, "saw_pool", lambda *a, f=observed.saw_pool: f(*a) or f(*a))
    observed.saw_gpu(key, "zstd", 50.0, 1.0)  # nvCOMP took 50x the figures (clipped to 20x)
    assert s.split(tasks, at(GPU), "zstd").route == "host"
    observed.saw_gpu(key, "blosc-zstd", 1.0, 1.0)  # another chain's pace is its own
    assert s.split(tasks, at(GPU), "zstd").route == "host"
    observed.forget()
    observed.saw_pool(key, "zstd", 2**20, 1.0)  # the threads did 1 MiB/s
    assert s.split(tasks, at(GPU), "zstd").route == "batch"
    observed.forget()
    observed.saw_pool(key, "zstd", 8 * 10**9, 1.0)  # 8 GB/s on the CPU, figures on the GPU
    observed.saw_gpu(key, "zstd", 2.0, 1.0)
    split = s.split(tasks, at(GPU), "zstd")
    assert split.route == "share", split
    assert observed.pace("gpu", "zstd").pool == 8e9


def _both_warm() -> str:
    """Paces seen for both processors (after their warm-up): CPU threads at 8 GB/s, nvCOMP at
    twice its figures' time, so that large zstd reads are shared; the device's key."""
    key = sch.seen_on(at(GPU))
    _saw("pool", key, "zstd", 8 * 10**9, 1.0)
    _saw("gpu", key, "zstd", 2.0, 1.0)
    return key


def test_the_margin_keeps_a_split_that_gains_little_away(paces, options):
    s = Scheduler(RATES)
    tasks = _tasks(("zstd",), 1024)
    _both_warm()
    assert s.split(tasks, at(GPU), "zstd").route == "share"
    options(share_margin=0.99)
    assert s.split(tasks, at(GPU), "zstd").route in ("host", "batch")


def _planned(count: int):
    return [SimpleNamespace(direct=None, **vars(t)) for t in _tasks(("zstd",), count)]


def test_a_route_that_ran_slower_than_its_figures_is_charged_for_it(paces, c_api):
    """A split that took three times its figures is not chosen again for reads of that size
    (reads of another size keep their own factor); the route chosen instead keeps the reads
    once it ran as figured. Nothing is learned before the route's processors warmed up."""
    s, key = Scheduler(RATES), sch.seen_on(at(GPU))
    assert s.plan(_planned(1024), at(GPU, "auto")).model is None  # nothing warm yet
    _both_warm()
    plan = s.plan(_planned(1024), at(GPU, "auto"))
    kind, route, nbytes, model_s = plan.model
    assert (kind, route, nbytes) == ("zstd", "share", 1024 * 4 * 2**20) and model_s > 0
    s.saw_read(plan, at(GPU), 3 * model_s)
    assert observed.outcome(key, "zstd", "share", nbytes) == 3.0
    assert observed.outcome(key, "zstd", "share", nbytes // 16) is None
    again = s.plan(_planned(1024), at(GPU, "auto"))
    assert again.model[1] in ("host", "batch") and again.decisions[0].route == again.model[1]
    assert not again.shared and again.decisions[0].why.startswith(("CPU threads alone", "nvCOMP alone"))
    s.saw_read(again, at(GPU), again.model[3])
    assert s.plan(_planned(1024), at(GPU, "auto")).model[1] == again.model[1]
    assert s.plan(_planned(4096), at(GPU, "auto")).decisions[0].route == "share"  # another size
    forced = Scheduler(RATES, force="share")
    forced.saw_read(plan, at(GPU), 100 * model_s)  # a forced route teaches nothing
    assert observed.outcome(key, "zstd", "share", nbytes) == 3.0


def test_a_close_route_is_tried_once_at_a_size(paces, c_api, options):
    """With ``route_explore``, a processor alone never read at a size whose figures come
    close to the learned route's time is tried once; whichever then ran faster keeps the
    reads. Without it, or where its figures are further off, it is not tried."""
    s = Scheduler(RATES)
    _both_warm()
    tasks = _planned(64)
    first = s.plan(tasks, at(GPU, "auto"))
    _, chosen, _, model_s = first.model
    assert chosen in ("host", "batch")
    other = "batch" if chosen == "host" else "host"
    s.saw_read(first, at(GPU), model_s)  # ran as figured
    why = s.split(tasks, at(GPU), "zstd").why
    ms = {"batch": r"call (\d+) ms", "host": r"threads (\d+) ms"}
    t = {r: float(re.search(pattern, why).group(1)) / 1e3 for r, pattern in ms.items()}
    ratio = t[other] / t[chosen]
    options(route_explore=0.9 * ratio)
    assert s.plan(tasks, at(GPU, "auto")).model[1] == chosen
    options(route_explore=1.1 * ratio)
    tried = s.plan(tasks, at(GPU, "auto"))
    assert tried.model[1] == other and "tried at this size" in tried.decisions[0].why
    s.saw_read(tried, at(GPU), 0.5 * t[chosen])  # it ran in half the chosen route's time
    again = s.plan(tasks, at(GPU, "auto"))
    assert again.model[1] == other and "tried" not in again.decisions[0].why  # and keeps the reads
    for _ in range(3):
        s.saw_read(again, at(GPU), 10 * t[chosen])  # until it runs slow
    assert s.plan(tasks, at(GPU, "auto")).model[1] == chosen


def test_a_route_seen_slow_once_is_tried_again(paces, c_api, options):
    """With ``route_forget``, a route charged for one slow read forgets a share of its
    charge for each read of that size that goes elsewhere, until the figures send a read
    back to it; run slow again, it is charged what it had learned at once. Without it the
    charge stays for good."""
    s, key = Scheduler(RATES), _both_warm()
    tasks = _planned(64)
    first = s.plan(tasks, at(GPU, "auto"))
    _, chosen, nbytes, model_s = first.model
    s.saw_read(first, at(GPU), 4 * model_s)  # one slow read: charged fourfold
    for _ in range(20):
        plan = s.plan(tasks, at(GPU, "auto"))
        assert plan.model[1] != chosen
        s.saw_read(plan, at(GPU), plan.model[3])  # the other route runs as figured
    assert observed.outcome(key, "zstd", chosen, nbytes) == 4.0
    assert observed.outcome(key, "zstd", chosen, nbytes, forget=0.5) < 1.01  # (20 reads since)
    observed.saw_outcome(key, "zstd", chosen, nbytes, 4 * model_s, model_s)  # learned again
    options(route_forget=0.5)
    reads = 0
    while (plan := s.plan(tasks, at(GPU, "auto"))).model[1] != chosen and reads < 20:
        s.saw_read(plan, at(GPU), plan.model[3])
        reads += 1
    assert plan.model[1] == chosen and 0 < reads < 10, reads
    s.saw_read(plan, at(GPU), 4 * model_s)  # slow again: its whole factor, not the forgotten one
    assert observed.outcome(key, "zstd", chosen, nbytes, forget=0.5) == 4.0
    assert s.plan(tasks, at(GPU, "auto")).model[1] != chosen


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_route_forget_is_a_share(share):
    from cupy_xarray import set_options

    with pytest.raises(ValueError, match="route_forget must be between 0 and 1"):
        set_options(route_forget=share)


def test_a_factor_learned_from_more_reads_is_forgotten_more_slowly(paces):
    key = "gpu"
    for reads, nbytes in ((1, 2**20), (4, 2**30)):
        for _ in range(reads):
            observed.saw_outcome(key, "zstd", "batch", nbytes, 3.0, 1.0)
        for _ in range(3):
            observed.passed_over(key, "zstd", "batch", nbytes)
    once = observed.outcome(key, "zstd", "batch", 2**20, forget=0.3)
    often = observed.outcome(key, "zstd", "batch", 2**30, forget=0.3)
    assert 1.0 < once < often < 3.0
    assert observed.outcome(key, "zstd", "batch", 2**30) == 3.0
    assert observed.outcome(key, "zstd", "batch", 2**30, forget=1.0) == 3.0 ** (0.75**3)


def test_the_threads_pace_beside_the_batches_is_kept_apart(paces):
    """The CPU threads slowed beside the batches do not make them look slow alone: the pace
    of a shared queue's back is its own figure."""
    s, key = Scheduler(RATES), sch.seen_on(at(GPU))
    _saw("pool", key, "zstd", 8 * 10**9, 1.0)
    _saw("gpu", key, "zstd", 20.0, 1.0)  # a slow GPU: the threads alone
    assert s.split(_planned(1024), at(GPU), "zstd").route == "host"
    observed.saw_pool(key, "zstd", 2**20, 1.0, shared=True)
    observed.saw_pool(key, "zstd", 2**20, 1.0, shared=True)
    seen = observed.pace(key, "zstd")
    assert seen.pool == 8e9 and seen.pool_shared == 2**20
    assert s.split(_planned(1024), at(GPU), "zstd").route == "host"


def test_a_pace_mixes_what_reads_saw(paces):
    """The first observation (a process's first call: kernels loaded, threads started) is not
    learned from; later ones are mixed in, each moving a figure at most threefold."""
    observed.saw_gpu("k", "zstd", 30.0, 1.0)  # 2 s where 70 ms is the pace: a warm-up
    assert observed.pace("k", "zstd").gpu_k == 1.0
    observed.saw_io("k", "zstd", 1, 1.0)
    observed.saw_io("k", "zstd", 10, 1.0)
    observed.saw_io("k", "zstd", 30, 1.0)
    assert observed.pace("k", "zstd").io == 20 and observed.pace("k", "zstd").io_seen == 2
    observed.saw_io("k", "zstd", 10**6, 1.0)  # one read at 50,000x: three times at most
    assert observed.pace("k", "zstd").io == 0.5 * 20 + 0.5 * 60
    observed.saw_gpu("k", "zstd", -1, 1.0)  # nothing to learn from
    assert observed.pace("k", "zstd").gpu_seen == 0
    assert observed.pace("other", "zstd").pool == 0


def test_equal_recipes_share_a_key():
    """Variables stored alike are routed together and decoded in one call."""
    a = ChunkRecipe((8,), np.dtype("f4"), bytes_codecs=("zstd",))
    b = ChunkRecipe((8,), np.dtype("f4"), bytes_codecs=("zstd",))
    c = ChunkRecipe((8,), np.dtype("f8"), bytes_codecs=("zstd",))
    assert a is not b and a.key == b.key != c.key


def test_decode_choice_overrides_the_model():
    s = Scheduler(RATES)
    for codecs in [("zstd",), ("gzip",), ("blosc-zstd",)]:
        assert set(s.routes(_tasks(codecs, 64), at(GPU, "gpu"))[0]) == {"batch"}
        assert set(s.routes(_tasks(codecs, 64), at(GPU, "cpu"))[0]) == {"host"}
    # uncompressed tiles: a large read is staged with the batches (kvikio), a small one (a
    # dask task, a selection) goes to CPU threads; a CPU read uses its threads
    assert set(s.routes(_tasks((), 64), at(GPU, "auto"))[0]) == {"batch"}
    assert set(s.routes(_tasks((), 2), at(GPU, "auto"))[0]) == {"host"}
    # fetched bytes are in host memory already: copied from there, however many
    fetched = _tasks((), 64)
    for t in fetched:
        t.blob = np.zeros(1, np.uint8)
    assert set(s.routes(fetched, at(GPU, "auto"))[0]) == {"host"}
    assert set(s.routes(_tasks(("gzip",), 64), at(CPU, "gpu"))[0]) == {"host"}
    assert Scheduler(force="batch").routes(_tasks(("zstd",), 3), at(GPU, "cpu"))[0] == ["batch"] * 3
    assert Scheduler(force="share").routes(_tasks(("zstd",), 3), at(CPU, "cpu"))[0] == ["share"] * 3
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
    assert s.direct_routes(direct(1, 4 * 2**20), at(GPU)) == ["host"]
    assert s.direct_routes(direct(4), at(GPU)) == ["host"] * 4
    assert s.direct_routes(direct(5), at(GPU)) == ["batch"] * 5
    assert s.direct_routes(direct(1, 16 * 2**20), at(GPU)) == ["batch"]
    assert s.direct_routes(direct(2), at(CPU)) == ["batch"] * 2
    assert Scheduler(force="host").direct_routes(direct(64), at(CPU)) == ["host"] * 64


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch, options):
    options(cache_dir=str(tmp_path))
    monkeypatch.setattr(cal, "_cache", {})
    calls = []
    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda kind, dev: calls.append(kind) or real(kind, dev))
    cpu = resolve_device("cpu")
    r = cal.rates("gzip", cpu, get_options())
    assert r.measured and r.host_thread > 1e6 and calls == ["gzip"]
    stored = json.loads((tmp_path / "decode-rates.json").read_text())
    (key,) = stored
    assert key.endswith("|gzip") and stored[key]["host_thread"] == r.host_thread
    monkeypatch.setattr(cal, "_cache", {})  # a new process: the file answers
    assert cal.rates("gzip", cpu, get_options()) == r and calls == ["gzip"]
    options(calibrate=False)
    assert cal.rates("zstd", cpu, get_options()) == sch.DEFAULT_RATES["zstd"] and calls == ["gzip"]


def test_reads_never_measure_rates(tmp_path, monkeypatch, options):
    """A read seeds the shared queue with the rates measured before (warm_up measures them)
    or the built-in ones: it never waits for a measurement."""
    options(cache_dir=str(tmp_path))
    monkeypatch.setattr(cal, "_cache", {})
    monkeypatch.setattr(cal, "calibrate", lambda kind, dev: pytest.fail("a read measured rates"))
    cpu = resolve_device("cpu")
    assert cal.known_rates("gzip", at(cpu)) == sch.DEFAULT_RATES["gzip"]
    measured = cal.Rates(1e9, 10e9, 1e9, 1e-3, True, host_pool=8e9)
    key = f"{cal.machine_key(cpu)}|gzip"
    (tmp_path / "decode-rates.json").write_text(json.dumps({key: cal.asdict(measured)}))
    monkeypatch.setattr(cal, "_cache", {})
    assert cal.known_rates("gzip", at(cpu)) == measured


def test_warm_up_measures_the_rates_when_asked(tmp_path, monkeypatch, options):
    import cupy_xarray

    options(cache_dir=str(tmp_path))
    monkeypatch.setattr(cal, "_cache", {})
    cupy_xarray.warm_up(device="cpu")
    assert not (tmp_path / "decode-rates.json").exists()
    cupy_xarray.warm_up(device="cpu", measure=True)
    stored = json.loads((tmp_path / "decode-rates.json").read_text())
    assert {k.rsplit("|", 1)[-1] for k in stored} == set(cal.STREAMS)
    assert all(v["measured"] for v in stored.values())
    assert cal.known_rates("zstd", at(resolve_device("cpu"))).measured


def test_calibration_keeps_the_nvcomp_figures_of_blosc_blocks():
    """Bare 64 KiB LZ4 blocks cannot show what whole Blosc reads get from nvCOMP: only the
    CPU thread is measured for them; bare streams of the other kinds measure the GPU too."""
    decoded = []

    class Codecs:
        available = True

        def decode(self, kind, srcs, expected, on_gpu=True):
            decoded.append((kind, len(srcs)))

    gpu = SimpleNamespace(name="gpu", xp=np, codecs=Codecs(), synchronize=lambda: None)
    r = cal.calibrate("lz4-block", gpu)
    base = sch.DEFAULT_RATES["lz4-block"]
    assert r.measured and (r.gpu, r.gpu_stream, r.gpu_call) == (base.gpu, base.gpu_stream, base.gpu_call)
    assert decoded == []
    r = cal.calibrate("gzip", gpu)
    assert decoded and decoded[0][0] == "gzip" and r.gpu != sch.DEFAULT_RATES["gzip"].gpu


def test_the_reason_names_both_processors():
    s = Scheduler(RATES)
    _, d = s.routes(_tasks(("gzip",), 1), at(GPU, "auto"))
    assert d.gpu == 0 and "nvCOMP call" in d.why and "CPU threads" in d.why
    _, d = s.routes(_tasks(("gzip",), 1024), at(GPU, "auto"))
    assert d.shared and "shared" in d.why and "both" in d.why, d  # gzip: the GPU's 2.8 GB/s beside 1.7
    d.gpu, d.host = 700, 324  # what each end took, written in after the read
    assert "700 chunks to nvCOMP, 324 to CPU threads" in str(d)


@pytest.mark.parametrize("kind", ["zstd", "gzip", "zlib", "lz4", "lz4-block"])
def test_sample_streams_decode_to_their_size(kind):
    from cupy_xarray.engine.decoders import stream

    (s,), n = sample_streams_one(kind)
    assert len(stream(kind).decode_host(s, n)) == n and len(s) < n


def sample_streams_one(kind):
    return cal.sample_streams(kind, 1, 2**16)


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
    # what only a GPU read chooses is not printed for a CPU read
    assert "staging" not in str(report) and "decode=" not in str(report) and "to the cpu" in str(report)
    report.device = "gpu"
    assert "staging 0.0 MiB, decode='auto'" in str(report)


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
    forced = [Scheduler(force=route) for route in ("batch", "host", "share")]
    _check_all_routes(tmp_path, "cpu", ["auto"], [None, *forced])


@pytest.mark.gpu
def test_every_route_reads_the_same_gpu(tmp_path):
    """decode="gpu", "cpu" and "auto" (and each route forced) on the GPU: bitwise zarr-python's."""
    _check_all_routes(tmp_path, "gpu", ["auto", "gpu", "cpu"], [None])
    forced = [Scheduler(force=route) for route in ("batch", "host", "share")]
    _check_all_routes(tmp_path, "gpu", ["auto"], forced)


@pytest.mark.gpu
def test_default_reads_learn_their_route_factor(tmp_path, paces):
    """Default GPU reads of a store the model routes learn what their route took over its
    figures (after a warm-up read), and read zarr-python's values each time."""
    arr = _store(tmp_path, "zstd", (256, 256, 256), (4, 256, 256))  # 64 chunks: the pool's pace is seen
    spec, dev, want = array_spec(arr, name="zstd"), resolve_device("gpu"), arr[:]
    sel = (slice(None),) * 3
    for _ in range(4):
        (got,) = read_arrays([(spec, sel)], dev, decode="auto")
        np.testing.assert_array_equal(host(got), want)
    assert observed._outcomes, "no route factor learned"
    assert {k[1] for k in observed._outcomes} == {"zstd"}


@pytest.mark.gpu
def test_without_the_c_api_a_default_read_reports_what_decoded(tmp_path, options, paces):
    """With ``nvcomp_c=False`` (nvCOMP's Python API only: no decoder process), a default read
    of zstd frames no check proves, which the figures would send to nvCOMP, decodes on CPU
    threads and its report says so; zarr-python's values either way."""
    from cupy_xarray import record_reads
    from cupy_xarray.engine.decoders import Rates

    arr = _store(tmp_path, "zstd", (64, 256, 256), (4, 256, 256))
    spec, dev, want = array_spec(arr, name="zstd"), resolve_device("gpu"), arr[:]
    fast_gpu = {"zstd": Rates(host_thread=1e6, gpu=1e13, gpu_stream=1e13, gpu_call=1e-6)}
    sel = (slice(None),) * 3
    for c_api in (True, False):
        options(nvcomp_c=c_api)
        with record_reads() as reports:
            (got,) = read_arrays([(spec, sel)], dev, decode="auto", scheduler=Scheduler(fast_gpu))
        np.testing.assert_array_equal(host(got), want)
        (d,) = reports[-1].decisions
        if c_api:  # the figures send the frames to nvCOMP, in the decoder process
            assert d.gpu == 16 and d.host == 0, str(d)
        else:
            assert d.gpu == 0 and d.host == 16 and not d.shared, str(d)
            assert "16 to CPU threads" in str(reports[-1])


@pytest.mark.parametrize("gather", ["off", "on"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_concurrent_mixed_reads(tmp_path, device, gather, options):
    """16 threads, each reading random selections of stores of every codec with every decode
    choice at once, gathered across threads or not: every result equals zarr-python's."""
    options(gather=gather)
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


def test_reads_beside_other_reads_are_marked_crowded():
    """Two reads that overlap are each marked crowded (fewer uncompressed batches in flight);
    a read alone again is not."""
    from cupy_xarray.engine.read import RUNNING, Clock

    clock = Clock()
    with RUNNING.running(clock):
        pass
    assert not clock.crowded
    first, second = Clock(), Clock()
    with RUNNING.running(first):
        with RUNNING.running(second):  # a second read starts while the first runs
            pass
    assert first.crowded and second.crowded
    alone = Clock()
    with RUNNING.running(alone):
        pass
    assert not alone.crowded


def test_batch_size_is_chosen_per_read_unless_given():
    from cupy_xarray import get_options
    from cupy_xarray.engine.batches import staging_limit

    o = get_options()
    most = o.default_batch_bytes

    def of(outs, batch_bytes, decode):  # a read with these outputs and choices
        return SimpleNamespace(outs=outs, batch_bytes=batch_bytes, decode=decode, options=o)

    gib = np.empty(0)  # outputs only count their bytes
    outs = [SimpleNamespace(nbytes=4 * 2**30), gib]
    assert staging_limit(of(outs, None, "auto")) == 512 * 2**20  # an eighth of 4 GiB
    assert staging_limit(of([SimpleNamespace(nbytes=2**20)], None, "cpu")) == 128 * 2**20
    assert staging_limit(of([SimpleNamespace(nbytes=2**40)], None, "auto")) == most
    assert staging_limit(of(outs, None, "gpu")) == most
    assert staging_limit(of(outs, 2**31, "auto")) == 2**31  # what the user asked for
    assert staging_limit(of(outs, 1000, "gpu")) == 1000
    # a GPU read nvCOMP decodes: a third of its share of the free memory, within bounds
    assert staging_limit(of(outs, None, "auto"), free=60 * 2**30) == min(o.max_batch_bytes, 10 * 2**30)
    assert staging_limit(of(outs, None, "gpu"), free=6 * 2**30) == 2**30
    assert staging_limit(of(outs, None, "auto"), free=2**20) == 128 * 2**20
    assert staging_limit(of(outs, None, "cpu"), free=60 * 2**30) == 512 * 2**20  # CPU threads decode
    assert staging_limit(of(outs, 2**31, "auto"), free=60 * 2**30) == 2**31


def test_a_one_chunk_read_runs_on_the_calling_thread(tmp_path, monkeypatch):
    """Nothing else to wait for: the single job skips the pool's hand-off; more chunks use it."""
    import threading

    from cupy_xarray.engine import host as host_route

    seen = []
    real = host_route.Jobs.run_task

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(host_route.Jobs, "run_task", spy)
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


def test_a_starting_decoder_process_is_charged_to_the_routes_that_wait_for_it(options, c_api, paces):
    """A read sent before the decoder process has started (a process's first read after open)
    goes where it ends first counting that wait: a 4 GiB read of unproven zstd frames to the
    CPU threads, with the reason, a 64 GiB one still with nvCOMP; without the wait, or with
    the ``route_start_wait`` option off (it is on by default), the figures alone decide."""
    options(decoder_process="auto", route_start_wait=True)
    starting = Scheduler(RATES, start_wait=lambda: 1.5)
    routes, d = starting.routes(_tasks(("zstd",), 1024), at(GPU))
    assert set(routes) == {"host"} and "the decoder process starts in 1500 ms" in d.why, d
    huge, d = starting.routes(_tasks(("zstd",), 16384), at(GPU))
    assert set(huge) != {"host"} and d.gpu + d.shared > 0, d
    started = Scheduler(RATES, start_wait=lambda: 0.0)
    assert set(started.routes(_tasks(("zstd",), 1024), at(GPU))[0]) != {"host"}
    options(route_start_wait=False)
    assert set(starting.routes(_tasks(("zstd",), 1024), at(GPU))[0]) != {"host"}
    # proven frames never wait for the decoder process: they decode in this one
    options(route_start_wait=True)
    assert "decoder process" not in (starting.routes(_tasks(("crc32c", "zstd"), 1024), at(GPU))[1].why)
