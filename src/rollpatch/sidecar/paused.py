"""An engine paused while no commit of this sidecar runs.

Someone paused it behind the sidecar's back, or a sidecar before this one died inside a
pause-mode commit (``kill -9``) and left it paused: every request then waits until somebody
resumes it. Found by audits: vLLM paused by hand (session 39) and SGLang left paused by a
killed sidecar (session 40); ``/ready`` said 200 meanwhile.

- vLLM answers ``GET /is_paused`` (its RL routes);
- SGLang has no such route: its own ``GET /ready`` answers 503 while it is paused (or not
  healthy), and ``GET /ping`` 200 while it is healthy, paused or not;
- an engine with neither route says nothing.

:func:`paused_behind` is ``/ready``'s probe (503 with the reason); :func:`resume_left_paused`
runs once as a sidecar starts and resumes an engine it finds paused, since no commit of its
own can be running yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

import httpx

from ..engines.base import EngineAdapter

__all__ = ["paused_behind", "resume_left_paused"]

log = logging.getLogger("rollpatch.sidecar")


async def paused_behind(client: httpx.AsyncClient, timeout: float) -> str | None:
    """Why the engine at ``client``'s base URL is paused, or None (not paused, or it cannot
    tell)."""
    try:
        r = await client.get("/is_paused", timeout=timeout)
        if r.status_code == 200:
            if r.json().get("is_paused") is not True:
                return None
            return (
                "vLLM is paused, and not by this sidecar (no commit runs): requests wait until "
                "it is resumed"
            )
        if r.status_code != 404:
            return None
        ready = await client.get("/ready", timeout=timeout)
        if ready.status_code != 503:
            return None
        ping = await client.get("/ping", timeout=timeout)
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if ping.status_code != 200:  # not healthy: the engine probe's business, not a pause
        return None
    return (
        "the engine is paused, and not by this sidecar (its own /ready answers 503 while it "
        "is healthy, as SGLang's does when paused; no commit runs): requests wait until it is "
        "resumed"
    )


def resume_left_paused(engine: EngineAdapter, url: str, token: str | None, timeout: float) -> bool:
    """At a sidecar's start: resume an engine found paused (by a pause and resume of its
    adapter, so its own routes are used); True when it was."""

    async def probe() -> str | None:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        async with httpx.AsyncClient(base_url=url, headers=headers) as client:
            return await paused_behind(client, timeout)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # whatever loop this thread runs
        reason = pool.submit(asyncio.run, probe()).result()
    if reason is None:
        return False
    log.warning(
        "the engine is paused as this sidecar starts (%s); a sidecar before this one died "
        "inside a commit? resuming it",
        reason,
    )
    engine.pause()
    engine.resume()
    return True
