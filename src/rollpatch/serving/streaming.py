"""Server-sent events at the edge: relay an upstream stream, own what it holds.

Both services pass an OpenAI stream through (the sidecar from its engine, the gateway from a
sidecar) and annotate its *last* data event (the versions it ran under; the island that
served it). :func:`relay_sse` does the pass-through once: each ``data:`` line becomes one
event, other lines (comments, keep-alives) are dropped, the last data event is held back and
handed to the caller's ``last_event`` before ``[DONE]`` (or the end), and an upstream failure
may end the stream with an error event (:func:`sse_data`).

:class:`OwnedStream` is a streaming response that owns what the stream holds (an admission
slot, the upstream response): its ``on_close`` runs however the response ends — sent in full,
the client gone before the first byte, an error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

__all__ = ["DONE", "OwnedStream", "relay_sse", "sse_data"]

#: The event that ends an OpenAI stream.
DONE = b"data: [DONE]\n\n"


def sse_data(obj: Any) -> bytes:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def relay_sse(
    lines: AsyncIterator[str],
    last_event: Callable[[bytes, bool], bytes],
    *,
    on_done: Callable[[], object] | None = None,
    failures: tuple[type[Exception], ...] = (),
    on_failure: Callable[[Exception], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The events of an upstream SSE stream (``lines``, as ``aiter_lines`` gives them).

    ``last_event(line, done)`` writes the last data event (``line`` is its ``data:`` line;
    ``done``: ``[DONE]`` followed it). ``on_done`` runs when ``[DONE]`` arrives, before that
    event is written. An exception of ``failures`` from ``lines`` ends the stream: the held
    event goes out as it came, then ``on_failure(error)`` (nothing when None).
    """
    held: bytes | None = None
    try:
        async for line in lines:
            raw = line.encode()
            if not raw.startswith(b"data:"):
                continue
            if raw[5:].strip() == b"[DONE]":
                if on_done is not None:
                    on_done()
                if held is not None:
                    yield last_event(held, True)
                    held = None
                yield DONE
                continue
            if held is not None:
                yield held + b"\n\n"
            held = raw
        if held is not None:
            yield last_event(held, False)
    except failures as e:
        if held is not None:
            yield held + b"\n\n"
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
