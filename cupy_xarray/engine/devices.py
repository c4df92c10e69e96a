"""The engine's devices: a :class:`~cupy_xarray.device.Device` for ``"gpu"`` or ``"cpu"``
with the engine's byte-range reader (:mod:`.io`) and batch decoders
(:mod:`.decoders.batch`), and the user's ``device=`` argument turned into one."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..device import Device, PrototypeDevice, default_threads, require_gpu
from ..options import get_options
from . import sandbox
from .decoders.batch import CPUCodecs, GPUCodecs
from .io import KvikioIO, PosixIO


def cpu_device(threads: int | None = None) -> Device:
    """A Device for the CPU: NumPy, POSIX reads, CPU decoders (the decoder process behind
    them where a route isolates streams)."""
    return Device("cpu", np, PosixIO(), CPUCodecs(sandbox), threads or default_threads())


def gpu_device(threads: int | None = None) -> Device:
    """A Device for the current GPU: cupy, kvikio reads, nvCOMP, the decoder process for the
    streams a route isolates (raises where no GPU can be used)."""
    cupy = require_gpu()
    return Device("gpu", cupy, KvikioIO(), GPUCodecs(sandbox), threads or default_threads())


@functools.lru_cache(maxsize=16)
def _named_device(name: str, threads: int) -> Device:
    return gpu_device(threads) if name == "gpu" else cpu_device(threads)


def resolve_device(device: Any = "gpu", threads: int | None = None) -> Device | PrototypeDevice:
    """Turn the user's ``device=`` argument into a Device.

    Parameters
    ----------
    device
        ``"gpu"`` (default; also ``"cuda"``; the CPU where the ``device`` setting,
        ``CUPY_XARRAY_DEVICE``, is ``"cpu"``), ``"cpu"``, a zarr ``BufferPrototype``, or a
        Device already resolved.
    threads
        I/O threads; default :func:`default_threads`.
    """
    if isinstance(device, Device | PrototypeDevice):
        return device
    if isinstance(device, str):
        key = {"cuda": "gpu"}.get(device.lower(), device.lower())
        if key == "gpu" and get_options().device == "cpu":  # code for a GPU, run on the CPU
            key = "cpu"
        if key in ("gpu", "cpu"):
            return _named_device(key, threads or default_threads())
        raise ValueError(f"device must be 'gpu', 'cpu' or a zarr BufferPrototype, got {device!r}")
    from zarr.core.buffer import BufferPrototype

    if isinstance(device, BufferPrototype):
        return PrototypeDevice(device)
    raise TypeError(f"device must be 'gpu', 'cpu' or a zarr BufferPrototype, got {type(device).__name__}")
