"""The reading process's side of the decoder process: start it, keep a spare warm, send it a
batch, wait for the answer no longer than the watchdog allows, kill and replace it when it
dies or stalls (:class:`DecoderLost`: the caller then decodes the batch on CPU threads)."""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ...options import Options, child_environment
from ...runtime.buffers import holds_idle_memory
from ..decoders.base import DecodeFailure, aligned_slots
from .arena import make_arena

#: seconds a new decoder process may take to start (CUDA and nvCOMP load in 1.5-2 s on an H200 host)
START_TIMEOUT_S = 60.0
#: seconds a decoder process takes from its spawn to its first answer (CUDA and nvCOMP
#: loaded: 1.5-2 s on the H100 and H200 hosts), what a batch sent before then waits
START_S = 2.0
_SLOT = 256


class DecoderLost(RuntimeError):
    """The decoder process died, stalled or failed while decoding a batch (it was replaced)."""


class _Worker:
    """One decoder process, its two pipes, and the answers its batches are waiting for.

    Several threads may each have a batch in flight; whichever of them is waiting reads the
    next answer from the pipe and hands it to the batch it names."""

    def __init__(self, mode: str) -> None:
        child_reads, we_write = os.pipe()
        we_read, child_writes = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cupy_xarray.engine.sandbox.worker",
                str(child_reads),
                str(child_writes),
                mode,
            ],
            pass_fds=(child_reads, child_writes),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=child_environment(sys.path),
            close_fds=True,
        )
        os.close(child_reads)
        os.close(child_writes)
        self.started = time.monotonic()
        self.send = Connection(we_write, readable=False)
        self.answers = Connection(we_read, writable=False)
        self.ready = False
        self._sending = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, tuple] = {}
        self._reading = False
        #: why this process is lost (None while it lives)
        self.lost: str | None = None

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        if not self.answers.poll(timeout):
            raise DecoderLost(f"the decoder process did not start within {timeout:.0f} s")
        try:
            reply = self.answers.recv()
        except (EOFError, OSError):
            raise DecoderLost("the decoder process ended while it started") from None
        if reply[0] != "ready":
            raise DecoderLost(f"the decoder process cannot decode here: {reply[-1]}")
        self.ready = True

    def request(self, msg: tuple) -> None:
        try:
            with self._sending:
                self.send.send(msg)
        except OSError:
            raise DecoderLost("the decoder process had ended") from None

    def answer(self, rid: int, wait_s: float) -> tuple:
        """The answer to batch ``rid``; DecoderLost where the process dies, fails or gives no
        answer to it within ``wait_s`` seconds (every batch in flight is then lost)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._cond:
                while True:
                    if rid in self._replies:
                        return self._replies.pop(rid)
                    if self.lost is not None:
                        raise DecoderLost(self.lost)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._mark_lost(
                            f"the decoder process did not answer within {wait_s:.1f} s (a damaged stream?)"
                        )
                        raise DecoderLost(self.lost)
                    if not self._reading:
                        self._reading = True
                        break
                    self._cond.wait(remaining)
            reply = why = None
            try:
                if self.answers.poll(remaining):
                    reply = self.answers.recv()
            except (EOFError, OSError):
                why = "the decoder process died while it decoded (a damaged stream?)"
            with self._cond:
                self._reading = False
                if reply is not None and reply[0] == "done":
                    self._replies[reply[1]] = reply[2:]
                elif reply is not None:
                    self._mark_lost(f"the decoder process failed: {reply[-1]}")
                elif why is not None:
                    self._mark_lost(why)
                self._cond.notify_all()

    def _mark_lost(self, why: str) -> None:  # (holding self._cond)
        if self.lost is None:
            self.lost = why
        self._cond.notify_all()

    def forget(self, arena_id: str) -> None:
        """Tell the process to unmap an arena (no answer)."""
        if self.ready and self.lost is None:
            try:
                self.request(("forget", arena_id))
            except DecoderLost:
                pass

    def kill(self) -> None:
        with self._cond:
            self._mark_lost("the decoder process was stopped")
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for conn in (self.send, self.answers):
            try:
                conn.close()
            except OSError:
                pass


class DecoderProcesses:
    """The decoder processes of one mode (``"nvcomp"`` or ``"host"``): the one that decodes,
    and a spare started beside it, which takes over when the first is lost."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.Lock()
        self._current: _Worker | None = None
        self._spare: _Worker | None = None
        self._ids = itertools.count()
        #: processes lost to a death, a stall or a failure, and batches answered, since this
        #: object was made
        self.lost = 0
        self.batches = 0
        self._fault: str | None = None
        #: the arenas batches are decoded in
        self.arenas = _ArenaPool(self, mode == "nvcomp")

    def start(self) -> None:
        """Start the process that will decode, without waiting for it (a warm start)."""
        with self._lock:
            if self._current is None and self._spare is None:
                self._spare = _Worker(self.mode)

    def start_wait(self) -> float:
        """Seconds a batch sent now would wait for the process that decodes to start: 0 where
        one has answered (or none was started: nothing known), else what is left of
        :data:`START_S` since it was spawned."""
        # (without the lock: a batch holds it while it waits for the process to start, and
        # routing must not wait with it; a worker that answers meanwhile is ready the sooner)
        worker = self._current or self._spare
        if worker is None or worker.ready or worker.lost is not None:
            return 0.0
        try:
            if worker.answers.poll(0):  # its first answer is waiting
                return 0.0
        except (OSError, ValueError):  # its pipe is closed: the batch finds it lost
            return 0.0
        return max(0.0, START_S - (time.monotonic() - worker.started))

    def fail_next(self, fault: str) -> None:
        """Make the next batch fail on purpose (``"die"`` or ``"stall"``): for tests of the
        watchdog, the restart and the re-decode on CPU threads."""
        self._fault = fault

    def _take(self) -> _Worker:
        if self._current is None:
            self._current, self._spare = self._spare or _Worker(self.mode), None
        try:
            self._current.wait_ready(START_TIMEOUT_S)
        except DecoderLost:
            self._lose(self._current)
            raise
        if self._spare is None:
            self._spare = _Worker(self.mode)  # starts now, beside the batch
        return self._current

    def _lose(self, worker: _Worker) -> None:  # (holding self._lock)
        worker.kill()
        if worker is self._current:
            self._current = None
            self.lost += 1

    def run(self, msg: tuple, wait_s: float) -> tuple[np.ndarray, np.ndarray, dict]:
        """Send one batch; its (sizes, statuses, seconds), or DecoderLost after ``wait_s``
        seconds. Batches from several threads are in flight at once."""
        with self._lock:
            worker = self._take()
            rid = next(self._ids)
            if self._fault is not None:
                msg, self._fault = msg[:-1] + (self._fault,), None
        try:
            worker.request(("decode", rid) + msg)
            sizes, statuses, seconds = worker.answer(rid, wait_s)
        except DecoderLost:
            with self._lock:
                self._lose(worker)
            raise
        with self._lock:
            self.batches += 1
        return sizes, statuses, seconds

    def forget(self, arena_id: str) -> None:
        """Tell the decoding process to unmap an arena that is about to be freed."""
        with self._lock:
            worker = self._current
        if worker is not None:
            worker.forget(arena_id)

    def close(self) -> None:
        try:
            self.arenas.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the device may be gone already
            pass
        with self._lock:
            for w in (self._current, self._spare):
                if w is not None:
                    w.kill()
            self._current = self._spare = None


class _Lease:
    """An arena lent to one batch; the arena goes back to its pool when the lease goes (the
    decoded bytes may be read where they landed until then)."""

    def __init__(self, pool: _ArenaPool, arena: Any, linger: float) -> None:
        self.pool, self.arena, self.linger = pool, arena, linger

    def __del__(self) -> None:
        try:
            self.pool.give(self.arena, self.linger)
        except Exception:  # noqa: BLE001 - at interpreter exit the pool may be gone
            pass


class _ArenaPool:
    """Arenas kept between batches, so that the decoder process maps each only once (mapping
    an arena it has not seen costs about 8 ms per GiB on an H200). One batch uses an arena at
    a time; a free arena is freed once none has been taken for ``arena_linger`` seconds (an
    option), by a watcher thread, or at once where that is 0, where keeping it would hold
    more than a quarter of the device memory otherwise free (memory others may want: cupy's
    pool does not know of it), or where a read runs short of memory."""

    #: free arenas kept at most
    KEEP = 2

    def __init__(self, procs: DecoderProcesses, on_device: bool) -> None:
        self.procs, self.on_device = procs, on_device
        self._lock = threading.Lock()
        self._free: list[tuple[Any, Any]] = []  # (arena, event its last user's work recorded)
        self._last_used, self._linger = 0.0, 0.0
        self._watcher: threading.Thread | None = None
        #: arenas made since this pool was made (for tests)
        self.made = 0

    def take(self, nbytes: int) -> Any:
        with self._lock:
            fits = [k for k, (a, _) in enumerate(self._free) if nbytes <= a.nbytes <= 2 * nbytes + (64 << 20)]
            found = self._free.pop(min(fits, key=lambda k: self._free[k][0].nbytes)) if fits else None
            self._last_used = time.monotonic()
        if found is not None:
            arena, event = found
            if event is not None:
                event.synchronize()  # what read its last batch's bytes has run
            return arena
        try:
            arena = make_arena(nbytes, self.on_device)
        except MemoryError:
            self.release()
            arena = make_arena(nbytes, self.on_device)
        self.made += 1
        return arena

    def give(self, arena: Any, linger: float) -> None:
        """Take back an arena, kept free for ``linger`` seconds (the batch's ``arena_linger``
        option; 0: freed now)."""
        if linger <= 0 or (self.on_device and not self._room_for(arena)):
            self._free_one(arena)
            return
        event = None
        if self.on_device:
            import cupy

            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record()  # on this thread's stream, where the decoded bytes were placed from
        with self._lock:
            self._free.append((arena, event))
            gone = self._free[: -self.KEEP]
            del self._free[: -self.KEEP]
            self._last_used, self._linger = time.monotonic(), linger
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="cupy-xarray-arenas", daemon=True)
                self._watcher.start()
        for a, _ in gone:
            self._free_one(a)

    def _room_for(self, arena: Any) -> bool:
        """Whether keeping ``arena`` (and the free ones) leaves three quarters of the memory
        that would otherwise be free."""
        import cupy

        with self._lock:
            kept = arena.nbytes + sum(a.nbytes for a, _ in self._free)
        free = cupy.cuda.runtime.memGetInfo()[0]
        return kept <= (free + kept) // 4

    def release(self) -> None:
        """Free every arena no batch uses."""
        with self._lock:
            gone, self._free = self._free, []
        for arena, event in gone:
            if event is not None:
                event.synchronize()
            self._free_one(arena)

    def _free_one(self, arena: Any) -> None:
        self.procs.forget(arena.id)
        arena.close()

    def _watch(self) -> None:
        while True:
            time.sleep(min(self._linger, 0.5))
            with self._lock:
                if not self._free:
                    self._watcher = None
                    return
                idle = time.monotonic() - self._last_used >= self._linger
            if idle:
                self.release()


_processes: dict[str, DecoderProcesses] = {}
_processes_lock = threading.Lock()


def decoder_processes(mode: str) -> DecoderProcesses:
    """This process's decoder processes of ``mode``, started at the first batch."""
    with _processes_lock:
        p = _processes.get(mode)
        if p is None:
            p = _processes[mode] = DecoderProcesses(mode)
        return p


def start_wait(mode: str = "nvcomp") -> float:
    """Seconds a batch of ``mode`` sent now would wait for its decoder process to start
    (:meth:`DecoderProcesses.start_wait`; 0 where none was started)."""
    with _processes_lock:
        procs = _processes.get(mode)
    return 0.0 if procs is None else procs.start_wait()


def release_arenas() -> None:
    """Free the arenas no batch uses now (a read or write short of memory asks for them back:
    :func:`~cupy_xarray.runtime.buffers.release_idle_memory`)."""
    for p in list(_processes.values()):
        p.arenas.release()


holds_idle_memory(release_arenas)


def _close_all() -> None:
    for p in list(_processes.values()):
        p.close()


def _forget_after_fork() -> None:  # a forked child owns none of its parent's decoder processes
    global _processes_lock
    _processes.clear()
    _processes_lock = threading.Lock()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_after_fork)


def watchdog_seconds(expected_s: float, o: Options) -> float:
    """How long a batch expected to take ``expected_s`` may take before its process is killed:
    a few times what it should take, at least ``decoder_min_wait``, at most ``decoder_timeout``
    (options of ``o``)."""
    return min(o.decoder_timeout, max(o.decoder_min_wait, 4 * expected_s))


def decode_batch(
    kind: str,
    srcs: list[Any],
    expected: list[int],
    into: list[Any] | None,
    on_device: bool,
    expected_s: float,
    fault: str | None = None,
    seconds: dict | None = None,
    *,
    options: Options,
) -> tuple[list[Any], Any]:
    """Decode bare streams of ``kind`` in the decoder process, with the read's settings
    ``options`` (``decoder_timeout``, ``decoder_min_wait``, ``arena_linger``): copied into an arena, decoded
    there, checked (status and exact size per stream), and copied into ``into[i]`` where
    given (the others into slots of one new buffer), else left where they landed. Returns
    (outputs, what keeps them: the new buffer, or the lease of the arena they lie in, which
    goes back to its pool with the owner). Several threads may each have a batch in flight.

    Raises DecodeFailure naming the first stream that does not decode to its size, and
    DecoderLost where the process died or stalled (it is replaced; decode the batch again
    on CPU threads). ``fault``: ``"die"`` or ``"stall"``, on purpose (tests). ``seconds``:
    filled with the time of each step (``arena``, ``fill``, ``answer``: the round trip, and
    the decoder process's ``map`` and ``decode``), where given.
    """
    t0 = time.perf_counter()
    n = len(srcs)
    lens = np.array([len(s) for s in srcs], dtype=np.int64)
    caps = np.asarray(expected, dtype=np.int64)
    src_off, in_total = aligned_slots(lens, _SLOT)
    in_total = -(-in_total // _SLOT) * _SLOT
    dst_off, out_total = aligned_slots(caps, _SLOT)
    dst_off = dst_off + in_total
    procs = decoder_processes("nvcomp" if on_device else "host")
    arena = procs.arenas.take(in_total + out_total)
    lease = _Lease(procs.arenas, arena, options.arena_linger)  # gives the arena back however this ends
    try:
        t1 = time.perf_counter()
        _fill(arena, srcs, src_off, on_device)
        t2 = time.perf_counter()
        msg = (arena.export(), kind, src_off, lens, dst_off, caps, fault)
        sizes, statuses, spent = procs.run(msg, watchdog_seconds(expected_s, options))
        if seconds is not None:
            seconds.update(arena=t1 - t0, fill=t2 - t1, answer=time.perf_counter() - t2, **spent)
        bad = np.flatnonzero((statuses != 0) | (sizes != caps))
        if len(bad):
            k = int(bad[0])
            if statuses[k]:
                from ...runtime.nvcomp import status_text

                if on_device:
                    raise DecodeFailure(k, f"{kind} stream does not decode: {status_text(statuses[k])}")
                raise DecodeFailure(
                    k, f"{kind} stream does not decode to the {int(caps[k])} bytes it must hold"
                )
            raise DecodeFailure(k, f"{kind} stream decoded to {int(sizes[k])} bytes, expected {int(caps[k])}")
        if into is None or all(o is None for o in into):
            # the decoded bytes are read where they landed, while the caller holds the lease
            return [arena.view(int(o), int(c)) for o, c in zip(dst_off, caps)], lease
        return _drain(arena, dst_off, caps, into, on_device, n)
    finally:
        del lease  # (the caller's reference, where it has one, keeps the arena)


def _fill(arena: Any, srcs: list[Any], offsets: np.ndarray, on_device: bool) -> None:
    if not on_device:
        for s, off in zip(srcs, offsets.tolist()):
            arena.view(off, len(s))[:] = s
        return
    import cupy

    arena.fill(srcs, offsets)
    cupy.cuda.get_current_stream().synchronize()  # the decoder process reads them next


def _drain(arena: Any, offsets: np.ndarray, caps: np.ndarray, into, on_device: bool, n: int):
    """Copy the decoded bytes out of the arena: into ``into[i]``, else slots of one buffer."""
    if on_device:
        import cupy as xp
    else:
        xp = np
    outs: list[Any] = list(into) if into is not None else [None] * n
    missing = [i for i, o in enumerate(outs) if o is None]
    scratch = None
    if missing:
        slots, total = aligned_slots(caps[missing], 16)
        scratch = xp.empty(max(int(total), 1), dtype=xp.uint8)
        for i, p in zip(missing, slots.tolist()):
            outs[i] = scratch[p : p + int(caps[i])]
    for i in range(n):
        outs[i][...] = arena.view(int(offsets[i]), int(caps[i]))
    if on_device:
        xp.cuda.get_current_stream().synchronize()  # the arena is freed next
    return outs, scratch
