"""The package's shape, checked from its imports: what one module takes from another."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cupy_xarray"


def _imports():
    """(importing module, imported module, names) for every ``from ... import`` of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "cupy_xarray":
                yield module, target, [a.name for a in node.names]


def test_the_walk_sees_the_imports():
    found = {(m, t) for m, t, _ in _imports()}
    assert ("cupy_xarray.xarray.backend", "cupy_xarray.xarray.opening") in found
    assert ("cupy_xarray.engine.reader", "cupy_xarray.engine.route") in found


def test_no_module_takes_another_modules_private_names():
    """What a module keeps to itself (a leading underscore) stays there: a name another
    module needs is public, with a docstring."""
    taken = [
        f"{m} imports {n} from {t}"
        for m, t, names in _imports()
        for n in names
        if n.startswith("_") and not n.startswith("__") and t != m
    ]
    assert not taken, taken


def test_formats_and_runtime_stand_on_the_ground_floor():
    """``formats`` (byte formats) and ``runtime`` (what reader and writer run on) import
    nothing of the package but each other's floor: options, errors and device."""
    floor = ("cupy_xarray.options", "cupy_xarray.errors", "cupy_xarray.device")
    above = [
        f"{m} imports {t}"
        for m, t, _ in _imports()
        if m.startswith(("cupy_xarray.formats", "cupy_xarray.runtime"))
        and not t.startswith((*floor, "cupy_xarray.formats"))
        and not (m.startswith("cupy_xarray.runtime") and t.startswith("cupy_xarray.runtime"))
    ]
    assert not above, above


def test_the_writer_imports_nothing_of_the_reader():
    """``write`` stands on ``formats`` and ``runtime``, as the reader does, not on the reader."""
    taken = [
        f"{m} imports {t}"
        for m, t, _ in _imports()
        if m.startswith("cupy_xarray.write") and t.startswith("cupy_xarray.engine")
    ]
    assert not taken, taken


def test_the_device_knows_no_engine():
    """``device.py`` is a floor: the engine builds its devices (``engine/devices.py``)."""
    taken = [
        f"{m} imports {t}"
        for m, t, _ in _imports()
        if m == "cupy_xarray.device" and t.startswith("cupy_xarray.engine")
    ]
    assert not taken, taken


def test_only_the_xarray_face_calls_the_reader():
    """The reader (``engine/reader.py``, ``read_arrays``) is called from the xarray face
    (``xarray/``) and from inside the engine, nowhere else."""
    taken = [
        f"{m} imports {t}"
        for m, t, names in _imports()
        if not m.startswith(("cupy_xarray.engine", "cupy_xarray.xarray"))
        and (
            t == "cupy_xarray.engine.reader"
            or (t == "cupy_xarray.engine" and {"reader", "read_arrays"} & set(names))
        )
    ]
    assert not taken, taken


def test_memory_kept_idle_is_freed_where_a_read_or_write_runs_short(monkeypatch):
    """The decoder process's idle arenas are given back through the runtime (the writer names
    no reader to ask for them)."""
    from types import SimpleNamespace

    from cupy_xarray.engine import sandbox
    from cupy_xarray.runtime import buffers

    asked = []
    process = SimpleNamespace(arenas=SimpleNamespace(release=lambda: asked.append("released")))
    monkeypatch.setattr(sandbox.client, "_processes", {"a decoder process": process})
    buffers.release_idle_memory()
    assert asked == ["released"]


def test_the_decoders_import_nothing_else_of_the_engine():
    """``engine/decoders`` follow the route they are given (:class:`~cupy_xarray.engine.route.Route`);
    the decoder process reaches them from the device (``engine/devices.py``), not by import."""
    taken = [
        f"{m} imports {t}"
        for m, t, _ in _imports()
        if m.startswith("cupy_xarray.engine.decoders")
        and t.startswith("cupy_xarray.engine")
        and not t.startswith("cupy_xarray.engine.decoders")
    ]
    assert not taken, taken


def test_only_the_device_and_the_route_ask_the_devices_name():
    """What differs between the CPU and the GPU is asked of the device's capabilities
    (``Device.host_memory``, ``side_stream()`` ...) or of the group's route, not of its name:
    ``device.py`` and ``engine/route.py`` alone compare it."""
    import re

    asked = re.compile(r'(\.name|"name", [^)]*\))\s*[!=]=\s*"(gpu|cpu)"')
    allowed = {"device.py", "engine/route.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in allowed:
            found += [f"{rel}: {m.group(0)}" for m in asked.finditer(path.read_text())]
    assert not found, found


def test_the_engine_reads_the_process_settings_only_at_its_entry_points():
    """Inside ``engine/`` a read's settings come from the read (``read.options``, carried to
    its stages, its decoders, the decoder process's limits and its fetchers): only the entry
    points ask for the settings in effect."""
    entry = {
        ("engine/reader.py", "read_arrays"),
        ("engine/reader.py", "describe"),
        ("engine/devices.py", "resolve_device"),
        ("engine/warmup.py", "_warm_up_here"),
    }
    found = set()
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "get_options":
                    found.add((rel, fn.name))
    assert found <= entry, sorted(found - entry)
    assert ("engine/reader.py", "read_arrays") in found  # the walk sees the calls
