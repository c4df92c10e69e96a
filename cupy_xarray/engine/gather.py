"""Reads gathered across threads: small reads that arrive together become one read.

Dask tasks and data-loader threads read a chunk or a few at a time. Alone, each such read is
too small for nvCOMP (a call costs as much for one frame as for hundreds) and pays the read's
fixed costs by itself. The :class:`ReadService` of a process lets the first of them run at
once; one that arrives while another runs opens a **party** and waits a bounded time (the
``gather_wait`` option, a few milliseconds) for others to join, then reads every request of
the party in one engine read, whose batches and shared queue see all of them. Each caller gets
its own outputs. A party's read that fails is read again caller by caller, so that each gets
its own result or its own error. Each caller's ``record_reads()`` gets the party's report.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class _Member:
    """One caller's requests in a party, and what it gets back."""

    def __init__(self, requests: list, recorders: list | None) -> None:
        self.requests = requests
        self.recorders = recorders
        self.outs: list | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def result(self) -> list:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.outs  # type: ignore[return-value]


class _Party:
    """Reads gathered into one: members join until the leader's wait ends or it is full."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.members: list[_Member] = []
        self.nbytes = 0
        self.closed = False
        self.full = threading.Event()

    def join(self, requests: list, nbytes: int, recorders: list | None) -> _Member:
        member = _Member(requests, recorders)
        self.members.append(member)
        self.nbytes += nbytes
        return member

    def run(self, read: Callable[[list], tuple[list, list]]) -> None:
        """Read every member's requests in one read; where it fails, each member's alone.
        Every member is answered, whatever happens (none waits for ever)."""
        try:
            self._run(read)
        except BaseException as exc:
            for m in self.members:
                if not m.done.is_set():
                    self._finish(m, None, [], exc)
            raise

    def _run(self, read: Callable[[list], tuple[list, list]]) -> None:
        together = [r for m in self.members for r in m.requests]
        try:
            outs, reports = read(together)
        except Exception as exc:  # handed to the members, each read again alone
            if len(self.members) == 1:
                self._finish(self.members[0], None, [], exc)
                return
            for m in self.members:
                try:
                    got, reports = read(m.requests)
                except Exception as own:  # this member's own error
                    self._finish(m, None, [], own)
                else:
                    self._finish(m, got, reports, None)
            return
        for report in reports:
            report.gathered = len(self.members)
        at = 0
        for m in self.members:
            self._finish(m, outs[at : at + len(m.requests)], reports, None)
            at += len(m.requests)

    @staticmethod
    def _finish(member: _Member, outs: list | None, reports: list, error: BaseException | None) -> None:
        member.outs, member.error = outs, error
        if member.recorders is not None:
            member.recorders.extend(reports)
        member.done.set()


class ReadService:
    """Gathers the reads of one process that arrive together (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Any, _Party] = {}
        self._active = 0  # reads of this service running now
        #: reads asked of the service, parties read, and the reads those held
        self.reads = 0
        self.parties = 0
        self.gathered = 0

    def read(
        self,
        requests: list,
        nbytes: int,
        key: Any,
        read: Callable[[list], tuple[list, list]],
        recorders: Any,
        wait_s: float,
        most_bytes: int,
    ) -> list:
        """The outputs of ``requests`` (``nbytes`` of them), read alone at once where no other
        read of the service runs, else gathered with the reads of the same ``key`` (device and
        settings) that arrive within ``wait_s``, up to ``most_bytes`` in all. ``read(requests)``
        reads and returns the outputs and the reports filed; ``recorders``: the caller's
        ``record_reads`` list (a ContextVar's value) or None."""
        leader = False
        with self._lock:
            self.reads += 1
            party = self._open.get(key)
            if party is not None and not party.closed and party.nbytes + nbytes <= most_bytes:
                member = party.join(requests, nbytes, recorders)
                if party.nbytes >= most_bytes:
                    party.full.set()
            elif self._active == 0:
                self._active += 1
                party = None
            else:
                party = self._open[key] = _Party(key)
                member = party.join(requests, nbytes, recorders)
                leader = True
        if party is None:  # alone: nothing to wait for
            try:
                outs, reports = read(requests)
            finally:
                with self._lock:
                    self._active -= 1
            if recorders is not None:
                recorders.extend(reports)
            return outs
        if not leader:
            return member.result()
        party.full.wait(wait_s)
        with self._lock:
            party.closed = True
            if self._open.get(key) is party:
                del self._open[key]
            self._active += 1
            self.parties += 1
            self.gathered += len(party.members)
        try:
            party.run(read)
        finally:
            with self._lock:
                self._active -= 1
        return member.result()


SERVICE = ReadService()
