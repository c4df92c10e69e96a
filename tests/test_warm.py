"""The warm start: opening a store for the GPU starts, on a background thread, what the first
read would otherwise wait for."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from cupy_xarray.device import start_gpu
from cupy_xarray.engine import host


def _fake_cupy(index: int, calls: list):
    runtime = SimpleNamespace(
        getDevice=lambda: index,
        setDevice=lambda i: calls.append(("setDevice", i)),
        free=lambda p: calls.append(("free", p)),
    )
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def test_the_context_then_the_engine_start_in_the_background_once_per_device():
    calls: list = []
    done = threading.Event()

    def then():
        calls.append(("then", threading.current_thread().name))
        done.set()

    cupy = _fake_cupy(9901, calls)
    start_gpu(cupy, then, before=lambda: calls.append(("before", threading.current_thread().name)))
    assert done.wait(10)
    # what needs no context first (the decoder process), off the caller's thread
    assert calls[0] == ("before", "cupy-xarray-cuda-start")
    assert calls[1:3] == [("setDevice", 9901), ("free", 0)]  # then the context
    assert calls[3] == ("then", "cupy-xarray-cuda-start")  # then the engine
    start_gpu(cupy, then)  # once per device
    assert sum(c[0] == "then" for c in calls) == 1


def test_warm_engine_starts_the_pool_and_leaves_no_setting_changed(options):
    from cupy_xarray.engine.warmup import warm_engine
    from cupy_xarray.options import get_options

    before = get_options()
    warm_engine(3, before)  # on a machine without nvCOMP or kvikio: the pool alone, no error
    assert 3 in host._pools and get_options() == before


@pytest.mark.gpu
def test_warm_engine_readies_page_locked_memory_for_the_first_small_read():
    """A small first read copies from page-locked memory: the warm start makes cupy's pinned
    pool hold a block, without importing cupyx (which imports SciPy's sparse matrices: a few
    hundred ms that a first read waited for)."""
    code = (
        "import cupy\n"
        "cupy.cuda.runtime.free(0)\n"
        "pool = cupy.get_default_pinned_memory_pool()\n"
        "before = pool.n_free_blocks()\n"
        "from cupy_xarray.engine.warmup import warm_engine\n"
        "from cupy_xarray.options import get_options\n"
        "warm_engine(2, get_options())\n"
        "import sys\n"
        "print(before, pool.n_free_blocks(), int('scipy.sparse' in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, sparse = map(int, out.stdout.split()[-3:])
    assert before == 0 and after >= 1 and not sparse
