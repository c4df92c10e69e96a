"""Read many byte ranges of many files into device buffers, with many threads.

Two implementations of one small interface::

    with io.session(threads, inline_bytes) as s:
        pending = s.submit(reads)    # starts the reads (or, for a few small ones, does them)
        pending.wait()               # raises ChunkError on any failure

``PosixIO`` uses ``os.preadv`` on a thread pool into NumPy buffers (a single read, or reads
of the ``inline_read_bytes`` option in all, on the calling thread); ``KvikioIO`` uses
``kvikio.CuFile.pread`` into cupy buffers (GPUDirect Storage where the system has it,
kvikio's POSIX compatibility mode with pinned bounce buffers elsewhere).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ChunkChangedError, ChunkError
from ..runtime.pools import first_error, kept_pool, run_now


@dataclass
class ReadOp:
    """Read ``nbytes`` at ``offset`` of ``path`` into ``dest`` (a 1-D uint8 buffer).

    ``blob``: the object's bytes already fetched from a remote store (a uint8 NumPy array);
    ``offset`` is then into it, and nothing is read from a file. ``containment``: the root an
    untrusted store's files must lie in (:func:`open_chunk` checks what it opened).
    ``ident``: the file's identity when the read was planned (:func:`file_ident`); a file
    opened now that is another one (replaced by a writer's rename) or gone raises
    :class:`~cupy_xarray.errors.ChunkChangedError`, not damage.
    """

    path: str
    offset: int
    nbytes: int
    dest: Any
    array: str
    chunk: str
    blob: Any = None
    containment: Any = None
    ident: tuple[int, int] | None = None


def file_ident(st: os.stat_result) -> tuple[int, int]:
    """What tells one file from another that took its name: (device, inode)."""
    return st.st_dev, st.st_ino


def open_chunk(path: str, containment: Any, array: str, key: str) -> tuple[int, os.stat_result]:
    """Open a chunk or shard file for reading: (descriptor, its ``fstat``). Only a regular file is
    read (a FIFO would block the open, which is non-blocking for that reason; a device would
    never end); for an untrusted store, the file opened must lie inside its root
    (:meth:`~cupy_xarray.containment.Containment.check_opened`: what was opened, not the name,
    is checked). Raises ChunkError naming the chunk, FileNotFoundError where there is none."""
    from ..containment import file_kind

    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    nofollow = getattr(os, "O_NOFOLLOW", 0) if containment is not None else 0
    try:
        try:
            fd = os.open(path, flags | nofollow)
        except OSError as exc:
            if not nofollow or exc.errno != errno.ELOOP:
                raise
            # the chunk is a link: followed only once its target is known to be inside
            containment.check_path(path, key, "chunk")
            fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ChunkError(_os_message(exc), array=array, chunk=key, path=path) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ChunkError(
                f"chunk path is {file_kind(st.st_mode)}, not a regular file (refused)",
                array=array,
                chunk=key,
                path=path,
            )
        if containment is not None:
            containment.check_opened(fd, path, key)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _open(op: ReadOp) -> int:
    try:
        fd, st = open_chunk(op.path, op.containment, op.array, op.chunk)
    except FileNotFoundError as exc:
        if op.ident is not None:
            raise _changed(op, "removed") from exc
        raise _error(op, "chunk file disappeared during the read") from exc
    if op.ident is not None and file_ident(st) != op.ident:
        os.close(fd)
        raise _changed(op, "replaced")
    size = st.st_size
    if op.offset + op.nbytes > size:
        os.close(fd)
        got = max(0, size - op.offset)
        raise _error(op, f"file ended after {got} of {op.nbytes} bytes (truncated?)")
    return fd


def _changed(op: ReadOp, how: str) -> ChunkChangedError:
    msg = f"chunk file was {how} after the read was planned (a writer updated the store)"
    return ChunkChangedError(msg, array=op.array, chunk=op.chunk, path=op.path)


def _error(op: ReadOp, msg: str) -> ChunkError:
    return ChunkError(msg, array=op.array, chunk=op.chunk, path=op.path)


def _os_message(exc: OSError) -> str:
    if isinstance(exc, IsADirectoryError):
        return "chunk path is a directory, not a file"
    if isinstance(exc, PermissionError):
        return "permission denied reading the chunk"
    return f"cannot read chunk: {exc}"


def blob_bytes(op: ReadOp) -> np.ndarray:
    """The ``op.nbytes`` at ``op.offset`` of a fetched object (a view, not a copy)."""
    if op.offset + op.nbytes > len(op.blob):
        raise _error(op, f"object is {len(op.blob)} bytes, shorter than the {op.nbytes} bytes at {op.offset}")
    return op.blob[op.offset : op.offset + op.nbytes]


def copy_blob(op: ReadOp) -> None:
    """Copy a fetched object's bytes into ``op.dest`` (NumPy, or cupy from the host)."""
    src = blob_bytes(op)
    if isinstance(op.dest, np.ndarray):
        op.dest[: op.nbytes] = src
    elif op.nbytes:
        import cupy

        # a synchronous copy on the legacy default stream, which the readers' (blocking)
        # streams wait for: done before this returns, on any thread
        src = np.ascontiguousarray(src)
        rt = cupy.cuda.runtime
        rt.memcpy(op.dest.data.ptr, src.ctypes.data, op.nbytes, rt.memcpyHostToDevice)


def pread_into(op: ReadOp) -> None:
    """Read ``op``'s byte ranges into its host buffer (``os.preadv``; a fetched blob is copied)."""
    if op.blob is not None:
        copy_blob(op)
        return
    fd = _open(op)
    try:
        view = memoryview(op.dest).cast("B")
        done = 0
        while done < op.nbytes:
            n = os.preadv(fd, [view[done : op.nbytes]], op.offset + done)
            if n == 0:
                raise _error(op, f"file ended after {done} of {op.nbytes} bytes (truncated?)")
            done += n
    except OSError as exc:
        raise _error(op, _os_message(exc)) from exc
    finally:
        os.close(fd)


class _Pending:
    def __init__(self, futures):
        self._futures = futures

    def wait(self) -> None:
        first = first_error(self._futures)
        if first is not None:
            raise first


class _PosixSession:
    def __init__(self, pool: ThreadPoolExecutor, inline_bytes: int):
        self._pool = pool
        self._inline = inline_bytes

    def submit(self, ops: list[ReadOp]) -> _Pending:
        # reads of a few bytes in all run on this thread (a hand-off to the pool and back
        # costs tens of microseconds, more than reading them), as does a single read
        if len(ops) == 1 or sum(op.nbytes for op in ops) <= self._inline:
            return _Pending([run_now(pread_into, op) for op in ops])
        return _Pending([self._pool.submit(pread_into, op) for op in ops])


def _posix_pool(threads: int) -> ThreadPoolExecutor:
    return kept_pool("io", threads)


class PosixIO:
    """Byte-range reads into host (NumPy) buffers with ``os.preadv`` on a thread pool."""

    name = "posix"

    @contextlib.contextmanager
    def session(self, threads: int, inline_bytes: int = 0):
        """Reads on ``threads`` threads; reads of ``inline_bytes`` in all (the
        ``inline_read_bytes`` option), or a single one, on the calling thread."""
        yield _PosixSession(_posix_pool(threads), inline_bytes)


# kvikio's thread pool is process-wide: raise it while reads of ours run, and restore the
# user's setting once none has run for LINGER_S seconds (a refcount, so concurrent reads
# don't race). Setting num_threads rebuilds kvikio's pool, so restoring after every read
# would cost milliseconds per dask task; one watcher thread restores it (a timer per read
# would start a thread per dask task).
LINGER_S = 1.0
_kvikio_lock = threading.Lock()
_kvikio_users = 0
_kvikio_saved: int | None = None
_kvikio_idle_since = 0.0
_kvikio_watcher: threading.Thread | None = None


def kvikio_enter(threads: int) -> None:
    """A reader of ``threads`` kvikio threads starts: kvikio's thread count is raised to it
    while any reader runs, and given back once they have been idle a while (:func:`kvikio_exit`)."""
    global _kvikio_users, _kvikio_saved
    import kvikio.defaults as kd

    with _kvikio_lock:
        if _kvikio_saved is None:
            _kvikio_saved = kd.get("num_threads")
        if threads > kd.get("num_threads"):
            kd.set("num_threads", threads)
        _kvikio_users += 1


def kvikio_exit() -> None:
    """A reader started by :func:`kvikio_enter` is done."""
    global _kvikio_users, _kvikio_idle_since, _kvikio_watcher
    with _kvikio_lock:
        _kvikio_users -= 1
        if _kvikio_users == 0 and _kvikio_saved is not None:
            _kvikio_idle_since = time.monotonic()
            if _kvikio_watcher is None:
                _kvikio_watcher = threading.Thread(target=_watch, name="cupy-xarray-kvikio", daemon=True)
                _kvikio_watcher.start()


def _watch() -> None:
    """Restore kvikio's thread count once our reads have been idle for LINGER_S seconds."""
    global _kvikio_watcher
    while True:
        time.sleep(LINGER_S / 4)
        with _kvikio_lock:
            if _kvikio_saved is None:
                _kvikio_watcher = None
                return
            idle = _kvikio_users == 0 and time.monotonic() - _kvikio_idle_since >= LINGER_S
        if idle:
            restore_kvikio_threads()


def restore_kvikio_threads() -> None:
    """Give kvikio back the thread count it had before our reads, now, if none is running."""
    global _kvikio_saved
    with _kvikio_lock:
        if _kvikio_users or _kvikio_saved is None:
            return
        import kvikio.defaults as kd

        if kd.get("num_threads") != _kvikio_saved:
            kd.set("num_threads", _kvikio_saved)
        _kvikio_saved = None


class _KvikioPending:
    def __init__(self, items):
        self._items = items

    def wait(self) -> None:
        first = None
        for f, fut, op in self._items:
            try:
                if f is None:
                    fut.result()
                elif fut is not None:
                    n = fut.get()
                    if n != op.nbytes and first is None:
                        first = _error(op, f"read {n} of {op.nbytes} bytes (truncated?)")
            except Exception as exc:  # noqa: BLE001 - re-raised with the chunk named
                if first is None:
                    first = exc if isinstance(exc, ChunkError) else _error(op, f"kvikio read failed: {exc}")
            finally:
                if f is not None:
                    f.close()
        self._items = []
        if first is not None:
            raise first

    def wait_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()


@functools.cache
def _has_proc_fd() -> bool:
    return os.path.isdir("/proc/self/fd")


def _opened_name(fd: int, path: str) -> str:
    """A name that opens the same file as ``fd`` (Linux: ``/proc/self/fd/N``), else ``path``."""
    return f"/proc/self/fd/{fd}" if _has_proc_fd() else path


class _KvikioSession:
    def __init__(self, threads: int) -> None:
        self._threads = threads

    def submit(self, ops: list[ReadOp]) -> _KvikioPending:
        # (starting them from several threads at once was slower: 95-190 ms for a thousand
        # files against 36-55 from one thread, on an H200 host)
        import kvikio

        items = []
        try:
            for op in ops:
                if op.blob is not None:  # fetched bytes: copied to the device on CPU threads
                    items.append((None, _posix_pool(self._threads).submit(copy_blob, op), op))
                    continue
                fd = _open(op)
                try:
                    # kvikio opens by name: the name of what was opened and checked, so that
                    # a file swapped meanwhile is not what it reads
                    f = kvikio.CuFile(_opened_name(fd, op.path), "r")
                except Exception as exc:
                    if isinstance(exc, OSError):
                        raise _error(op, _os_message(exc)) from exc
                    raise _error(op, f"kvikio cannot open the chunk: {exc}") from exc
                finally:
                    os.close(fd)
                try:
                    fut = f.pread(op.dest, op.nbytes, file_offset=op.offset)
                except Exception:
                    f.close()
                    raise
                items.append((f, fut, op))
        except BaseException:
            _KvikioPending(items).wait_quietly()
            raise
        return _KvikioPending(items)


class KvikioIO:
    """Byte-range reads into GPU (cupy) buffers with ``kvikio.CuFile.pread``."""

    name = "kvikio"

    @contextlib.contextmanager
    def session(self, threads: int, inline_bytes: int = 0):
        """Reads on kvikio's pool of ``threads`` threads (``inline_bytes``: as
        :meth:`PosixIO.session`; kvikio hands every read to its pool)."""
        try:
            import kvikio  # noqa: F401
        except ImportError as exc:
            from ..errors import missing_package

            raise missing_package("kvikio", exc) from None
        kvikio_enter(threads)
        try:
            yield _KvikioSession(threads)
        finally:
            kvikio_exit()
