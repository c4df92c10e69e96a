"""cupy-xarray: Zarr data into NVIDIA GPU memory as xarray objects.

Importing the package registers the ``.cupy`` accessor on DataArray, Dataset and DataTree; the
``engine="kvikio"`` backend is registered through the package's entry point.
"""

from . import accessors  # noqa: F401  (registers .cupy)
from .device import gpu_available
from .loader import read_datatree_gds, read_zarr_gds
from .warmup import warm_up

__version__ = "0.2.0"
__all__ = ["__version__", "gpu_available", "read_datatree_gds", "read_zarr_gds", "warm_up"]
