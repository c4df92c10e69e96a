"""The conformance tool's plugin decides what is cupy-xarray's own call by module name, and
counts what it routed (a route that routes nothing fails the run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture
def plugin():
    spec = importlib.util.spec_from_file_location(
        "conformance_route_under_test", TOOLS / "conformance_route.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call_from(plugin, module: str, filename: str) -> bool:
    """``plugin._from_cupy_xarray()`` called from code of ``module`` in file ``filename``."""
    code = compile(
        "def caller():\n    return check()\n\ndef outer():\n    return caller()\n", filename, "exec"
    )
    scope = {"__name__": module, "check": plugin._from_cupy_xarray}
    exec(code, scope)
    return scope["outer"]()


def test_calls_are_told_apart_by_module_not_by_path(plugin):
    env = "/opt/conda/envs/cupy_xarray/lib/python3.12/site-packages/xarray/backends/api.py"
    assert not _call_from(plugin, "xarray.backends.api", env)  # an env named like the package
    assert plugin.ROUTED == 1
    assert _call_from(plugin, "cupy_xarray.write.dataset", "/somewhere/else.py")
    assert plugin.ROUTED == 1  # the package's own call is not routed
    assert not _call_from(plugin, "cupy_xarray_extras", "/x.py")


def test_a_route_that_routes_nothing_fails(tmp_path, monkeypatch):
    sys.path.insert(0, str(TOOLS))
    try:
        import conformance
    finally:
        sys.path.remove(str(TOOLS))

    def fake_run(cmd, env, cwd, capture_output, text):
        log = Path(env["CUPY_XARRAY_ROUTE_LOG"])
        log.write_text('{"test": "t1", "outcome": "passed", "message": ""}\n{"routed": 0}\n')

        class Done:
            returncode, stdout, stderr = 0, "", ""

        return Done()

    monkeypatch.setattr(conformance.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="no call was routed"):
        conformance.run_route("reads", "cpu", [], tmp_path, tmp_path)
    results, _ = conformance.run_route("baseline", "cpu", [], tmp_path, tmp_path)
    assert list(results) == ["t1"]
