"""The engine's CUDA sources, one ``.cu`` file per module that launches them (a decoder, or
the scatter), compiled on first use (cupy caches the binaries on disk) and shared by every thread."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

_HERE = Path(__file__).parent
_functions: dict[tuple[str, str], Any] = {}
_modules: dict[str, Any] = {}
_lock = threading.Lock()


def function(source: str, name: str) -> Any:
    """Kernel ``name`` of :file:`{source}.cu`, loaded once per process."""
    key = (source, name)
    kernel = _functions.get(key)
    if kernel is None:
        import cupy

        with _lock:
            module = _modules.get(source)
            if module is None:
                module = _modules[source] = cupy.RawModule(code=(_HERE / f"{source}.cu").read_text())
            kernel = _functions[key] = module.get_function(name)
    return kernel
