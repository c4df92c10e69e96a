"""The reading process's side of the decoder process: start it, keep a spare warm, send it a
batch, wait for the answer no longer than the watchdog allows, kill and replace it when it
dies or stalls (:class:`DecoderLost`: the caller then decodes the batch on CPU threads)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ...options import child_environment, get_options
from ..decoders.base import DecodeFailure, aligned_slots
from .arena import make_arena

#: seconds a new decoder process may take to start (CUDA and nvCOMP load in 1.5-2 s on an H200 host)
START_TIMEOUT_S = 60.0
_SLOT = 256


class DecoderLost(RuntimeError):
    """The decoder process died, stalled or failed while decoding a batch (it was replaced)."""


class _Worker:
    """One decoder process and its two pipes."""

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
        self.send = Connection(we_write, readable=False)
        self.answers = Connection(we_read, writable=False)
        self.ready = False

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
            raise DecoderLost(f"the decoder process cannot decode here: {reply[1]}")
        self.ready = True

    def kill(self) -> None:
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
        #: processes lost to a death, a stall or a failure, and batches answered, since this
        #: object was made
        self.lost = 0
        self.batches = 0
        self._fault: str | None = None

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
            self._lose()
            raise
        if self._spare is None:
            self._spare = _Worker(self.mode)  # starts now, beside the batch
        return self._current

    def _lose(self) -> None:
        if self._current is not None:
            self._current.kill()
            self._current = None
            self.lost += 1

    def run(self, msg: tuple, wait_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Send one batch; its (sizes, statuses), or DecoderLost after ``wait_s`` seconds."""
        with self._lock:
            worker = self._take()
            if self._fault is not None:
                msg, self._fault = msg[:-1] + (self._fault,), None
            try:
                worker.send.send(msg)
            except OSError:
                self._lose()
                raise DecoderLost("the decoder process had ended") from None
            if not worker.answers.poll(wait_s):
                self._lose()
                raise DecoderLost(
                    f"the decoder process did not answer within {wait_s:.1f} s (a damaged stream?)"
                )
            try:
                reply = worker.answers.recv()
            except (EOFError, OSError):
                self._lose()
                raise DecoderLost("the decoder process died while it decoded (a damaged stream?)") from None
            if reply[0] != "done":
                self._lose()
                raise DecoderLost(f"the decoder process failed: {reply[1]}")
            self.batches += 1
            return reply[1], reply[2]

    def close(self) -> None:
        with self._lock:
            for w in (self._current, self._spare):
                if w is not None:
                    w.kill()
            self._current = self._spare = None


_processes: dict[str, DecoderProcesses] = {}
_processes_lock = threading.Lock()


def decoder_processes(mode: str) -> DecoderProcesses:
    """This process's decoder processes of ``mode``, started at the first batch."""
    with _processes_lock:
        p = _processes.get(mode)
        if p is None:
            p = _processes[mode] = DecoderProcesses(mode)
        return p


def _close_all() -> None:
    for p in list(_processes.values()):
        p.close()


def _forget_after_fork() -> None:  # a forked child owns none of its parent's decoder processes
    global _processes_lock
    _processes.clear()
    _processes_lock = threading.Lock()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_after_fork)


def watchdog_seconds(expected_s: float) -> float:
    """How long a batch expected to take ``expected_s`` may take before its process is killed:
    a few times what it should take, at least ``decoder_min_wait``, at most ``decoder_timeout``."""
    o = get_options()
    return min(o.decoder_timeout, max(o.decoder_min_wait, 4 * expected_s))


def decode_batch(
    kind: str,
    srcs: list[Any],
    expected: list[int],
    into: list[Any] | None,
    on_device: bool,
    expected_s: float,
    fault: str | None = None,
) -> tuple[list[Any], Any]:
    """Decode bare streams of ``kind`` in the decoder process: copied into an arena, decoded
    there, checked (status and exact size per stream), and copied into ``into[i]`` where
    given, else into slots of one new buffer. Returns (outputs, the buffer that holds them).

    Raises DecodeFailure naming the first stream that does not decode to its size, and
    DecoderLost where the process died or stalled (it is replaced; decode the batch again
    on CPU threads). ``fault``: ``"die"`` or ``"stall"``, on purpose (tests).
    """
    n = len(srcs)
    lens = np.array([len(s) for s in srcs], dtype=np.int64)
    caps = np.asarray(expected, dtype=np.int64)
    src_off, in_total = aligned_slots(lens, _SLOT)
    in_total = -(-in_total // _SLOT) * _SLOT
    dst_off, out_total = aligned_slots(caps, _SLOT)
    dst_off = dst_off + in_total
    arena = make_arena(in_total + out_total, on_device)
    try:
        _fill(arena, srcs, src_off, on_device)
        mode = "nvcomp" if on_device else "host"
        msg = ("decode", arena.export(), kind, src_off, lens, dst_off, caps, fault)
        sizes, statuses = decoder_processes(mode).run(msg, watchdog_seconds(expected_s))
        bad = np.flatnonzero((statuses != 0) | (sizes != caps))
        if len(bad):
            k = int(bad[0])
            if statuses[k]:
                from ..decoders.nvcomp import status_text

                if on_device:
                    raise DecodeFailure(k, f"{kind} stream does not decode: {status_text(statuses[k])}")
                raise DecodeFailure(
                    k, f"{kind} stream does not decode to the {int(caps[k])} bytes it must hold"
                )
            raise DecodeFailure(k, f"{kind} stream decoded to {int(sizes[k])} bytes, expected {int(caps[k])}")
        if into is None or all(o is None for o in into):
            # the decoded bytes are read where they are: their views keep the arena's memory
            return [arena.view(int(o), int(c)) for o, c in zip(dst_off, caps)], None
        return _drain(arena, dst_off, caps, into, on_device, n)
    finally:
        arena.close()


def _fill(arena: Any, srcs: list[Any], offsets: np.ndarray, on_device: bool) -> None:
    if not on_device:
        for s, off in zip(srcs, offsets.tolist()):
            arena.view(off, len(s))[:] = s
        return
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream()
    for s, off in zip(srcs, offsets.tolist()):
        rt.memcpyAsync(arena.ptr + off, s.data.ptr, len(s), rt.memcpyDeviceToDevice, stream.ptr)
    stream.synchronize()  # the decoder process reads them next


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
