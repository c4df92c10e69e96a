"""``engine="kvikio"``: xarray's Zarr backend, with the read engine underneath.

xarray's own :class:`~xarray.backends.zarr.ZarrStore` reads the metadata (groups, v2/v3,
consolidated or not, dimension names, attributes); :class:`KvikioStore` swaps each
variable's lazy array for a :class:`KvikioBackendArray` that reads through
:func:`cupy_xarray.engine.read_arrays` onto the chosen device.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from xarray.backends import BackendArray, BackendEntrypoint
from xarray.backends.store import StoreBackendEntrypoint
from xarray.backends.zarr import ZarrStore
from xarray.core import indexing
from xarray.core.variable import Variable

from ..containment import Containment
from ..device import Device, PrototypeDevice, import_cupy, start_gpu
from ..engine import array_spec, read_arrays
from ..engine.decoders import decode_choice
from ..engine.devices import resolve_device
from ..engine.plan import normalize_selection
from ..engine.points import read_points
from ..engine.warmup import start_decoder_process, warm_engine
from ..errors import StoreError, StoreNotFoundError
from ..options import Options, carried, get_options, using
from . import readahead
from .cf import device_agnostic, find_backend_array
from .opening import (
    is_local_store_object,
    local_store_path,
    open_failure,
    open_retrying,
    patient_storage_options,
)
from .readahead import ReadAhead

_MAKING_AHEAD = threading.Lock()  # one read-ahead per array


@dataclass(frozen=True)
class ReadSettings:
    """How a dataset's variables are read: ``engine="kvikio"``'s own keywords (checked,
    :func:`read_settings`), and the settings in effect when it was opened
    (:func:`cupy_xarray.set_options`), which its reads keep on any thread or dask worker."""

    device: Any = "gpu"
    threads: int | None = None
    batch_bytes: int | None = None
    decode: str | None = None
    options: Options = field(default_factory=get_options)


class KvikioBackendArray(BackendArray):
    """A lazy Zarr array read by the engine (outer indexing, and points: only the chunks
    they lie in are read; xarray does the rest).

    Parameters
    ----------
    zarr_array
        The open ``zarr.Array``.
    name
        The variable's name, in errors.
    reads
        How it is read (:class:`ReadSettings`: the device, ``"gpu"``, ``"cpu"`` or a zarr
        ``BufferPrototype``, resolved at read time so that the array pickles; I/O threads;
        batch memory; ``decode``; the settings its reads use). Default: the GPU, with the
        settings in effect now.
    containment
        What keeps the reads of a local store inside its root (None: a remote store).
    """

    __slots__ = ("_preloaded", "_readahead", "dtype", "reads", "shape", "spec")

    def __init__(
        self,
        zarr_array: Any,
        name: str,
        reads: ReadSettings | None = None,
        containment: Containment | None = None,
    ):
        self.reads = ReadSettings() if reads is None else reads
        with using(self.options):  # what the array's metadata is checked against
            self.spec = array_spec(zarr_array, name=name, containment=containment)
        self.shape = self.spec.shape
        self.dtype = self.spec.dtype
        self._preloaded = None
        self._readahead: ReadAhead | None = None  # made by the first read that reads ahead

    def __getstate__(self) -> dict:
        state = {k: getattr(self, k) for k in self.__slots__ if hasattr(self, k)}
        state["_readahead"] = None  # a process's own
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    @property
    def options(self) -> Options:
        """The settings its reads use."""
        return self.reads.options

    @property
    def device(self) -> Any:
        """Where it is read to, as given (``"gpu"``, ``"cpu"`` or a ``BufferPrototype``)."""
        return self.reads.device

    def resolved_device(self) -> Device | PrototypeDevice:
        with using(self.options):
            return resolve_device(self.reads.device, self.reads.threads)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> Any:
        if isinstance(key, indexing.VectorizedIndexer) and self._preloaded is None:
            # points: only the chunks they lie in are read (not the box of their indices)
            return read_points(self.spec, key.tuple, self._read_requests, self.options.point_wave_bytes)
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.OUTER, self._raw_getitem
        )

    async def async_getitem(self, key: indexing.ExplicitIndexer) -> Any:
        """``load_async``: the engine's read on a thread of asyncio's pool (it blocks; its own
        threads do the I/O), the event loop going on meanwhile."""
        import asyncio

        return await asyncio.to_thread(self.__getitem__, key)

    def read(self, key: tuple) -> Any:
        """The selection ``key`` (a tuple of ints, slices and 1-D integer arrays, outer
        indexing) read through the engine."""
        return self._raw_getitem(key)

    def _raw_getitem(self, key: tuple) -> Any:
        if self._preloaded is not None:
            sel = normalize_selection(key, self.shape)
            if all(isinstance(s, slice) and s == slice(0, n, 1) for s, n in zip(sel, self.shape)):
                out, self._preloaded = self._preloaded, None
                return out
        ahead = self._ahead()
        if ahead is not None:
            handled, out = ahead.get(
                key, self._ahead_budget, self.options.read_ahead_linger, self.options.read_ahead_wait
            )
            if handled:
                return out
        return self._read_requests([(self.spec, key)])[0]

    def plans(self) -> bool:
        """Whether its reads in a dask compute would read ahead by the compute's plan."""
        opts = self.options
        return opts.read_ahead_plan and readahead.wanted(opts.read_ahead, self._on_gpu, dask=True)

    def expect(self, keys: list[tuple], token: Any) -> bool:
        """The boxes the tasks of a dask compute (``token``) will ask for, in the order they
        run (:mod:`.dask_plan`), handed to the read-ahead where the ``read_ahead`` option has
        one for dask's reads; whether it took them."""
        ahead = self._ahead(planning=True) if self.options.read_ahead_plan else None
        if ahead is None:
            return False
        ahead.expect(keys, token)
        return True

    def unexpect(self, token: Any) -> None:
        """The compute ``token`` ended (:meth:`expect`)."""
        if self._readahead is not None:
            self._readahead.unexpect(token)

    def _ahead(self, planning: bool = False) -> ReadAhead | None:
        """The array's read-ahead (:mod:`.readahead`) where the ``read_ahead`` option has it
        for this read (``planning``: for the reads of a dask compute about to run)."""
        if not readahead.wanted(self.options.read_ahead, self._on_gpu, planning):
            return None
        if self._readahead is None:
            with _MAKING_AHEAD:  # dask's first tasks arrive on several threads at once
                if self._readahead is None:
                    self._readahead = ReadAhead(self.shape, self.dtype.itemsize, self._read_boxes, True)
        return self._readahead

    def _on_gpu(self) -> bool:
        device = self.resolved_device()
        return isinstance(device, Device) and not device.host_memory

    def _read_boxes(self, keys: list[tuple], ready: Callable[[int, Any], None] | None = None) -> list[Any]:
        """The arrays of a read-ahead window's boxes, in one read (``ready``: each handed out
        as soon as it is read, with the ``read_ahead_early`` option)."""
        how = self.options.read_ahead_outputs
        whole = readahead.cover(keys, self.shape) if how == "box" else None
        if whole is None:
            early = ready if self.options.read_ahead_early else None
            return self._read_requests([(self.spec, k) for k in keys], one_buffer=how != "each", ready=early)
        # boxes that tile one box: one request, as an eager read of it (one output, one plan);
        # each block a C-contiguous array of its own (a strided view of the box would slow
        # the kernels that take it, cupy's reductions 2.5x)
        out = self._read_requests([(self.spec, whole[0])])[0]
        parts = [out[place] for place in whole[1]]
        return [p if p.flags.c_contiguous else p.copy() for p in parts]

    def _ahead_budget(self) -> int:
        """Bytes a read-ahead window may hold: ``read_ahead_bytes``, on a GPU within the
        ``memory_share`` of its free memory."""
        opts = self.options
        device = self.resolved_device()
        if not isinstance(device, Device) or device.host_memory:
            return opts.read_ahead_bytes
        return min(opts.read_ahead_bytes, int(opts.memory_share * device.free_bytes()))

    def _read_requests(
        self, requests: list, one_buffer: bool = False, ready: Callable[[int, Any], None] | None = None
    ) -> list[Any]:
        with using(self.options):
            device = self.resolved_device()
            reads = self.reads
            return read_arrays(
                requests,
                device,
                batch_bytes=reads.batch_bytes,
                decode=reads.decode,
                one_buffer=one_buffer,
                ready=ready,
            )


def _slots(cls: type) -> list[str]:
    return [name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())]


class KvikioStore(ZarrStore):
    """xarray's ZarrStore whose variables read through the engine.

    Parameters
    ----------
    opened
        The group as xarray's own ZarrStore opened it (metadata, members, zarr_format).
    reads
        How its variables are read (:class:`ReadSettings`).
    containment
        What keeps the reads of a local store inside its root (None: a remote store).
    """

    def __init__(
        self, opened: ZarrStore, reads: ReadSettings, containment: Containment | None = None
    ) -> None:
        for name in _slots(ZarrStore):  # take over the opened group, as xarray's store holds it
            if hasattr(opened, name):
                setattr(self, name, getattr(opened, name))
        self.reads = reads
        self.containment = containment

    def open_store_variable(self, name, *args, **kwargs):
        var = super().open_store_variable(name, *args, **kwargs)
        zarr_array = find_backend_array(var._data, BackendArray).get_array()
        reads = self.reads
        if var.dims == (name,):  # dimension coordinates become pandas indexes: read to the host
            reads = replace(reads, device="cpu")
        array = KvikioBackendArray(zarr_array, name, reads, self.containment)
        data = indexing.LazilyIndexedArray(array)
        return Variable(var.dims, data, var.attrs, var.encoding)


_PACKAGE_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (__import__("xarray"), __import__("zarr"), __import__("cupy_xarray"))
)


_warnings_lock = threading.Lock()


def _user_warnings(fn, *args, **kwargs):
    """Call ``fn``; warnings it raises are raised again at the user's line (the first frame
    outside xarray, zarr and this package), as engine="zarr"'s point at the user's call.

    ``warnings.catch_warnings`` swaps process-wide state: opens take turns through it, so
    that two threads opening stores cannot restore each other's filters.
    """
    import sys
    import warnings

    with _warnings_lock, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRS):
        frame, level = frame.f_back, level + 1
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=level)
    return result


def _stores(
    path: Any,
    *,
    group: str | None,
    tree: bool,
    consolidated: bool | None,
    zarr_format: int | None,
    storage_options: dict | None,
    allow_external_links: bool,
    use_zarr_fill_value_as_mask: bool | None,
    cache_members: bool,
    reads: ReadSettings,
) -> dict[str, KvikioStore]:
    """The group's store, or with ``tree`` one store per group below it (keys: group paths),
    their variables read as ``reads`` says."""
    containment = None
    local = local_store_path(path)
    # remote URLs (s3://, https://, gs://, memory://, ...) open through zarr's own fsspec
    # store; the engine fetches their chunks through it (engine/remote.py)
    if local is not None and storage_options:
        raise StoreError(
            "storage_options apply to remote stores (s3://, https://, ...); "
            f"{os.fspath(local)!r} is a local store: leave storage_options out"
        )
    if local is not None:
        if not os.path.exists(local):
            raise StoreNotFoundError(f"no such Zarr store: {local!r} does not exist")
        # every form of a local store gets the same containment (and the engine's reads)
        containment = Containment.for_store(local, allow_external_links)
        if tree:
            containment.check_hierarchy(group)
        else:
            containment.check_group(group)
        if not is_local_store_object(path):
            path = local
    options = dict(
        mode="r",
        consolidated=consolidated,
        consolidate_on_close=False,
        storage_options=storage_options,
        zarr_format=zarr_format,
        # True is what xarray's zarr engine gives (it passes None whatever is asked): a v3
        # array's fill_value is not a missing-value marker (a to_zarr store's is 0), and masking
        # it would turn real zeros into NaN; False still leaves a v2 fill value unmasked
        use_zarr_fill_value_as_mask=None if use_zarr_fill_value_as_mask else use_zarr_fill_value_as_mask,
        cache_members=cache_members,
    )
    remote = local is None and isinstance(path, str) and "://" in path
    if remote:
        options["storage_options"] = patient_storage_options(path, storage_options)
    try:
        opened = open_retrying(path, group, tree, options, remote)
    except StoreError:
        raise
    except Exception as exc:
        storage = options.get("storage_options")
        raise open_failure(path, exc, group, local, zarr_format, storage, remote) from exc
    return {key: KvikioStore(store, reads, containment) for key, store in opened.items()}


def _positive(name: str, value: Any, hint: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name} must be a positive number or None, got {value!r} ({hint})")


def read_settings(device: Any, threads: Any, batch_bytes: Any, decode: str | None) -> ReadSettings:
    """The engine's own keywords, checked now (a wrong value fails at open, not at the first
    load), with the settings in effect."""
    _positive("threads", threads, "I/O threads; None: one per core, 4 to 32")
    _positive("batch_bytes", batch_bytes, "bytes; default None: chosen per read")
    if decode is not None:
        decode_choice(decode, get_options())
    if isinstance(device, str):
        resolved = resolve_device(device, threads)  # no GPU, no cupy: say so now
        if not resolved.host_memory:
            # (with the settings in effect here: decoder_process="off" starts no decoder process)
            options = get_options()
            warm = carried(functools.partial(warm_engine, resolved.threads, options))
            start_gpu(resolved.xp, warm, before=carried(functools.partial(start_decoder_process, options)))
    else:
        resolved = resolve_device(device, threads)  # None, 0, False ...: refused now, not at the first load
        if isinstance(resolved, PrototypeDevice) and resolved.gpu:
            import_cupy()  # zarr's GPU buffers need cupy: say so now, not at the first load
    return ReadSettings(device, threads, batch_bytes, decode)


def _dataset(store: KvikioStore, decoding: dict):
    """The Dataset of one store's group, its variables read through the engine."""
    ds = StoreBackendEntrypoint().open_dataset(store, **decoding)
    for name, var in ds.variables.items():
        if name in ds.coords:
            array = find_backend_array(var._data, KvikioBackendArray)
            if array is not None:
                array.reads = replace(array.reads, device="cpu")  # coordinates stay on the host
        else:
            var._data = device_agnostic(var._data)
    return ds


#: every keyword of ``open_dataset`` with its default, in one table: CF decoding, opening
#: the store (xarray's zarr engine's), the engine's reads, and two accepted to be refused
DECODING = dict(
    drop_variables=None,
    mask_and_scale=True,
    decode_times=True,
    concat_characters=True,
    decode_coords=True,
    use_cftime=None,
    decode_timedelta=None,
)
OPENING = dict(
    group=None,
    consolidated=None,
    storage_options=None,
    zarr_format=None,
    use_zarr_fill_value_as_mask=None,
    cache_members=True,
    allow_external_links=False,
)
READS = dict(device="gpu", threads=None, batch_bytes=None, decode=None)
CHECKED = dict(mode="r", store=None)
KEYWORDS = {**DECODING, **OPENING, **READS, **CHECKED}


def _check_zarr_only(mode: str, store: Any) -> None:
    if mode != "r":
        raise ValueError(
            f"engine='kvikio' only reads: mode must be 'r', got {mode!r} (write with ds.cupy.to_zarr(...))"
        )
    if store is not None:
        raise ValueError(
            "engine='kvikio' opens its own stores: pass the store (a path, a file:// URL or a "
            "zarr.storage.LocalStore) as the first argument instead of store="
        )


def _prepare(kwargs: dict) -> tuple[dict, dict]:
    """The keywords of :meth:`KvikioBackendEntrypoint.open_dataset` (:data:`KEYWORDS`),
    checked, as (opening the store, with its reads' settings; CF decoding)."""
    kwargs.pop("engine", None)
    unknown = sorted(set(kwargs) - set(KEYWORDS))
    if unknown:
        import difflib

        named = []
        for name in unknown:
            near = difflib.get_close_matches(name, KEYWORDS, n=1)
            named.append(f"{name!r} (did you mean {near[0]!r}?)" if near else repr(name))
        raise TypeError(f"engine='kvikio' got unknown keyword(s) {', '.join(named)}")
    given = {**KEYWORDS, **kwargs}
    _check_zarr_only(given["mode"], given["store"])
    opening = {k: given[k] for k in OPENING}
    opening["reads"] = read_settings(*(given[k] for k in READS))
    return opening, {k: given[k] for k in DECODING}


def open_kvikio_dataset(filename_or_obj: Any, **kwargs: Any):
    """Open one group of a Zarr store lazily; variables load through the engine (the keywords
    of :meth:`KvikioBackendEntrypoint.open_dataset`)."""
    opening, decoding = _prepare(kwargs)

    def build():
        (one,) = _stores(filename_or_obj, tree=False, **opening).values()
        return _dataset(one, decoding)

    return _user_warnings(build)


def open_kvikio_groups(filename_or_obj: Any, **kwargs: Any) -> dict[str, Any]:
    """Every group at or below ``group``, each as a lazy Dataset (keys: paths relative to
    ``group``, ``"/"`` for it), with the keywords of :func:`open_kvikio_dataset`."""
    from xarray.core.treenode import NodePath

    opening, decoding = _prepare(kwargs)
    group = opening["group"]
    parent = "/" + (group or "").strip("/")

    def build():
        stores = _stores(filename_or_obj, tree=True, **opening)
        return {
            str(NodePath(path).relative_to(parent)) if group else str(NodePath(path)): _dataset(s, decoding)
            for path, s in stores.items()
        }

    return _user_warnings(build)


class KvikioBackendEntrypoint(BackendEntrypoint):
    """Open Zarr stores straight into GPU memory: ``xr.open_dataset(path, engine="kvikio")``,
    ``xr.open_datatree(path, engine="kvikio")`` and ``xr.open_groups(path, engine="kvikio")``.

    Every keyword of xarray's zarr engine, plus ``device`` (``"gpu"`` default, ``"cpu"`` or a
    zarr ``BufferPrototype``), ``threads`` (I/O threads), ``allow_external_links`` (follow
    symbolic links that leave the store's root; refused by default), ``batch_bytes`` (memory
    one read's batches may hold beside its output) and ``decode`` (``"auto"``: nvCOMP for the
    streams it decodes safely, CPU threads for the others; ``"gpu"``: nvCOMP for all, for
    stores you trust; ``"cpu"``).
    """

    description = (
        "Open Zarr stores into GPU memory (cupy) with kvikio and nvCOMP; device='cpu' for NumPy "
        "through the same engine"
    )
    supports_groups = True
    open_dataset_parameters = ("filename_or_obj", *KEYWORDS, "engine")

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        return False  # only when asked for by name; ".zarr" stays with the zarr engine

    def open_dataset(self, filename_or_obj: Any, **kwargs: Any):  # type: ignore[override]
        """Open one group of a Zarr store lazily, its variables read by the engine.

        Every keyword is optional, with the default :data:`KEYWORDS` gives it.

        Parameters
        ----------
        filename_or_obj
            A local store: a path (``~`` is expanded), a ``file://`` URL or a
            ``zarr.storage.LocalStore``.
        drop_variables, mask_and_scale, decode_times, concat_characters, decode_coords
            CF decoding, as for :func:`xarray.open_dataset`.
        use_cftime, decode_timedelta
            As for :func:`xarray.open_dataset`.
        group, consolidated, zarr_format, storage_options, use_zarr_fill_value_as_mask, cache_members
            As for xarray's zarr engine.
        mode, store, engine
            Accepted as the zarr engine accepts them: ``mode`` must be ``"r"`` and ``store``
            None (this engine only reads, from stores it opens itself).
        device
            ``"gpu"`` (cupy output), ``"cpu"`` (NumPy, same engine) or a zarr ``BufferPrototype``.
        threads
            I/O threads (None: one per core, 4 to 32; ``CUPY_XARRAY_THREADS``).
        allow_external_links
            Follow symbolic links that resolve outside the store (refused by default).
        batch_bytes
            Memory one read's batches may hold beside its output (default 2 GiB).
        decode
            ``"auto"`` (default, or ``CUPY_XARRAY_DECODE``), ``"gpu"`` or ``"cpu"``: where a GPU
            read decodes compressed chunks (see the engine's documentation).

        Returns
        -------
        xarray.Dataset
            Lazy; data variables load onto ``device``, coordinates onto the host.
        """
        return open_kvikio_dataset(filename_or_obj, **kwargs)

    def open_groups_as_dict(self, filename_or_obj: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Every group at or below ``group`` as a lazy Dataset (keywords of :meth:`open_dataset`)."""
        kwargs.pop("engine", None)
        return open_kvikio_groups(filename_or_obj, **kwargs)

    def open_datatree(self, filename_or_obj: Any, **kwargs: Any):  # type: ignore[override]
        """The groups at or below ``group`` as a lazy DataTree (keywords of :meth:`open_dataset`)."""
        from xarray.backends.common import datatree_from_dict_with_io_cleanup

        return datatree_from_dict_with_io_cleanup(self.open_groups_as_dict(filename_or_obj, **kwargs))


__all__ = [
    "KvikioBackendArray",
    "KvikioBackendEntrypoint",
    "KvikioStore",
    "open_kvikio_dataset",
    "open_kvikio_groups",
]
