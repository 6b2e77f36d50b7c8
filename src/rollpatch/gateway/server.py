"""Assemble and run a gateway in this process (used by the CLI, tests and demos)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..serving import ServerHandle, serve_app
from .config import GatewayConfig, IslandSpec
from .core import Gateway

__all__ = ["RunningGateway", "start_gateway"]


@dataclass
class RunningGateway:
    """A gateway serving HTTP in this process: ``url``, ``gateway`` and :meth:`stop`."""

    gateway: Gateway
    server: ServerHandle

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        """Stop serving, then stop polling the islands."""
        self.server.stop()
        self.gateway.stop()


def start_gateway(
    islands: Sequence[IslandSpec | str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: GatewayConfig | None = None,
    **serve_kw: Any,
) -> RunningGateway:
    """Poll ``islands`` (``NAME=URL``, URLs or specs) and serve the gateway; returns once
    listening and every island answered (or failed) its first poll (on uvloop and httptools
    when installed, as the sidecar: the same head limits)."""
    from .app import create_app

    gw = Gateway(islands, config)
    gw.start()
    # the sidecar's edge: httptools enforces the 64 KiB head bound on every read, and refuses
    # Content-Length with Transfer-Encoding (serving.protocols); uvloop when installed
    serve_kw.setdefault("loop", "fast")
    serve_kw.setdefault("http", "fast")
    try:
        server = serve_app(create_app(gw), host, port, name="gateway", **serve_kw)
    except BaseException:
        gw.stop()
        raise
    return RunningGateway(gw, server)
