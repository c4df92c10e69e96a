"""Start, before the first read, what the first read would otherwise wait for."""

from __future__ import annotations

from typing import Any


def warm_up(client: Any = None, device: str = "gpu") -> dict:
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

    Returns
    -------
    dict
        What was started: ``{"device": ..., "threads": ...}``, or one such dict per worker
        address when ``client`` is given.
    """
    if client is not None:
        return client.run(_warm_up_here, device)
    return _warm_up_here(device)


def _warm_up_here(device: str) -> dict:
    from .device import gpu_available, resolve_device
    from .engine import host, reader  # noqa: F401 - the engine's imports, once

    name = "gpu" if device == "gpu" and gpu_available() else "cpu"
    dev = resolve_device(name)
    if dev.name == "gpu":
        dev.xp.cuda.runtime.free(0)  # the first runtime call that needs a context makes it
        from .engine.decoders import nvcomp

        nvcomp.library()
    host.pool(dev.threads)
    return {"device": dev.name, "threads": dev.threads}
