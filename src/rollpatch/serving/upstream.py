"""The hot path's HTTP/1.1 client to one upstream (the sidecar's engine): pooled keep-alive
connections on asyncio protocols, the body handed on as it arrives.

Why not httpx here: profiled behind a real engine, httpx + httpcore + anyio cost the sidecar
more CPU per streamed request than everything else it did (cancel scopes, locks and async
iterators per chunk, line decoding to ``str``). This client does only what a proxy's hop to
a known engine needs, within bounds:

- requests with a body of bytes; responses framed by ``Content-Length``, ``chunked`` or the
  connection's end; ``1xx`` answers skipped;
- a response head is at most :data:`MAX_HEAD` bytes, a chunk-size line at most
  :data:`MAX_LINE`; anything else malformed is an :class:`UpstreamError`, never a hang;
- at most ``max_connections`` open at once (the others wait); idle ones are kept for
  ``keepalive_expiry_s``, and a request that finds its pooled connection closed before any
  byte of the answer is sent once more on a new one (generation has no side effects);
- reading pauses while ``MAX_BUFFER`` bytes wait unread (a slow client slows the engine's
  socket, not the sidecar's memory).

The client must be used from one event loop (the server's).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from ..errors import ConfigError
from .http1 import MAX_HEAD, MAX_LINE, UpstreamError, UpstreamResponse, _Conn, _Stale

__all__ = ["MAX_HEAD", "MAX_LINE", "Upstream", "UpstreamError", "UpstreamResponse"]


class Upstream:
    """Pooled HTTP/1.1 connections to ``base_url`` (``http://`` or ``https://``)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_s: float,
        max_connections: int,
        keepalive_expiry_s: float = 5.0,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError("the upstream URL must be http(s)://HOST[:PORT]", value=base_url)
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        self._prefix = u.path.rstrip("/")
        netloc = u.netloc.rsplit("@", 1)[-1]
        self._host_header = netloc.encode("idna") if not netloc.isascii() else netloc.encode()
        self.connect_s = connect_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: list[_Conn] = []
        self._max = max_connections
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        self.opened = 0  #: connections opened (the sidecar's engine_connections_opened)
        #: Sent with every request (the engine's ``Authorization``).
        self.headers = list(headers)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> UpstreamResponse:
        """Send one request and read the answer's head (the body is read from the answer)."""
        if self._closed:
            raise UpstreamError("the upstream client is closed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max)
        await self._slots.acquire()
        try:
            head = self._head(method, path, len(body), headers)
            conn = self._pooled()
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body, reused=True)
                except _Stale:
                    pass  # closed while idle: once more on a new connection
            return await self._exchange(await self._connect(), head, body, reused=False)
        except BaseException:
            self._slots.release()
            raise

    def _head(
        self, method: str, path: str, length: int, headers: Sequence[tuple[bytes, bytes]]
    ) -> bytes:
        lines = [
            f"{method} {self._prefix}{path} HTTP/1.1".encode(),
            b"host: " + self._host_header,
            b"content-length: " + str(length).encode(),
        ]
        lines += [k + b": " + v for k, v in (*self.headers, *headers)]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _pooled(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.alive() and now - conn.idle_since < self.keepalive_expiry_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    _Conn,
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None,
                ),
                self.connect_s,
            )
        except asyncio.TimeoutError:
            raise UpstreamError(f"connect timeout after {self.connect_s:g} s") from None
        except OSError as e:
            raise UpstreamError(f"cannot connect: {e}") from None
        self.opened += 1
        return conn

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, reused: bool
    ) -> UpstreamResponse:
        assert conn.transport is not None
        try:
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            status, headers = await self._read_head(conn)
        except UpstreamError:
            conn.close()
            if reused and not conn.buf:
                raise _Stale("the pooled connection was closed") from None
            raise
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, conn, status, headers)

    async def _read_head(self, conn: _Conn) -> tuple[int, list[tuple[bytes, bytes]]]:
        while True:
            end = conn.buf.find(b"\r\n\r\n", 0, MAX_HEAD)
            if end < 0:
                if len(conn.buf) >= MAX_HEAD:
                    raise UpstreamError(f"response head from the engine is over {MAX_HEAD} bytes")
                await conn.more()
                continue
            raw = bytes(conn.buf[:end])
            del conn.buf[: end + 4]
            lines = raw.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                raise UpstreamError(f"bad status line from the engine: {lines[0][:60]!r}")
            status = int(parts[1])
            headers = []
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not name or name != name.strip():
                    raise UpstreamError(f"bad header line from the engine: {line[:60]!r}")
                headers.append((name.lower(), value.strip()))
            if 100 <= status < 200:
                continue  # 100 Continue and friends: the real answer follows
            return status, headers

    def _release(self, conn: _Conn, keep: bool) -> None:
        if self._slots is not None:
            self._slots.release()
        if keep and not self._closed and conn.alive():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Close every idle connection; answers still open close their own."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
