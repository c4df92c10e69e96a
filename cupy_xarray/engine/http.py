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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import numpy as np

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _left(deadline: float, timeout: float) -> float:
    """Seconds left before ``deadline``; TimeoutError once there are none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no whole answer within {timeout:g} s (remote_timeout)")
    return left


def _threads(threads: int) -> ThreadPoolExecutor:
    """The process's fetch threads: made once, at the first fetch (``threads``: its read's
    ``http_threads`` option)."""
    global _pool
    with _pool_lock:
        if _pool is None:
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
    client = dict(getattr(fs, "client_kwargs", None) or {})
    client.pop("timeout", None)  # the deadline the engine sets itself (it has its own)
    if options or client or getattr(fs, "encoded", False):
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
        whole: int | None = None,
    ) -> np.ndarray | TooLarge | None:
        """The object's bytes (``[start, end)``; ``end`` None with ``start`` < 0: the last
        ``-start``), None for 404, :class:`TooLarge` for an answer of more than ``most`` bytes
        (not read); raises :class:`HTTPError` or the connection's error. ``land(n)``: the
        buffer of ``n`` bytes a body is read into (default a new NumPy array). ``whole``: for a
        range, the most bytes the whole object can hold; a server that ignores ``Range`` (200
        and the whole object) is read up to that and the range cut from it. ``timeout``
        bounds the whole request, body included (a server that drips bytes cannot hold it
        longer), not only each wait for bytes."""
        deadline = time.monotonic() + timeout
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
            conn = self._connection(_left(deadline, timeout), scheme, host, port)
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
                if start is not None and resp.status == 200:  # Range ignored: the whole object
                    if whole is None:
                        return self._body(resp, scheme, host, port, most, land, deadline, timeout)
                    body = self._body(resp, scheme, host, port, whole, None, deadline, timeout)
                    if body is None or isinstance(body, TooLarge):
                        return body
                    return body[start:] if end is None else body[start:end]
                return self._body(resp, scheme, host, port, most, land, deadline, timeout)
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
        land: Callable[[int], np.ndarray] | None,
        deadline: float,
        timeout: float,
    ) -> Any:
        conn = getattr(_local, "conns", {}).get((scheme, host, port))

        def wait_left() -> None:  # each wait for bytes: at most what is left of the deadline
            left = _left(deadline, timeout)
            if conn is not None and conn.sock is not None:
                conn.sock.settimeout(left)

        if resp.status == 404:
            resp.read()
            return None
        if resp.status not in (200, 206):
            resp.read()
            raise HTTPError(resp.status, resp.reason)
        if resp.getheader("Content-Encoding", "identity").lower() in ("gzip", "x-gzip", "deflate"):
            return self._decoded_body(resp, most, wait_left, lambda: self._drop(scheme, host, port))
        length = resp.getheader("Content-Length")
        if length is None:  # chunked transfer: no size to read into
            parts, got = [], 0
            while most is None or got <= most:
                wait_left()
                part = resp.read1(2**20)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            if most is None or got <= most:
                resp.read()  # (ends the response: its connection is reused)
            body = b"".join(parts)
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
            wait_left()
            # one receive at a time (readinto would wait for the whole buffer, however slowly
            # it comes): the deadline is checked between receives
            n = resp.fp.readinto1(view[done:]) if resp.fp is not None else 0
            if not n:
                raise http.client.IncompleteRead(b"", len(buf) - done)
            done += n
            resp.length -= n
        resp.read()  # (ends the response: its connection is reused)
        if resp.will_close:
            self._drop(scheme, host, port)
        return buf

    def _decoded_body(
        self, resp: http.client.HTTPResponse, most: int | None, wait_left, drop: Callable[[], None]
    ) -> Any:
        """A body a server compressed although asked not to (``Content-Encoding``): inflated,
        at most ``most`` bytes of it (a compressed answer cannot make a read take more).
        ``drop``: forget the connection, whose answer is then left unread."""
        import zlib

        gz = resp.getheader("Content-Encoding", "").lower() in ("gzip", "x-gzip")
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 16 if gz else zlib.MAX_WBITS)
        parts, got, cap = [], 0, (None if most is None else most + 1)
        while True:
            wait_left()
            part = resp.read1(2**20)
            if not part:
                break
            out = inflate.decompress(part, 0 if cap is None else cap - got + 1)
            parts.append(out)
            got += len(out)
            if cap is not None and got >= cap:
                drop()  # the rest of the body is not read: the connection cannot be reused
                return TooLarge(got)
        resp.read()  # (ends the response: its connection is reused)
        if not inflate.eof:
            raise http.client.IncompleteRead(b"", 0)
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

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

    def fetch_all(self, jobs: list[tuple[Any, ...]], attempt_one, threads: int) -> list[Any]:
        """Run ``attempt_one(job)`` for each job on the fetch threads (``threads`` of them
        where the process has none yet); results in order. After a failure, the jobs not
        started yet are cancelled and the first error is raised."""
        pool = _threads(threads)
        futures = [pool.submit(attempt_one, job) for job in jobs]
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
