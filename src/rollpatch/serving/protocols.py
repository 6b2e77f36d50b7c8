"""The HTTP/1.1 protocols a rollpatch server runs under uvicorn, each with the slow-client
guards of :class:`~rollpatch.serving.server.ServeOptions`.

Two parsers, one set of guards (:data:`HttpKind`):

- ``"h11"``: uvicorn's pure-Python h11 protocol (every service's default);
- ``"fast"``: uvicorn's httptools protocol (llhttp, C) when httptools is installed (the
  ``web`` extra installs it), h11 otherwise. The sidecar runs on it: profiled behind an engine,
  h11's per-event bookkeeping (its state machine on every streamed event, the event objects,
  the header checks) was the largest part of the proxy's CPU per request after the loop's
  wake-ups.

The guards, the same on both (tests/test_serving_guards.py runs each on each):

- **head deadline**: a connection must deliver a complete request head within
  ``header_timeout_s`` of connecting (or of its first byte after a keep-alive pause), else it
  gets ``408`` and is closed;
- **head size**: a head over ``max_header_bytes`` gets ``400`` and is closed, never buffered
  (h11: its incomplete-event bound; httptools: at most the remaining budget of bytes is handed
  to the parser while a head is open);
- **early answer**: an answer sent before the request's body was read in full (a refusal)
  closes the connection, so a body still trickling in cannot hold it;
- **lingering close** after a 408, a 400 or an early answer: the answer and a FIN go out, what the
  client still sends is read and dropped until it closes its side or for at most
  :data:`LINGER_S`, then the socket closes. Closing at once with bytes unread makes the kernel
  answer with a reset, and the client loses the answer it had not read yet (an oversized
  upload saw ``Connection reset by peer``, not its 413); RFC 9112 §9.6, nginx's
  ``lingering_close``;
- ``TCP_NODELAY`` on every TCP connection.

Idle keep-alive (``timeout_keep_alive``), the connection bound (``limit_concurrency``: 503)
and pipelining (answered in order) are uvicorn's, on both.
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Any, Literal

__all__ = ["HttpKind", "guarded_protocol", "http_name"]

#: The HTTP/1.1 parser a server runs: h11, or httptools when installed (``"fast"``).
HttpKind = Literal["h11", "fast"]

TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
    b"content-length: 32\r\nconnection: close\r\n\r\nrequest head not received in time"
)
_HEAD_TOO_LARGE = "request head is over the limit"
#: Longest a connection lingers after its last answer (see the module docstring).
LINGER_S = 3.0


def http_name(kind: HttpKind) -> Literal["h11", "httptools"]:
    """The parser ``kind`` runs on this installation."""
    if kind == "fast" and importlib.util.find_spec("httptools") is not None:
        return "httptools"
    return "h11"


def no_delay(transport: Any) -> None:
    """TCP_NODELAY on a TCP connection: h11 writes an answer's head and body separately, and
    with Nagle's algorithm the body waited for the client's delayed ACK of the head (40 ms
    on Linux) — on every small answer (LATEST, manifests, JSON), measured on loopback."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone; the protocol sees that next
            pass


def guarded_protocol(kind: HttpKind, header_timeout_s: float, max_header_bytes: int) -> type:
    """uvicorn's protocol class for ``kind`` with the guards of the module docstring."""
    if http_name(kind) == "httptools":
        return _guarded_httptools(header_timeout_s, max_header_bytes)
    return _guarded_h11(header_timeout_s)


class _HeadDeadline:
    """The head deadline's timer, for a uvicorn protocol class (``loop``, ``_head_late``):
    armed on connecting and by a byte while a head is due, disarmed when the head ends."""

    _head_timeout_s = 10.0
    _head_timer: Any = None
    _linger_timer: Any = None  # set while lingering: what arrives is dropped
    loop: Any
    transport: Any
    _unset_keepalive_if_required: Any  # uvicorn's, on both protocols

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        raise NotImplementedError

    def _close_lingering(self) -> None:
        """Close after the last answer has been written: FIN now, the socket at the client's
        EOF (asyncio closes the transport when ``eof_received`` returns None, as uvicorn's
        does) or after :data:`LINGER_S`."""
        transport = self.transport
        if transport.is_closing() or self._linger_timer is not None:
            return
        self._disarm()
        self._unset_keepalive_if_required()  # the linger is the bound now, not keep-alive
        # a request still being answered on this connection (a head that broke after its
        # body, e.g. a Content-Length shorter than the body sent) can write nothing more: its
        # cycle is told the client is gone, as uvicorn's immediate close would tell it,
        # instead of failing in write() after the FIN with a traceback in the log
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not transport.can_write_eof():  # TLS: its close_notify ends the stream
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()  # a refused body may have paused reading
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head it cannot parse (or one over the bound), then a
        lingering close instead of uvicorn's immediate one (the client may still be sending
        the rest of that head)."""
        body = msg.encode("ascii", "replace")
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self._close_lingering()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        no_delay(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]


def _guarded_h11(header_timeout_s: float) -> type:
    """h11 (its head bound is uvicorn's ``h11_max_incomplete_event_size``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(_HeadDeadline, H11Protocol):
        _head_timeout_s = header_timeout_s

        def data_received(self, data: bytes) -> None:
            if self._linger_timer is not None:
                return
            if self.conn.their_state is h11.IDLE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            # the state of the request just answered (after super(), a pipelined next one's)
            reading_body = self.conn.their_state is h11.SEND_BODY
            super().on_response_complete()
            # answered before the body was read (a refusal): a body still trickling in would
            # hold the connection, so it is closed instead of being drained
            if reading_body:
                self._close_lingering()

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(TIMEOUT_408)
                    self._close_lingering()
                else:  # an answer is still being written: cut it
                    self.transport.close()

    return GuardedH11


def _guarded_httptools(header_timeout_s: float, max_header_bytes: int) -> type:
    """httptools, with the head's state tracked from the parser's callbacks. The deadline is
    armed by any byte that arrives while a head is due, as with h11 (so blank lines cannot
    hold a connection either), and disarmed when a head ends."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(_HeadDeadline, HttpToolsProtocol):
        _head_timeout_s = header_timeout_s
        _head_open = True  # between messages or inside a head
        _head_bytes = 0  # received since the last message ended

        def data_received(self, data: bytes) -> None:
            if self._linger_timer is not None:
                return
            if not self._head_open:
                super().data_received(data)
                return
            self._arm()  # a head is due: it has header_timeout_s from its first byte
            budget = max_header_bytes - self._head_bytes
            if len(data) <= budget:
                self._head_bytes += len(data)
                super().data_received(data)
                return
            # only the budget may be parsed as head; the rest once the head has ended
            self._head_bytes = max_header_bytes
            super().data_received(data[:budget])
            if self.transport.is_closing() or self.parser is None:
                return
            if self._head_open:
                self._refuse_head()
            else:
                self.data_received(data[budget:])

        def _refuse_head(self) -> None:
            self._disarm()
            self.send_400_response(_HEAD_TOO_LARGE)

        def on_headers_complete(self) -> None:
            self._head_open = False
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._head_open, self._head_bytes = True, 0
            super().on_message_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle  # the newest request; when answered, it is the one just answered
            super().on_response_complete()
            # answered before its body was read (a refusal): see GuardedH11. An older answer
            # of pipelined requests completing does not count: its body had been read
            if cycle is not None and cycle.response_complete and cycle.more_body:
                self._close_lingering()

        def _head_late(self) -> None:
            self._head_timer = None
            if self._head_open and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(TIMEOUT_408)
                    self._close_lingering()
                else:  # an answer is still being written: cut it
                    self.transport.close()

    return GuardedHttpTools
