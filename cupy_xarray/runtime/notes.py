"""What a read had to do differently, noted by the stage that did it (a decoder process lost,
smaller batches): added to the running read's report, whichever module notices; and the
reports of the reads and writes of a block, collected for ``record_reads``/``record_writes``."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

_reading: contextvars.ContextVar[Any] = contextvars.ContextVar("cupy_xarray_read", default=None)


@contextlib.contextmanager
def reporting(report: Any):
    """Make ``report`` (a :class:`~.read.ReadReport`) the one :func:`note` adds to, for the
    code inside the block."""
    token = _reading.set(report)
    try:
        yield
    finally:
        _reading.reset(token)


def note(text: str) -> None:
    """Add ``text`` to the notes of the read running in this context (if any)."""
    report = _reading.get()
    if report is not None and text not in report.notes:
        report.notes.append(text)


@contextlib.contextmanager
def collecting(recorders: contextvars.ContextVar):
    """Collect, in a new list yielded to the block, the reports :func:`file` gives
    ``recorders`` inside it (a ContextVar: reports of other threads never mix in)."""
    reports: list = []
    token = recorders.set(reports)
    try:
        yield reports
    finally:
        recorders.reset(token)


def file(recorders: contextvars.ContextVar, report: Any) -> None:
    """Add ``report`` to the list a :func:`collecting` block around this code collects, if any."""
    reports = recorders.get()
    if reports is not None:
        reports.append(report)
