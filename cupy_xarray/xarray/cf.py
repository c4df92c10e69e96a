"""CF decoding (masking, scale/offset) that works on cupy as well as NumPy arrays.

xarray decides *what* to decode (which fill values, which float dtype) and wraps each
variable lazily in functions like ``_apply_mask``, which call ``np.array`` on the data and
fail on cupy. :func:`device_agnostic` keeps xarray's decisions and swaps those functions
for versions written against the array's own module, so values are identical to
``engine="zarr"`` on either device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from xarray.coding import variables as _vars
from xarray.core import indexing

from ..device import array_namespace, is_cupy_array

try:
    from xarray.coding.common import _ElementwiseFunctionArray
except ImportError:  # xarray < 2025.1 kept it in variables
    _ElementwiseFunctionArray = _vars._ElementwiseFunctionArray


def apply_mask(data: Any, encoded_fill_values: list, decoded_fill_value: Any, dtype: Any) -> Any:
    """``xarray.coding.variables._apply_mask`` for NumPy or cupy data."""
    xp = array_namespace(data)
    data = xp.array(data, dtype=dtype, copy=True)
    if encoded_fill_values:
        condition = xp.zeros(data.shape, dtype=bool)
        for fv in encoded_fill_values:
            condition |= data == fv
        data[condition] = decoded_fill_value
    return data


def scale_offset(data: Any, scale_factor: Any, add_offset: Any, dtype: Any) -> Any:
    """``xarray.coding.variables._scale_offset_decoding`` for NumPy or cupy data."""
    data = data.astype(dtype=dtype, copy=True)
    if scale_factor is not None:
        data *= scale_factor
    if add_offset is not None:
        data += add_offset
    return data


def as_dtype(data: Any, dtype: Any) -> Any:
    """``np.asarray(data, dtype=dtype)`` (xarray's _Unsigned handling) for either module."""
    return array_namespace(data).asarray(data, dtype=dtype)


def on_host(func: Any, data: Any) -> Any:
    """Run a NumPy-only decoder on the host and move its result back."""
    if not is_cupy_array(data):
        return func(data)
    import cupy

    result = func(data.get())
    return cupy.asarray(result) if np.asarray(result).dtype.kind in "biufc" else result


def _swap(func: Any) -> Any:
    if isinstance(func, functools.partial):
        if func.func is _vars._apply_mask:
            return functools.partial(apply_mask, *func.args, **func.keywords)
        if func.func is _vars._scale_offset_decoding:
            return functools.partial(scale_offset, *func.args, **func.keywords)
        if func.func is np.asarray and set(func.keywords) == {"dtype"} and not func.args:
            return functools.partial(as_dtype, **func.keywords)
    if func in (apply_mask, scale_offset, as_dtype) or (
        isinstance(func, functools.partial) and func.func in (apply_mask, scale_offset, as_dtype, on_host)
    ):
        return func
    return functools.partial(on_host, func)


def device_agnostic(data: Any) -> Any:
    """Rebuild xarray's lazy decoding wrappers around ``data`` with device-agnostic functions."""
    if isinstance(data, _ElementwiseFunctionArray):
        return _ElementwiseFunctionArray(device_agnostic(data.array), _swap(data.func), data.dtype)
    if isinstance(data, indexing.LazilyIndexedArray):
        return indexing.LazilyIndexedArray(device_agnostic(data.array), data.key)
    if isinstance(data, indexing.LazilyVectorizedIndexedArray):
        return indexing.LazilyVectorizedIndexedArray(device_agnostic(data.array), data.key)
    return data


def find_backend_array(data: Any, cls: type) -> Any:
    """The first ``cls`` instance in a chain of xarray's lazy wrappers (and the engine's dask
    chunk source), or None."""
    seen = 0
    while data is not None and seen < 32:
        if isinstance(data, cls):
            return data
        inner = getattr(data, "array", None)
        data = inner if inner is not None else getattr(data, "adapter", None)
        seen += 1
    return None
