"""A streamed answer relayed inside the engine connection's ``data_received``.

Why: in front of an engine that streams one event per token, each event that arrives alone
wakes the sidecar, and what the wake does decides its CPU per request. Relayed by the
request's task, an event cost a future set in the upstream protocol, the task's step through
the ASGI chain, the upstream body's de-chunking in the reader, the relay, an ASGI message and
uvicorn's ``send`` (docs/sidecar.md, *What it costs*). Here the engine connection's protocol
is swapped, for the body of one answer, for a :class:`StreamTap` whose ``data_received``
de-chunks what came, passes it through the request's :class:`~rollpatch.serving.streaming.SseRelay`
and writes the events to the client's transport as one HTTP chunk: no task wakes per event.

What stays with the request's task (:meth:`StreamTap.run`): the answer's head and its last
body message (uvicorn's ``send``, so the server's response state — completion, keep-alive —
is its own), waiting for a slow client (backpressure: the engine connection stops reading
while the client's transport is over its high-water mark, and reads again once uvicorn says
it drained), and every way the stream ends: the engine's last chunk (the connection goes back
to the pool, its trailers read by :meth:`UpstreamResponse.piece`), the engine failing or
closing mid-answer, a client that leaves (its connection closed: the engine's is closed too,
so the engine stops generating).

Only for uvicorn's httptools server (the sidecar's, :func:`~.server.start_sidecar`) and a
``chunked`` engine answer (vLLM's, SGLang's and the built-in engine's streams);
:func:`client_of` returns None otherwise and the task relays as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..serving.streaming import SseRelay, _plain_events
from ..serving.upstream import MAX_LINE, UpstreamError, UpstreamResponse

__all__ = ["Ending", "StreamTap", "client_of", "hang_up", "tappable"]

_HEX = b"0123456789abcdefABCDEF"


def client_of(send: Any) -> Any | None:
    """uvicorn's httptools request cycle behind ``send`` (its ``transport``, ``flow`` and
    ``disconnected`` are what the tap writes through), or None for any other server."""
    cycle: Any = getattr(send, "__self__", None)
    if type(cycle).__name__ != "RequestResponseCycle" or not type(cycle).__module__.endswith(
        "httptools_impl"
    ):
        return None
    if cycle.response_complete or cycle.disconnected or not cycle.chunked_encoding:
        return None
    return cycle


def hang_up(send: Any) -> None:
    """Close the client's connection with its streamed answer incomplete (the engine broke it):
    what was written still goes out, then the client sees a cut stream, never a clean end.
    uvicorn is told the client is gone, so it does not log the answer's end as an error of the
    app's own (one ERROR line per broken stream); under another server the connection is closed
    by the server when the app returns, as before."""
    cycle = client_of(send)
    if cycle is not None:
        cycle.disconnected = True
        cycle.transport.close()


def tappable(resp: UpstreamResponse) -> bool:
    """A ``chunked`` answer (as the response parsed its head: not after a 204 or 304) whose
    connection is still open for the tap to take over."""
    return resp._chunked and resp._conn.transport is not None


class Ending:
    """Whether a stream's end reached its client before the client left (audit G-F1: an
    OpenAI client closes its connection right after ``[DONE]``, before the sidecar reads the
    engine's own end; counted as gone, those whole answers were left out of the latency
    histogram). :attr:`whole`: ``[DONE]`` was written to a client still connected."""

    __slots__ = ("cycle", "gone", "pending", "tapped", "whole")

    def __init__(self, gone: asyncio.Future[None], cycle: Any, *, tapped: bool) -> None:
        self.gone, self.cycle, self.tapped = gone, cycle, tapped
        self.whole = False
        self.pending = False  # the task's next send carries [DONE]

    def left(self) -> bool:
        """The client has gone (uvicorn's cycle knows at once; the watch a loop turn later;
        a watch cancelled by the proxy itself is no disconnect)."""
        cycle, gone = self.cycle, self.gone
        if cycle is not None and (cycle.disconnected or cycle.transport.is_closing()):
            return True
        return gone.done() and not gone.cancelled()

    def reached(self) -> None:
        """``[DONE]`` came from the engine; its event is written next: by the tap in this
        same call (which drops it for a client that left), else by the task's next send
        (checked after it: :meth:`sent`)."""
        self.whole = not self.left()
        self.pending = not self.tapped

    def sent(self) -> None:
        """The task's send returned: a ``[DONE]`` it carried reached a connected client."""
        if self.pending:
            self.pending = False
            self.whole = self.whole and not self.left()


class StreamTap(asyncio.Protocol):
    """The engine connection's protocol while one chunked SSE body is relayed (see the module
    docstring). :meth:`run` (the request's task) returns once the engine's last chunk has
    arrived (the connection is then the pool's :class:`_Conn` again, its trailers left to
    ``resp.piece()``), or raises :class:`UpstreamError` when the body broke or ended early;
    any other exception of the relay (the last event's annotation) is raised there too."""

    def __init__(self, resp: UpstreamResponse, relay: SseRelay, cycle: Any) -> None:
        self._resp, self._conn = resp, resp._conn
        self._relay, self._cycle = relay, cycle
        self._client = cycle.transport
        self._buf = bytearray()
        self._held: bytes | None = None  # the newest whole chunk of plain events, as it came
        self._need = 0  # bytes the buffered incomplete chunk needs in all
        self._error: BaseException | None = None
        self._ended = False
        self._paused = False
        self._wake: asyncio.Future[None] | None = None

    async def run(self) -> None:
        conn = self._conn
        transport = conn.transport
        assert transport is not None
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        transport.set_protocol(self)
        if conn.paused:  # the pool's reader had paused on a full buffer
            conn.paused = False
            transport.resume_reading()
        if conn.buf:  # body bytes that came with the head (maybe all of it)
            data = bytes(conn.buf)
            conn.buf.clear()
            self.data_received(data)
        if conn.eof:  # closed before the tap took over: broken unless the body was whole
            self._fail(UpstreamError("the engine closed the connection mid-answer"))
        try:
            while True:
                await self._wake
                if self._error is not None:
                    raise self._error
                if self._ended:
                    return
                self._wake = loop.create_future()
                if self._paused:  # the client's buffer is full: read on once it drains
                    await self._cycle.flow.drain()
                    self._paused = False
                    if not self._ended and self._error is None:
                        transport.resume_reading()
        finally:
            if transport.get_protocol() is self:
                transport.set_protocol(conn)
            if self._paused:  # the end came in the read that filled the client's buffer
                self._paused = False
                transport.resume_reading()
            self._flush_held()  # ended early: the relay abandons its last event

    # -- the engine connection's protocol ----------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._ended or self._error is not None:
            return
        try:
            relay = self._relay
            if not self._buf and not relay._partial and _whole_plain_chunk(data):
                # the common read: one chunk of whole events, none the end. It goes out as it
                # came (its framing is the client's too) when the next one arrives; the last
                # one before [DONE] is the relay's to annotate. What the relay holds (from a
                # read that took the general path) goes first, as the relay would send it
                ev = relay.abandon()  # what it holds, unannotated (it is not the last event)
                if ev:
                    self._write(b"%x\r\n%b\r\n" % (len(ev), ev))
                held, self._held = self._held, data
                if held is not None:
                    self._write(held)
                return
            self._flush_held()
            body, broken = self._dechunk(data)
            if body:
                out = self._relay.feed(body)
                if out:
                    self._write(b"%x\r\n%b\r\n" % (len(out), out))
            if broken is not None:  # after the chunks before it, as the engine sent them
                raise broken
        except BaseException as e:  # noqa: BLE001  (raised in the request's task)
            self._fail(e)

    def eof_received(self) -> bool:
        self._conn.eof = True
        self._fail(UpstreamError("the engine closed the connection mid-answer"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.connection_lost(exc)
        self._fail(UpstreamError("the engine closed the connection mid-answer"))

    # -- the relay ----------------------------------------------------------------------------

    def _flush_held(self) -> None:
        """The held chunk into the relay (which holds back its last event), the rest out."""
        held = self._held
        if held is not None:
            self._held = None
            out = self._relay.feed(held[held.find(b"\r\n") + 2 : -2])
            if out:
                self._write(b"%x\r\n%b\r\n" % (len(out), out))

    def _write(self, chunk: bytes) -> None:
        """One HTTP chunk to the client; past its high-water mark, the engine waits."""
        cycle = self._cycle
        if cycle.disconnected or self._client.is_closing():
            # the client left: the task's disconnect watch closes the engine connection
            return
        self._client.write(chunk)
        if cycle.flow.write_paused and not self._paused:
            self._paused = True
            transport = self._conn.transport
            if transport is not None:
                transport.pause_reading()
            self._signal()

    def _dechunk(self, data: bytes) -> tuple[bytes, UpstreamError | None]:
        """The payload of every complete chunk received, joined; at the last chunk the rest
        goes back to the pool's connection and :meth:`run` returns. The common read (whole
        chunks) is parsed in place; an incomplete tail waits in a buffer for the next. A
        malformed chunk is the error returned, with the payload of the chunks before it."""
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:  # a large chunk still arriving: no re-parse
                return b"", None
            data = bytes(self._buf)
            self._buf.clear()
        self._need = 0
        out: list[bytes] = []
        pos, n = 0, len(data)
        broken: UpstreamError | None = None
        try:
            pos = self._chunks(data, out)
        except UpstreamError as e:
            broken, pos = e, n
        if pos < n:
            self._buf += data[pos:]
        body = b"" if not out else out[0] if len(out) == 1 else b"".join(out)
        return body, broken

    def _chunks(self, data: bytes, out: list[bytes]) -> int:
        """Append the payload of each whole chunk of ``data`` to ``out``; returns where the
        unparsed rest begins."""
        pos, n = 0, len(data)
        while pos < n:
            nl = data.find(b"\r\n", pos, pos + MAX_LINE + 2)
            if nl < 0:
                if n - pos > MAX_LINE:
                    raise UpstreamError("chunk-size line from the engine is too long")
                break
            size = _chunk_size(data[pos:nl])
            if size == 0:  # the last chunk: its trailers are the pool reader's
                self._end(data[pos:])
                pos = n
                break
            end = nl + 2 + size
            if n < end + 2:
                self._need = end + 2 - pos
                break
            if data[end : end + 2] != b"\r\n":
                raise UpstreamError("a chunk from the engine does not end with CRLF")
            out.append(data[nl + 2 : end])
            pos = end + 2
        return pos

    def _end(self, rest: bytes) -> None:
        conn = self._conn
        conn.buf += rest
        if conn.transport is not None:
            conn.transport.set_protocol(conn)
        self._ended = True
        self._signal()

    def _fail(self, e: BaseException) -> None:
        if self._error is None and not self._ended:
            self._error = e
        self._signal()

    def _signal(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)


def _whole_plain_chunk(data: bytes) -> bool:
    """``data`` is one whole chunk (a size line of hex digits alone) of plain events
    (:func:`~rollpatch.serving.streaming._plain_events`: whole ``data:`` events, no
    ``[DONE]``), so it is valid as it is on the client's connection."""
    nl = data.find(b"\r\n", 0, 10)
    if nl <= 0 or data[:nl].strip(_HEX) or not data.endswith(b"\n\n\r\n"):
        return False
    return len(data) == nl + 4 + int(data[:nl], 16) and _plain_events(data[nl + 2 : -2])


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (hex digits, optional extensions after ``;``,
    surrounding whitespace), as the pool's reader parses it."""
    if 0 < len(line) <= 8 and line.isalnum():
        try:
            return int(line, 16)
        except ValueError:
            pass  # not hex: the general parse names the error
    text = line.split(b";", 1)[0].strip()
    try:
        return int(text, 16)
    except ValueError:
        raise UpstreamError(f"bad chunk size from the engine: {text[:40]!r}") from None
