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
from collections.abc import AsyncIterator, Sequence
from typing import cast
from urllib.parse import urlsplit

from ..errors import ConfigError

__all__ = ["MAX_HEAD", "MAX_LINE", "Upstream", "UpstreamError", "UpstreamResponse"]

#: Largest response head accepted (status line and headers), in bytes.
MAX_HEAD = 64 * 1024
#: Longest chunk-size line (with extensions) or trailer line accepted, in bytes.
MAX_LINE = 4096
#: Unread bytes buffered per connection before reading pauses.
MAX_BUFFER = 1 << 20


def _chunk_size(buf: bytearray, nl: int) -> int:
    """The size on the chunk-size line ``buf[:nl]`` (hex digits, optional extensions after
    ``;``, surrounding whitespace). The common line (hex digits alone) is read without a copy
    or a split; anything else takes the general parse, which gives the same size or error."""
    if 0 < nl <= 8 and buf[:nl].isalnum():
        try:
            return int(buf[:nl], 16)
        except ValueError:
            pass  # not hex: the general parse names the error
    size_text = bytes(buf[:nl]).split(b";", 1)[0].strip()
    try:
        return int(size_text, 16)
    except ValueError:
        raise UpstreamError(f"bad chunk size from the engine: {size_text[:40]!r}") from None


class UpstreamError(Exception):
    """The upstream could not be reached, or its answer broke HTTP/1.1."""


class _Stale(UpstreamError):
    """A pooled connection closed before any byte of the answer (safe to send again)."""


class _Conn(asyncio.Protocol):
    """One connection: bytes received wait in :attr:`buf` until the reader takes them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.paused = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP (or TLS) transport; uvloop's are not asyncio.Transport subclasses
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > MAX_BUFFER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def more(self) -> None:
        """Wait for bytes beyond what :attr:`buf` holds (UpstreamError at the end)."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if self.eof:
            raise UpstreamError("the engine closed the connection mid-answer")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def alive(self) -> bool:
        t = self.transport
        return not self.eof and t is not None and not t.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """One answer: :attr:`status`, :attr:`headers` (lower-case names), then the body through
    :meth:`read` or :meth:`chunks`; :meth:`close` (always) gives the connection back."""

    def __init__(
        self, pool: Upstream, conn: _Conn, status: int, headers: list[tuple[bytes, bytes]]
    ):
        self.status = status
        self.headers = headers
        self._pool, self._conn = pool, conn
        self._done = False
        self._closed = False
        te = self.header(b"transfer-encoding")
        length = self.header(b"content-length")
        self._keep = (self.header(b"connection") or b"").lower() != b"close"
        self._chunked = te is not None and b"chunked" in te.lower()
        self._left: int | None = None
        if not self._chunked and length is not None:
            if not length.strip().isdigit():
                raise UpstreamError(f"bad Content-Length from the engine: {length[:40]!r}")
            self._left = int(length)
        elif not self._chunked:
            self._keep = False  # the body ends with the connection
        if status in (204, 304):
            self._left, self._chunked = 0, False

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while part := await self.piece():
            parts.append(part)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (each piece is what one or more reads brought)."""
        while part := await self.piece():
            yield part

    async def piece(self) -> bytes:
        """The next part of the body: every byte of it that has arrived, at least one (``b""``
        once the body has ended). A proxy's per-event call: no generator, and the chunks
        one read brought come out as one piece."""
        if self._done:
            return b""
        c = self._conn
        if self._chunked:
            while True:
                if c.buf:  # an empty buffer (the common case between events): wait first
                    part = self._dechunk()
                    if part or self._done:
                        return part
                await c.more()
        if self._left is not None:
            if self._left == 0:
                self._done = True
                return b""
            while not c.buf:
                await c.more()
            part = bytes(c.buf[: self._left])
            del c.buf[: len(part)]
            self._left -= len(part)
            self._done = self._left == 0
            return part
        while not c.buf:  # the body ends with the connection
            if c.eof:
                self._done = True
                return b""
            try:
                await c.more()
            except UpstreamError:
                self._done = True
                return b""
        part = bytes(c.buf)
        c.buf.clear()
        return part

    def _dechunk(self) -> bytes:
        """Every complete chunk buffered, joined (``b""`` when none); :attr:`_done` at the
        last chunk and its trailers."""
        c = self._conn
        out: list[bytes] = []
        while True:
            nl = c.buf.find(b"\r\n", 0, MAX_LINE + 2)
            if nl < 0:
                if len(c.buf) > MAX_LINE:
                    raise UpstreamError("chunk-size line from the engine is too long")
                break
            size = _chunk_size(c.buf, nl)
            if size == 0:
                end = c.buf.find(b"\r\n\r\n", nl)
                if end < 0:  # trailers (rare) not complete yet
                    if len(c.buf) > MAX_HEAD:
                        raise UpstreamError("chunked trailer from the engine is too long")
                    break
                del c.buf[: end + 4]
                self._done = True
                break
            if len(c.buf) < nl + 2 + size + 2:
                break
            if c.buf[nl + 2 + size : nl + 4 + size] != b"\r\n":
                raise UpstreamError("a chunk from the engine does not end with CRLF")
            out.append(bytes(c.buf[nl + 2 : nl + 2 + size]))
            del c.buf[: nl + 4 + size]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def abort(self) -> None:
        """Close the connection now (the reader sees its end); no-op once closed."""
        if not self._closed:
            self._conn.close()

    def close(self) -> None:
        """Give the connection back (kept alive when the answer was read in full)."""
        if self._closed:
            return
        self._closed = True
        self._pool._release(self._conn, self._done and self._keep and not self._conn.buf)


class Upstream:
    """Pooled HTTP/1.1 connections to ``base_url`` (``http://`` or ``https://``)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_s: float,
        max_connections: int,
        keepalive_expiry_s: float = 5.0,
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
        lines += [k + b": " + v for k, v in headers]
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
