"""``python -m cupy_xarray info``: one screen of facts for bug reports."""

from __future__ import annotations

import importlib
import platform
import sys


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - report, don't fail
        return f"not available ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "installed"))


def info_lines() -> list[str]:
    """The lines ``info`` prints; works with no GPU and no cupy."""
    from . import __version__
    from .device import default_threads, gpu_available

    lines = [
        f"cupy_xarray   {__version__}",
        f"python        {sys.version.split()[0]} ({platform.platform()})",
    ]
    for name, module in [
        ("xarray", "xarray"),
        ("zarr", "zarr"),
        ("numpy", "numpy"),
        ("numcodecs", "numcodecs"),
        ("dask", "dask"),
        ("cupy", "cupy"),
        ("kvikio", "kvikio"),
        ("nvCOMP", "nvidia.nvcomp"),
    ]:
        lines.append(f"{name:<13} {_version(module)}")
    from .runtime.nvcomp import describe as nvcomp_c_api

    lines.append(f"nvCOMP C API  {nvcomp_c_api()}")
    from .options import get_options

    try:
        device = get_options().device
    except ValueError as exc:
        device = f"invalid: {exc}"
    lines.append(f"device        {device} (CUPY_XARRAY_DEVICE or device=: where reads put their arrays)")
    lines.append(f"io threads    {default_threads()} (CUPY_XARRAY_THREADS or threads=)")
    try:
        from .engine.decoders import decode_choice

        choice = decode_choice(None, get_options())
    except ValueError as exc:
        choice = f"invalid: {exc}"
    lines.append(f"decode        {choice} (CUPY_XARRAY_DECODE or decode=: where GPU reads decode chunks)")
    from .engine import rates

    path = rates.cache_path(get_options())
    known = sorted({k.rsplit("|", 1)[-1] for k in rates.load(path)})
    measure = "cupy_xarray.warm_up(measure=True) measures them"
    rates = f"measured for {', '.join(known)}" if known else f"none measured: built-in figures ({measure})"
    lines.append(f"decode rates  {rates}: {path}")
    if not gpu_available():
        if device == "cpu":
            lines.append("GPU           none available: reads use the CPU (device='cpu': NumPy arrays)")
        else:
            lines.append(
                f"GPU           none available: reads with device={device!r} raise NoGPUError; "
                "pass device='cpu' or set CUPY_XARRAY_DEVICE=cpu to read into NumPy arrays"
            )
        return lines
    import cupy

    rt = cupy.cuda.runtime
    lines.append(f"CUDA          driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}")
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(f"GPU {i}         {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB")
    try:
        import kvikio
        import kvikio.defaults as kd

        compat = kd.get("compat_mode")
        try:
            gds = kvikio.cufile_driver.libcufile_version() if hasattr(kvikio, "cufile_driver") else None
        except Exception:  # noqa: BLE001
            gds = None
        is_compat = kd.is_compat_mode_preferred() if hasattr(kd, "is_compat_mode_preferred") else compat
        mode = (
            "compatibility mode (POSIX reads + pinned bounce buffers; no GPUDirect Storage)"
            if is_compat
            else "GPUDirect Storage"
        )
        lines.append(f"kvikio mode   {mode}; compat_mode={compat}, libcufile={gds}")
        lines.append(
            f"kvikio        num_threads={kd.get('num_threads')} (raised to our io threads "
            f"during reads), task_size={kd.get('task_size')}"
        )
    except Exception as exc:  # noqa: BLE001
        lines.append(f"kvikio        unusable: {exc}")
    return lines


def print_info() -> None:
    print("\n".join(info_lines()))
