"""The gateway: one OpenAI-compatible front over many islands (sidecars), routed by version.

Each request's constraint (the sidecar protocol's ``rollpatch`` field or headers, forwarded
untouched) is routed to an island whose served version satisfies it, least loaded first; else
to the island closest to it, whose sidecar catches up. Refusals (409), unready islands (503)
and unreachable ones are retried on another island. See docs/gateway.md::

    from rollpatch.gateway import start_gateway
    gw = start_gateway(["a=http://10.0.0.5:8100", "http://10.0.0.6:8100"])
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused")

The config (``config``) and the ranking (``routing``) need no web stack; :class:`Gateway`
(``core``: it polls islands with httpx), :func:`create_app` and :func:`start_gateway` need the
``web`` extra, imported on use (a core install's ``rollpatch`` command registers ``gateway``
from the config alone: before session 43 it died on ``import httpx``, every command with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GatewayConfig, IslandSpec, parse_island
from .routing import IslandView, Tier, fleet_latest, fleet_newest, rank, tier_of

if TYPE_CHECKING:
    from .app import create_app
    from .core import Gateway
    from .server import RunningGateway, start_gateway

__all__ = [
    "Gateway",
    "GatewayConfig",
    "IslandSpec",
    "IslandView",
    "RunningGateway",
    "Tier",
    "create_app",
    "fleet_latest",
    "fleet_newest",
    "parse_island",
    "rank",
    "start_gateway",
    "tier_of",
]


def __getattr__(name: str) -> Any:
    if name == "Gateway":  # httpx is an optional extra
        from .core import Gateway

        return Gateway
    if name == "create_app":  # fastapi is an optional extra
        from .app import create_app

        return create_app
    if name in ("RunningGateway", "start_gateway"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
