"""Writing xarray objects to Zarr from where their data lie (GPU or host).

``dataset.py`` is the xarray side (what xarray writes, what the engine writes), ``context.py``
a Write per call (its settings, encoders, file threads, report), ``chunks.py``
one array's chunks into a local store, ``encoders.py`` chunk bytes -> file bytes (numcodecs on
CPU threads, nvCOMP on the GPU).
"""

from .chunks import WriteReport
from .dataset import record_writes, to_zarr

__all__ = ["WriteReport", "record_writes", "to_zarr"]
