"""Shared fixtures: devices to run on, stores to read, a host copy of any array."""

from __future__ import annotations

import contextvars
import threading

import numpy as np
import pytest


def _gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


HAS_GPU = _gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU available (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def host(x):
    """A NumPy copy of a numpy/cupy array."""
    return x.get() if hasattr(x, "__cuda_array_interface__") else np.asarray(x)


def expected_type(device: str) -> str:
    return "cupy" if device == "gpu" else "numpy"


def module_of(x) -> str:
    return type(x).__module__.split(".")[0]


def run_in_threads(work, count: int, timeout: float | None = None) -> list[BaseException]:
    """Run ``work(k)`` for k in range(count), each in its own thread with the test's settings
    (``set_options`` is per context: each thread starts from a copy of this one's), waiting up
    to ``timeout`` seconds for each (None: for ever); return what they raised."""
    errors: list[BaseException] = []

    def guarded(k):
        try:
            work(k)
        except Exception as exc:  # noqa: BLE001 - handed back to the test to assert on
            errors.append(exc)

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(guarded, k)) for k in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


@pytest.fixture
def c_api(monkeypatch):
    """nvCOMP's C API as where it loads, so that the decoder process can run for a GPU
    read (the routes of a GPU read planned on a machine without one)."""
    from cupy_xarray.runtime import nvcomp

    monkeypatch.setattr(nvcomp, "library", lambda: object())


@pytest.fixture
def options():
    """``options(name=value, ...)`` changes cupy_xarray's settings for the rest of the test
    (:func:`cupy_xarray.set_options`); they are restored afterwards."""
    from cupy_xarray import set_options

    changes = []

    def change(**kwargs):
        changes.append(set_options(**kwargs))
        return changes[-1].options

    yield change
    for c in reversed(changes):
        c.__exit__(None, None, None)


def pytest_terminal_summary(terminalreporter):
    """Why tests were skipped, counted by reason (most need a GPU; the rest say what they need)."""
    from collections import Counter

    reasons: Counter = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:6d}  {reason}")
