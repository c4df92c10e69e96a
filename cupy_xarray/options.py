"""Every setting of the engine in one place, and ``set_options`` to change them for a while.

The defaults come from the environment (``CUPY_XARRAY_<NAME>`` for every setting, read once,
when settings are first needed) and otherwise from the table below. :func:`set_options`
changes them for the code inside its ``with`` block, in the calling thread (and in the
engine's own worker threads while that code reads); other threads and other reads keep
theirs, so concurrent reads never see each other's settings. A lazily opened dataset keeps
the settings in effect when it was opened, so its dask tasks read the same way on any
thread or worker::

    with cupy_xarray.set_options(decode="cpu", remote_timeout=10):
        ds = xr.open_dataset("s3://bucket/data.zarr", engine="kvikio")
        ds.load()
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

DECODE_CHOICES = ("auto", "gpu", "cpu")


@functools.cache
def cores() -> int:
    """CPU cores of this machine (asked once)."""
    return os.cpu_count() or 4


@dataclass(frozen=True)
class Options:
    """The engine's settings (see :func:`set_options` for what each one does)."""

    # -- what users set ---------------------------------------------------------------------
    device: str = "gpu"
    decode: str = "auto"
    threads: int | None = None
    decode_threads: int | None = None
    batch_bytes: int | None = None
    progress: bool = False
    profile: bool = False
    calibrate: bool = True
    cache_dir: str | None = None
    decode_timeout: float = 120.0
    nvcomp_c: bool = True
    decoder_process: str = "auto"
    gather: str = "auto"
    gather_wait: float = 0.002
    decoder_timeout: float = 5.0
    decoder_min_wait: float = 1.0
    arena_linger: float = 2.0
    max_chunk_bytes: int = 2**32
    read_ahead: str = "auto"
    read_ahead_bytes: int = 4 * 2**30
    read_ahead_linger: float = 2.0
    read_ahead_wait: float = 0.0
    read_ahead_plan: bool = True
    # remote stores
    remote_timeout: float = 120.0
    remote_retries: int = 4
    remote_concurrency: int = 64
    remote_backoff: float = 0.1
    remote_backoff_max: float = 5.0
    threaded_http: bool = True
    http_threads: int = 32
    max_cached_indexes: int = 4096
    coalesce_gap: int = 1 << 20
    coalesce_max: int = 64 << 20
    # -- how the engine cuts a read up (measured on an H200 host; see the engine docs) -----
    default_batch_bytes: int = 2048 * 2**20
    memory_share: float = 0.5
    max_batch_bytes: int = 8 * 2**30
    min_batch_bytes: int = 64 * 2**20
    host_assembly_bytes: int = 16 * 2**20
    check_memory_bytes: int = 64 * 2**20
    stream_bytes: int = 256 * 2**20
    uncompressed_depth: int = 4
    wave_bytes: int = 128 * 2**20
    gpu_wave_bytes: int = 512 * 2**20
    waves_ahead: int = 3
    fetch_ahead_bytes: int = 2 * 2**30
    inline_bytes: int = 4 * 2**20
    inline_read_bytes: int = 256 * 2**10
    job_bytes: int = 4 * 2**20
    share_start: str = "decode"
    share_margin: float = 0.1
    route_explore: float = 0.0
    route_forget: float = 0.0
    route_start_wait: bool = True
    force_route: str = "auto"
    kept_buffer_bytes: int = 64 * 2**20
    small_read_bytes: int = 64 * 2**20
    gather_read_bytes: int = 256 * 2**20
    gather_bytes: int = 2 * 2**30
    box_min_row: int = 512
    box_max_copies: int = 16
    read_ahead_outputs: str = "one"
    read_ahead_early: bool = False
    point_wave_bytes: int = 2**30
    # -- how a write (``.cupy.to_zarr``) is cut up (measured on an H200 host with 16 cores;
    # see the contributor guide) -------------------------------------------------------------
    small_write_bytes: int = 8 * 2**20
    write_batch_bytes: int = 2**30
    write_gpu_batch_chunks: int = 256
    write_in_flight: int = 2
    write_pack_output: bool = True
    write_gpu_min_bytes: int = 256 * 2**20
    write_cpu_share_zstd: float = 0.0
    write_cpu_share_lz4: float = 1.0

    def host_decode_threads(self) -> int:
        """CPU threads that decode for a GPU read: ``decode_threads``, else one per core (at most 32)."""
        return max(1, self.decode_threads or min(32, cores()))

    def write_cpu_share(self, algorithm: str) -> float:
        """The share of a write's batch CPU threads compress beside nvCOMP, for nvCOMP's
        ``algorithm`` (``"Zstd"`` or ``"LZ4"``; 0 for any other)."""
        return {"Zstd": self.write_cpu_share_zstd, "LZ4": self.write_cpu_share_lz4}.get(algorithm, 0.0)

    def io_threads(self) -> int:
        """I/O threads where none are asked for: ``threads``, else one per core, 4 to 32
        (kvikio's own default of one thread is about 8x slower on an H200 host than 16)."""
        return max(1, self.threads) if self.threads else min(32, max(4, cores()))


#: environment variable -> field: ``CUPY_XARRAY_<FIELD>`` for every field, and the older
#: short names kept
ENVIRONMENT = {f"CUPY_XARRAY_{f.name.upper()}": f.name for f in fields(Options)} | {
    "CUPY_XARRAY_CACHE": "cache_dir",
}

_TYPES = {f.name: f.type for f in fields(Options)}


def _convert(name: str, value: Any, source: str) -> Any:
    """``value`` as field ``name`` holds it; ValueError naming ``source`` where it cannot be."""
    kind = _TYPES[name]
    try:
        if isinstance(value, str):
            if "bool" in kind:
                if value.strip().lower() in ("1", "true", "yes", "on"):
                    return True
                if value.strip().lower() in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(value)
            if value == "" and "None" in kind:
                return None
            if kind.startswith("int"):
                return int(value)
            if kind.startswith("float"):
                return float(value)
            return value
        if value is None and "None" in kind:
            return value
        if "bool" in kind:
            if not isinstance(value, bool):
                raise TypeError(value)
            return value
        if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(value)
        if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise TypeError(value)
        return value
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be {kind.replace(' | None', ' or None')}, got {value!r} ({source})"
        ) from None


def _check(options: Options, source: str) -> Options:
    if options.device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {options.device!r} ({source})")
    for name in ("read_ahead", "gather", "decoder_process"):
        value = getattr(options, name)
        if value not in ("auto", "on", "off"):
            raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {value!r} ({source})")
    if options.force_route not in ("auto", "host", "batch", "share"):
        raise ValueError(
            f"force_route must be 'auto', 'host', 'batch' or 'share', got {options.force_route!r} ({source})"
        )
    if options.read_ahead_outputs not in ("each", "one", "box"):
        how = options.read_ahead_outputs
        raise ValueError(f"read_ahead_outputs must be 'each', 'one' or 'box', got {how!r} ({source})")
    if options.share_start not in ("decode", "now"):
        raise ValueError(f"share_start must be 'decode' or 'now', got {options.share_start!r} ({source})")
    if options.decode not in DECODE_CHOICES:
        raise ValueError(f"decode must be 'auto', 'gpu' or 'cpu', got {options.decode!r} ({source})")
    for name in ("threads", "decode_threads", "batch_bytes"):
        value = getattr(options, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive number or None, got {value!r} ({source})")
    if options.read_ahead_wait < 0:
        wait = options.read_ahead_wait
        raise ValueError(f"read_ahead_wait must be 0 or more seconds, got {wait!r} ({source})")
    for name in ("write_cpu_share_zstd", "write_cpu_share_lz4", "route_forget"):
        if not 0 <= getattr(options, name) <= 1:
            raise ValueError(f"{name} must be between 0 and 1, got {getattr(options, name)!r} ({source})")
    for name in ("write_batch_bytes", "write_gpu_batch_chunks", "write_in_flight"):
        if getattr(options, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(options, name)!r} ({source})")
    return options


#: variables of the package's name that are not settings (the docs build's, the tests', the
#: benchmarks' and the conformance tool's), by prefix
NOT_SETTINGS = (
    "CUPY_XARRAY_DOCS_OFFLINE",
    "CUPY_XARRAY_EXAMPLES",
    "CUPY_XARRAY_HYPOTHESIS_SEED",
    "CUPY_XARRAY_DAMAGE_",
    "CUPY_XARRAY_BENCH_COMMIT",
    "CUPY_XARRAY_ROUTE",
    "CUPY_XARRAY_FIRST_WRITE_RUNS",
)


def unknown_variables(environ: dict) -> list[str]:
    """``CUPY_XARRAY_*`` variables of ``environ`` that name no setting, each with the nearest
    one where there is one."""
    import difflib

    found = []
    for var in sorted(environ):
        if var.startswith("CUPY_XARRAY_") and var not in ENVIRONMENT and not var.startswith(NOT_SETTINGS):
            close = difflib.get_close_matches(var, list(ENVIRONMENT), n=1)
            found.append(f"{var} (did you mean {close[0]}?)" if close else var)
    return found


def from_environment(environ: dict | None = None) -> Options:
    """The defaults with the ``CUPY_XARRAY_*`` variables of ``environ`` (default: this
    process's) applied. A variable that names no setting is warned about; a bad value raises
    ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if unknown:
        import warnings

        warnings.warn(
            f"environment variable(s) that name no cupy-xarray setting, ignored: {', '.join(unknown)}",
            UserWarning,
            stacklevel=3,
        )
    found = {}
    for var, name in ENVIRONMENT.items():
        if var in environ:
            found[name] = _convert(name, environ[var], var)
            _check(Options(**{name: found[name]}), f"from {var}")
    if "cache_dir" not in found and environ.get("XDG_CACHE_HOME"):
        found["cache_dir"] = os.path.join(environ["XDG_CACHE_HOME"], "cupy-xarray")
    return _check(Options(**found), "from the environment")


_current: contextvars.ContextVar[Options | None] = contextvars.ContextVar("cupy_xarray_options", default=None)


@functools.cache
def _defaults() -> Options:
    # read at first use, not at import: a bad variable is named where settings are first
    # needed, and ``import cupy_xarray`` itself never fails for one (a failure is not cached)
    return from_environment()


def get_options() -> Options:
    """The settings in effect here (this thread, this ``set_options`` block)."""
    return _current.get() or _defaults()


class set_options:  # noqa: N801 - a function-like context manager, as xarray.set_options
    """Change the engine's settings inside a ``with`` block (this thread and the engine's
    threads working for it). Keywords are the fields of :class:`Options`:

    device
        Where reads for the GPU go (``CUPY_XARRAY_DEVICE``): ``"gpu"`` (default), or ``"cpu"``
        to run code written for a GPU unchanged on a machine without one: ``device="gpu"``
        (every reader's default) then reads into NumPy on the CPU. Conversions asked for by
        name (``.cupy.as_cupy()``) still need a GPU.
    decode
        Where a GPU read decodes compressed chunks: ``"auto"``, ``"gpu"`` or ``"cpu"``
        (``CUPY_XARRAY_DECODE``).
    threads, decode_threads
        I/O threads (``CUPY_XARRAY_THREADS``; default one per core, 4 to 32) and CPU threads
        that decode for a GPU read (``CUPY_XARRAY_DECODE_THREADS``).
    batch_bytes
        Memory a read's batches may hold beside its output (default: chosen per read).
    progress, profile
        A progress bar over the bytes read; exact per-phase timings in read reports
        (``CUPY_XARRAY_PROFILE``: the GPU is synchronized between phases).
    calibrate, cache_dir
        Measure decode rates on this machine once (``CUPY_XARRAY_CALIBRATE``), kept in
        ``cache_dir`` (``CUPY_XARRAY_CACHE``; default ``~/.cache/cupy-xarray``).
    decode_timeout, nvcomp_c
        Seconds a batch of nvCOMP decodes may take (``CUPY_XARRAY_DECODE_TIMEOUT``); use
        nvCOMP's C API (``CUPY_XARRAY_NVCOMP_C``).
    decoder_process, decoder_timeout, decoder_min_wait
        Streams no check has proven are decoded by nvCOMP in a process of its own
        (``"auto"``: on GPU reads; ``"on"``: CPU reads too, with CPU decoders; ``"off"``: never,
        and ``decode="auto"`` keeps them on CPU threads; ``CUPY_XARRAY_DECODER_PROCESS``). A
        batch it does not answer within a few times its expected time (at least
        ``decoder_min_wait``, at most ``decoder_timeout`` seconds; ``CUPY_XARRAY_DECODER_TIMEOUT``)
        costs that process, and the batch is decoded again on CPU threads.
    gather, gather_wait
        Small reads (up to ``gather_read_bytes``: dask tasks, a data loader's batches) made in
        several threads at once are read together, as one read of up to ``gather_bytes``
        (:mod:`~cupy_xarray.engine.gather`): ``"auto"`` on GPU reads, ``"on"`` on CPU reads
        too, ``"off"`` never (``CUPY_XARRAY_GATHER``). A read that arrives while another runs
        waits up to ``gather_wait`` seconds (default 2 ms) for others to join it; a read
        alone never waits.
    read_ahead, read_ahead_bytes, read_ahead_linger, read_ahead_wait
        Where an array's boxes (dask chunks) are asked for in order, read the next ones with
        the box asked for, in one read whose window doubles with each box asked for in order,
        up to ``read_ahead_bytes`` (default 4 GiB; on a GPU, within ``memory_share`` of its free
        memory); the tasks that ask next take their box from it (:mod:`~cupy_xarray.xarray.readahead`).
        ``"auto"`` (the default): dask tasks' reads of their blocks on a GPU; ``"on"``: every
        read of an array's boxes in order, CPU reads and lazy selections too; ``"off"``: never
        (``CUPY_XARRAY_READ_AHEAD``). A box not asked for within ``read_ahead_linger`` seconds
        (default 2) is dropped. With ``read_ahead_wait`` above 0 (seconds; default 0: off), a box
        asked for while another window of its array is read waits that long for the asks of
        other threads, and they are read in one window with as many boxes again after them
        (dask starts a task on each of its threads at once).
    read_ahead_plan
        Where a dask compute runs on dask's local schedulers (threads, sync), read ahead the
        blocks its graph shows its tasks will read (:mod:`~cupy_xarray.xarray.dask_plan`), in
        the order dask runs them, instead of guessing from the order of the asks: the first
        block asked for is read with the blocks that follow, up to ``read_ahead_bytes``, in one
        read; a selection reads only its own blocks. Default True; False: guess as above.
    arena_linger
        Seconds the device memory the decoder process decodes in (mapped once by it: 8 ms
        per GiB on an H200) is kept for the next read once no read uses it (default 2; 0:
        freed after each batch; ``CUPY_XARRAY_ARENA_LINGER``); never more than a quarter of
        the device memory that would otherwise be free.
    max_chunk_bytes
        Largest chunk a store's metadata may ask for (``CUPY_XARRAY_MAX_CHUNK_BYTES``).
    remote_timeout, remote_retries, remote_concurrency, remote_backoff, remote_backoff_max
        Remote stores: seconds per request, retries of transient failures, requests in
        flight, first and largest backoff (``CUPY_XARRAY_REMOTE_*``).
    threaded_http, http_threads
        Fetch HTTP(S) stores on a pool of threads (``CUPY_XARRAY_THREADED_HTTP``,
        ``CUPY_XARRAY_HTTP_THREADS``).

    memory_share, max_batch_bytes, min_batch_bytes
        A large GPU read nvCOMP decodes may use up to ``memory_share`` (default a half) of the
        device memory free beyond its outputs for its batches, each at most
        ``max_batch_bytes``; its report says what its staging took. Where memory runs short,
        a read whose outputs fit starts again with batches a quarter the size, down to
        ``min_batch_bytes`` (default 64 MiB), and its report says so. A write from the GPU
        (``.cupy.to_zarr``) keeps its two batches in flight within the same share.
    small_write_bytes
        A Dataset of fewer bytes is written by xarray from host copies: faster than the
        engine's setup (default 8 MiB).

    The others (``wave_bytes``, ``stream_bytes``, ``inline_bytes``, ``write_batch_bytes``,
    ``write_gpu_min_bytes``, ...) say how the engine cuts a read or a write up; the
    contributor guide explains them.
    """

    def __init__(self, **changes: Any) -> None:
        unknown = sorted(set(changes) - set(_TYPES))
        if unknown:
            import difflib

            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, list(_TYPES), n=1)
                hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
            raise ValueError(
                f"unknown option(s) {', '.join(hints)}; the options are the fields of cupy_xarray.Options "
                "(see help(cupy_xarray.set_options))"
            )
        values = {k: _convert(k, v, "set_options") for k, v in changes.items()}
        self.options = _check(dataclasses.replace(get_options(), **values), "set_options")
        self._token = _current.set(self.options)

    def __enter__(self) -> Options:
        return self.options

    def __exit__(self, *exc: Any) -> None:
        _current.reset(self._token)


@contextlib.contextmanager
def using(options: Options):
    """Read with exactly ``options`` inside the block (a dataset's reads use the settings in
    effect when it was opened)."""
    token = _current.set(options)
    try:
        yield options
    finally:
        _current.reset(token)


def child_environment(path: list[str]) -> dict[str, str]:
    """The environment of a process this one starts (the decoder process): this one's, with
    ``path`` (``sys.path``) on ``PYTHONPATH`` so that it imports the same package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def carried(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, to be run on other threads with this thread's settings and read reports (each
    call in a copy of this thread's context: one context cannot run on two threads at once)."""
    ctx = contextvars.copy_context()

    def run(*args: Any, **kwargs: Any) -> Any:
        return ctx.copy().run(fn, *args, **kwargs)

    return run
