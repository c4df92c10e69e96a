"""``engine="kvikio"``: xarray's Zarr backend, with the read engine underneath.

xarray's own :class:`~xarray.backends.zarr.ZarrStore` reads the metadata (groups, v2/v3,
consolidated or not, dimension names, attributes); :class:`KvikioStore` swaps each
variable's lazy array for a :class:`KvikioBackendArray` that reads through
:func:`cupy_xarray.engine.read_arrays` onto the chosen device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from xarray.backends import BackendArray, BackendEntrypoint
from xarray.backends.store import StoreBackendEntrypoint
from xarray.backends.zarr import ZarrStore
from xarray.core import indexing
from xarray.core.variable import Variable

from . import chunked
from .cf import device_agnostic, find_backend_array
from .containment import Containment
from .device import Device, PrototypeDevice, resolve_device
from .engine import array_spec, read_arrays
from .engine.codecs import decode_choice
from .engine.plan import normalize_selection
from .engine.reader import DEFAULT_BATCH_BYTES
from .errors import StoreError


class KvikioBackendArray(BackendArray):
    """A lazy Zarr array read by the engine (outer indexing; xarray does the rest).

    Parameters
    ----------
    zarr_array
        The open ``zarr.Array``.
    device
        ``"gpu"``, ``"cpu"`` or a zarr ``BufferPrototype`` (resolved at read time, so the
        array pickles).
    threads
        I/O threads, or None for the default.
    batch_bytes
        Memory a read's batches may hold beside its output (:func:`~cupy_xarray.engine.read_arrays`).
    decode
        Where a GPU read decodes: ``"auto"``, ``"gpu"`` or ``"cpu"`` (None: ``CUPY_XARRAY_DECODE``).
    """

    __slots__ = ("_preloaded", "batch_bytes", "decode", "device", "dtype", "shape", "spec", "threads")

    def __init__(
        self,
        zarr_array: Any,
        name: str,
        device: Any = "gpu",
        threads: int | None = None,
        containment: Containment | None = None,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        decode: str | None = None,
    ):
        self.spec = array_spec(zarr_array, name=name, containment=containment)
        self.batch_bytes = batch_bytes
        self.decode = decode
        self.shape = self.spec.shape
        self.dtype = self.spec.dtype
        self.device = device
        self.threads = threads
        self._preloaded = None

    def resolved_device(self) -> Device | PrototypeDevice:
        return resolve_device(self.device, self.threads)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> Any:
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.OUTER, self._raw_getitem
        )

    def _raw_getitem(self, key: tuple) -> Any:
        if self._preloaded is not None:
            sel = normalize_selection(key, self.shape)
            if all(isinstance(s, slice) and s == slice(0, n, 1) for s, n in zip(sel, self.shape)):
                out, self._preloaded = self._preloaded, None
                return out
        device = self.resolved_device()
        return read_arrays([(self.spec, key)], device, batch_bytes=self.batch_bytes, decode=self.decode)[0]


class KvikioStore(ZarrStore):
    """xarray's ZarrStore whose variables read through the engine."""

    _cupy_xarray_device: Any = "gpu"
    _cupy_xarray_threads: int | None = None
    _cupy_xarray_containment: Containment | None = None
    _cupy_xarray_batch_bytes: int = DEFAULT_BATCH_BYTES
    _cupy_xarray_decode: str | None = None

    def open_store_variable(self, name, *args, **kwargs):
        var = super().open_store_variable(name, *args, **kwargs)
        zarr_array = find_backend_array(var._data, BackendArray).get_array()
        # dimension coordinates become pandas indexes: they are always read to the host
        device = "cpu" if var.dims == (name,) else self._cupy_xarray_device
        array = KvikioBackendArray(
            zarr_array,
            name,
            device,
            self._cupy_xarray_threads,
            self._cupy_xarray_containment,
            self._cupy_xarray_batch_bytes,
            self._cupy_xarray_decode,
        )
        data = indexing.LazilyIndexedArray(array)
        return Variable(var.dims, data, var.attrs, var.encoding)


def _is_local_store_object(obj: Any) -> bool:
    return type(obj).__name__ == "LocalStore" and hasattr(obj, "root")


def local_store_path(obj: Any) -> str | None:
    """The directory behind a local store given as a path, a ``file://`` URL or a
    ``zarr.storage.LocalStore``; None for anything else (remote URLs, other stores)."""
    if _is_local_store_object(obj):
        return os.fspath(obj.root)
    if not isinstance(obj, str | os.PathLike):
        return None
    path = os.fspath(obj)
    if path.startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        url = urlparse(path)
        if url.netloc not in ("", "localhost"):
            return None
        return url2pathname(url.path)
    return None if "://" in path else path


def _open_store(
    path, *, group, consolidated, zarr_format, storage_options, allow_external_links=False
) -> KvikioStore:
    containment = None
    local = local_store_path(path)
    if local is not None:
        if not os.path.exists(local):
            raise StoreError(f"no such Zarr store: {local!r} does not exist")
        # every form of a local store gets the same containment (and the engine's reads)
        containment = Containment.for_store(local, allow_external_links)
        containment.check_group(group)
        if not _is_local_store_object(path):
            path = local
    try:
        store = KvikioStore.open_group(
            path,
            mode="r",
            group=group,
            consolidated=consolidated,
            consolidate_on_close=False,
            storage_options=storage_options,
            zarr_format=zarr_format,
        )
    except StoreError:
        raise
    except Exception as exc:
        where = f"group {group!r} of " if group else ""
        raise StoreError(
            f"cannot open {where}{path!r} as a Zarr store ({type(exc).__name__}: {exc}); "
            "check the path, the group and zarr_format"
        ) from exc
    store._cupy_xarray_containment = containment
    return store


def open_kvikio_dataset(
    filename_or_obj: Any,
    *,
    device: Any = "gpu",
    threads: int | None = None,
    mask_and_scale: bool = True,
    decode_times: Any = True,
    concat_characters: bool = True,
    decode_coords: Any = True,
    drop_variables: str | Iterable[str] | None = None,
    use_cftime: bool | None = None,
    decode_timedelta: Any = None,
    group: str | None = None,
    consolidated: bool | None = None,
    zarr_format: int | None = None,
    storage_options: dict | None = None,
    allow_external_links: bool = False,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    decode: str | None = None,
):
    """Open a Zarr store lazily; variables load through the engine on ``device``."""
    if decode is not None:
        decode_choice(decode)  # a wrong value fails now, not at the first load
    if not isinstance(batch_bytes, int) or isinstance(batch_bytes, bool) or batch_bytes <= 0:
        raise ValueError(
            f"batch_bytes must be a positive number of bytes, got {batch_bytes!r} (default 2 GiB)"
        )
    if isinstance(device, str):
        resolve_device(device, threads)  # fail now (no GPU, no cupy), not at first load
    store = _open_store(
        filename_or_obj,
        group=group,
        consolidated=consolidated,
        zarr_format=zarr_format,
        storage_options=storage_options,
        allow_external_links=allow_external_links,
    )
    store._cupy_xarray_device = device
    store._cupy_xarray_threads = threads
    store._cupy_xarray_batch_bytes = batch_bytes
    store._cupy_xarray_decode = decode
    ds = StoreBackendEntrypoint().open_dataset(
        store,
        mask_and_scale=mask_and_scale,
        decode_times=decode_times,
        concat_characters=concat_characters,
        decode_coords=decode_coords,
        drop_variables=drop_variables,
        use_cftime=use_cftime,
        decode_timedelta=decode_timedelta,
    )
    for name, var in ds.variables.items():
        if name in ds.coords:
            array = find_backend_array(var._data, KvikioBackendArray)
            if array is not None:
                array.device = "cpu"  # coordinates stay on the host, as in .cupy.as_cupy()
        else:
            var._data = device_agnostic(var._data)
    return ds


class KvikioBackendEntrypoint(BackendEntrypoint):
    """Open Zarr stores straight into GPU memory: ``xr.open_dataset(path, engine="kvikio")``.

    Extra keywords beside the zarr engine's: ``device`` (``"gpu"`` default, ``"cpu"`` or a
    zarr ``BufferPrototype``), ``threads`` (I/O threads), ``allow_external_links``
    (follow symbolic links that leave the store's root; refused by default),
    ``batch_bytes`` (memory one read's batches may hold beside its output) and ``decode``
    (``"auto"``: nvCOMP for the streams it decodes safely, CPU threads for the others;
    ``"gpu"``: nvCOMP for all, for stores you trust; ``"cpu"``).
    """

    description = "Open Zarr stores into GPU memory (cupy) with kvikio and nvCOMP"
    url = "https://github.com/xarray-contrib/cupy-xarray"
    open_dataset_parameters = (
        "filename_or_obj",
        "drop_variables",
        "mask_and_scale",
        "decode_times",
        "concat_characters",
        "decode_coords",
        "use_cftime",
        "decode_timedelta",
        "group",
        "consolidated",
        "zarr_format",
        "storage_options",
        "device",
        "threads",
        "allow_external_links",
        "batch_bytes",
        "decode",
    )

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        return False  # only when asked for by name; ".zarr" stays with the zarr engine

    def open_dataset(  # type: ignore[override]
        self,
        filename_or_obj: Any,
        *,
        drop_variables: str | Iterable[str] | None = None,
        mask_and_scale: bool = True,
        decode_times: Any = True,
        concat_characters: bool = True,
        decode_coords: Any = True,
        use_cftime: bool | None = None,
        decode_timedelta: Any = None,
        group: str | None = None,
        consolidated: bool | None = None,
        zarr_format: int | None = None,
        storage_options: dict | None = None,
        device: Any = "gpu",
        threads: int | None = None,
        allow_external_links: bool = False,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        decode: str | None = None,
    ):
        return open_kvikio_dataset(
            filename_or_obj,
            device=device,
            threads=threads,
            mask_and_scale=mask_and_scale,
            decode_times=decode_times,
            concat_characters=concat_characters,
            decode_coords=decode_coords,
            drop_variables=drop_variables,
            use_cftime=use_cftime,
            decode_timedelta=decode_timedelta,
            group=group,
            consolidated=consolidated,
            zarr_format=zarr_format,
            storage_options=storage_options,
            allow_external_links=allow_external_links,
            batch_bytes=batch_bytes,
            decode=decode,
        )


chunked.install()  # dask chunks of engine arrays keep the device's meta

__all__ = ["KvikioBackendArray", "KvikioBackendEntrypoint", "KvikioStore", "open_kvikio_dataset"]
