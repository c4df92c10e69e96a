"""``read_zarr_gds``: a whole Zarr group (or some of its variables) into GPU memory, eagerly;
``read_datatree_gds``: every group of a store, as a DataTree, the same way."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import xarray as xr

from ..engine import read_arrays
from ..engine.devices import resolve_device
from ..errors import StoreError
from ..options import using
from .backend import KvikioBackendArray
from .cf import find_backend_array

_PROGRESS_BYTES = 2**30
#: xarray's own open_dataset keywords a read may pass on, beside the engine's table
_XARRAY_KEYWORDS = ("cache", "inline_array", "decode_cf", "chunked_array_type", "from_array_kwargs")


#: the loaders' own keywords
_OWN = ("group", "variables", "device", "threads", "progress", "batch_bytes", "consolidated",
        "zarr_format", "chunks", "allow_external_links", "decode")  # fmt: skip


def _check_keywords(name: str, given: dict, own: tuple[str, ...]) -> None:
    """Refuse a keyword neither ``name`` nor ``xr.open_dataset`` knows (a typo such as
    ``devise=`` would otherwise pass unnoticed), suggesting the nearest one."""
    import difflib

    from .backend import DECODING, OPENING

    known = (*own, *DECODING, *OPENING, *_XARRAY_KEYWORDS)
    for key in given:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}{hint}")


def read_zarr_gds(
    store: Any,
    *,
    group: str | None = None,
    variables: str | Iterable[str] | None = None,
    device: Any = "gpu",
    threads: int | None = None,
    progress: bool | None = None,
    batch_bytes: int | None = None,
    consolidated: bool | None = None,
    zarr_format: int | None = None,
    chunks: Any = None,
    allow_external_links: bool = False,
    decode: str | None = None,
    **decode_kwargs: Any,
) -> xr.Dataset:
    """Read a Zarr store into GPU memory as an :class:`xarray.Dataset`, in one go.

    All requested variables are planned together and read by one engine call: many I/O
    threads through kvikio, compressed chunks decoded on the GPU with nvCOMP.

    Parameters
    ----------
    store
        A Zarr store (v2 or v3): a path, a ``file://`` URL or a ``zarr.storage.LocalStore``;
        or a remote one: an ``s3://``, ``https://`` or other fsspec URL (with
        ``storage_options=``), or zarr's ``FsspecStore`` / ``ObjectStore``.
    group
        Group inside the store.
    variables
        Data variables to read (default all); their coordinates come along.
    device
        ``"gpu"`` (default), ``"cpu"`` (NumPy output, same code path) or a zarr
        ``BufferPrototype``.
    threads
        I/O threads (default: one per core, 4 to 32; ``CUPY_XARRAY_THREADS``).
    progress
        Show a progress bar; default: when more than 1 GiB is read. Eager reads only
        (with ``chunks=``, ``progress=True`` is refused: use dask's progress bar).
    batch_bytes
        Memory a batch of reads may hold beside the output: the stored bytes of chunks
        decoded straight into the output, the decoded bytes of the others. Default None: an
        eighth of the output (128 MiB to 2 GiB; 2 GiB with ``decode="gpu"``). Smaller saves
        memory; larger gives nvCOMP more streams per call, which is faster.
        With ``chunks=``, each dask task's read keeps to it.
    consolidated, zarr_format
        As for ``xr.open_zarr``.
    chunks
        None (default) reads now. Anything else (``{}`` for the store's chunks, ``"auto"``,
        a mapping of dimension to size) returns dask arrays whose tasks read through the
        engine and whose ``_meta`` is on ``device``; nothing is read until computed.
    allow_external_links
        Follow symbolic links that resolve outside the store (refused by default).
    decode
        Where compressed chunks are decoded for a GPU read: ``"auto"`` (default, or
        ``CUPY_XARRAY_DECODE``): each codec where it decodes fastest, small reads on CPU
        threads, zstd frames no checksum proved in a separate decoder process (nvCOMP can
        fault on damaged ones), Blosc's zstd on CPU threads; ``"gpu"``: nvCOMP for every
        codec; ``"cpu"``: CPU threads for all. The values read are the same.
    **decode_kwargs
        CF decoding options of ``xr.open_dataset`` (``mask_and_scale``, ``decode_times``...).

    Returns
    -------
    xarray.Dataset
        Data variables as cupy arrays (for ``device="gpu"``); coordinates on the host.
    """
    _check_keywords("read_zarr_gds", decode_kwargs, _OWN)
    dev = resolve_device(device, threads)
    options = dict(
        device=device,
        threads=threads,
        group=group,
        consolidated=consolidated,
        zarr_format=zarr_format,
        allow_external_links=allow_external_links,
        batch_bytes=batch_bytes,
        decode=decode,
        **decode_kwargs,
    )
    if chunks is not None:
        try:
            import dask.array  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "chunks= makes dask arrays, and dask is not installed: install this package's "
                "'.[dask]' extra from its source folder, or dask[array] (and distributed)"
            ) from exc
        if progress:
            raise ValueError(
                "progress=True shows an eager read's progress; with chunks= nothing is read until "
                "computed: use dask's progress bar (dask.diagnostics.ProgressBar, or distributed's "
                "dashboard) instead"
            )
        ds = xr.open_dataset(store, engine="kvikio", chunks=chunks, **options)
        return _select(ds, variables, store, group)
    # through xarray's own open_dataset: it builds the indexes and sets encoding["source"]
    ds = xr.open_dataset(store, engine="kvikio", **options)
    ds = _select(ds, variables, store, group)
    arrays = [
        a
        for name in ds.data_vars
        if (a := find_backend_array(ds[name].variable._data, KvikioBackendArray)) is not None
    ]
    return _load_in_one_read(ds, arrays, dev, progress)


def _load_in_one_read(obj, arrays, dev, progress):
    """``obj.load()``, its engine arrays read beforehand by one engine call, with the
    settings they were opened with (one open: the same for all of them)."""
    if not arrays:
        return obj.load()
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)
    if progress is None:
        progress = total > _PROGRESS_BYTES
    reads = arrays[0].reads
    with using(reads.options):
        outs = read_arrays(
            [(a.spec, (slice(None),) * len(a.shape)) for a in arrays],
            dev,
            batch_bytes=reads.batch_bytes,
            progress=progress,
            decode=reads.decode,
        )
    for a, out in zip(arrays, outs):
        a._preloaded = out
    try:
        return obj.load()
    finally:
        for a in arrays:
            a._preloaded = None


def read_datatree_gds(
    store: Any,
    *,
    group: str | None = None,
    device: Any = "gpu",
    threads: int | None = None,
    progress: bool | None = None,
    batch_bytes: int | None = None,
    consolidated: bool | None = None,
    zarr_format: int | None = None,
    allow_external_links: bool = False,
    decode: str | None = None,
    **decode_kwargs: Any,
) -> xr.DataTree:
    """Read every group of a Zarr store (or below ``group``) into GPU memory as an
    :class:`xarray.DataTree`, all nodes' data variables in one engine call.

    The keywords are :func:`read_zarr_gds`'s; the result is what
    ``xr.open_datatree(store, engine="kvikio", ...).load()`` gives, read faster.
    """
    _check_keywords("read_datatree_gds", decode_kwargs, _OWN)
    dev = resolve_device(device, threads)
    tree = xr.open_datatree(
        store,
        engine="kvikio",
        group=group,
        device=device,
        threads=threads,
        consolidated=consolidated,
        zarr_format=zarr_format,
        allow_external_links=allow_external_links,
        batch_bytes=batch_bytes,
        decode=decode,
        **decode_kwargs,
    )
    arrays = [
        a
        for node in tree.subtree
        for var in node.to_dataset(inherit=False).data_vars.values()
        if (a := find_backend_array(var.variable._data, KvikioBackendArray)) is not None
    ]
    return _load_in_one_read(tree, arrays, dev, progress)


def _select(ds: xr.Dataset, variables: Any, store: Any, group: str | None) -> xr.Dataset:
    if variables is None:
        return ds
    names = [variables] if isinstance(variables, str) else list(variables)
    unknown = [n for n in names if n not in ds.data_vars]
    if unknown:
        raise StoreError(
            f"unknown variable(s) {unknown} in {store!r}"
            + (f" group {group!r}" if group else "")
            + f"; data variables are {sorted(map(str, ds.data_vars))}"
        )
    return ds[names]
