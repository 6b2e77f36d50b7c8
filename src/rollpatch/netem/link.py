""":class:`Link`: the link emulator on its own thread, for synchronous code and tests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ..errors import ConfigError
from .config import LinkConfig, LinkStats
from .proxy import AsyncLink

__all__ = ["Link"]

#: How long starting or closing may take before the link gives up on its thread.
_CONTROL_TIMEOUT_S = 30.0


class Link:
    """A TCP link emulator listening on loopback and forwarding to ``upstream``.

    ::

        with Link(upstream=("127.0.0.1", 8000), latency_ms=25, mbps=1000) as link:
            url = f"http://127.0.0.1:{link.port}/"

    Takes a :class:`LinkConfig`, or its fields as keywords. ``start()`` (or ``with``) listens;
    ``close()`` stops accepting and closes every connection through the link. The event loop
    runs on a daemon thread, so the caller's thread never blocks on the link.
    """

    def __init__(self, config: LinkConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise ConfigError(
                "give Link a LinkConfig or its fields, not both", fields=sorted(fields)
            )
        self.config = config if config is not None else LinkConfig(**fields)
        if not isinstance(self.config, LinkConfig):
            raise ConfigError("Link needs a LinkConfig", value=type(self.config).__name__)
        self._core = AsyncLink(self.config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the link listens on."""
        return self._core.address

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        """The port to connect to instead of the upstream's."""
        return self.address[1]

    @property
    def url(self) -> str:
        """``http://host:port`` of the link (for HTTP upstreams)."""
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def stats(self) -> LinkStats:
        """Connections and bytes through the link so far."""
        return self._core.stats()

    def start(self) -> Link:
        """Listen (idempotent); :class:`ConfigError` when the address cannot be bound."""
        with self._lock:
            if self._loop is not None:
                return self
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever,
                daemon=True,
                name=f"rollpatch-netem-{self.config.upstream[1]}",
            )
            thread.start()
            try:
                asyncio.run_coroutine_threadsafe(self._core.start(), loop).result(
                    _CONTROL_TIMEOUT_S
                )
            except BaseException:
                _stop(loop, thread)
                raise
            self._loop, self._thread = loop, thread
            return self

    def close(self) -> None:
        """Stop accepting and close every connection through the link (idempotent)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return
            self._loop = self._thread = None
            try:
                asyncio.run_coroutine_threadsafe(self._core.aclose(), loop).result(
                    _CONTROL_TIMEOUT_S
                )
            finally:
                _stop(loop, thread)

    def __enter__(self) -> Link:  # noqa: PYI034 (typing.Self needs 3.11)
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        where = f"{self.address[0]}:{self.address[1]}" if self._loop is not None else "closed"
        return (
            f"Link({where} -> {c.upstream[0]}:{c.upstream[1]}, latency_ms={c.latency_ms:g}, "
            f"mbps={c.mbps}, loss={c.loss:g})"
        )


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(_CONTROL_TIMEOUT_S)
    if not thread.is_alive():
        loop.close()
