"""The xarray face: what xarray and its users call, on top of the read engine and the writer.

``backend.py`` is ``engine="kvikio"`` (the entrypoint, the store, the lazy ``BackendArray``),
``opening.py`` a store's forms and why one did not open, ``loader.py`` the eager readers
(``read_zarr_gds``), ``chunked.py`` dask chunks that keep the device's meta, ``readahead.py``
a dask task's read that takes the next chunks along, ``cf.py`` CF decoding on cupy, and
``accessors.py`` the ``.cupy`` accessor.
"""
