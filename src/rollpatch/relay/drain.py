"""The relay's shutdown drain (``rollpatch relay --shutdown-grace``): :class:`Draining`, the
state, and :class:`DrainGate`, the ASGI middleware that counts the board reads in flight
(``/v1/``: an object's body counts until its last byte is sent) and, once
:meth:`Draining.start` is called, answers new ones ``503`` "the relay
is shutting down" with ``Retry-After: 1`` (a follower's relay client retries a 503 with backoff:
docs/store.md) and ``/health`` ``503`` ``{"status": "draining"}`` (a load balancer stops
sending), while the reads in flight, keyframes included, run to their end. ``/metrics`` stays
open. Before, a SIGTERM gave in-flight bodies uvicorn's 2 s and cut the rest.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..serving.admission import wait_drained
from ..serving.responses import error_body

__all__ = ["DrainGate", "Draining"]

_REFUSAL = "the relay is shutting down; retry (another relay, or this one once restarted)"


class Draining:
    """The relay's reads in flight, and whether it drains (module docstring); safe from any
    thread."""

    def __init__(self) -> None:
        self.draining = False
        self._lock = threading.Lock()
        self._inflight = 0

    def inflight(self) -> int:
        """Board reads (``/v1/``) being answered now."""
        with self._lock:
            return self._inflight

    def start(self) -> None:
        """Refuse new reads from now on (the ones in flight go on)."""
        with self._lock:
            self.draining = True

    def wait(self, grace_s: float, stop: threading.Event | None = None) -> bool:
        """:meth:`start`, then wait up to ``grace_s`` for the reads in flight to end (``stop``
        set cuts it short); True when none is left."""
        self.start()
        return wait_drained(self.inflight, grace_s, stop)

    def admit(self) -> bool:
        """Count a read in, unless draining (then False: refuse it)."""
        with self._lock:
            if self.draining:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._inflight -= 1


class DrainGate:
    """ASGI middleware of :class:`Draining` (module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: Draining) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/health" and self.state.draining:
            await _refuse(send, path)
            return
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if not self.state.admit():
            await _refuse(send, path)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()


async def _refuse(send: Any, path: str) -> None:
    """503: ``{"status": "draining"}`` for ``/health``, the error body for a read."""
    if path == "/health":
        doc: dict[str, Any] = {"status": "draining"}
    else:
        doc = error_body(503, _REFUSAL, "unavailable", hint="the relay got SIGTERM or SIGINT")
    body = json.dumps(doc).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
