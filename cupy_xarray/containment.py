"""Untrusted stores: every file the reader opens lies inside the store's root.

A store's metadata names the files that are read (group members, consolidated members,
chunk keys, shards). :class:`Containment` checks keys (no ``..`` component, no leading
``/``), resolves links (a link that leaves the root is refused unless
``allow_external_links=True``) and refuses metadata that asks for absurd resources, each
with a :class:`UnsafeStoreError` naming the key. Checks run before zarr-python or the
engine open anything; links are resolved once per directory while an array is open, and
per chunk only when the chunk file itself is a link.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from .errors import UnsafeStoreError
from .options import get_options

#: most inner chunks one shard may index (2**24 entries are a 256 MiB index)
MAX_CHUNKS_PER_SHARD = 2**24
#: largest metadata document read (zarr.json, .zarray, .zmetadata ...)
MAX_METADATA_BYTES = 256 * 2**20

_METADATA_FILES = ("zarr.json", ".zgroup", ".zarray", ".zattrs", ".zmetadata")
_LINK_HINT = "pass allow_external_links=True if you trust this store"


def check_key(key: str, what: str, where: str) -> None:
    """Refuse a store key that could name a file outside the root."""
    parts = key.replace("\\", "/").split("/")
    if key.startswith(("/", "\\")) or ".." in parts or "\x00" in key or (len(key) > 1 and key[1] == ":"):
        raise UnsafeStoreError(
            f"{what} {key!r} in {where} leaves the store root ('..' components, absolute paths and "
            "drive letters are refused in untrusted stores)",
            key=key,
        )


@dataclass(frozen=True)
class Containment:
    """The store root every opened path must resolve into.

    Parameters
    ----------
    root
        The store's directory, already resolved (``os.path.realpath``).
    allow_external_links
        Follow links that resolve outside the root.
    """

    root: str
    allow_external_links: bool = False

    @classmethod
    def for_store(cls, path: str | os.PathLike, allow_external_links: bool = False) -> Containment:
        return cls(os.path.realpath(os.fspath(path)), allow_external_links)

    def inside(self, path: str) -> bool:
        return self._holds(os.path.realpath(path))

    def _holds(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def check_opened(self, fd: int, path: str, key: str) -> None:
        """Refuse a file already opened (``fd``, opened by ``path``) that lies outside the root:
        what was opened is checked, not the name, so a file swapped for a link between a
        check and the open cannot lead out (Linux's ``/proc/self/fd``; elsewhere the name)."""
        if self.allow_external_links:
            return
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(path)
        if not self._holds(real):
            raise UnsafeStoreError(
                f"chunk {key!r} opened {real!r}, outside the store root {self.root!r} (a symbolic "
                f"link?); {_LINK_HINT}",
                key=key,
            )

    def check_path(self, path: str, key: str, what: str = "path") -> None:
        """Refuse ``path`` when it resolves outside the root (and links out are not allowed)."""
        if self.allow_external_links or self.inside(path):
            return
        raise UnsafeStoreError(
            f"{what} {key!r} resolves to {os.path.realpath(path)!r}, outside the store root "
            f"{self.root!r} (a symbolic link?); {_LINK_HINT}",
            key=key,
        )

    def stat_chunk(self, path: str, key: str, checked_dirs: set[str], base: str = "") -> os.stat_result:
        """``os.stat`` of a chunk or shard file, after checking it stays inside the root.

        ``checked_dirs`` caches directories already checked (the array's); ``base`` (the
        array's directory) is resolved in full once, the directories below it only need
        an ``lstat`` each to show they are not links. Raises FileNotFoundError for a
        missing chunk.
        """
        self._check_dir(os.path.dirname(path), key, checked_dirs, base.rstrip(os.sep))
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            self.check_path(path, key, "chunk")
            st = os.stat(path)
        return st

    def _check_dir(self, d: str, key: str, checked: set[str], base: str) -> None:
        if d in checked:
            return
        if not base or len(d) <= len(base) or not d.startswith(base + os.sep):
            self.check_path(d, key, "chunk directory of")
        else:
            self._check_dir(os.path.dirname(d), key, checked, base)
            if stat.S_ISLNK(os.lstat(d).st_mode):
                self.check_path(d, key, "chunk directory of")
        checked.add(d)

    def check_tree(self, directory: str, name: str) -> None:
        """Check every link below an array's directory (before zarr-python reads from it)."""
        if self.allow_external_links:
            return
        for top, dirs, files in os.walk(directory, followlinks=False):
            for entry in dirs + files:
                full = os.path.join(top, entry)
                if os.path.islink(full):
                    self.check_path(full, os.path.relpath(full, self.root), f"file of array {name!r}:")

    def check_group(self, group: str | None) -> None:
        """Check a group key, its directory, its metadata files and its members' before opening."""
        where = f"store {self.root!r}"
        group = (group or "").lstrip("/")  # "/inner" names the group "inner", as in xarray
        if group:
            check_key(group, "group", where)
        gdir = os.path.join(self.root, group) if group else self.root
        self.check_path(gdir, group or "/", "group")
        if not os.path.isdir(gdir):
            return
        for name in _METADATA_FILES:
            self._check_metadata(os.path.join(gdir, name), _join(group, name), where)
        with os.scandir(gdir) as entries:
            for entry in entries:
                if entry.is_symlink():
                    self.check_path(entry.path, _join(group, entry.name), "member")
                if entry.is_dir():
                    for name in _METADATA_FILES:
                        path = os.path.join(entry.path, name)
                        self._check_metadata(path, _join(group, entry.name, name), where)
        for key in consolidated_members(gdir):
            check_key(key, "consolidated member", f"{where} (consolidated metadata)")

    def _check_metadata(self, path: str, key: str, where: str) -> None:
        """A metadata file (group's or member's), if there is one: inside the root, a regular
        file (a FIFO would block its reader, a device never end), at most MAX_METADATA_BYTES."""
        if not os.path.lexists(path):
            return
        if os.path.islink(path):
            self.check_path(path, key, "metadata file")
        try:
            st = os.stat(path)
        except OSError:
            return  # a dangling link: zarr-python reports the member missing
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStoreError(
                f"metadata file {key!r} in {where} is {file_kind(st.st_mode)}, not a regular file", key=key
            )
        if st.st_size > MAX_METADATA_BYTES:
            raise UnsafeStoreError(
                f"metadata file {key!r} in {where} is {st.st_size} bytes, more than the "
                f"{MAX_METADATA_BYTES} read",
                key=key,
            )

    def check_hierarchy(self, group: str | None) -> None:
        """:meth:`check_group` for a group and every group below it (before zarr-python lists
        them): arrays are not descended into."""
        self.check_group(group)
        gdir = os.path.join(self.root, (group or "").lstrip("/"))
        if not os.path.isdir(gdir):
            return
        with os.scandir(gdir) as entries:
            subgroups = [e.name for e in entries if e.is_dir(follow_symlinks=False) and _is_group(e.path)]
        for name in sorted(subgroups):
            self.check_hierarchy(_join(group, name))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages."""
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _is_group(path: str) -> bool:
    """A directory holding a Zarr group's metadata (v2 ``.zgroup`` or v3 ``zarr.json``)."""
    if os.path.isfile(os.path.join(path, ".zgroup")):
        return True
    meta = os.path.join(path, "zarr.json")
    if not os.path.isfile(meta) or os.path.getsize(meta) > MAX_METADATA_BYTES:  # (isfile: no FIFO)
        return False
    try:
        with open(meta, "rb") as f:
            return json.loads(f.read()).get("node_type") == "group"
    except (OSError, ValueError, AttributeError):
        return False


def _join(*parts: str | None) -> str:
    return "/".join(p.strip("/") for p in parts if p)


def consolidated_members(gdir: str) -> list[str]:
    """Member keys listed in a group's consolidated metadata (v3 ``zarr.json`` or v2 ``.zmetadata``)."""
    keys: list[str] = []
    for name, pick in (("zarr.json", _v3_members), (".zmetadata", _v2_members)):
        path = os.path.join(gdir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read(MAX_METADATA_BYTES + 1))
        except (OSError, ValueError):
            continue  # zarr-python reports unreadable metadata itself
        keys.extend(pick(doc))
    return keys


def _v3_members(doc: Any) -> list[str]:
    cm = doc.get("consolidated_metadata") if isinstance(doc, dict) else None
    meta = cm.get("metadata") if isinstance(cm, dict) else None
    keys = list(meta) if isinstance(meta, dict) else []
    for value in (meta or {}).values():  # nested groups carry their own consolidated metadata
        keys.extend(_v3_members(value))
    return [str(k) for k in keys]


def _v2_members(doc: Any) -> list[str]:
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    return (
        [str(k).rsplit("/", 1)[0] if "/" in str(k) else str(k) for k in meta]
        if isinstance(meta, dict)
        else []
    )


def _declared_chunk_shape(meta: Any) -> tuple[int, ...] | None:
    """The chunk shape the metadata document declares (a regular grid's), as written (read
    from its fields: serializing the document again makes zarr warn about data types whose
    v3 form is not specified, which a read has no business doing)."""
    try:
        shape = meta.chunks if meta.zarr_format == 2 else meta.chunk_grid.chunk_shape
        return tuple(int(c) for c in shape)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def regular_shards(array: Any) -> tuple[int, ...] | None:
    """A zarr array's shard shape, None where it is not sharded or its chunk grid is not
    regular (zarr >= 3.2's rectilinear grids have no one shard shape)."""
    try:
        shards = getattr(array, "shards", None)
    except NotImplementedError:
        return None
    return tuple(int(n) for n in shards) if shards else None


def check_array(array: Any, name: str, containment: Containment | None) -> None:
    """Refuse an array whose key, chunk key encoding or sizes are unsafe (before any allocation)."""
    where = f"array {name!r}"
    meta = array.metadata
    if containment is not None:
        check_key(array.path, "array", f"store {containment.root!r}")
        containment.check_path(os.path.join(containment.root, array.path), array.path, "array")
    if meta.zarr_format == 3:
        enc = meta.chunk_key_encoding
        sep = getattr(enc, "separator", None)
        if getattr(enc, "name", None) not in ("default", "v2") or sep not in ("/", "."):
            raise UnsafeStoreError(
                f"{where}: chunk key encoding {enc!r} is not one the spec allows", key=name
            )
    elif getattr(meta, "dimension_separator", ".") not in (".", "/", None):
        raise UnsafeStoreError(
            f"{where}: dimension_separator {meta.dimension_separator!r} is not '.' or '/'", key=name
        )
    itemsize = max(1, getattr(array.dtype, "itemsize", 1) or 1)
    shape = tuple(int(s) for s in array.shape)
    if any(s < 0 for s in shape) or math.prod(shape) * itemsize >= 2**63:
        raise UnsafeStoreError(f"{where}: shape {shape} overflows 64-bit sizes (corrupt metadata?)", key=name)
    shards = regular_shards(array)
    # the metadata document's own chunk shape too: zarr >= 3.4 reads a 0 there as 1
    grids = [("chunk shape", _declared_chunk_shape(meta) or ()), ("shard shape", tuple(shards or ()))]
    try:
        chunks = tuple(int(c) for c in array.chunks)
        grids.append(("chunk shape", chunks))
    except (NotImplementedError, TypeError):
        chunks = None
    for what, grid in grids:
        if any(int(c) <= 0 for c in grid):
            raise UnsafeStoreError(
                f"{where}: {what} {tuple(int(c) for c in grid)} has a length of 0 or less (corrupt "
                "metadata: every chunk length must be at least 1)",
                key=name,
            )
    if chunks is None:
        return
    nbytes = math.prod(chunks) * itemsize
    most = get_options().max_chunk_bytes
    if nbytes > most:
        raise UnsafeStoreError(
            f"{where}: chunk shape {chunks} is {nbytes} bytes decoded, more than the {most} "
            "allowed per chunk (raise set_options(max_chunk_bytes=...) or CUPY_XARRAY_MAX_CHUNK_BYTES if "
            "the store is genuine)",
            key=name,
        )
    if shards:
        per_shard = math.prod(-(-int(s) // c) for s, c in zip(shards, chunks))
        if per_shard > MAX_CHUNKS_PER_SHARD:
            raise UnsafeStoreError(
                f"{where}: shard shape {tuple(shards)} over chunk shape {chunks} gives {per_shard} inner "
                f"chunks per shard, more than the {MAX_CHUNKS_PER_SHARD} allowed",
                key=name,
            )
