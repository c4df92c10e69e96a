"""Opening a store's groups: the forms a local store comes in, a remote store opened
patiently, and why a store did not open (what the path is, what a remote failure means, and
what to do)."""

from __future__ import annotations

import os
import time
from typing import Any

from xarray.backends.zarr import ZarrStore

from ..errors import StoreError, StoreNotFoundError
from ..options import get_options


def is_local_store_object(obj: Any) -> bool:
    """Whether ``obj`` is a ``zarr.storage.LocalStore``."""
    return type(obj).__name__ == "LocalStore" and hasattr(obj, "root")


#: fsspec protocols that only cache what they wrap (a chain of them over a local file system
#: is a local store)
_CACHES = ("simplecache", "filecache", "blockcache")


def _fsspec_local_path(obj: Any) -> str | None:
    """The directory behind ``zarr.storage.FsspecStore`` over fsspec's local file system."""
    fs = getattr(obj, "fs", None)
    if type(obj).__name__ != "FsspecStore" or fs is None:
        return None
    fs = getattr(fs, "sync_fs", fs)  # (zarr wraps a synchronous file system for async use)
    protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if not {"file", "local"} & set(protocol):
        return None
    return os.path.abspath(fs._strip_protocol(obj.path))


def local_store_path(obj: Any) -> str | None:
    """The directory behind a local store, whatever form names it: a path (``~`` expanded), a
    ``file://`` or ``local://`` URL (behind fsspec's caches too: ``simplecache::file://...``),
    a ``zarr.storage.LocalStore`` or an ``FsspecStore`` over the local file system; None for
    anything else (remote URLs, other stores). Every one of them gets the same checks."""
    if is_local_store_object(obj):
        return os.fspath(obj.root)
    fsspec_path = _fsspec_local_path(obj)
    if fsspec_path is not None:
        return fsspec_path
    if not isinstance(obj, str | os.PathLike):
        return None
    path = os.fspath(obj)
    *wrappers, last = path.split("::") if "::" in path else [path]
    if wrappers and all(w.split("://")[0] in _CACHES for w in wrappers):
        path = last
    if path.startswith("local://"):
        path = "file://" + path[len("local://") :]
    if path.startswith("file://") and not path.startswith(("file:///", "file://localhost/")):
        return os.path.abspath(path[len("file://") :])  # fsspec's file://relative/path
    if path.startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        url = urlparse(path)
        if url.netloc not in ("", "localhost"):
            return None
        return url2pathname(url.path)
    return None if "://" in path else os.path.expanduser(path)


#: the fsspec file system each remote protocol needs, and the package that brings it
_PROTOCOL_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
}


def install_hint(path: str) -> str:
    """What to install to open ``path``'s protocol."""
    protocol = path.split("://", 1)[0].lower()
    package = _PROTOCOL_PACKAGES.get(protocol)
    extra = "this package's '.[remote]' extra (from its source folder) brings fsspec, s3fs and aiohttp"
    if package is None:
        return f"remote stores open through fsspec: install the file system for {protocol}://; {extra}"
    return f"{protocol}:// stores open through fsspec's {package}: pip install fsspec {package}; {extra}"


def _chain(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def remote_failure(
    path: str, exc: BaseException, group: str | None = None, storage_options: dict | None = None
) -> tuple[type | None, str]:
    """What made a remote store fail to open, and what to do: (the error type, its message),
    or (None, "") where the cause is not one of those below."""
    import socket
    from urllib.parse import urlsplit

    chain = list(_chain(exc))
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    url = urlsplit(path)
    where = f"group {group!r} of " if group else ""
    start = f"cannot open {where}{path!r}"
    if any(isinstance(e, socket.gaierror) for e in chain) or "ClientConnectorDNSError" in names:
        return StoreError, (
            f"{start}: the host name {url.hostname!r} does not resolve (DNS); check the URL's host, "
            "and that this machine reaches the network"
        )
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        port = f":{url.port}" if url.port else ""
        return StoreError, (
            f"{start}: the connection to {url.hostname}{port} was refused (nothing listens there); "
            "check the URL's host and port, and that the server runs"
        )
    if "NoCredentialsError" in names or "Unable to locate credentials" in text:
        return StoreError, (
            f"{start}: no credentials were found; set them in the environment (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in storage_options=, or pass "
            "storage_options={'anon': True} for a public bucket"
        )
    if any(isinstance(e, TimeoutError) for e in chain):
        return StoreError, (
            f"{start}: the server did not answer in time; try again, or raise the remote_timeout "
            "setting (cupy_xarray.set_options(remote_timeout=...))"
        )
    missing = any(isinstance(e, FileNotFoundError) for e in chain) or "GroupNotFoundError" in names
    if missing and not _has_metadata(path, group, storage_options):
        return StoreNotFoundError, (
            f"no such Zarr store: {where}{path!r} does not exist (the server answered, but holds no "
            "zarr.json or .zgroup there); check the path, the group and zarr_format"
        )
    return None, ""


def _has_metadata(path: str, group: str | None, storage_options: dict | None) -> bool:
    """Whether a remote store holds a Zarr metadata document where it failed to open (asked
    only then: one more request); True where that cannot be told."""
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        where = "/".join(p for p in (root.rstrip("/"), (group or "").strip("/")) if p)
        return any(fs.exists(f"{where}/{name}") for name in ("zarr.json", ".zgroup", ".zarray"))
    except Exception:  # noqa: BLE001 - no answer: say nothing about what is there
        return True


def what_is_there(local: str, group: str | None, zarr_format: int | None) -> str | None:
    """What a local path that did not open as a Zarr group is, and what to do (None: a Zarr
    group whose failure is its own)."""
    import json

    path = os.path.join(local, group.strip("/")) if group and group.strip("/") else local
    reads = "engine='kvikio' reads Zarr stores (directories)"
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(b"\x89HDF"):
            return f"it is an HDF5 / NetCDF-4 file; {reads}: open it with engine='h5netcdf' or 'netcdf4'"
        if head.startswith(b"CDF"):
            return f"it is a NetCDF-3 file; {reads}: open it with engine='scipy' or 'netcdf4'"
        return f"it is a file, not a directory; {reads}"
    if not os.path.isdir(path):
        return None
    names = set(os.listdir(path))
    if not names:
        return f"it is an empty directory; {reads}"
    v3 = "zarr.json" in names
    node = None
    if v3:
        try:
            with open(os.path.join(path, "zarr.json"), "rb") as f:
                node = json.loads(f.read(2**20)).get("node_type")
        except (OSError, ValueError, AttributeError):
            node = None
    if ".zarray" in names or node == "array":
        parent, name = os.path.split(path.rstrip(os.sep))
        return (
            f"it is a Zarr array, not a group: open its group {parent!r} and take the variable "
            f"{name!r} (xr.open_dataset({parent!r}, engine='kvikio')[{name!r}])"
        )
    if zarr_format == 2 and v3 and ".zgroup" not in names:
        return "it is a Zarr v3 store (zarr.json), opened with zarr_format=2: pass 3 or leave it out"
    if zarr_format == 3 and not v3 and ".zgroup" in names:
        return "it is a Zarr v2 store (.zgroup), opened with zarr_format=3: pass 2 or leave it out"
    if not v3 and not names & {".zgroup", ".zmetadata"}:
        return f"it is a directory with no Zarr metadata (zarr.json, .zgroup or .zarray); {reads}"
    return None


def patient_storage_options(url: str, storage_options: dict | None) -> dict | None:
    """``storage_options`` with the ``remote_timeout`` option as the deadline of each
    metadata request, where the file system takes one and the user gave none (HTTP(S):
    aiohttp's total timeout; S3: botocore's connect and read timeouts)."""
    timeout = get_options().remote_timeout
    opts = dict(storage_options or {})
    scheme = url.split("://", 1)[0].split("::")[-1].lower()
    if scheme in ("http", "https"):
        client = dict(opts.get("client_kwargs") or {})
        if "timeout" not in client:
            try:
                import aiohttp
            except ImportError:
                return storage_options
            client["timeout"] = aiohttp.ClientTimeout(total=timeout)
            opts["client_kwargs"] = client
    elif scheme in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        opts["config_kwargs"] = config
    else:
        return storage_options
    return opts


def _transient_chain(exc: BaseException) -> bool:
    from ..engine.remote import transient

    seen = 0
    while exc is not None and seen < 8:
        if transient(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def open_retrying(path: Any, group: str | None, tree: bool, options: dict, remote: bool) -> dict:
    """Open the group (or the tree below it); a remote store's transient failures (timeouts,
    5xx, dropped connections) are tried again, as its chunks are (``remote_retries``, with
    ``remote_backoff`` doubling up to ``remote_backoff_max``)."""
    o = get_options()
    attempts = o.remote_retries + 1 if remote else 1
    for attempt in range(attempts):
        try:
            if tree:
                parent = "/" + (group or "").strip("/")
                return ZarrStore.open_store(path, group=parent, **options)
            return {group or "/": ZarrStore.open_group(path, group=group, **options)}
        except Exception as exc:
            if attempt + 1 >= attempts or not _transient_chain(exc):
                raise
            time.sleep(min(o.remote_backoff_max, o.remote_backoff * 2**attempt))
    raise AssertionError("unreachable")


def open_failure(
    path: Any,
    exc: BaseException,
    group: str | None,
    local: str | None,
    zarr_format: int | None,
    storage_options: dict | None,
    remote: bool,
) -> Exception:
    """The error to raise where a store did not open with ``exc``: what the path is where
    that explains it, what a ``remote`` store's failure means, else zarr's error with what to
    check."""
    if isinstance(exc, ImportError):  # a remote protocol whose fsspec filesystem is not installed
        return StoreError(f"cannot open {path!r}: {exc} ({install_hint(path)})")
    if isinstance(exc, PermissionError):
        return StoreError(
            f"cannot open {path!r}: access denied ({exc}); check the credentials (storage_options=, or "
            "the AWS_* / cloud provider's environment variables) and that they may read this store"
        )
    where = f"group {group!r} of " if group else ""
    what = what_is_there(local, group, zarr_format) if local is not None else None
    if what is not None:
        return StoreError(f"cannot open {where}{path!r}: {what}")
    if remote:
        kind, why = remote_failure(path, exc, group, storage_options)
        if kind is not None:
            return kind(why)
    return StoreError(
        f"cannot open {where}{path!r} as a Zarr store ({type(exc).__name__}: {exc}); "
        "check the path, the group and zarr_format"
    )
