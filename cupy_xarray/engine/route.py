"""The one place a read's routes are decided: where each chunk is read, decoded and placed.

A read's chunks are grouped by recipe, and the :class:`Scheduler` gives each chunk a route
(:meth:`Scheduler.plan`); every other stage follows its answer:

``"batch"``
    Read into staging with its batch, decoded by ``Device.codecs`` in one call per codec
    (nvCOMP on the GPU), scattered (:mod:`.reader`).
``"host"``
    Read, decoded and checked by one CPU thread, then placed into the output (copied to
    the GPU for a GPU read) (:mod:`.host`).

Each group of one recipe gets one frozen :class:`Route` (way, who decodes its streams, whether
in the decoder process, why), which the decoders follow (:class:`~.tasks.Group` carries it);
fetched bytes land in pinned memory where they go to the GPU as they are
(:func:`lands_pinned`); large uncompressed reads are planned batch by batch
(:meth:`Scheduler.streams`); arrays the engine does not decode go to zarr-python
(``ArraySpec.fallback``, decided when the array is opened).

``decode="gpu"`` sends every compressed chunk of a GPU read to nvCOMP, ``"cpu"`` every one
to CPU threads. ``"auto"`` sends to nvCOMP only the streams it decodes safely
(:func:`safe_on_gpu`, or in the decoder process), and sends each group of
those to the processor that ends it first, or splits it between both where that ends sooner
(:meth:`Scheduler.split`, at the pace this process's reads saw: :mod:`.observed`; a split's
chunks wait in one queue, ``"share"``: :mod:`.share`). A group too small for one nvCOMP call
to pay (a one-chunk selection, a dask task) goes to CPU threads alone. A CPU read decodes
every chunk on the host route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..runtime import nvcomp
from . import observed, sandbox
from .decoders import Rates, compressor, proven, stream, stream_bytes, stream_kind
from .rates import DEFAULT_RATES, known_rates

log = logging.getLogger("cupy_xarray")


@dataclass(frozen=True)
class Route:
    """Where one group of a read's chunks (one recipe) goes, who decodes it, and why; made
    here alone, and followed by every other stage.

    Attributes
    ----------
    way
        ``"host"`` (CPU threads, a chunk per job), ``"batch"`` (staged, decoded in batched
        calls) or ``"share"`` (one queue both take from); None before the cost model chose
        (:meth:`Scheduler.split`).
    decoder
        Who decodes a batched group's streams: ``"nvcomp"``, ``"threads"`` (CPU threads, for
        a GPU read: streams ``decode`` keeps off nvCOMP), ``"cpu"`` (a CPU read's batch
        decoders) or ``"none"`` (no compressor).
    isolated
        The streams are decoded in the decoder process (:mod:`.sandbox`).
    why
        The reason, as the read's report says it.
    """

    way: str | None
    decoder: str
    isolated: bool = False
    why: str = ""

    @property
    def nvcomp(self) -> bool:
        """nvCOMP decodes the group's streams where they are decoded in batches."""
        return self.decoder == "nvcomp"

    @property
    def batch_decoders(self) -> bool:
        """The device's batch decoders take the group (nvCOMP, or a CPU read's), not CPU
        threads standing in for nvCOMP on a GPU read."""
        return self.decoder != "threads"


@dataclass
class RoutePlan:
    """A read's tasks split by route: ``batched`` (staged, decoded in batched calls),
    ``on_host`` (CPU threads, a chunk per job), ``shared`` (either, as they come free), with
    each recipe's :class:`Route` (by ``recipe.key``) and the decisions with their reasons."""

    batched: list
    on_host: list
    routes: dict[int, Route]
    decisions: list
    shared: list = field(default_factory=list)  # taken by either processor (:mod:`.share`)
    front_bytes: int | None = None  # decoded bytes of ``shared`` the batches take first (None: half)
    fixed_s: float = 0.0  # the least seconds of one nvCOMP call of the shared chunks
    #: where the model routed every chunk, one route and one stream kind, its routes warm:
    #: (kind, route, decoded bytes, the model's seconds), learned from (:meth:`Scheduler.saw_read`)
    model: tuple[str, str, int, float] | None = None

    def route_of(self, recipe: Any, read: Any) -> Route:
        """A recipe's route; for one located after the plan (a streamed request's, every
        piece of which goes with the batches: :meth:`Scheduler.streams`), ``"batch"``."""
        route = self.routes.get(recipe.key)
        if route is None:
            route = replace(chain_route(recipe.bytes_codecs, read), way="batch", why="streamed")
            self.routes[recipe.key] = route
        return route


@dataclass
class Decision:
    """The routes a group of chunks (one recipe) got, and why."""

    array: str
    codec: str
    gpu: int
    host: int
    why: str
    kind: str = ""
    key: int = 0  # the recipe's key (:attr:`~.spec.ChunkRecipe.key`)
    shared: bool = False  # both processors took from one queue: ``gpu``/``host`` say what each took
    front_bytes: int = 0  # shared: decoded bytes the batches were planned to take
    fixed_s: float = 0.0  # shared: the seconds an nvCOMP call of these chunks costs at the least
    model_s: float = 0.0  # chosen by the model: the seconds its figures gave the route (0: not)
    warm: bool = False  # chosen by the model with what the route runs on warm (:meth:`.observed.Pace.warm`)
    nbytes: int = 0  # chosen by the model: the group's decoded bytes

    @property
    def route(self) -> str:
        """``"share"``, ``"batch"`` or ``"host"``: where the group went."""
        return "share" if self.shared else "batch" if self.gpu else "host"

    def __str__(self) -> str:
        where = f"{self.gpu} chunks to nvCOMP, {self.host} to CPU threads"
        return f"{self.array}: {self.codec}: {where} ({self.why})"


class Scheduler:
    """Give each chunk of a group a route: ``"batch"``, ``"host"`` or ``"share"``.

    Every method takes the read (a :class:`~.read.Read`, or anything with its ``device``,
    ``decode`` and ``options``).

    Parameters
    ----------
    rates
        Rates per stream kind, the figures :meth:`split` starts from; default: this
        machine's where measured (:func:`known_rates`), else :data:`DEFAULT_RATES`.
    force
        ``"host"``, ``"batch"`` or ``"share"``: one route for every chunk (tests run each on
        the CPU; ``"share"`` plans half for each end, so that both take work).
    start_wait
        Seconds a batch sent now would wait for the decoder process to start
        (:func:`.sandbox.start_wait`): charged to the routes on which it decodes.
    """

    def __init__(
        self,
        rates: dict[str, Rates] | None = None,
        force: str | None = None,
        start_wait: Callable[[], float] = sandbox.start_wait,
    ) -> None:
        if force not in (None, "host", "batch", "share"):
            raise ValueError(f"force must be 'host', 'batch' or 'share', got {force!r}")
        self._rates = rates
        self.force = force
        self.start_wait = start_wait

    def plan(self, tasks: list[Any], read: Any) -> RoutePlan:
        """Give every located task its route."""
        batched, on_host, shared, groups, direct = [], [], [], {}, []
        for t in tasks:
            if t.direct is not None:
                direct.append(t)
            else:
                groups.setdefault(t.spec.recipe.key, []).append(t)
        if direct:
            for t, r in zip(direct, self.direct_routes(direct, read)):
                (on_host if r == "host" else batched).append(t)
        decisions, routes = [], {}
        modelled = not direct
        front, fixed = 0, 0.0
        by_route = {"host": on_host, "batch": batched, "share": shared}
        for key, group in groups.items():
            way, decision = self.routes(group, read)
            for t in group:
                by_route[way[0]].append(t)
            if way[0] == "share" and decision is not None:
                front += (
                    decision.front_bytes
                    if self.force is None
                    else sum(t.spec.recipe.nbytes for t in group) // 2
                )
                fixed = max(fixed, decision.fixed_s)
            why = decision.why if decision is not None else ""
            routes[key] = replace(chain_route(group[0].spec.recipe.bytes_codecs, read), way=way[0], why=why)
            modelled = modelled and decision is not None and decision.model_s > 0 and decision.warm
            if decision is not None:
                decisions.append(decision)
                log.debug("decode: %s", decision)
        plan = RoutePlan(batched, on_host, routes, decisions, shared, front if shared else None, fixed)
        if modelled and decisions and len({(d.kind, d.route, d.key) for d in decisions}) == 1:
            d = decisions[0]
            plan.model = (pace_key(groups[d.key][0].spec.recipe.bytes_codecs), d.route, d.nbytes, d.model_s)
        return plan

    def saw_read(self, plan: RoutePlan, read: Any, seconds: float) -> None:
        """A GPU read the model routed whole (``plan.model``) took ``seconds``, this process's
        only read meanwhile: learn the route's factor (:func:`.observed.saw_outcome`)."""
        if plan.model is not None and self.force is None and _learns(read):
            kind, route, nbytes, model_s = plan.model
            observed.saw_outcome(seen_on(read), kind, route, nbytes, seconds, model_s)

    def saw_io(self, batch: list[Any], read: Any, seconds: float) -> None:
        """A GPU read's first batch (nothing else ran on the I/O threads yet) read its stored
        bytes in ``seconds``: the pace of the batches' reads."""
        kind = _chain(batch)
        if kind is not None and _learns(read):
            observed.saw_io(seen_on(read), kind, sum(t.nbytes for t in batch), seconds)

    def saw_pool(self, on_host: list[Any], queue: Any, read: Any, seconds: float) -> None:
        """The CPU threads' pace where they all had work on a GPU read: a shared queue's back
        end, or a host route of many chunks of one stream kind."""
        if not _learns(read):
            return
        device = read.device
        if queue is not None and queue.taken_back and queue.back_started:
            kind = _chain(queue.taken_back)
            if kind is not None and len(queue.taken_back) >= 2 * device.threads:
                seconds = queue.back_ended - queue.back_started
                observed.saw_pool(seen_on(read), kind, queue.back_done, seconds, shared=True)
        elif on_host and len(on_host) >= 2 * device.threads:
            kind = _chain(on_host)
            if kind is not None and all(t.spec.recipe.bytes_codecs for t in on_host):
                nbytes = sum(t.spec.recipe.nbytes for t in on_host)
                observed.saw_pool(seen_on(read), kind, nbytes, seconds)

    def streams(self, spec: Any, pieces: list, read: Any) -> bool:
        """Whether a request's pieces are located and planned batch by batch, as their
        batches are submitted (the ``stream_bytes`` option): a large uncompressed, unsharded
        local read whose every piece goes with the batches (a GPU read, or a scheduler that
        sends every chunk there), so that its first reads start once one batch is planned."""
        batched = getattr(read.device, "name", None) == "gpu" or self.force == "batch"
        return (
            batched
            and spec.source is None
            and spec.shard is None
            and not spec.recipe.bytes_codecs
            and self.force != "host"
            and len(pieces) * spec.recipe.nbytes >= read.options.stream_bytes
        )

    def rates_for(self, kind: str, read: Any) -> Rates:
        if self._rates is not None:
            return self._rates.get(kind, DEFAULT_RATES.get(kind, DEFAULT_RATES["zstd"]))
        return known_rates(kind, read)

    def gpu_figure(self, recipe: Any, total: int, read: Any) -> float:
        """Seconds one nvCOMP call of ``total`` decoded bytes of ``recipe``'s chunks takes by
        the stream kind's figures: its fixed cost and its longest stream on one group of GPU
        threads, or, where its streams fill the GPU, its bytes at the rate of many streams."""
        r = self.rates_for(stream_kind(recipe.bytes_codecs), read)
        longest = min(recipe.nbytes, stream_bytes(recipe.bytes_codecs) or recipe.nbytes)
        return max(r.gpu_call + longest / r.gpu_stream, total / r.gpu)

    def saw_gpu(self, group: Any, read: Any, seconds: float) -> None:
        """A batch's nvCOMP call on a group (:class:`~.tasks.Group`) took ``seconds``
        (:mod:`.observed`)."""
        recipe = group.recipe
        if not group.route.nvcomp or stream_kind(recipe.bytes_codecs) is None:
            return
        figure = self.gpu_figure(recipe, sum(t.spec.recipe.nbytes for t in group.tasks), read)
        observed.saw_gpu(seen_on(read), pace_key(recipe.bytes_codecs), seconds, figure)

    def direct_routes(self, tasks: list[Any], read: Any) -> list[str]:
        """Routes for pieces read straight into the output (their bytes are one run of it):
        on a GPU, a read small enough for the calling thread (the ``inline_bytes`` option) goes
        to the host route (read into the thread's pinned buffer, one copy each: a dask task or
        a selection of a chunk or two; kvikio's per-read setup and its hand-off to its own
        threads cost more), larger ones with the batches (kvikio, many threads per read)."""
        if self.force is not None:
            return ["batch" if self.force == "share" else self.force] * len(tasks)
        small = sum(t.direct[1] for t in tasks) <= read.options.inline_bytes
        if read.device.name == "gpu" and small:
            return ["host"] * len(tasks)
        return ["batch"] * len(tasks)

    def routes(self, tasks: list[Any], read: Any) -> tuple[list[str], Decision | None]:
        """Routes for ``tasks``: chunks of one recipe, none of them read straight into the
        output."""
        recipe = tasks[0].spec.recipe
        codecs = recipe.bytes_codecs
        name = tasks[0].spec.name
        if self.force in ("host", "batch"):
            return [self.force] * len(tasks), None
        if self.force == "share":
            codec, kind = compressor(codecs) or "stored", stream_kind(codecs) or ""
            decision = Decision(name, codec, 0, 0, "forced", kind, recipe.key, shared=True)
            return ["share"] * len(tasks), decision
        if read.device.name != "gpu":
            return ["host"] * len(tasks), None
        if not codecs:  # uncompressed tiles, staged only to be scattered
            fetched = getattr(tasks[0], "blob", None) is not None
            if not fetched and sum(t.nbytes for t in tasks) > read.options.small_read_bytes:
                return ["batch"] * len(tasks), None  # kvikio: 2.7x the CPU threads' rate
            # a dask task, a selection (no kvikio setup); fetched bytes, already in (pinned)
            # host memory: copied from there into their place in the output, no staging
            return ["host"] * len(tasks), None
        kind = stream_kind(codecs)
        codec = compressor(codecs) or "crc32c"
        if kind is None:  # crc32c alone
            return ["batch"] * len(tasks), None
        key = recipe.key
        fixed = chain_route(codecs, read)
        if fixed.way is not None:
            n = len(tasks) if fixed.way == "batch" else 0
            return [fixed.way] * len(tasks), Decision(name, codec, n, len(tasks) - n, fixed.why, kind, key)
        split = self.split(tasks, read, kind)
        name = split.names
        learn = dict(model_s=split.model_s, warm=split.warm, nbytes=split.nbytes)
        if split.route == "host":
            return ["host"] * len(tasks), Decision(name, codec, 0, len(tasks), split.why, kind, key, **learn)
        if split.route == "batch":
            return ["batch"] * len(tasks), Decision(name, codec, len(tasks), 0, split.why, kind, key, **learn)
        decision = Decision(
            name, codec, 0, 0, split.why, kind, key, True, split.front_bytes, split.fixed_s, **learn
        )
        return ["share"] * len(tasks), decision

    def split(self, tasks: list[Any], read: Any, kind: str) -> Split:
        """Who decodes a group either processor may decode: the GPU alone (its reads, then
        nvCOMP), the CPU threads alone, or both (the batches take ``front_bytes`` from the
        front, the CPU threads the rest from the back once the batch's reads have landed),
        whichever the pace seen so far (:mod:`.observed`) says ends first, each time charged
        what reads of that route and size took over their figures (:func:`.observed.outcome`).
        A split must end sooner than the faster processor alone by ``share_margin``:
        coordinating two ends costs what no figure shows. Where nvCOMP decodes in the decoder
        process, the batches and a split are charged the time it still needs to start (a
        process's first read after open: the ``route_start_wait`` option)."""
        device = read.device
        recipe = tasks[0].spec.recipe
        r = self.rates_for(kind, read)
        key, chain = seen_on(read), pace_key(recipe.bytes_codecs)
        seen = observed.pace(key, chain)
        total = sum(t.spec.recipe.nbytes for t in tasks)
        stored = sum(t.nbytes for t in tasks) or total
        threads = max(1, device.threads)
        alone = seen.pool or (r.host_pool * min(threads, 16) / 16 if r.host_pool else threads * r.host_thread)
        pool = seen.pool_shared or alone  # beside the batches
        io = seen.io or IO_BYTES_S
        fixed = seen.gpu_k * self.gpu_figure(recipe, 0, read)
        per = seen.gpu_k / r.gpu  # seconds per decoded byte of a call that fills the GPU

        def gpu(nbytes: float) -> float:  # one call: its fixed cost, or its bytes where they fill the GPU
            return max(fixed, nbytes * per)

        wait = 0.0  # before the decoder process can take a batch
        if read.options.route_start_wait and chain_route(recipe.bytes_codecs, read).isolated:
            wait = self.start_wait()
        t_cpu = total / alone
        t_gpu = wait + stored / io + gpu(total)
        # the CPU threads' share x ends with the GPU's call, x / pool = wait + gpu(total - x):
        # within the fixed cost, x = pool * (wait + fixed); past it, x / pool = wait +
        # (total - x) * per
        x = min(total, pool * (wait + fixed))
        if (total - x) * per > fixed:
            x = min(total, (wait + total * per) / (1 / pool + per))
        size = recipe.nbytes
        x = int(x // size) * size
        front = total - x
        t_split = wait + stored * front / total / io + gpu(front)
        model = {"host": t_cpu, "batch": t_gpu, "share": t_split}
        forget = read.options.route_forget
        factor = {route: observed.outcome(key, chain, route, total, forget) for route in model}
        charged = {route: t * (factor[route] or 1.0) for route, t in model.items()}
        t_cpu, t_gpu, t_split = charged["host"], charged["batch"], charged["share"]
        names = ", ".join(dict.fromkeys(t.spec.name for t in tasks))
        figures = f"reads + nvCOMP call {t_gpu * 1e3:.0f} ms, CPU threads {t_cpu * 1e3:.0f} ms"
        if wait:
            figures += f" (the decoder process starts in {wait * 1e3:.0f} ms)"
        best = min(t_cpu, t_gpu)
        if 0 < x < total and t_split < best * (1 - read.options.share_margin):
            route, why = "share", f"shared: {figures}, both {t_split * 1e3:.0f} ms"
        elif t_cpu <= t_gpu:
            route, why = "host", f"CPU threads alone: {figures}"
        else:
            route, why = "batch", f"nvCOMP alone: {figures}"
        tried = _worth_a_try(route, charged, factor, seen, read.options.route_explore)
        if tried is not None:
            alone = "CPU threads alone" if tried == "host" else "nvCOMP alone"
            route, why = tried, f"{alone}, tried at this size: {figures}"
        for other in model:
            if other != route and factor[other] is not None:
                observed.passed_over(key, chain, other, total)
        share = route == "share"
        return Split(
            route,
            why,
            names,
            front if share else 0,
            fixed if share else 0.0,
            model[route],
            seen.warm(route),
            total,
        )


def _learns(read: Any) -> bool:
    """Whether a read's timings teach the pace (:mod:`.observed`): a GPU read that ran alone."""
    return read.device.name == "gpu" and not read.clock.crowded


def _chain(tasks: list[Any]) -> str | None:
    """The one codec chain of compressed tasks, as paces are kept (None: none, or several)."""
    chains = {t.spec.recipe.bytes_codecs for t in tasks}
    if len(chains) != 1 or stream_kind(next(iter(chains))) is None:
        return None
    return pace_key(chains.pop())


def _worth_a_try(
    chosen: str, charged: dict, factors: dict, pace: observed.Pace, explore: float
) -> str | None:
    """A processor alone that the chosen route's learned time does not rule out: one never
    read at this size, warm, whose figures come within ``explore`` (the ``route_explore``
    option) of the chosen route's charged time, once that route has shown what it takes (its
    factor is seen). The figures' pace is each processor's on another read (another array,
    size or data): one read of each settles which really ends first."""
    if explore <= 0 or factors[chosen] is None:
        return None
    for other in ("host", "batch"):
        if other != chosen and factors[other] is None and pace.warm(other):
            if charged[other] <= explore * charged[chosen]:
                return other
    return None


@dataclass
class Split:
    """:meth:`Scheduler.split`'s answer."""

    route: str
    why: str
    names: str
    front_bytes: int = 0
    fixed_s: float = 0.0
    model_s: float = 0.0  # the route's seconds by the figures, before its charge
    warm: bool = False  # the route's processors ran before in this process
    nbytes: int = 0  # the group's decoded bytes


#: stored bytes per second of a batch's reads before a read has shown its own (kvikio, 16
#: threads, page cache, on the H100 and H200 hosts)
IO_BYTES_S = 25e9


def pace_key(codecs: tuple[str, ...]) -> str:
    """What the pace seen is kept under for a chain (Blosc's zstd blocks run at a pace of
    their own, not a zstd chunk's)."""
    return "/".join(codecs)


def seen_on(read: Any) -> str:
    """What the pace a read sees is kept under: its device's kind and index (``Device.key``)."""
    key = getattr(read.device, "key", None)
    return key if isinstance(key, str) else getattr(read.device, "name", "cpu")


def chain_route(codecs: tuple[str, ...], read: Any) -> Route:
    """The route of a chain's chunks in a read (``read``: its ``device``, ``decode`` and
    ``options``) as far as it is fixed before the cost model: ``way`` where every chunk takes
    one whatever the model would say (``decode="gpu"`` or ``"cpu"``, streams nvCOMP may not
    decode safely here), None where the model chooses; who decodes batched streams; whether
    in the decoder process (streams nvCOMP may fault on that no check proves, where that
    process can run)."""
    device, decode = read.device, read.decode
    kind = stream_kind(codecs)
    gpu = getattr(device, "name", None) == "gpu"
    if kind is None:
        return Route("host" if not gpu else None, "none")
    isolating = isolable(codecs) and decoder_process_on(read)
    if not gpu:
        return Route("host", "cpu", isolating, "a read to the CPU")
    safe = safe_on_gpu(kind, proven(codecs))
    nvcomp = decode == "gpu" or (decode == "auto" and (isolating or safe))
    decoder = "nvcomp" if nvcomp else "threads"
    isolated = isolating and nvcomp
    if decode == "gpu":
        return Route("batch", decoder, isolated, "decode='gpu'")
    if decode == "cpu":
        return Route("host", decoder, isolated, "decode='cpu'")
    if not isolating and not safe:
        return Route("host", decoder, isolated, stream(kind).host_only or "decoded safely on the CPU")
    return Route(None, decoder, isolated)


def safe_on_gpu(kind: str, proven: bool = False) -> bool:
    """Whether nvCOMP decodes ``kind``'s streams safely in this process after the engine's
    checks, so that ``decode="auto"`` may hand them to it there (else CPU threads, then a
    copy, or the decoder process): gzip and zlib, LZ4, Blosc's LZ4 blocks, and zstd frames
    whose stored bytes a crc32c proved (``proven``); a decoder's
    :attr:`~.decoders.base.StreamDecoder.host_only` says why not. (``decode="gpu"`` hands
    nvCOMP everything, for stores you trust: the fastest; ``"cpu"`` nothing.)"""
    return proven or not stream(kind).host_only


def decoder_process_on(read: Any) -> bool:
    """Whether a read's unproven streams may go to the decoder process (:mod:`.sandbox`): the
    ``decoder_process`` option; on a GPU where nvCOMP's C API can be used, on the CPU only
    when asked for (``"on"``: CPU decoders behind the same machinery, as CI runs it)."""
    if getattr(read.device, "name", None) == "gpu":
        return gpu_decoder_process_on(read.options)
    return read.options.decoder_process == "on"


def gpu_decoder_process_on(options: Any) -> bool:
    """Whether a GPU read's unproven streams may go to the decoder process: the
    ``decoder_process`` option is not ``"off"`` and nvCOMP's C API can be used here."""
    return options.decoder_process != "off" and nvcomp.enabled() and nvcomp.library() is not None


def isolable(codecs: tuple[str, ...]) -> bool:
    """Whether the decoder process may take a chain's streams: its compressor writes streams
    nvCOMP may fault on (for Blosc: its blocks' streams), not proven by a crc32c."""
    kind = stream_kind(codecs)
    if kind is None or proven(codecs):
        return False
    return stream(kind).nvcomp_faults


def lands_pinned(spec: Any, read: Any) -> bool:
    """Whether an array's fetched bytes land in pinned memory: those read to a GPU that go
    there as they are (uncompressed chunks, copied or read in place by a kernel; streams
    nvCOMP may decode), where copies run at full speed (cupy's pinned pool keeps the blocks
    for the next fetches)."""
    if getattr(read.device, "name", None) != "gpu":
        return False
    codecs = spec.recipe.bytes_codecs
    if not codecs:
        return True
    return compressor(codecs) is not None and chain_route(codecs, read).way != "host"


def describe_route(codecs: tuple[str, ...], read: Any) -> str:
    """Where a read decodes a compressed chain's chunks, in words (:func:`.reader.describe`)."""
    if getattr(read.device, "name", None) != "gpu":
        return "CPU threads, one chunk each"
    route, decode = chain_route(codecs, read), read.decode
    if route.way == "batch":
        where = f"nvCOMP (decode={decode!r})"
    elif route.way == "host":
        where = f"CPU threads (decode={decode!r}), copied to the GPU"
    else:
        where = "nvCOMP and CPU threads, sharing one queue (decode='auto')"
    return where + (", nvCOMP in the decoder process" if route.isolated else "")
