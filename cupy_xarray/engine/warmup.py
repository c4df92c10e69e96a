"""Start, before the first read, what the first read would otherwise wait for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..options import Options


def warm_up(client: Any = None, device: str = "gpu", measure: bool = False) -> dict:
    """Start the engine here, or on every worker of a dask client, before the first read.

    A process's first read otherwise waits for the engine's imports, the CUDA context,
    nvCOMP's library and the engine's CPU threads. On a fresh dask cluster that skews the
    first computation: the worker that is ready first takes the reads the others are not
    ready for (of 48 small reads on two fresh CPU workers, one read 46; after this, 23 to 25 each).

    Parameters
    ----------
    client
        A ``dask.distributed.Client``: warm each of its workers (``client.run``). None: this
        process.
    device
        ``"gpu"`` (where there is one; else the CPU side only) or ``"cpu"``.
    measure
        Also measure this machine's decode rates (0.1-0.5 s per codec, kept in the cache
        folder): the one figure a shared read starts from (:mod:`.engine.share`). Reads
        never measure; without it they use the figures measured before, else built-in ones.

    Returns
    -------
    dict
        What was started: ``{"device": ..., "threads": ...}``, or one such dict per worker
        address when ``client`` is given.
    """
    if client is not None:
        return client.run(_warm_up_here, device, measure)
    return _warm_up_here(device, measure)


def _warm_up_here(device: str, measure: bool = False) -> dict:
    from ..device import gpu_available
    from ..options import get_options
    from . import host, reader  # noqa: F401 - the engine's imports, once
    from .devices import resolve_device

    options = get_options()
    name = "gpu" if device == "gpu" and gpu_available() else "cpu"
    dev = resolve_device(name)
    if not dev.host_memory:
        dev.xp.cuda.runtime.free(0)  # the first runtime call that needs a context makes it
        warm_engine(dev.threads, options)
    host.pool(dev.threads)
    if measure:
        from . import rates
        from .decoders.registry import STREAMS

        for kind in STREAMS:
            rates.rates(kind, dev, options)
    return {"device": dev.name, "threads": dev.threads}


def start_decoder_process(options: Options) -> None:
    """Start the GPU's decoder process, without waiting for it, where reads would use it
    (nvCOMP's C API loads and the ``decoder_process`` option is not ``"off"``): it takes
    1.5-2 s to load CUDA and nvCOMP, and needs no CUDA context of this process, so an open
    starts it first (a read sent before it has started is routed counting that wait:
    :meth:`.route.Scheduler.split`)."""
    from .route import gpu_decoder_process_on

    try:  # what fails here, the read that needs it reports
        if gpu_decoder_process_on(options):
            from .sandbox.client import decoder_processes

            decoder_processes("nvcomp").start()
    except Exception:  # noqa: BLE001
        pass


def warm_engine(threads: int, options: Options) -> None:
    """Start what a GPU read would start itself (the CUDA context made already): cupy's pool
    of page-locked memory, the pool of CPU threads, nvCOMP's library, the decoder process (it
    takes 1.5-2 s to load CUDA and nvCOMP, so it starts now, not at the first large read) and
    kvikio with its threads. Called on a background thread when a store is opened for the GPU (the decoder
    process started already there: :func:`start_decoder_process`)."""
    from ..runtime.buffers import pinned_buffer
    from . import host

    try:
        pinned_buffer(1)
    except Exception:  # noqa: BLE001 - the read that needs it reports what is wrong
        pass
    host.pool(threads)
    start_decoder_process(options)
    try:
        from .io import kvikio_enter, kvikio_exit

        kvikio_enter(threads)  # kvikio's pool of threads, made once
        kvikio_exit()
    except Exception:  # noqa: BLE001 - no kvikio, or none that works here
        pass
