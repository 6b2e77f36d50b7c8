"""One HTTP/1.1 connection to an upstream and the response read from it, within bounds (the
wire side of :mod:`rollpatch.serving.upstream`, whose pool owns the connections): the size
limits, the chunked framing, the asyncio protocol and :class:`UpstreamResponse`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from .upstream import Upstream

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
