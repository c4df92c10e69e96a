"""A pytest plugin that routes xarray's own Zarr tests through cupy-xarray.

Loaded by ``tools/conformance.py`` (``-p conformance_route``); ``CUPY_XARRAY_ROUTE`` says what
is routed:

``baseline``
    nothing: xarray's tests as they are, the bar the other routes are held to.
``reads``
    every open whose engine is (or is guessed to be) ``"zarr"`` goes through ``engine="kvikio"``
    on ``CUPY_XARRAY_ROUTE_DEVICE`` (``cpu`` or ``gpu``).
``writes``
    every ``Dataset``/``DataArray``/``DataTree.to_zarr`` goes through ``.cupy.to_zarr``.
``engine-writes``
    as ``writes``, and small Datasets are written by the engine's writer too (by default a
    Dataset of less than 8 MiB is written by xarray from host copies).

Calls made from inside cupy-xarray itself (which opens stores with ``engine="zarr"`` and writes
metadata with xarray's ``to_zarr``) are never routed: a call is cupy-xarray's where a module
of the ``cupy_xarray`` package is on the call stack (by module name, not by file path, which
an environment's name may contain). Every test's outcome is appended to the JSON-lines file
``CUPY_XARRAY_ROUTE_LOG``, and at the end the number of calls routed (``{"routed": n}``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys

import pytest

ROUTE = os.environ.get("CUPY_XARRAY_ROUTE", "baseline")
DEVICE = os.environ.get("CUPY_XARRAY_ROUTE_DEVICE", "cpu")
ROUTED = 0  # calls routed through cupy-xarray in this run


def _ours(module: str) -> bool:
    return module == "cupy_xarray" or module.startswith("cupy_xarray.")


def _from_cupy_xarray() -> bool:
    """Whether cupy-xarray is on the call stack (its own opens and writes stay as they are);
    where not, the call is counted as routed."""
    global ROUTED
    frame = sys._getframe(2)
    while frame is not None:
        if _ours(frame.f_globals.get("__name__", "")):
            return True
        frame = frame.f_back
    ROUTED += 1
    return False


def _route_reads() -> None:
    from xarray.backends import plugins

    from cupy_xarray.xarray.backend import KvikioBackendEntrypoint

    class Routed(KvikioBackendEntrypoint):
        """``engine="kvikio"`` on the route's device, standing in for ``engine="zarr"``."""

        def open_dataset(self, filename_or_obj, **kwargs):  # type: ignore[override]
            kwargs.setdefault("device", DEVICE)
            return super().open_dataset(filename_or_obj, **kwargs)

        def open_datatree(self, filename_or_obj, **kwargs):  # type: ignore[override]
            kwargs.setdefault("device", DEVICE)
            return super().open_datatree(filename_or_obj, **kwargs)

        def open_groups_as_dict(self, filename_or_obj, **kwargs):  # type: ignore[override]
            kwargs.setdefault("device", DEVICE)
            return super().open_groups_as_dict(filename_or_obj, **kwargs)

    original = plugins.get_backend

    @functools.wraps(original)
    def get_backend(engine):
        if engine == "zarr" and not _from_cupy_xarray():
            return Routed()
        return original(engine)

    plugins.get_backend = get_backend


def _route_writes(small: bool) -> None:
    import xarray as xr

    import cupy_xarray  # the .cupy accessor

    for cls in (xr.Dataset, xr.DataArray, xr.DataTree):
        original = cls.to_zarr
        signature = inspect.signature(original)

        def routed(self, *args, __original=original, __signature=signature, **kwargs):
            if _from_cupy_xarray():
                return __original(self, *args, **kwargs)
            bound = __signature.bind(self, *args, **kwargs).arguments
            bound.pop("self")
            bound.update(bound.pop("kwargs", {}))
            if small:
                with cupy_xarray.set_options(small_write_bytes=0):
                    return self.cupy.to_zarr(**bound)
            return self.cupy.to_zarr(**bound)

        functools.update_wrapper(routed, original)
        cls.to_zarr = routed


def pytest_configure(config: pytest.Config) -> None:
    if ROUTE == "reads":
        _route_reads()
    elif ROUTE in ("writes", "engine-writes"):
        _route_writes(small=ROUTE == "engine-writes")
    elif ROUTE != "baseline":
        raise pytest.UsageError(f"CUPY_XARRAY_ROUTE={ROUTE!r}: baseline, reads, writes or engine-writes")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    log = os.environ.get("CUPY_XARRAY_ROUTE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"routed": ROUTED}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    log = os.environ.get("CUPY_XARRAY_ROUTE_LOG")
    if not log:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        state = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        if hasattr(report, "wasxfail") and report.passed:
            state = "xpassed"
        message = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)[-500:]
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "outcome": state, "message": message[:1000]}) + "\n")
