"""Object stores on loopback for tests and benchmarks: an HTTP server with ranges and faults,
and an S3-compatible server (moto).

``HTTPStores(root)`` serves the files below ``root`` at ``http://127.0.0.1:<port>/``:
``GET`` and ``HEAD``, ``Range: bytes=a-b``, ``a-`` and ``-n`` (206 with ``Content-Range``),
404 for missing files, HTTP/1.1 keep-alive. ``faults`` maps a path suffix to the faults the
next requests for it get, one per request, in order:

- ``"503"``, ``"500"``, ``"403"``, ``"429"``: that status, no body;
- ``"reset"``: the connection is closed without an answer;
- ``"short"``: the headers promise the whole body, half of it is sent, the connection closed;
- ``"ignore-range"``: 200 with the whole file, whatever ``Range`` said;
- ``"stall"``: nothing is sent for ``stall_s`` seconds;
- ``"stall-body"``: half the body, then nothing for ``stall_s`` seconds, then the rest;
- ``"redirect"``: 302 to the same file at another URL (on the server ``redirect_to`` names);
- ``"close-after"``: the answer, then the connection closed without ``Connection: close``;
- ``"drip"``: the body one byte every ``stall_s / 8`` seconds (each wait short, the whole long);
- ``"gzip"``: the body gzip-compressed with ``Content-Encoding: gzip``, whatever was asked.

``requests`` logs ``(method, path, range header, authorization header)`` of every request.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as object stores' servers do: the headers go out in one write and the body
    # in another, and with Nagle's algorithm a body's last segment waits for the client's
    # delayed acknowledgement (40 ms on Linux), now and then, on a kept-alive connection
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _fault(self, path: str) -> str | None:
        with self.server.lock:
            for suffix, pending in self.server.faults.items():
                if path.endswith(suffix) and pending:
                    return pending.pop(0)
        return None

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, body: bool) -> None:
        url_path = unquote(urlparse(self.path).path)
        rng = self.headers.get("Range")
        with self.server.lock:
            self.server.requests.append((self.command, url_path, rng, self.headers.get("Authorization")))
        fault = self._fault(url_path)
        if fault is not None and fault.isdigit():
            return self._empty(int(fault))
        if fault == "reset":
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if fault == "stall":
            time.sleep(self.server.stall_s)
        if fault == "redirect":  # to the same file, by another URL
            self.send_response(302)
            self.send_header("Location", f"{self.server.redirect_to}{url_path}?moved=1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        full = os.path.realpath(os.path.join(self.server.root, url_path.lstrip("/")))
        if not full.startswith(self.server.root + os.sep) or not os.path.isfile(full):
            return self._empty(404)
        size = os.path.getsize(full)
        start, end, status = 0, size, 200
        if rng and fault != "ignore-range":
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._empty(416)
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                start, end = max(0, size - int(m.group(2))), size
            if start >= size and size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            status = 206
        n = end - start
        if fault == "gzip":
            import gzip

            with open(full, "rb") as f:
                packed = gzip.compress(os.pread(f.fileno(), n, start))
            self.send_response(status)
            self.send_header("Content-Length", str(len(packed)))
            self.send_header("Content-Encoding", "gzip")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            if body:
                self.wfile.write(packed)
            return None
        self.send_response(status)
        self.send_header("Content-Length", str(n))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return None
        with open(full, "rb") as f:
            if fault == "short":
                self.wfile.write(os.pread(f.fileno(), n // 2, start))
                self.wfile.flush()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return None
            sent = 0
            tls = hasattr(self.connection, "cipher")  # sendfile would bypass the encryption
            if fault == "drip":
                for k in range(n):
                    self.wfile.write(os.pread(f.fileno(), 1, start + k))
                    self.wfile.flush()
                    time.sleep(self.server.stall_s / 8)
                return None
            if fault == "stall-body":  # half the body, then a pause as long as a stall
                self.wfile.write(os.pread(f.fileno(), n // 2, start))
                self.wfile.flush()
                sent = n // 2
                time.sleep(self.server.stall_s)
            while sent < n:  # sendfile: the server's own cost stays small beside the client's
                if tls:
                    k = self.wfile.write(os.pread(f.fileno(), min(n - sent, 1 << 22), start + sent))
                else:
                    k = os.sendfile(
                        self.connection.fileno(), f.fileno(), start + sent, min(n - sent, 1 << 24)
                    )
                if not k:
                    break
                sent += k
        if fault == "close-after":  # as servers drop idle kept-alive connections: no warning
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        return None

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that gave up
            self._serve(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(False)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = os.path.realpath(root)
        self.faults: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.stall_s = 2.0
        self.redirect_to = ""  # another server's URL, or "" for this one


class _OnServer:
    """An attribute of :class:`HTTPStores`' server, read and set through the stores object."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return getattr(obj._server, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._server, self.name, value)


class HTTPStores:
    """An HTTP server for the files below ``root``, on a loopback port, in a thread; with
    ``tls=(certificate file, key file)``, HTTPS."""

    def __init__(self, root: str | os.PathLike, tls: tuple[str, str] | None = None) -> None:
        self._server = _Server(os.fspath(root))
        scheme = "http"
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    #: the server's fault plan, requests seen, redirect target and stall (what tests set)
    faults = _OnServer()
    requests = _OnServer()
    redirect_to = _OnServer()
    stall_s = _OnServer()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HTTPStores:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def self_signed(folder: str | os.PathLike) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, written below ``folder``: (cert, key) paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


class S3Stores:
    """moto's S3-compatible server on a loopback port, with ``bucket`` created; ``put`` copies
    a local store into it. ``options`` are the ``storage_options`` that reach it."""

    def __init__(self, bucket: str = "data") -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = bucket
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}
        self.fs().mkdir(bucket)

    def fs(self, **extra):
        import s3fs

        return s3fs.S3FileSystem(**self.options, skip_instance_cache=True, **extra)

    def put(self, local: str | os.PathLike, name: str, public: bool = False, private: tuple = ()) -> str:
        """Copy the store at ``local`` to ``s3://bucket/name``; its URL. ``public``: readable
        without credentials, except the keys in ``private``."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        local = os.fspath(local)
        for folder, _, files in os.walk(local):
            for file in files:
                rel = os.path.relpath(os.path.join(folder, file), local).replace(os.sep, "/")
                extra = {"ACL": "public-read"} if public and rel not in private else {}
                with open(os.path.join(folder, file), "rb") as f:
                    client.put_object(Bucket=self.bucket, Key=f"{name}/{rel}", Body=f.read(), **extra)
        return f"s3://{self.bucket}/{name}"

    def close(self) -> None:
        self._server.stop()

    def __enter__(self) -> S3Stores:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    """``python tests/loopback.py ROOT``: serve ROOT over HTTP, print the URL, run until killed
    (a server in its own process, so that it does not share a client's interpreter lock)."""
    import sys

    server = HTTPStores(sys.argv[1])
    print(server.url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
