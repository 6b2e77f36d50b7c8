"""Polling one island's ``GET /version``: bounded in bytes and, as a whole, in time.

Each poll must bring a complete answer within ``poll_timeout_s`` (one deadline for the
connection, the head and the body, not a per-read timeout: an island that trickles a byte a
second is unreachable like one that does not answer) and within 1 MiB (a ``Content-Length``
over it is refused before the body is read; a body without one is read with a running total).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx

from .. import jsonsafe
from ..errors import ConfigError
from .answers import BadAnswer, read_bounded
from .config import IslandSpec

if TYPE_CHECKING:
    import threading

    from .core import Gateway

__all__ = ["MAX_VERSION_BYTES", "fetch_version", "poll_loop"]

#: A ``/version`` answer is a few hundred bytes.
MAX_VERSION_BYTES = 1 << 20


async def fetch_version(client: httpx.AsyncClient, url: str, name: str) -> dict[str, Any]:
    """One ``/version`` answer, parsed strictly and within bounds (ValueError-like errors,
    :class:`BadAnswer` or ``httpx.HTTPError`` otherwise)."""
    async with client.stream("GET", f"{url}/version") as r:
        r.raise_for_status()
        raw = await read_bounded(r, MAX_VERSION_BYTES, "/version answer")
    # islands run on hosts we do not control: bounded, strict JSON only
    body = jsonsafe.loads(
        raw, what="/version answer", max_bytes=MAX_VERSION_BYTES, max_depth=8, island=name
    )
    if not isinstance(body, dict):
        raise TypeError("/version did not answer a JSON object")
    return body


async def poll_loop(gw: Gateway, spec: IslandSpec, first: threading.Event) -> None:
    """Poll ``spec`` every ``poll_s`` until the gateway stops; ``first`` is set after the
    first poll (answered or failed)."""
    deadline_s = gw.config.poll_timeout_s
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=deadline_s) as client:
        while not gw.stopping():
            try:
                body = await asyncio.wait_for(
                    fetch_version(client, spec.url, spec.name), deadline_s
                )
            except asyncio.TimeoutError:
                gw.observe_failure(
                    spec.name, f"poll: no complete /version answer within {deadline_s:g} s"
                )
            except (httpx.HTTPError, BadAnswer, ConfigError, ValueError, TypeError) as e:
                gw.observe_failure(spec.name, f"poll: {e}")
            else:
                gw.observe_version(spec.name, body)
            first.set()
            await loop.run_in_executor(None, gw.wait_stop, gw.config.poll_s)
