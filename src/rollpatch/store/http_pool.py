"""Keep-alive connections for the relay client (:class:`~rollpatch.store.http_client.HttpStore`).

A follower's sync is a handful of small requests (LATEST, a listing, manifests) and a few
objects, and a relay's upstream reads cross a WAN: opening a TCP connection per request (and a
TLS session, with ``https``) costs one to three round trips each time. The pool keeps idle
connections and reuses them; a reused connection the server closed meanwhile (its idle
timeout) is retried once at once on a new one, before any byte of the answer was read.

Stdlib only (``http.client``, ``ssl``). TLS trusts the default verify paths
(``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` and the system store), read when the first ``https``
connection opens. Proxies come from the standard environment variables, as urllib reads them
(``http_proxy``, ``https_proxy``, ``no_proxy``): ``http`` requests go to the proxy in absolute
form, ``https`` through a ``CONNECT`` tunnel (TLS end to end with the relay). Credentials in
a proxy URL are not supported.

:class:`Held` is the long-poll's connection: one request at a time that the server may hold for
many seconds, on a connection of its own (a held request never blocks the pool's), which
another thread can cancel at once (a follower stopping, or told to poll now).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Mapping
from types import TracebackType

__all__ = ["Held", "HttpStatusError", "Pool", "Response"]

#: Idle connections kept per pool (a follower fetches with a few threads at once).
MAX_IDLE = 16
#: The most of an error answer's body that is read (the relay's are a few hundred bytes).
MAX_ERROR_BYTES = 64 * 1024

_STALE = (ConnectionResetError, BrokenPipeError, http.client.BadStatusLine)


class HttpStatusError(Exception):
    """An answer with a status of 300 or more: its code, headers and (bounded) body."""

    def __init__(self, code: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        super().__init__(f"HTTP {code}")
        self.code, self.headers, self.body = code, headers, body


class Response:
    """A 2xx answer on a pooled connection; closing it hands the connection back when its
    body was read to the end (else the connection is closed: a body is never drained)."""

    def __init__(
        self, pool: Pool, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse
    ):
        self._pool, self._resp = pool, resp
        self._conn: http.client.HTTPConnection | None = conn
        self.status, self.headers = resp.status, resp.headers

    def read(self, n: int | None = None) -> bytes:
        return self._resp.read() if n is None else self._resp.read(n)

    def close(self) -> None:
        if self._conn is None:
            return
        conn, resp, self._conn = self._conn, self._resp, None
        if resp.length == 0 and not resp.isclosed():
            resp.read()  # a HEAD or an empty body: nothing left, finish it
        if resp.isclosed() and not resp.will_close:
            self._pool.give(conn)
        else:
            resp.close()
            conn.close()

    def __enter__(self) -> Response:  # noqa: PYI034 (typing.Self needs 3.11)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Pool:
    """Idle keep-alive connections to one ``http(s)://host[:port]`` (thread-safe)."""

    def __init__(self, base_url: str, timeout: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port
        self.timeout = timeout
        #: ``(host, port)`` of the proxy from the environment, or None (direct).
        self.proxy = _proxy_for(parts.scheme, self.host)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        #: Connections opened so far (tests and metrics: reuse keeps this small).
        self.opened = 0

    def request(self, method: str, target: str, headers: Mapping[str, str]) -> Response:
        """Send one request; a 2xx answer as a :class:`Response`, else
        :class:`HttpStatusError`. Network errors propagate (``OSError``,
        ``http.client.HTTPException``, ``TimeoutError``)."""
        conn, reused = self._take()
        while True:
            try:
                conn.request(method, self.absolute(target), headers=dict(headers))
                resp = conn.getresponse()
                break
            except _STALE:
                conn.close()
                if not reused:
                    raise
                conn, reused = self._open(), False  # the server closed it while idle
            except BaseException:
                conn.close()
                raise
        if resp.status < 300:
            return Response(self, conn, resp)
        try:
            body = resp.read(MAX_ERROR_BYTES + 1)
        except (OSError, http.client.HTTPException):
            body = b""
        Response(self, conn, resp).close()
        raise HttpStatusError(resp.status, resp.headers, body)

    def absolute(self, target: str) -> str:
        """``target`` as sent: in absolute form to an ``http`` proxy, else as it is."""
        if self.proxy is not None and not self.https and target.startswith("/"):
            return self._origin + target
        return target

    def give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._open(), False

    def open(self) -> http.client.HTTPConnection:
        """A new connection (not pooled), through the proxy if one applies."""
        return self._open()

    def _open(self) -> http.client.HTTPConnection:
        self.opened += 1
        host, port = self.proxy if self.proxy is not None else (self.host, self.port)
        if not self.https:
            return http.client.HTTPConnection(host, port, timeout=self.timeout)
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._ssl)
        if self.proxy is not None:
            conn.set_tunnel(self.host, self.port)  # TLS with the relay, through CONNECT
        return conn


class Held:
    """A connection of its own for requests the server may hold (the relay's long-poll of
    LATEST); :meth:`cancel` from another thread ends the request in progress at once, or the
    next one if none is in progress (a cancel is never lost to a race)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._cancelled = False

    def get(
        self, target: str, headers: Mapping[str, str], timeout: float, max_bytes: int
    ) -> tuple[http.client.HTTPMessage, bytes] | None:
        """GET ``target``; the 2xx answer's headers and body (at most ``max_bytes + 1`` bytes
        read), or None when cancelled. Raises :class:`HttpStatusError` and network errors."""
        for attempt in range(2):
            with self._lock:
                if self._cancelled:
                    self._cancelled = False
                    return None
                reused = self._conn is not None
                conn = self._conn = self._conn or self._pool.open()
            try:
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.request("GET", self._pool.absolute(target), headers=dict(headers))
                resp = conn.getresponse()
                body = resp.read(max_bytes + 1) if resp.status < 300 else resp.read(MAX_ERROR_BYTES)
            except (OSError, http.client.HTTPException):
                with self._lock:
                    self._conn = None
                    cancelled, self._cancelled = self._cancelled, False
                conn.close()
                if cancelled:
                    return None
                if reused and attempt == 0:
                    continue  # the server closed it while idle: once more on a new one
                raise
            if resp.will_close or not resp.isclosed():
                with self._lock:
                    self._conn = None
                conn.close()
            if resp.status >= 300:
                raise HttpStatusError(resp.status, resp.headers, body)
            return resp.headers, body
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        """End the request in progress (its :meth:`get` returns None), or the next one."""
        with self._lock:
            self._cancelled = True
            conn = self._conn
        sock = None if conn is None else conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _proxy_for(scheme: str, host: str) -> tuple[str, int | None] | None:
    """The proxy the environment names for ``scheme`` (None: none, or ``no_proxy`` bypasses
    ``host``), as ``urllib.request`` would choose it."""
    url = urllib.request.getproxies_environment().get(scheme)
    if not url or not host or urllib.request.proxy_bypass(host):
        return None
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or 80
