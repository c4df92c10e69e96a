"""What a read had to do differently, noted by the stage that did it (a decoder process lost,
smaller batches): added to the running read's report, whichever module notices."""

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
