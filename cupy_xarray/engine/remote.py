"""Chunk bytes from stores that are not a local directory: S3, HTTP(S), GCS, memory ...

The engine reads metadata through zarr's own store (``FsspecStore``, ``ObjectStore``,
``MemoryStore``) and fetches the chunk and shard bytes it needs through the same store's
``get``, many requests at once on zarr's event loop. What it fetched then goes through the
same decoders, scheduler and checks as bytes read from a local file.

- Concurrency: the ``remote_concurrency`` option's requests in flight per read
  (:mod:`cupy_xarray.options`; ``CUPY_XARRAY_REMOTE_CONCURRENCY``).
- Retries: timeouts, dropped connections, truncated bodies and HTTP 408/429/500/502/503/504
  (S3's ``SlowDown`` included) are retried ``remote_retries`` times with exponential backoff
  and jitter (``CUPY_XARRAY_REMOTE_RETRIES``); then a :class:`~cupy_xarray.errors.ChunkError`
  names the object and what the last attempt got.
- Not retried: a missing object (its chunk reads as the fill value, as in zarr-python),
  access denied (401/403, named with a hint about credentials), and other errors.
- Lengths: a byte range that comes back shorter or longer than asked (a server that ignores
  ``Range``, a shard shorter than its index says) is refused, never used; a body cut short of
  its ``Content-Length`` is retried.
- Shards: each shard's index is fetched with one range request (its first or last bytes) and
  kept while the array is open; the inner chunks a read needs are fetched with range requests,
  neighbours closer than ``coalesce_gap`` merged into one.
- Keys: every key fetched is checked to stay below the store's prefix (no ``..``, no URL
  syntax such as ``?`` or ``#``), whatever the store's metadata says.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from ..containment import UnsafeStoreError
from ..errors import ChunkError
from ..options import Options

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_DENIED_STATUS = frozenset({401, 403})
_RETRY_WORDS = (
    "SlowDown",
    "reduce your request rate",
    "ServiceUnavailable",
    "RequestTimeout",
    "InternalError",
)
_RETRY_TYPES = frozenset(
    {
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientOSError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "IncompleteRead",
        "BadStatusLine",
        "RemoteDisconnected",
    }
)
# one key segment: what zarr's chunk key encodings and array names produce
_SEGMENT = re.compile(r"[^\x00-\x1f\x7f?#%\\/]+")


@dataclass(frozen=True)
class Request:
    """Fetch ``key`` whole (``start`` None), its bytes ``[start, end)``, or with ``start``
    negative and ``end`` None its last ``-start`` bytes. ``most``: the largest whole object
    that can be right (a larger one is refused, on HTTP(S) before its body is read)."""

    key: str
    start: int | None = None
    end: int | None = None
    most: int | None = None

    @property
    def nbytes(self) -> int | None:
        if self.start is None:
            return None
        return -self.start if self.end is None else self.end - self.start

    @property
    def limit(self) -> int | None:
        """The most bytes an answer may hold."""
        return self.most if self.start is None else self.nbytes

    def describe(self) -> str:
        if self.end is None:
            return f"the last {-self.start} bytes"
        return f"bytes {self.start}-{self.end - 1} ({self.end - self.start} bytes)"


def check_remote_key(key: str, where: str) -> None:
    """Refuse a key that could address an object outside the store's prefix."""
    parts = key.split("/")
    bad = [p for p in parts if p in ("", ".", "..") or not _SEGMENT.fullmatch(p)]
    if bad or "://" in key:
        raise UnsafeStoreError(
            f"key {key!r} in {where} is not a plain key below the store's prefix ('..', '.', empty "
            "segments and URL syntax such as '?', '#' or '%' are refused)",
            key=key,
        )


def store_url(store: Any) -> str:
    """A URL for messages: where a zarr store that is not a local directory lives."""
    path = str(getattr(store, "path", "") or "")
    fs = getattr(store, "fs", None)
    if fs is not None:
        if "://" in path:
            return path.rstrip("/")
        proto = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
        return f"{proto}://{path}".rstrip("/")
    inner = getattr(store, "store", None)  # obstore's store
    if inner is not None:
        url = getattr(inner, "url", None)
        if not url:
            config = getattr(inner, "config", None) or {}
            bucket = config.get("bucket") or config.get("container_name")
            scheme = {"S3Store": "s3", "GCSStore": "gs", "AzureStore": "az"}.get(type(inner).__name__)
            prefix = str(getattr(inner, "prefix", "") or "")
            url = (
                f"{scheme}://{bucket}/{prefix}" if scheme and bucket else f"{type(inner).__name__}()/{prefix}"
            )
        return f"{str(url).rstrip('/')}/{path}".rstrip("/")
    return f"{type(store).__name__}:{path}".rstrip("/:")


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(exc, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def transient(exc: BaseException) -> bool:
    """True for failures worth another attempt: timeouts, dropped connections, 5xx, throttling."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | ConnectionError):
        return True
    status = _status(exc)
    if status is not None:
        return status in _RETRY_STATUS
    names = {t.__name__ for t in type(exc).__mro__}
    if names & _RETRY_TYPES:
        return True
    text = str(exc)
    return any(w in text for w in _RETRY_WORDS) or bool(re.search(r"\b(500|502|503|504)\b", text))


def _denied(exc: BaseException) -> bool:
    return isinstance(exc, PermissionError) or _status(exc) in _DENIED_STATUS


class RemoteSource:
    """The chunk objects of one array in a store that is not a local directory.

    Parameters
    ----------
    store
        The zarr store the array was opened from.
    prefix
        The array's path in the store (``""`` at the root).
    name
        The array's name, for messages.
    """

    def __init__(self, store: Any, prefix: str, name: str) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.name = name
        self.url = store_url(store)
        from .http import fetcher_for

        # plain HTTP(S): fetched on threads, unless the threaded_http option says otherwise
        self._http = fetcher_for(store)
        #: shard indexes already fetched, kept while the array is open: a dask task of one inner
        #: chunk then makes one request, not two (reopen the dataset after the store changes)
        self.shard_indexes: dict = {}
        if self.prefix:
            for part in self.prefix.split("/"):
                check_remote_key(part, f"array {name!r}")

    def http(self, options: Options) -> Any:
        """The threaded HTTP(S) fetcher of a plain HTTP(S) store (None for others, or with
        the ``threaded_http`` option off: the store's own ``get``)."""
        return self._http if options.threaded_http else None

    def lands_pinned(self, options: Options) -> bool:
        """Whether :meth:`fetch` with ``pinned=True`` lands the bytes in page-locked memory
        (the threaded HTTP(S) fetcher does; a store's own ``get`` returns its own buffers)."""
        return self.http(options) is not None

    def remember(self, cache: dict, key: Any, value: Any, options: Options) -> None:
        """Keep ``value`` in ``cache`` (at most ``max_cached_indexes`` entries, an option)."""
        if len(cache) >= options.max_cached_indexes:
            cache.clear()
        cache[key] = value

    def key(self, chunk_key: str) -> str:
        """The store key of a chunk key (checked to stay below the store's prefix)."""
        check_remote_key(chunk_key, f"array {self.name!r}")
        return f"{self.prefix}/{chunk_key}" if self.prefix else chunk_key

    def location(self, chunk_key: str) -> str:
        """The object's URL, for messages."""
        return f"{self.url}/{self.prefix}/{chunk_key}" if self.prefix else f"{self.url}/{chunk_key}"

    def fetch(
        self,
        requests: list[Request],
        options: Options,
        chunks: list[str] | None = None,
        pinned: bool = False,
    ) -> list[Any]:
        """The bytes of each request (a uint8 NumPy array), None where the object does not
        exist, fetched with the read's settings ``options`` (on other threads too).
        ``chunks``: the chunk named in each request's error (default its key); for a
        request that holds many, ``[(end within the request, chunk), ...]`` in order of end:
        an answer cut short names the first one it does not hold whole.
        ``pinned``: land the bytes in page-locked memory where the fetcher reads bodies into
        buffers of its own (plain HTTP(S)), for bytes that go to the GPU as they are."""
        if not requests:
            return []
        chunks = chunks or [r.key for r in requests]
        http = self.http(options)
        if http is not None:
            land = pinned_landing if pinned else None
            jobs = [(r, c, land, options) for r, c in zip(requests, chunks)]
            return http.fetch_all(jobs, self._attempts_threaded, options.http_threads)
        from zarr.core.sync import sync

        return sync(self._fetch_all(requests, chunks, options))

    async def _fetch_all(self, requests: list[Request], chunks: list[str], options: Options) -> list[Any]:
        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()
        gate = asyncio.Semaphore(options.remote_concurrency)

        async def get(r: Request) -> Any:
            from zarr.abc.store import RangeByteRequest, SuffixByteRequest

            if r.start is None:
                byte_range = None
            elif r.end is None:
                byte_range = SuffixByteRequest(-r.start)
            else:
                byte_range = RangeByteRequest(r.start, r.end)
            buf = await self.store.get(self.key(r.key), prototype=proto, byte_range=byte_range)
            return None if buf is None else buf.as_numpy_array().view("u1").reshape(-1)

        async def one(r: Request, chunk: str) -> Any:
            async with gate:
                data = await self._attempts(r.key, chunk, options, get, r)
            return self._checked(r, chunk, data)

        tasks = [asyncio.ensure_future(one(r, c)) for r, c in zip(requests, chunks)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            # the first failure is the answer: stop the other requests and let them wind down
            # here, rather than leave them running on zarr's event loop
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _attempts(self, key: str, chunk: str, options: Options, fn, *args) -> Any:
        """``fn(*args)`` with bounded retries of transient failures; a ChunkError after."""
        for attempt in range(options.remote_retries + 1):
            try:
                return await asyncio.wait_for(fn(*args), options.remote_timeout)
            except (UnsafeStoreError, ChunkError):
                raise
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised naming the object
                if self._judge(exc, attempt, key, chunk, options.remote_retries):
                    return None
                await asyncio.sleep(_delay(attempt, options))
        raise AssertionError("unreachable")

    def _attempts_threaded(self, job: tuple) -> Any:
        """:meth:`_attempts` for the HTTP fetcher's threads (one request: ``job``)."""
        r, chunk, land, options = job
        for attempt in range(options.remote_retries + 1):
            try:
                data = self._http.get(
                    self.key(r.key), r.start, r.end, options.remote_timeout, r.limit, land, r.most
                )
                break
            except (UnsafeStoreError, ChunkError):
                raise
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised naming the object
                if self._judge(exc, attempt, r.key, chunk, options.remote_retries):
                    return None
                time.sleep(_delay(attempt, options))
        return self._checked(r, chunk, data)

    def _judge(self, exc: BaseException, attempt: int, key: str, chunk: str, retries: int) -> bool:
        """After a failed attempt: True for a missing object; raise the ChunkError that names a
        failure not worth retrying (or the last one); return False to try again."""
        where = dict(array=self.name, chunk=_named(chunk, None), path=self.location(key))
        if _denied(exc):
            raise ChunkError(
                f"access denied ({type(exc).__name__}: {exc}); check the credentials "
                "(storage_options=, or the AWS_* / cloud provider's environment variables) and "
                "that they may read this object",
                **where,
            ) from exc
        if isinstance(exc, FileNotFoundError):
            return True
        if not transient(exc):
            raise ChunkError(f"cannot fetch the object ({type(exc).__name__}: {exc})", **where) from exc
        if attempt == retries:
            what = "timed out" if isinstance(exc, TimeoutError | asyncio.TimeoutError) else "failed"
            raise ChunkError(
                f"fetching the object {what} {retries + 1} time{'s' if retries else ''}, the last with "
                f"{type(exc).__name__}: {exc or 'no message'} (raise the remote_retries or remote_timeout "
                "options, or CUPY_XARRAY_REMOTE_RETRIES / CUPY_XARRAY_REMOTE_TIMEOUT, for a slow server)",
                **where,
            ) from exc
        return False

    def _checked(self, r: Request, chunk: str, data: Any) -> Any:
        """The answer's bytes, after its length is checked against what could be right."""
        from .http import TooLarge

        if data is None:
            return None
        got = data.nbytes if isinstance(data, TooLarge) else len(data)
        where = dict(array=self.name, chunk=_named(chunk, got), path=self.location(r.key))
        if r.nbytes is not None and got != r.nbytes:
            # a server that ignores Range, or an object shorter than its index says: the same
            # answer every time, so not retried
            raise ChunkError(
                f"asked the server for {r.describe()} of the object, got {got} bytes (a server that "
                "ignores Range requests, or an object shorter than its shard index says)",
                **where,
            )
        if r.most is not None and got > r.most:
            raise ChunkError(
                f"the object is {got} bytes, more than the {r.most} any codec stores this array's "
                "chunks in (corrupt store, or an object that is not this chunk)",
                **where,
            )
        return data


def _named(chunk: Any, got: int | None) -> str:
    """The chunk an error names: ``chunk``, or of a request's ``[(end, chunk), ...]`` the first
    that an answer of ``got`` bytes does not hold whole (the first where ``got`` is unknown)."""
    if isinstance(chunk, str):
        return chunk
    if got is not None:
        for end, name in chunk:
            if end > got:
                return name
    return chunk[0][1]


def pinned_landing(nbytes: int) -> Any:
    """``nbytes`` of page-locked memory from cupy's pinned pool, for a fetched body. The size
    asked of the pool is rounded up (at most a quarter more) so that bodies of similar sizes
    reuse the pool's blocks rather than each pinning new memory."""
    from ..runtime.buffers import pinned_buffer

    step = 1 << max(nbytes.bit_length() - 3, 12)
    return pinned_buffer(-(-nbytes // step) * step)[:nbytes]


def _delay(attempt: int, options: Options) -> float:
    """Seconds to wait before attempt ``attempt + 1``: exponential backoff with jitter."""
    return min(options.remote_backoff_max, options.remote_backoff * 2**attempt) * (0.5 + random.random() / 2)


def coalesce(ranges: list[tuple[int, int]], gap: int, most: int):
    """Merge sorted-able ``(start, end)`` ranges closer than ``gap`` into requests of at most
    ``most`` bytes (a read's: the options ``coalesce_gap`` and ``coalesce_max``); returns
    ``[(start, end, [indices of the ranges it holds])]``."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    merged: list[tuple[int, int, list[int]]] = []
    for i in order:
        s, e = ranges[i]
        if merged:
            ms, me, members = merged[-1]
            if s - me <= gap and max(me, e) - ms <= most:
                merged[-1] = (ms, max(me, e), members + [i])
                continue
        merged.append((s, e, [i]))
    return merged
