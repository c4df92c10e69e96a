"""Command line: ``python -m cupy_xarray info`` and ``python -m cupy_xarray demo``."""

from __future__ import annotations

import argparse
import sys


def demo(device: str | None = None) -> int:
    """Open the embedded sample store with engine='kvikio', compute, check against zarr."""
    import numpy as np
    import xarray as xr

    import cupy_xarray  # noqa: F401
    from cupy_xarray.device import gpu_available
    from cupy_xarray.sample import sample_path

    if device is None:
        device = "gpu" if gpu_available() else "cpu"
        if device == "cpu":
            print("No GPU available: running on the CPU (device='cpu', NumPy output).")
    path = sample_path()
    ds = xr.open_dataset(path, engine="kvikio", device=device)
    print(f"opened {path.name} lazily with engine='kvikio', device={device!r}")
    air = ds.air.load()
    print(f"air: {air.shape} {air.dtype}, data type {type(air.data).__module__}.{type(air.data).__name__}")
    clim = air.mean("time")
    print(f"time mean: {dict(clim.sizes)}, spatial mean {float(clim.mean().cupy.get()):.3f} K")
    ref = xr.open_dataset(path, engine="zarr").air.load()
    same = np.array_equal(air.cupy.get(), ref.values)
    print(f"identical to engine='zarr': {same}")
    if device == "gpu":
        back = air.cupy.as_numpy()
        again = back.cupy.as_cupy()
        print(
            f"round trip numpy -> cupy: is_cupy={again.cupy.is_cupy}, "
            f"equal={np.array_equal(again.cupy.get(), ref.values)}"
        )
    print(f"device used: {device}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupy-xarray")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, GPUs, kvikio mode: paste into bug reports")
    d = sub.add_parser("demo", help="read the embedded sample store (GPU if present)")
    d.add_argument("--device", choices=["gpu", "cpu"], default=None)
    args = parser.parse_args(argv)
    if args.cmd == "info":
        from .info import print_info

        print_info()
        return 0
    from .errors import NoGPUError

    try:
        return demo(args.device)
    except NoGPUError as exc:  # --device gpu on a machine without one: say it in one line
        from .device import CPU_HINT

        why = str(exc).replace(CPU_HINT, "run it with --device cpu, or without --device")
        print(f"cupy-xarray demo: {why}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
