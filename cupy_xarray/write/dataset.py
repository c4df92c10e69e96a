"""``to_zarr`` for xarray objects whose data live on the GPU (or on the host).

xarray and zarr-python write the metadata (groups, arrays with their codecs, attributes, CF
encoding, coordinates, consolidated metadata) exactly as ``Dataset.to_zarr`` does; the data of
numeric variables is then written chunk by chunk from where it lies (:mod:`.chunks`): zstd
chunks of GPU data through nvCOMP, every other compressor and host data through numcodecs on
CPU threads; dask arrays a task per block, under dask's threaded or synchronous scheduler.
Sharded arrays are written a whole shard at a time. A Dataset of little eager data (the
``small_write_bytes`` option) is written by xarray from host copies. Appends (``append_dim``)
and ``region=`` writes of slices go the same way where the data begin and end on chunk (shard) boundaries,
into the root or a ``group=``, and so does every group of a DataTree. Everything else (dask
under other schedulers, CF transforms of the values, filters, shard indexes the engine does
not write, remote stores, ``mode="a"`` without ``append_dim``, ``region="auto"``, appends and
regions across chunk boundaries) is written by xarray from host copies.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import threading
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from ..device import host_copy, is_dask_array
from ..options import get_options
from ..runtime.notes import collecting, file
from .chunks import Target, WriteReport
from .context import Write
from .encoders import Unsupported, chunk_shape, recipe_of

recorders: contextvars.ContextVar[list | None] = contextvars.ContextVar("cupy_xarray_writes", default=None)


@contextlib.contextmanager
def record_writes():
    """Collect the :class:`~cupy_xarray.write.WriteReport` of every ``.cupy.to_zarr`` made
    inside the block (in this thread or task): arrays whose chunks the engine wrote, the
    encoder (``"gpu"``: nvCOMP, ``"cpu"``: CPU threads, ``"gpu+cpu"``: both, a share of each
    batch each), chunks written and left out, bytes.

    Examples
    --------
    >>> with cupy_xarray.record_writes() as reports:  # doctest: +SKIP
    ...     ds.cupy.to_zarr("out.zarr")
    >>> print(reports[-1])  # doctest: +SKIP
    """
    with collecting(recorders) as reports:
        yield reports


def _local_root(store: Any) -> Path | None:
    if isinstance(store, os.PathLike):
        return Path(store)
    if isinstance(store, str) and "://" not in store and "::" not in store:
        return Path(os.path.expanduser(store))
    if isinstance(store, str) and store.startswith("file://"):
        return Path(store[len("file://") :])
    return None


def _on_gpu(data: Any) -> bool:
    from ..device import is_cupy_array

    return is_cupy_array(data)


def _host(var: xr.Variable) -> xr.Variable:
    """The variable with its data in host memory (lazily, block by block, for dask)."""
    data = var._data
    if is_dask_array(data) or _on_gpu(data):
        return var.copy(deep=False, data=host_copy(data))
    return var


def _engine_writes(var: xr.Variable, encoding: dict) -> bool:
    """Whether the engine may write a variable's chunks itself: numeric data (eager, or dask)
    whose values xarray writes as they are (``encoding``: what ``encoding=`` gives it)."""
    data = var._data
    if not (is_dask_array(data) or _on_gpu(data) or isinstance(data, np.ndarray)):
        return False
    if var.dtype.kind not in "biufc" or var.ndim == 0:
        return False
    return not _transforms(var, {**var.encoding, **encoding})


def _transforms(var: xr.Variable, enc: dict) -> bool:
    """Whether an encoding changes the values xarray writes (a scale, an offset, another
    dtype, a fill value on integers) or their layout (array-to-array filters): such variables
    are written by xarray, from a host copy. An encoding read from a store (its dtype, no
    filters) changes nothing; sharding is the engine's (:func:`.encoders.recipe_of`)."""
    if any(enc.get(k) is not None for k in ("scale_factor", "add_offset", "missing_value")):
        return True
    if enc.get("dtype") is not None and np.dtype(enc["dtype"]) != var.dtype:
        return True
    if enc.get("filters"):
        return True
    serializer = enc.get("serializer")
    if serializer is not None and type(serializer).__name__ not in ("BytesCodec", "ShardingCodec"):
        return True
    fill = enc.get("_FillValue", var.attrs.get("_FillValue"))
    return fill is not None and not (var.dtype.kind in "fc" and bool(np.isnan(fill)))


def auto_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The chunks zarr-python gives an array created without any (what xarray writes for
    NumPy data without ``chunks`` in its encoding)."""
    from zarr.core import chunk_grids

    guess = getattr(chunk_grids, "_guess_chunks", None) or chunk_grids._guess_regular_chunks  # 3.1 / 3.4
    return tuple(int(c) for c in guess(shape, itemsize))


def _placeholder(var: xr.Variable, encoding: dict | None) -> xr.Variable:
    """A lazy stand-in of a variable's data, one dask chunk, its zarr chunks in its encoding
    as xarray would choose them: xarray writes its metadata, never its values (the write it
    returns is dropped, never computed); ``encoding``: what ``encoding=`` gives it, which
    replaces its own."""
    import dask.array as da

    own = dict(encoding if encoding is not None else var.encoding)
    if not own.get("chunks"):
        own["chunks"] = auto_chunks(var.shape, var.dtype.itemsize)
    # (named: dask would hash the arguments for a name, a millisecond per variable)
    name = f"cupy-xarray-placeholder-{uuid.uuid4().hex}"
    out = var.copy(deep=False, data=da.empty(var.shape, dtype=var.dtype, chunks=-1, name=name))
    out.encoding = own
    return out


def _kind(root: Path | None, kwargs: dict) -> tuple[str | None, str]:
    """What the engine may write chunks for in this ``to_zarr`` call on a local path:
    ``"new"`` (a new store), ``"append"`` (``append_dim``), ``"region"`` (``region=`` of
    slices); None where xarray writes everything, with why (a note for the write's report)."""
    if root is None:
        return None, "not a local path (a remote or in-memory store): the engine writes chunk files"
    if kwargs.get("storage_options") or kwargs.get("chunkmanager_store_kwargs"):
        return None, "storage_options or chunkmanager_store_kwargs given"
    try:
        import dask.array  # noqa: F401 - the placeholders that let xarray write metadata only
    except ImportError:
        return None, "dask is not installed (pip install 'dask[array]'; the GPU extras bring it)"
    mode, region, append_dim = kwargs.get("mode"), kwargs.get("region"), kwargs.get("append_dim")
    if region is None and append_dim is None:
        if mode in (None, "w", "w-"):
            return "new", ""
        return None, f"mode={mode!r} without append_dim or region"
    if region is None and mode in (None, "a"):
        return "append", ""
    if append_dim is None and mode in (None, "r+", "a") and isinstance(region, dict):
        if all(isinstance(s, slice) and s.step in (None, 1) for s in region.values()):
            return "region", ""
        return None, "a region of other than unit-step slices"
    return None, "this combination of mode, region and append_dim"


#: ZarrStore.open_group's argument that leaves the group's members unlisted (as xarray's own
#: to_zarr returns its store: no metadata read), where this xarray has it
_LAZY = (
    {"cache_members": False}
    if "cache_members" in inspect.signature(xr.backends.ZarrStore.open_group).parameters
    else {}
)

#: the arguments this xarray's ``Dataset.to_zarr`` takes
_TO_ZARR = frozenset(inspect.signature(xr.Dataset.to_zarr).parameters)

#: open_dataset's argument that leaves the indexes unloaded, where this xarray has it
_NO_INDEXES = (
    {"create_default_indexes": False}
    if "create_default_indexes" in inspect.signature(xr.open_dataset).parameters
    else {}
)


def _origins(root: Path, ds: xr.Dataset, names: list, kind: str, kwargs: dict) -> dict | None:
    """Where each variable's data begins in its zarr array, in chunks (None: at the start),
    for the variables whose data begins and ends on chunk boundaries (or the array's end);
    the others are left out (xarray writes them). None when the store cannot be read."""
    if kind == "new":
        return dict.fromkeys(names)
    import zarr

    try:
        group = zarr.open_group(str(root), mode="r")
        # the arrays' own metadata (a consolidated copy may be stale; not having one warns),
        # of the variables written only, no index loaded
        others = [k for k in group.array_keys() if k not in names]
        with xr.open_dataset(
            root, engine="zarr", chunks=None, consolidated=False, drop_variables=others, **_NO_INDEXES
        ) as existing:
            stored = {n: existing[n].encoding for n in names if n in existing.variables}
    except Exception:  # noqa: BLE001 - no store there yet: xarray says what is wrong
        return None
    origins = {}
    for name in names:
        var, dims = ds[name].variable, ds[name].dims
        if name not in stored or name not in group:
            continue  # a new variable: xarray writes it
        arr = group[name]
        try:
            recipe_of(arr.metadata)
        except Unsupported:
            continue
        chunks, shape = chunk_shape(arr.metadata), arr.shape
        # xarray encodes the new values with the stored variable's encoding
        if len(chunks) != len(dims) or _transforms(var, stored[name]):
            continue
        if np.dtype(stored[name].get("dtype", var.dtype)) != var.dtype:
            continue
        if is_dask_array(var._data) and not _aligned(var._data.chunks, chunks):
            continue
        if kind == "append":
            dim = kwargs["append_dim"]
            if dim not in dims:
                continue
            axis = dims.index(dim)
            if shape[axis] % chunks[axis]:
                continue  # the last chunk is partly filled: xarray rewrites it
            origins[name] = tuple(shape[axis] // chunks[axis] if a == axis else 0 for a in range(len(dims)))
            continue
        starts = []
        for a, dim in enumerate(dims):
            s = kwargs["region"].get(dim, slice(None))
            start, stop, _ = s.indices(shape[a])
            if start % chunks[a] or (stop % chunks[a] and stop != shape[a]):
                break
            starts.append(start // chunks[a])
        else:
            origins[name] = tuple(starts)
    return origins


def _refuse_overwriting_a_source(ds: xr.Dataset, root: Path | None, kwargs: dict) -> None:
    """``mode="w"`` deletes the store first: never the store ``ds`` is still read from (by a
    lazily indexed variable, or by a dask array whose graph reads it, derived ones included)."""
    if root is None or kwargs.get("mode") != "w":
        return
    target = root.resolve()
    for name, var in ds.variables.items():
        for src in _read_from(var._data):
            if src == target or target in src.parents or src in target.parents:
                raise ValueError(
                    f"to_zarr(mode='w') would delete {str(target)!r}, which variable {name!r} is still "
                    "read from: load it first (ds.load()), or write to another path"
                )


def _read_from(data: Any) -> set[Path]:
    """The local directories lazy (not loaded) data is still read from: its own backend array,
    or every backend array a dask graph reads."""
    if is_dask_array(data):
        found: set[Path] = set()
        for value in dict(data.__dask_graph__()).values():
            for leaf in _graph_leaves(value):
                found |= _read_from(leaf)
        return found
    from xarray.backends.zarr import ZarrArrayWrapper

    from ..xarray.backend import KvikioBackendArray
    from ..xarray.cf import find_backend_array

    lazy = find_backend_array(data, KvikioBackendArray)
    if lazy is not None:
        return {Path(lazy.spec.directory).resolve()} if lazy.spec.source is None else set()
    wrapper = find_backend_array(data, ZarrArrayWrapper)
    store_path = getattr(getattr(wrapper, "_array", None), "store_path", None)
    root = getattr(getattr(store_path, "store", None), "root", None)
    if root is None:
        return set()
    return {(Path(root) / getattr(store_path, "path", "")).resolve()}


def _graph_leaves(value: Any, depth: int = 0) -> Any:
    """The objects a dask graph's value holds that may be lazily read arrays: the value, what a
    data node holds, a task's arguments (``from_array(..., inline_array=True)``), tuples'."""
    if depth > 8:
        return
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.ndarray):
        yield value
        return
    inner = getattr(value, "value", None)  # dask's DataNode
    if inner is not None and type(value).__name__ == "DataNode":
        yield from _graph_leaves(inner, depth + 1)
        return
    args = getattr(value, "args", None)  # dask's Task
    if isinstance(args, tuple) and hasattr(value, "func"):
        for arg in (*args, *getattr(value, "kwargs", {}).values()):
            yield from _graph_leaves(arg, depth + 1)
        return
    if isinstance(value, tuple | list):
        for item in value:
            yield from _graph_leaves(item, depth + 1)


@dataclass
class _Node:
    """One group's part of a write: its Dataset, what the engine writes of it and where, and
    the stand-in xarray writes the metadata from."""

    path: str  # the group's path in the store, "" for the root
    ds: xr.Dataset
    fast: list  # eager variables the engine writes
    blocks: list  # dask variables the engine writes, a task per block
    lazy: list  # dask variables xarray writes again after the metadata
    origins: dict
    template: xr.Dataset

    def key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def encoding(self, given: dict) -> dict:
        """The ``encoding=`` entries xarray writes the template with: ``given``, a placeholder's
        own (its chunks as xarray would choose them) for the variables it names."""
        return {**given, **{n: self.template[n].encoding for n in self.fast if n in given}}


def _plan(
    ds: xr.Dataset, root: Path | None, path: str, kind: str | None, encodings: dict, kwargs: dict
) -> _Node:
    """What the engine writes of ``ds`` (the group at ``path``) and the template xarray writes
    the metadata from; ``kind`` None: xarray writes it all."""
    # (a name other than a string, an encoding other than a mapping: xarray's to say what is wrong)
    ours = [
        n
        for n, v in ds.data_vars.items()
        if kind
        and isinstance(n, str)
        and isinstance(encodings.get(n, {}), Mapping)
        and _engine_writes(v.variable, encodings.get(n, {}))
    ]
    origins = _origins(root / path if path else root, ds, ours, kind, kwargs) if ours else {}
    if origins is None:
        kind, origins = None, {}
    ours = [n for n in ours if n in origins]
    fast = [n for n in ours if not is_dask_array(ds[n].variable._data)]
    blocks = [n for n in ours if n not in fast and _threads_of_this_process()]
    # every dask variable the engine does not write, coordinates included: xarray's write of
    # its host copy in the template is dropped with the placeholders', and made again below
    lazy = [n for n, v in ds.variables.items() if kind and is_dask_array(v._data) and n not in blocks]
    if kind in ("append", "region") and (lazy or not ours):
        fast, blocks, lazy = [], [], []  # xarray writes it all, as it would
    changes = {}
    for name, var in ds.variables.items():
        if name in fast:
            changes[name] = _placeholder(var, encodings.get(name))
        elif is_dask_array(var._data) or _on_gpu(var._data):
            changes[name] = _host(var)  # dask: its write in the template's is dropped, redone below
    template = ds.assign(changes) if changes else ds
    return _Node(path, ds, fast, blocks, lazy, origins, template)


def to_zarr(ds: xr.Dataset, store: Any, **kwargs: Any) -> Any:
    """Write ``ds`` as ``ds.to_zarr(store, **kwargs)`` would, its GPU data included; returns
    what that returns (a ``ZarrStore``, or a dask ``Delayed`` with ``compute=False``)."""
    _import_once()
    root = _local_root(store)
    _refuse_overwriting_a_source(ds, root, kwargs)
    small = _small(ds)
    if small is not None:  # the engine's start costs more than it saves
        _by_xarray([str(n) for n in ds.variables], small)
        return ds.assign({n: _host(v) for n, v in ds.variables.items() if _on_gpu(v._data)}).to_zarr(
            store, **kwargs
        )
    kind, why = _kind(root, kwargs)
    encodings = kwargs.get("encoding") or {}
    node = _plan(ds, root, (kwargs.get("group") or "").strip("/"), kind, encodings, kwargs)
    if not (node.fast or node.blocks or node.lazy):
        _by_xarray([str(n) for n in ds.variables], why)
        return node.template.to_zarr(store, **kwargs)
    compute = kwargs.pop("compute", True)
    kwargs["encoding"] = node.encoding(encodings)
    with _quiet_consolidation():
        node.template.to_zarr(store, compute=False, **kwargs)  # metadata, coordinates, host data
    return _write_chunks(root, store, [node], kind, compute, kwargs)


def _by_xarray(names: list[str], why: str) -> None:
    """File the report of a write xarray makes of every variable itself, and why."""
    why = why or "no variable the engine writes (see the writing guide)"
    file(recorders, WriteReport(notes=[why], by_xarray=names))


_quieting = threading.Lock()


@contextlib.contextmanager
def _quiet_consolidation():
    """Without zarr's warning, at each consolidation of a v3 store, that consolidated metadata
    is not in the v3 specification: for the metadata this package writes through xarray
    before its own chunks (a user's ``to_zarr`` of that store says it). Python's warning
    filters are the process's, not a thread's: the filter is held under a lock, for the
    metadata write alone, so that writes in several threads cannot leave it behind."""
    with _quieting, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        yield


_imported = threading.Event()
_importing = threading.Lock()


def _import_once() -> None:
    """Import, once and under a lock, what xarray's and dask's write paths import lazily
    (``dask.array``, ``dask.delayed``, ``distributed`` where installed): threads making the
    first writes of a process at once would otherwise import ``distributed`` side by side,
    and a thread can meet its modules partially initialised (an ImportError)."""
    if _imported.is_set():
        return
    import importlib

    with _importing:
        if not _imported.is_set():
            for name in ("dask.array", "dask.delayed", "distributed"):
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
            _imported.set()


def _small(ds: xr.Dataset) -> str | None:
    """Why xarray writes ``ds`` itself (a note for the write's report), or None."""
    if any(is_dask_array(v._data) for v in ds.variables.values()):
        return None
    nbytes = sum(int(v.nbytes) for v in ds.variables.values())
    small = get_options().small_write_bytes
    if nbytes >= small:
        return None
    return (
        f"small: {nbytes / 2**20:.1f} MiB, less than the {small / 2**20:.0f} MiB for "
        "which the engine's start pays"
    )


def tree_to_zarr(tree: xr.DataTree, store: Any, **kwargs: Any) -> Any:
    """Write ``tree`` as ``tree.to_zarr(store, **kwargs)`` would, its GPU data included: the
    chunks of every group's variables written as a Dataset's are."""
    _import_once()
    root = _local_root(store)
    kind, why = _kind(root, kwargs)
    if kind not in (None, "new"):  # xarray writes trees new only, or into existing groups' regions
        kind, why = None, "a DataTree is written by the engine only into a new store"
    encodings = kwargs.get("encoding") or {}
    nodes = []
    for rel, sub in tree.subtree_with_keys:
        ds = sub.to_dataset(inherit=sub is tree or bool(kwargs.get("write_inherited_coords")))
        _refuse_overwriting_a_source(ds, root, kwargs)
        path = "" if sub is tree else str(rel)
        nodes.append(_plan(ds, root, path, kind, encodings.get(sub.path, {}), kwargs))
    template = xr.DataTree.from_dict({"/" + n.path: n.template for n in nodes})
    if not any(n.fast or n.blocks or n.lazy for n in nodes):
        _by_xarray([f"{n.path}/{v}" if n.path else str(v) for n in nodes for v in n.template.variables], why)
        return template.to_zarr(store, **kwargs)
    compute = kwargs.pop("compute", True)
    by_path = {"/" + n.path: n for n in nodes}
    kwargs["encoding"] = {  # (a group the tree lacks: xarray says so)
        group: by_path[group].encoding(enc) if group in by_path else enc for group, enc in encodings.items()
    }
    with _quiet_consolidation():
        template.to_zarr(store, compute=False, **kwargs)
    return _write_chunks(root, store, nodes, kind, compute, kwargs)


def _write_chunks(root: Path, store: Any, nodes: list, kind: str, compute: bool, kwargs: dict) -> Any:
    """The engine's part of a write whose metadata xarray wrote: every node's chunks, then the
    dask variables xarray writes again."""
    writer = Write(root, overwrite=kind != "new", write_empty=kwargs.get("write_empty_chunks"))
    file(recorders, writer.report)
    tasks = []
    for node in nodes:
        for name in node.fast + node.blocks:
            data = node.ds[name].variable._data
            meta = _meta(root, node.key(name))
            try:
                recipe = recipe_of(meta)
            except Unsupported:
                node.lazy.append(name)  # another codec chain: zarr-python encodes it, below
                continue
            target = Target(node.key(name), meta, recipe)
            if name in node.fast:
                writer.write(target, data, node.origins[name])
            elif _aligned(data.chunks, chunk_shape(meta)):
                tasks += _block_writes(writer, target, data, node.origins[name])
            else:
                node.lazy.append(name)  # dask chunks across zarr chunks: xarray's checks and write
    import dask

    later = []
    # what xarray's write of the variables left to it keeps from the call
    kept = ("zarr_format", "zarr_version", "write_empty_chunks", "safe_chunks", "align_chunks")
    sub = {k: v for k, v in kwargs.items() if k in kept and k in _TO_ZARR}
    parts = {  # xarray writes these from host copies (block by block), into the arrays made
        node.path: xr.Dataset({n: _host(node.ds.variables[n]) for n in node.lazy})
        for node in nodes
        if node.lazy
    }
    if len(parts) == 1:
        ((path, part),) = parts.items()
        group = {"group": path} if path else {}
        later.append(part.to_zarr(store, mode="r+", compute=False, consolidated=False, **group, **sub))
    elif parts:  # every group in one write: dask inputs the groups share are computed once
        tree = xr.DataTree.from_dict({"/" + path: part for path, part in parts.items()})
        later.append(tree.to_zarr(store, mode="r+", compute=False, consolidated=False, **sub))
    writer.report.by_xarray += [
        node.key(str(n))
        for node in nodes
        for n in node.ds.variables
        if n not in node.fast + node.blocks or n in node.lazy
    ]
    if not tasks and not later and compute:
        return _opened(root, kwargs)
    done = dask.delayed(_joined, pure=False)(*later, *tasks)
    if not compute:
        return done
    done.compute()
    return _opened(root, kwargs)


def _threads_of_this_process() -> bool:
    """Whether dask runs tasks on threads of this process (its threaded or synchronous
    scheduler), where the engine's dask block writes run; under distributed or processes,
    xarray writes dask arrays."""
    import dask.base
    import dask.local
    import dask.threaded

    return dask.base.get_scheduler() in (None, dask.threaded.get, dask.local.get_sync)


def _aligned(chunks: tuple[tuple[int, ...], ...], shape: tuple[int, ...]) -> bool:
    """Whether every dask block but the last along each axis spans whole zarr chunks."""
    return all(all(n % c == 0 for n in sizes[:-1]) for sizes, c in zip(chunks, shape))


def _block_writes(writer: Write, target: Target, data: Any, base: tuple[int, ...] | None) -> list:
    """One dask task per block of ``data`` (which begins at chunk ``base`` of the array): its
    chunks written by the engine."""
    import dask

    shape = chunk_shape(target.meta)
    base = base or (0,) * data.ndim
    starts = [np.concatenate([[0], np.cumsum(sizes)[:-1]]) for sizes in data.chunks]
    blocks = data.to_delayed(optimize_graph=False)  # inputs shared with other writes: computed once
    write = dask.delayed(writer.write, pure=False)
    tasks = []
    for idx in np.ndindex(blocks.shape):
        origin = tuple(b + int(starts[d][i]) // shape[d] for d, (b, i) in enumerate(zip(base, idx)))
        tasks.append(write(target, blocks[idx], origin))
    return tasks


def _joined(*done: Any) -> None:
    """One task that waits for the write's tasks (what ``compute=False`` returns)."""


def _opened(root: Path, kwargs: dict) -> Any:
    """The written store, as xarray's ``to_zarr`` returns it (a ``ZarrStore``)."""
    try:
        return xr.backends.ZarrStore.open_group(
            str(root), mode="r", group=kwargs.get("group"), zarr_format=kwargs.get("zarr_format"), **_LAZY
        )
    except Exception:  # noqa: BLE001 - the data are written; the handle is a courtesy
        return None


def _meta(root: Path, path: str) -> Any:
    import zarr

    return zarr.open_array(store=str(root), path=path, mode="r").metadata
