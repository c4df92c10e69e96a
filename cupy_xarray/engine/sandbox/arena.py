"""Memory a batch's streams and decoded bytes share with the decoder process.

:class:`HostArena` is a file in shared memory (``/dev/shm``) both processes map;
:class:`DeviceArena` is device memory this process allocates and exports through CUDA IPC.
The client keeps them between batches for a short while (the ``arena_linger`` option), so
that the decoder process maps each only once.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
from typing import Any

import numpy as np

_names = itertools.count()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostArena:
    """``nbytes`` of host memory in a shared file. Closing unlinks the file; the memory goes
    once no view of it is left."""

    kind = "host"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 1)
        self.id = f"{os.getpid()}-{next(_names)}"
        self.path = os.path.join(_shm_dir(), f"cupy-xarray-{self.id}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self.array = np.frombuffer(mmap.mmap(fd, self.nbytes), dtype=np.uint8)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    def export(self) -> dict:
        return {"kind": self.kind, "id": self.id, "path": self.path, "size": self.nbytes}

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        self.array = None  # (views keep the mapping)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _DeviceAllocation:
    """One ``cudaMalloc``, freed when the last reference to it (arena or view) goes."""

    def __init__(self, nbytes: int) -> None:
        import cupy

        self.ptr = 0
        self.device = cupy.cuda.Device().id
        rt = cupy.cuda.runtime
        for _ in range(2):
            try:
                self.ptr = rt.malloc(nbytes)
                return
            except rt.CUDARuntimeError as exc:
                if exc.status != 2:  # cudaErrorMemoryAllocation
                    raise
            # cupy's pool may hold the memory as cached blocks, which cudaMalloc cannot use
            cupy.get_default_memory_pool().free_all_blocks()
        raise MemoryError(f"out of device memory for the decoder process's arena ({nbytes / 2**20:.0f} MiB)")

    def __del__(self) -> None:
        if self.ptr:
            try:
                import cupy

                with cupy.cuda.Device(self.device):  # (the thread freeing it may use another)
                    cupy.cuda.runtime.free(self.ptr)  # (waits for the device: nothing may still use it)
            except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone
                pass
            self.ptr = 0


class DeviceArena:
    """``nbytes`` of device memory allocated for sharing (not from cupy's pool: an IPC handle
    names a whole allocation). Closing drops this arena's hold; the memory goes once no view
    of it is left."""

    kind = "device"

    def __init__(self, nbytes: int) -> None:
        import cupy

        self.nbytes = max(int(nbytes), 1)
        self.id = f"{os.getpid()}-{next(_names)}"
        self._alloc = _DeviceAllocation(self.nbytes)
        self.ptr = self._alloc.ptr
        self.handle = cupy.cuda.runtime.ipcGetMemHandle(self.ptr)
        mem = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self._alloc)
        self.array = cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        self.device = cupy.cuda.Device().id

    def export(self) -> dict:
        return {
            "kind": self.kind,
            "id": self.id,
            "handle": bytes(self.handle),
            "size": self.nbytes,
            "device": self.device,
        }

    def view(self, offset: int, nbytes: int) -> Any:
        return self.array[offset : offset + nbytes]

    def fill(self, srcs: list[Any], offsets: np.ndarray) -> None:
        """Copy the device buffers ``srcs`` (1-D, contiguous) to ``offsets`` of the arena, in
        one launch on the current stream."""
        import cupy

        from ...runtime.kernels import function

        count = len(srcs)
        if not count:
            return
        lens = np.array([s.nbytes for s in srcs], dtype=np.int64)
        ptrs = np.array([s.data.ptr for s in srcs], dtype=np.uint64)
        if int(np.max(np.asarray(offsets) + lens)) > self.nbytes:
            raise ValueError("ranges run past the end of the arena")
        across = max(1, min(64, -(-int(lens.max()) // (16 * 256))))
        args = (
            self.array,
            cupy.asarray(np.asarray(offsets, dtype=np.int64)),
            cupy.asarray(ptrs),
            cupy.asarray(lens),
            np.int32(count),
        )
        function("arena", "copy_ranges")((across, min(count, 65535)), (256,), args)

    def close(self) -> None:
        self.array = self._alloc = None


def make_arena(nbytes: int, on_device: bool) -> HostArena | DeviceArena:
    """An arena of ``nbytes`` in GPU memory (``on_device``) or in shared host memory."""
    return DeviceArena(nbytes) if on_device else HostArena(nbytes)


class Mapped:
    """An arena as the decoder process sees it: its base address and views."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.size = spec["size"]
        if spec["kind"] == "host":
            fd = os.open(spec["path"], os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
            self.base = self.array.ctypes.data
        else:
            import cupy

            cupy.cuda.Device(spec["device"]).use()
            self.base = cupy.cuda.runtime.ipcOpenMemHandle(spec["handle"])
            self.array = None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        if self.spec["kind"] == "host":
            self.array = None
            try:
                self._map.close()
            except BufferError:
                pass
        else:
            import cupy

            cupy.cuda.runtime.ipcCloseMemHandle(self.base)
