"""The ``.cupy`` accessor on :class:`xarray.DataArray`, :class:`xarray.Dataset` and
:class:`xarray.DataTree`, and ``as_cupy()`` on the objects themselves (as cupy-xarray 0.1 had;
``as_numpy()`` is xarray's own)."""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from ..device import CONVERT_HINT, host_copy, is_cupy_array, is_dask_array, require_gpu, to_host


def _is_dask(data: Any) -> bool:
    return is_dask_array(data)


def _data_is_cupy(var: xr.Variable) -> bool:
    data = var._data
    if _is_dask(data):
        return is_cupy_array(data._meta)
    if is_cupy_array(data):
        return True
    from .backend import KvikioBackendArray
    from .cf import find_backend_array

    lazy = find_backend_array(data, KvikioBackendArray)
    if lazy is not None:  # not loaded yet: don't load just to answer
        return lazy.device in ("gpu", "cuda") and lazy.dtype.kind in "biufc"
    return is_cupy_array(getattr(data, "array", None))


def _to_cupy(data: Any) -> Any:
    cupy = require_gpu(CONVERT_HINT)
    if _is_dask(data):
        meta = cupy.empty((0,) * data.ndim, dtype=data.dtype)
        return data.map_blocks(cupy.asarray, dtype=data.dtype, meta=meta)
    return cupy.asarray(data)


def _convert_var(var: xr.Variable, fn) -> xr.Variable:
    data = var._data if _is_dask(var._data) or is_cupy_array(var._data) else var.values
    return var.copy(deep=False, data=fn(data))


@xr.register_dataarray_accessor("cupy")
class CupyDataArrayAccessor:
    """GPU helpers for a DataArray: ``da.cupy.as_cupy()``, ``da.cupy.is_cupy``..."""

    def __init__(self, da: xr.DataArray) -> None:
        self._da = da

    @property
    def is_cupy(self) -> bool:
        """True when the data is a cupy array, or dask with a cupy ``_meta``."""
        return _data_is_cupy(self._da.variable)

    def as_cupy(self, coords: bool = False) -> xr.DataArray:
        """A new DataArray with its data in GPU memory (dask stays lazy, with cupy meta).

        Parameters
        ----------
        coords
            Also move non-index coordinates (index coordinates always stay pandas indexes).
        """
        da = self._da
        data = da.variable._data if _is_dask(da.variable._data) else da.data
        out = da.copy(deep=False, data=_to_cupy(data))
        if coords:
            for name, coord in da.coords.items():
                if name not in da.indexes:
                    out = out.assign_coords({name: _convert_var(coord.variable, _to_cupy)})
        return out

    def as_numpy(self) -> xr.DataArray:
        """A new DataArray with its data (and coordinates) in host memory."""
        da = self._da
        data = da.variable._data if _is_dask(da.variable._data) else da.data
        out = da.copy(deep=False, data=host_copy(data))
        for name, coord in da.coords.items():
            cdata = coord.variable._data
            if name not in da.indexes and (is_cupy_array(cdata) or _is_dask(cdata)):
                out = out.assign_coords({name: _convert_var(coord.variable, host_copy)})
        return out

    def get(self) -> np.ndarray:
        """The data as a NumPy array (computing dask first)."""
        data = self._da.data
        if _is_dask(data):
            data = data.compute()
        return to_host(data)

    def to_zarr(self, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Write this DataArray to a Zarr store, as :meth:`xarray.DataArray.to_zarr` does.

        Takes every argument of :meth:`xarray.Dataset.to_zarr` (``mode``, ``append_dim``,
        ``region``, ``encoding``, ``consolidated``, ``zarr_format``, ``storage_options``,
        ``compute`` ...) and writes the same Zarr store it would, from GPU data too (xarray's own
        ``to_zarr`` refuses cupy arrays). A new store on a local path gets its chunks written by
        the engine: compressed with nvCOMP on the GPU (zstd) or numcodecs on CPU threads, each
        file under a temporary name renamed into place, dask arrays a task per block; so are
        appends and regions of whole chunks. Other writes (remote stores, CF-transformed
        values, appends sharing a chunk with data already written, dask under distributed)
        go through xarray from host copies.

        Returns
        -------
        ZarrStore or dask.delayed.Delayed
            What :meth:`xarray.Dataset.to_zarr` returns: the store, or with ``compute=False`` a
            dask ``Delayed`` that writes the dask arrays.
        """
        from xarray.backends.api import DATAARRAY_NAME, DATAARRAY_VARIABLE

        from ..write import to_zarr

        kwargs = _by_name(xr.DataArray.to_zarr, args, kwargs)
        da = self._da
        if da.name is None:
            ds = da.to_dataset(name=DATAARRAY_VARIABLE, promote_attrs=False)
        elif da.name in da.coords or da.name in da.dims:  # kept under xarray's name, as xarray does
            ds = da.to_dataset(name=DATAARRAY_VARIABLE, promote_attrs=False)
            ds.attrs[DATAARRAY_NAME] = da.name
        else:
            ds = da.to_dataset(promote_attrs=False)
        return to_zarr(ds, store, **kwargs)


@xr.register_dataset_accessor("cupy")
class CupyDatasetAccessor:
    """GPU helpers for a Dataset: ``ds.cupy.as_cupy()``, ``ds.cupy.is_cupy``..."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    @staticmethod
    def read_zarr_gds(store: Any, **kwargs: Any) -> xr.Dataset:
        """See :func:`cupy_xarray.read_zarr_gds`."""
        from .loader import read_zarr_gds

        return read_zarr_gds(store, **kwargs)

    @property
    def is_cupy(self) -> bool:
        """True when the Dataset has data variables and every one is on the GPU."""
        return _all_cupy(self._ds.data_vars.values())

    def _convert(self, fn) -> xr.Dataset:
        ds = self._ds
        out = ds.copy(deep=False)
        for name in ds.data_vars:
            out[name] = fn(ds[name])
        out.attrs = dict(ds.attrs)
        out.encoding = dict(ds.encoding)
        return out

    def to_zarr(self, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Write this Dataset to a Zarr store, as :meth:`xarray.Dataset.to_zarr` does.

        Takes every argument of :meth:`xarray.Dataset.to_zarr` (``mode``, ``append_dim``,
        ``region``, ``encoding``, ``consolidated``, ``zarr_format``, ``storage_options``,
        ``compute`` ...) and writes the same Zarr store it would, from GPU data too (xarray's own
        ``to_zarr`` refuses cupy arrays). A new store on a local path gets its chunks written by
        the engine: compressed with nvCOMP on the GPU (zstd) or numcodecs on CPU threads, each
        file under a temporary name renamed into place, dask arrays a task per block; so are
        appends and regions of whole chunks. Other writes (remote stores, CF-transformed
        values, appends sharing a chunk with data already written, dask under distributed)
        go through xarray from host copies.

        Returns
        -------
        ZarrStore or dask.delayed.Delayed
            What :meth:`xarray.Dataset.to_zarr` returns: the store, or with ``compute=False`` a
            dask ``Delayed`` that writes the dask arrays.

        Examples
        --------
        >>> ds = xr.open_dataset("in.zarr", engine="kvikio").load()  # doctest: +SKIP
        >>> (ds * 2).cupy.to_zarr("out.zarr", mode="w")  # doctest: +SKIP
        """
        from ..write import to_zarr

        return to_zarr(self._ds, store, **_by_name(xr.Dataset.to_zarr, args, kwargs))

    def as_cupy(self, coords: bool = False) -> xr.Dataset:
        """A new Dataset with every data variable in GPU memory (see DataArray.cupy.as_cupy)."""
        require_gpu(CONVERT_HINT)
        return self._convert(lambda da: da.cupy.as_cupy(coords=coords))

    def as_numpy(self) -> xr.Dataset:
        """A new Dataset with everything in host memory."""
        return self._convert(lambda da: da.cupy.as_numpy())


def _by_name(method, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with the positional ``args`` after ``store`` named as xarray's own ``method``
    names them (its signature, so that they mean what they mean there)."""
    if not args:
        return kwargs
    import inspect

    params = list(inspect.signature(method).parameters.values())[2:]  # after self, store
    names = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if len(args) > len(names):
        raise TypeError(
            f"to_zarr() takes at most {len(names) + 1} positional arguments ({len(args) + 1} given)"
        )
    named = dict(zip(names, args))
    both = sorted(set(named) & set(kwargs))
    if both:
        raise TypeError(f"to_zarr() got multiple values for argument {both[0]!r}")
    return {**named, **kwargs}


def _all_cupy(data_vars) -> bool:
    flags = [_data_is_cupy(v.variable) for v in data_vars]
    return bool(flags) and all(flags)


@xr.register_datatree_accessor("cupy")
class CupyDataTreeAccessor:
    """GPU helpers for a DataTree: the Dataset helpers applied to every node."""

    def __init__(self, tree: xr.DataTree) -> None:
        self._tree = tree

    @property
    def is_cupy(self) -> bool:
        """True when the tree has data variables and every one, in every node, is on the GPU."""
        return _all_cupy(v for node in self._tree.subtree for v in node.data_vars.values())

    def as_cupy(self, coords: bool = False) -> xr.DataTree:
        """A new DataTree with every node's data variables in GPU memory."""
        require_gpu(CONVERT_HINT)
        return self._tree.map_over_datasets(lambda ds: ds.cupy.as_cupy(coords=coords))

    def as_numpy(self) -> xr.DataTree:
        """A new DataTree with everything in host memory."""
        return self._tree.map_over_datasets(lambda ds: ds.cupy.as_numpy())

    def to_zarr(self, store: Any, *args: Any, **kwargs: Any) -> Any:
        """Write this DataTree to a Zarr store, as :meth:`xarray.DataTree.to_zarr` does, from GPU
        data too: xarray writes every group's metadata, the engine the chunks of each group's
        variables as it writes a Dataset's (see :meth:`CupyDatasetAccessor.to_zarr`)."""
        from ..write.dataset import tree_to_zarr

        return tree_to_zarr(self._tree, store, **_by_name(xr.DataTree.to_zarr, args, kwargs))


def _as_cupy(self, coords: bool = False):
    """This object with its data in GPU memory: the same as ``.cupy.as_cupy()``."""
    return self.cupy.as_cupy(coords=coords)


for _cls in (xr.DataArray, xr.Dataset, xr.DataTree):
    if not hasattr(_cls, "as_cupy"):  # cupy-xarray 0.1's top-level method
        _cls.as_cupy = _as_cupy
