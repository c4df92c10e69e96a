"""The one place that knows "gpu", "cpu" or a zarr ``BufferPrototype``.

A :class:`Device` bundles what the read engine needs from a place where arrays live:
the array module (``numpy`` or ``cupy``), allocation, a byte-range reader and a batch
decoder. The engine builds its devices (:mod:`cupy_xarray.engine.devices`: its I/O and
decoders); the engine and the xarray adapters only ever talk to a Device, so the same
orchestration runs in CI on the CPU and on the GPU. This module imports nothing of the
engine.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import NoGPUError, missing_package
from .options import get_options
from .runtime import buffers

CPU_HINT = (
    "pass device='cpu' (or use .cupy.as_numpy()) to stay on the CPU, or set CUPY_XARRAY_DEVICE=cpu "
    "to run code written for a GPU on the CPU"
)


def default_threads() -> int:
    """I/O threads used when none are asked for (:meth:`.options.Options.io_threads`)."""
    return get_options().io_threads()


def import_cupy():
    """Import cupy, or raise an ImportError that names the extra to install."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise missing_package("cupy", exc) from None
    return cupy


@functools.cache
def gpu_available() -> bool:
    """True where cupy imports and CUDA sees at least one device."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


_started: set[int] = set()
_started_lock = threading.Lock()


def start_gpu(cupy: Any, then: Any = None, before: Any = None) -> None:
    """Create the current GPU's CUDA context on a background thread, once per device, then
    run ``then()`` there (the opening of a store warms the engine so:
    :func:`~cupy_xarray.engine.warmup.warm_engine`); ``before()`` runs there first, for what
    needs no context of this process (starting the decoder process).

    Opening a store takes a while itself (xarray decodes its coordinates), so the first read
    finds much of it ready.
    """
    try:
        index = cupy.cuda.runtime.getDevice()
    except Exception:  # noqa: BLE001 - no device: the read says so
        return
    with _started_lock:
        if index in _started:
            return
        _started.add(index)

    def run() -> None:
        try:
            if before is not None:
                before()
            cupy.cuda.runtime.setDevice(index)
            cupy.cuda.runtime.free(0)  # the first runtime call that needs a context makes it
            if then is not None:
                then()
        except Exception:  # noqa: BLE001 - the read itself reports what is wrong
            pass

    threading.Thread(target=run, name="cupy-xarray-cuda-start", daemon=True).start()


#: what to do instead, for moves to the GPU that have no ``device`` to pass
CONVERT_HINT = "keep the data on the host here (NumPy: .cupy.as_numpy(), or leave it as it is)"


def require_gpu(hint: str = CPU_HINT):
    """Return the cupy module, or raise a clear error (ending in ``hint``, what to do
    instead) when no GPU can be used."""
    cupy = import_cupy()
    if not gpu_available():
        raise NoGPUError(f"no CUDA device is available on this machine; {hint}")
    return cupy


def is_cupy_array(x: Any) -> bool:
    """True for a ``cupy.ndarray`` (without importing cupy when it is not loaded)."""
    return type(x).__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def is_dask_array(x: Any) -> bool:
    return type(x).__module__.startswith("dask") and hasattr(x, "_meta")


def to_host(x: Any) -> np.ndarray:
    """``x`` in host memory: a cupy array copied there, anything else as a NumPy array."""
    return x.get() if is_cupy_array(x) else np.asarray(x)


def host_copy(data: Any) -> Any:
    """``data`` in host memory: a NumPy copy, or for a dask array, lazily, block by block."""
    if is_dask_array(data):
        meta = np.empty((0,) * data.ndim, dtype=data.dtype)
        return data.map_blocks(to_host, dtype=data.dtype, meta=meta)
    return np.array(to_host(data), copy=True)


def array_namespace(x: Any):
    """``cupy`` for cupy arrays, ``numpy`` for everything else."""
    if is_cupy_array(x):
        import cupy

        return cupy
    return np


@dataclass
class Device:
    """Where the engine puts its output, and how it reads and decodes there.

    Attributes
    ----------
    name
        ``"cpu"`` or ``"gpu"``.
    xp
        The array module: ``numpy`` or ``cupy``.
    io
        Reads byte ranges of files into buffers of this device.
    codecs
        Decodes batches of compressed streams on this device.
    threads
        I/O threads.
    """

    name: str
    xp: Any
    io: Any
    codecs: Any
    threads: int = field(default_factory=default_threads)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype):
        return self.xp.empty(shape, dtype=dtype)

    def full(self, shape: tuple[int, ...], fill: Any, dtype: np.dtype):
        return self.xp.full(shape, fill, dtype=dtype)

    def asarray(self, x: Any):
        """Move a host or device array to this device."""
        if self.name == "gpu":
            return self.xp.asarray(x)
        if is_cupy_array(x):
            return x.get()
        return np.asarray(x)

    def free_bytes(self) -> int | None:
        """Memory a read may still allocate here (None when unknown)."""
        if self.name == "gpu":
            free, _ = self.xp.cuda.runtime.memGetInfo()
            return int(free) + int(self.xp.get_default_memory_pool().free_bytes())
        return host_available_bytes()

    def release_cached(self) -> None:
        """Give the memory pool's cached blocks back to the device (after memory ran short)."""
        if self.name == "gpu":
            self.xp.get_default_memory_pool().free_all_blocks()

    def synchronize(self) -> None:
        """Wait for the work queued on this thread's current stream (nothing on the CPU)."""
        if self.name == "gpu":
            self.xp.cuda.get_current_stream().synchronize()

    @property
    def host_memory(self) -> bool:
        """Whether outputs live in host memory, where CPU threads write them in place (else
        they reach the device by copies, at full speed only from page-locked buffers)."""
        return self.name != "gpu"

    def model(self) -> str:
        """The GPU's name (``"none"`` on the CPU)."""
        if self.name != "gpu":
            return "none"
        name = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    @property
    def key(self) -> str:
        """What figures measured here are kept under: ``"gpu:<index>"`` or ``"cpu"``."""
        return f"gpu:{self.xp.cuda.Device().id}" if self.name == "gpu" else self.name

    def side_stream(self) -> Any:
        """This thread's stream for work started ahead of its own, so that the two overlap
        (:func:`~cupy_xarray.runtime.buffers.side_stream`); on the CPU, one that runs
        nothing apart. Use it as a context (``with device.side_stream():``)."""
        return buffers.side_stream(self.xp) if self.name == "gpu" else NO_STREAM

    def wait_all(self) -> None:
        """Wait for the work queued on every stream of the device (nothing on the CPU)."""
        if self.name == "gpu":
            self.xp.cuda.Device().synchronize()

    def own_stream(self) -> Any:
        """A context in which this thread's work runs on its own stream, so that reads in
        other threads overlap (:func:`~cupy_xarray.runtime.buffers.on_thread_stream`)."""
        return buffers.on_thread_stream(self.xp) if self.name == "gpu" else contextlib.nullcontext()


class _NoStream(contextlib.nullcontext):
    """The CPU's stand-in for a CUDA stream: work runs as it is called."""

    def synchronize(self) -> None:
        pass


NO_STREAM = _NoStream()


@dataclass
class PrototypeDevice:
    """A zarr ``BufferPrototype`` chosen by the user: reads go through zarr-python itself."""

    prototype: Any
    name: str = "prototype"

    @property
    def gpu(self) -> bool:
        """Whether the prototype's buffers are GPU memory (zarr's ``gpu`` buffers: cupy)."""
        return getattr(self.prototype.nd_buffer, "__module__", "").endswith(".gpu")

    @property
    def host_memory(self) -> bool:
        """Whether the prototype's buffers are host memory."""
        return not self.gpu

    def wait_all(self) -> None:
        """Nothing: zarr-python's reads end with their buffers filled."""


def empty_on(device: Device | PrototypeDevice, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """An uninitialized array of ``device``'s array type (NumPy for dtypes cupy lacks)."""
    if isinstance(device, PrototypeDevice):
        return device.prototype.nd_buffer.create(shape=shape, dtype=dtype).as_ndarray_like()
    if np.dtype(dtype).kind not in "biufc":  # cupy has no datetime or string arrays
        return np.empty(shape, dtype)
    return device.empty(shape, dtype)


def host_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (free plus reclaimable page cache), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def buffer_prototype(device: Device | PrototypeDevice):
    """The zarr ``BufferPrototype`` that matches a device (for zarr-python fallbacks)."""
    if isinstance(device, PrototypeDevice):
        return device.prototype
    if device.name == "gpu":
        from zarr.core.buffer import gpu

        return gpu.buffer_prototype
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype()
