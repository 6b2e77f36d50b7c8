"""Server-sent events at the edge: relay an upstream stream, own what it holds.

Both services pass an OpenAI stream through (the sidecar from its engine, the gateway from a
sidecar) and annotate its *last* data event (the versions it ran under; the island that
served it). :class:`SseRelay` does the pass-through once, on bytes as they arrive: each
``data:`` line becomes one event, other lines (comments, keep-alives) are dropped, the last
data event is held back and handed to the caller's ``last_event`` before ``[DONE]`` (or the
end). :func:`relay_sse` runs it over an iterator of lines (the gateway's), where an upstream
failure may end the stream with an error event (:func:`sse_data`).

:class:`OwnedStream` is a streaming response that owns what the stream holds (an admission
slot, the upstream response): its ``on_close`` runs however the response ends — sent in full,
the client gone before the first byte, an error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

__all__ = ["DONE", "OwnedStream", "SseRelay", "relay_sse", "sse_data"]

#: The event that ends an OpenAI stream.
DONE = b"data: [DONE]\n\n"


def sse_data(obj: Any) -> bytes:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class SseRelay:
    """The pass-through of one SSE stream, fed with bytes as they arrive (any split).

    :meth:`feed` returns what may be sent now: each ``data:`` line as one event, other lines
    (comments, keep-alives, blank lines) dropped, the newest data event held back. When
    ``[DONE]`` arrives, ``on_done`` runs, the held event goes out through ``last_event(line,
    True)``, then ``[DONE]``; :meth:`finish` ends a stream that stopped without it
    (``last_event(line, False)``). Nothing is parsed but the line structure, so per chunk it
    costs a split and a join, not a JSON round trip.
    """

    def __init__(
        self,
        last_event: Callable[[bytes, bool], bytes],
        on_done: Callable[[], object] | None = None,
    ) -> None:
        self._last_event = last_event
        self._on_done = on_done
        self._partial = b""
        self._held: bytes | None = None

    def feed(self, block: bytes) -> bytes:
        """The events completed by ``block``, joined (b"" when none may go out yet).

        The common block (whole events of one ``data:`` line each, as engines write them) goes
        out as the bytes that came, less its last event, which is held back (scanned by
        ``bytes`` methods, not split into lines); anything else takes :meth:`events`."""
        data = self._partial + block if self._partial else block
        if _plain_events(data):
            self._partial = b""
            return self._pass(data)
        done = data.find(b"data: [DONE]")  # the end, often in one read with events before it
        if done > 0 and _plain_events(data[:done]):
            self._partial = b""
            return self._pass(data[:done]) + b"".join(self.events(data[done:]))
        return b"".join(self.events(block))

    def _pass(self, data: bytes) -> bytes:
        """Plain events (:func:`_plain_events`) out as they came, the last one held."""
        i = data.rfind(b"\n\n", 0, len(data) - 2)
        cut = 0 if i < 0 else i + 2
        held, self._held = self._held, data[cut:-2]
        if held is None:
            return data[:cut]
        return held + b"\n\n" + data[:cut]

    def events(self, block: bytes) -> list[bytes]:
        """The events completed by ``block``, one item each."""
        if b"\r" in block:  # CR and CRLF end lines too; the blank lines this adds are dropped
            block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = (self._partial + block).split(b"\n") if self._partial else block.split(b"\n")
        self._partial = lines.pop()
        out: list[bytes] = []
        for line in lines:
            self._line(line, out)
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line.startswith(b"data:"):
            return
        held = self._held
        if line[5:].strip() == b"[DONE]":
            if self._on_done is not None:
                self._on_done()
            if held is not None:
                out.append(self._last_event(held, True))
                self._held = None
            out.append(DONE)
            return
        if held is not None:
            out.append(held + b"\n\n")
        self._held = line

    def finish(self) -> bytes:
        """The end of the upstream stream: an unterminated last line, then the held event."""
        return b"".join(self.finish_events())

    def finish_events(self) -> list[bytes]:
        """:meth:`finish`, one item per event."""
        out: list[bytes] = []
        if self._partial:
            self._line(self._partial, out)
            self._partial = b""
        if self._held is not None:
            out.append(self._last_event(self._held, False))
            self._held = None
        return out

    def abandon(self) -> bytes:
        """The upstream failed: the held event as it came (not annotated), nothing after."""
        held, self._held = self._held, None
        return b"" if held is None else held + b"\n\n"


def _plain_events(data: bytes) -> bool:
    """``data`` is whole events, each one ``data:`` line and a blank line, none ``[DONE]``
    (JSON strings hold no raw line breaks, so a payload cannot fake a line start)."""
    if not data.endswith(b"\n\n") or not data.startswith(b"data:"):
        return False
    n = data.count(b"\n\n")
    return (
        data.count(b"\n") == 2 * n
        and data.count(b"\n\ndata:") == n - 1
        and b"\r" not in data
        and b"[DONE]" not in data
    )


async def relay_sse(
    lines: AsyncIterator[str],
    last_event: Callable[[bytes, bool], bytes],
    *,
    on_done: Callable[[], object] | None = None,
    failures: tuple[type[Exception], ...] = (),
    on_failure: Callable[[Exception], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The events of an upstream SSE stream (``lines``, as ``aiter_lines`` gives them), one
    :class:`SseRelay` event at a time.

    ``last_event(line, done)`` writes the last data event (``line`` is its ``data:`` line;
    ``done``: ``[DONE]`` followed it). ``on_done`` runs when ``[DONE]`` arrives, before that
    event is written. An exception of ``failures`` from ``lines`` ends the stream: the held
    event goes out as it came, then ``on_failure(error)`` (nothing when None).
    """
    relay = SseRelay(last_event, on_done)
    try:
        async for line in lines:
            for event in relay.events(line.encode() + b"\n"):
                yield event
        for event in relay.finish_events():
            yield event
    except failures as e:
        held = relay.abandon()
        if held:
            yield held
        if on_failure is not None:
            yield on_failure(e)


class OwnedStream(StreamingResponse):
    """A ``text/event-stream`` response whose ``on_close`` runs however it ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
