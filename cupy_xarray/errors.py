"""Exceptions raised by cupy-xarray, each naming what went wrong and where."""

from __future__ import annotations

#: what to install for GPU reads (named by every error about a missing GPU package)
EXTRA_HINT = (
    "install this package's GPU extra for your CUDA major version where you installed it from "
    "(in its source folder: pip install '.[cuda13]', or '.[cuda12]'), or its three packages "
    "directly: pip install cupy-cuda13x kvikio-cu13 nvidia-nvcomp-cu13 (cu12 for CUDA 12); "
    "without a GPU, pass device='cpu' (or set CUPY_XARRAY_DEVICE=cpu) to read into NumPy"
)


class CupyXarrayError(Exception):
    """Base class of the package's own errors."""


class NoGPUError(CupyXarrayError, RuntimeError):
    """A GPU read or conversion was asked for on a machine where CUDA has no device."""


class MissingGPUPackageError(NoGPUError, ImportError):
    """A GPU package (cupy, kvikio, nvCOMP) is not installed: no GPU can be used either, so
    ``except NoGPUError`` catches it (and ``except ImportError``)."""


class ChunkError(CupyXarrayError, ValueError):
    """A chunk could not be read or decoded.

    Parameters
    ----------
    message
        What went wrong.
    array
        The array's path inside the store.
    chunk
        The chunk's key (``"c/0/1"``, or ``"c/0/1[inner 3, 0]"`` inside a shard).
    path
        The file that was read.
    """

    def __init__(self, message: str, *, array: str, chunk: str, path: str) -> None:
        self.array = array
        self.chunk = chunk
        self.path = path
        super().__init__(f"array {array!r}, chunk {chunk!r} ({path}): {message}")


class ChunkChangedError(ChunkError):
    """A chunk file was replaced (or removed) between planning a read and reading it: a
    writer updated the store. The read starts again from its plan; this escapes only where
    the store kept changing under every try."""


class StoreError(CupyXarrayError, ValueError):
    """The store, group or variable asked for does not exist or is not usable."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store (or group) asked for does not exist: ``except FileNotFoundError`` catches it, as
    it catches what ``engine="zarr"`` raises."""


class UnsafeStoreError(StoreError):
    """Store metadata that would make the reader leave the store root, or allocate absurdly.

    Attributes
    ----------
    key
        The offending key (member, group, chunk) as written in the store.
    """

    def __init__(self, message: str, *, key: str) -> None:
        self.key = key
        super().__init__(message)


class OutOfMemoryError(CupyXarrayError, MemoryError):
    """A read needs more device (or host) memory than is free; nothing was allocated."""


def missing_package(name: str, exc: ImportError) -> MissingGPUPackageError:
    """The error for a GPU package ``name`` that failed to import with ``exc``, with the fix;
    the cause is in the message (raise it ``from None``: the chained traceback would only
    double its length)."""
    why = (
        f"{name} is not installed"
        if isinstance(exc, ModuleNotFoundError)
        else f"{name} cannot be imported ({exc})"
    )
    return MissingGPUPackageError(f"{why}; {EXTRA_HINT}")
