"""Waiting on an island without being held by it: an await given up when the island stops
answering its ``/version`` polls, or when the caller hangs up.

A process that accepts connections and never answers (stopped, wedged) would otherwise hold a
request, and its in-flight count, for as long as the caller waits. A slow generation from an
island that answers its polls is waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx

from .core import Gateway

__all__ = ["Abandoned", "ClientGone", "Gone", "watched", "watched_lines"]

#: Asks whether the caller hung up (Starlette's ``Request.is_disconnected``).
Gone = Callable[[], Awaitable[bool]]
_T = TypeVar("_T")


class Abandoned(Exception):
    """The island stopped answering while a request waited for its answer."""


class ClientGone(Exception):
    """The caller hung up while a request waited for an island's answer."""


async def watched(gw: Gateway, island: str, aw: Awaitable[_T], gone: Gone | None) -> _T:
    """``aw`` (sending a request, reading an answer), given up when the island is found
    unreachable — its ``/version`` poll failed — after it began (:class:`Abandoned`; the
    request is then tried on another island), or when the caller hangs up
    (:class:`ClientGone`): a process that accepts connections and never answers (stopped,
    wedged) would otherwise hold the request, and its in-flight count, for as long as the
    caller waits. A generation that takes long is not given up while the island answers its
    polls."""
    since = time.monotonic()
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=gw.config.poll_s)
            if done:
                return task.result()
            if gw.failed_since(island, since):
                raise Abandoned(
                    "stopped answering (its /version poll failed) while the request waited "
                    "for an answer; tried elsewhere"
                )
            if gone is not None and await gone():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def watched_lines(gw: Gateway, island: str, lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """``lines`` of an island's stream, ended (``httpx.ReadTimeout``: the caller gets the
    mid-stream error event) when the island is found unreachable — its ``/version`` poll
    failed — while the stream waits for its next line: a wedged island would otherwise
    stall the stream for as long as the caller waits. A slow line from an island that
    answers its polls is waited for. One watcher per stream, waking every ``poll_s``; a line
    costs two assignments (a task per line cost ~15 us of the event loop per chunk)."""
    reader = asyncio.current_task()
    waiting: list[float | None] = [None]  # since when the reader awaits a line; None: not
    gave_up = asyncio.Event()

    async def watch() -> None:
        while reader is not None:
            await asyncio.sleep(gw.config.poll_s)
            since = waiting[0]  # the reader is suspended inside its read when this is set
            if since is not None and gw.failed_since(island, since):
                gave_up.set()
                reader.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    it = lines.__aiter__()
    try:
        while True:
            waiting[0] = time.monotonic()
            try:
                line = await it.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not gave_up.is_set():
                    raise
                if reader is not None and hasattr(reader, "uncancel"):  # 3.11+
                    reader.uncancel()
                raise httpx.ReadTimeout(
                    "stopped answering mid-stream (its /version poll failed)"
                ) from None
            finally:
                waiting[0] = None
            yield line
    finally:
        watcher.cancel()
