"""cupy-xarray: Zarr data into NVIDIA GPU memory as xarray objects.

Importing the package registers the ``.cupy`` accessor on DataArray, Dataset and DataTree; the
``engine="kvikio"`` backend is registered through the package's entry point.
"""

from .device import gpu_available
from .engine.read import ReadReport, record_reads
from .engine.warmup import warm_up
from .options import Options, get_options, set_options
from .write import WriteReport, record_writes
from .xarray import accessors, chunked  # noqa: F401  (accessors registers .cupy)
from .xarray.loader import read_datatree_gds, read_zarr_gds

chunked.install()  # dask chunks of engine arrays keep the device's meta

__version__ = "0.2.0"
__all__ = [
    "Options",
    "ReadReport",
    "__version__",
    "get_options",
    "gpu_available",
    "read_datatree_gds",
    "read_zarr_gds",
    "WriteReport",
    "record_reads",
    "record_writes",
    "set_options",
    "warm_up",
]
