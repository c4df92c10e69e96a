"""Chunk bytes of HTTP(S) stores fetched on a pool of threads, straight into NumPy buffers.

zarr's ``FsspecStore`` fetches through aiohttp on one event loop: every 64 KiB of every body
is a Python callback on that one thread, which then competes for the interpreter lock with
the threads that decode. For plain HTTP(S) stores the engine fetches instead with
``http.client`` on ``http_threads`` threads (an option): one kept-alive connection per thread and host,
each body read with ``readinto`` (the lock is released while bytes arrive), redirects
followed (:data:`MAX_REDIRECTS`; the store's headers are not sent to another host). Stores
with options this path does not know (authentication, client arguments, cookies) keep the
store's own fetches. The contract is :meth:`~.remote.RemoteSource.fetch`'s, retries and
length checks included.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import numpy as np

from ..options import get_options

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            threads = get_options().http_threads  # the process's pool: made once, at the first fetch
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="cupy-xarray-http")
        return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)

#: redirects followed per request (data portals send chunk requests on to object storage)
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class TooLarge:
    """An answer longer than could be right: its length, its body left unread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class HTTPError(OSError):
    """An HTTP answer that is not the bytes asked for; ``status`` is the HTTP status."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status} {reason}".strip())


def fetcher_for(store: Any) -> HTTPFetcher | None:
    """An :class:`HTTPFetcher` for a zarr ``FsspecStore`` over plain HTTP(S), else None."""
    fs = getattr(store, "fs", None)
    if fs is None or type(fs).__name__ != "HTTPFileSystem":
        return None
    url = str(getattr(store, "path", ""))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or "@" in parts.netloc:  # user:password@ needs fsspec's client
        return None
    options = dict(getattr(fs, "kwargs", {}) or {})
    headers = options.pop("headers", None) or {}
    if options or getattr(fs, "client_kwargs", None) or getattr(fs, "encoded", False):
        return None  # authentication, cookies, proxies ...: the store's own client knows them
    return HTTPFetcher(url, dict(headers))


class HTTPFetcher:
    """GET requests for keys below ``base`` (a URL), ``headers`` sent with each."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        self.base = base.rstrip("/")
        parts = urlsplit(self.base)
        self.scheme, self.host, self.port = parts.scheme, parts.hostname or "", parts.port
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.prefix = parts.path
        self.headers = {"Accept-Encoding": "identity", **headers}

    def path(self, key: str) -> str:
        return f"{self.prefix}/{quote(key, safe='/')}"

    def get(
        self,
        key: str,
        start: int | None,
        end: int | None,
        timeout: float,
        most: int | None = None,
        land: Callable[[int], np.ndarray] | None = None,
    ) -> np.ndarray | TooLarge | None:
        """The object's bytes (``[start, end)``; ``end`` None with ``start`` < 0: the last
        ``-start``), None for 404, :class:`TooLarge` for an answer of more than ``most`` bytes
        (not read); raises :class:`HTTPError` or the connection's error. ``land(n)``: the
        buffer of ``n`` bytes a body is read into (default a new NumPy array)."""
        headers = dict(self.headers)
        if start is not None and end is None:
            headers["Range"] = f"bytes={start}" if start < 0 else f"bytes={start}-"  # suffix: "bytes=-n"
        elif start is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        url = f"{self.origin}{self.path(key)}"
        hops = 0
        while hops <= MAX_REDIRECTS:
            parts = urlsplit(url)
            scheme, host, port = parts.scheme, parts.hostname or "", parts.port
            conn = self._connection(timeout, scheme, host, port)
            reused = conn.sock is not None
            try:
                try:
                    conn.request(
                        "GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers
                    )
                    resp = conn.getresponse()
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    if not reused:
                        raise
                    # the server closed a kept-alive connection while it was idle: once more, on
                    # a new one (not a failed attempt)
                    self._drop(scheme, host, port)
                    continue
                hops += 1
                if resp.status in _REDIRECTS and resp.getheader("Location"):
                    resp.read()
                    url = urljoin(url, resp.getheader("Location"))
                    target = urlsplit(url)
                    if target.scheme not in ("http", "https"):
                        raise HTTPError(resp.status, f"redirect to {url!r}")
                    if (target.scheme, target.hostname, target.port) != (self.scheme, self.host, self.port):
                        # another host: the store's own headers (credentials) stay behind
                        headers = {k: v for k, v in headers.items() if k in ("Range", "Accept-Encoding")}
                    continue
                return self._body(resp, scheme, host, port, most, land)
            except BaseException:
                self._drop(scheme, host, port)  # a connection in an unknown state is never reused
                raise
        raise OSError(f"more than {MAX_REDIRECTS} redirects")

    def _body(
        self,
        resp: http.client.HTTPResponse,
        scheme: str,
        host: str,
        port: int | None,
        most: int | None,
        land: Callable[[int], np.ndarray] | None = None,
    ) -> Any:
        if resp.status == 404:
            resp.read()
            return None
        if resp.status not in (200, 206):
            resp.read()
            raise HTTPError(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        if length is None:  # chunked transfer: no size to read into
            body = resp.read(None if most is None else most + 1)
            if most is not None and len(body) > most:
                self._drop(scheme, host, port)
                return TooLarge(len(body))
            return np.frombuffer(body, dtype=np.uint8)
        if most is not None and int(length) > most:
            self._drop(scheme, host, port)  # the body is not read: the connection cannot be reused
            return TooLarge(int(length))
        buf = land(int(length)) if land is not None else np.empty(int(length), dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < len(buf):
            n = resp.readinto(view[done:])
            if not n:
                raise http.client.IncompleteRead(b"", len(buf) - done)
            done += n
        if resp.will_close:
            self._drop(scheme, host, port)
        return buf

    def _connection(
        self, timeout: float, scheme: str, host: str, port: int | None
    ) -> http.client.HTTPConnection:
        conns = getattr(_local, "conns", None)
        if conns is None:
            conns = _local.conns = {}
        conn = conns.get((scheme, host, port))
        if conn is None:
            if scheme == "https":
                conn = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl.create_default_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            conns[scheme, host, port] = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop(self, scheme: str, host: str, port: int | None) -> None:
        conn = getattr(_local, "conns", {}).pop((scheme, host, port), None)
        if conn is not None:
            conn.close()

    def fetch_all(self, jobs: list[tuple[Any, ...]], attempt_one) -> list[Any]:
        """Run ``attempt_one(job)`` for each job on the fetch threads; results in order. After
        a failure, the jobs not started yet are cancelled and the first error is raised."""
        futures = [_threads().submit(attempt_one, job) for job in jobs]
        out, first = [], None
        for f in futures:
            if first is not None and f.cancel():
                continue
            try:
                out.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - the first error in order is raised
                first = first or exc
        if first is not None:
            raise first
        return out
