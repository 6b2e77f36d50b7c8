"""Forwarding one request through the gateway: pick, send, retry elsewhere, annotate.

A request goes to the island :meth:`Gateway.choose` names. ``409`` (cannot satisfy), ``503``
(not ready), ``502`` (its engine is down) and connection failures are retried on another
island, up to ``max_attempts``; anything else is the answer. When no island can, the last
sidecar refusal is returned as it came (or a gateway ``503`` when none could be reached).
Successful answers say which island served them: header ``X-Rollpatch-Island`` and body field
``rollpatch.island`` (the final chunk of a stream); the sidecar's versions pass through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from .. import jsonsafe
from ..errors import ConfigError
from ..logs import event
from ..protocol import HEADER_END, HEADER_START
from ..serving.admission import Slot
from ..serving.responses import error_response
from ..serving.streaming import OwnedStream, relay_sse, sse_data
from ..types import Constraint
from .core import Gateway

__all__ = ["HEADER_ISLAND", "RETRYABLE", "add_island", "forward"]

HEADER_ISLAND = "X-Rollpatch-Island"
#: Sidecar statuses that another island may answer better.
RETRYABLE = frozenset({409, 502, 503})
log = logging.getLogger("rollpatch.gateway")
#: Completion answers nest a few levels (choices → logprobs → top tokens); far deeper is hostile.
_MAX_ANSWER_DEPTH = 64
_KEPT_HEADERS = (
    "content-type",
    "retry-after",
    "x-should-retry",
    HEADER_START.lower(),
    HEADER_END.lower(),
)


@dataclass
class _Refusal:
    """How one attempt failed: a sidecar's answer (``status``) or no connection (``0``)."""

    island: str
    status: int
    content: bytes = b""
    headers: dict[str, str] | None = None
    error: str = ""


def add_island(raw: bytes, island: str) -> bytes:
    """Add ``rollpatch.island`` to a JSON object body (other bodies pass unchanged)."""
    # engines legitimately answer -Infinity logprobs, so not jsonsafe's strict parse; but the
    # depth is bounded first, so a hostile island cannot make the gateway recurse
    if jsonsafe.nesting_depth(raw) > _MAX_ANSWER_DEPTH:
        return raw
    try:
        body = json.loads(raw)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        return raw
    if not isinstance(body, dict):
        return raw
    rp = body.get("rollpatch")
    body["rollpatch"] = {**(rp if isinstance(rp, dict) else {}), "island": island}
    return json.dumps(body).encode()


def _kept(headers: httpx.Headers, island: str) -> dict[str, str]:
    out = {k: headers[k] for k in _KEPT_HEADERS if k in headers}
    out[HEADER_ISLAND] = island
    return out


def _header_int(headers: httpx.Headers, name: str) -> int | None:
    try:
        return int(headers[name])
    except (KeyError, ValueError):
        return None


def _learn(gw: Gateway, island: str, r: httpx.Response, content: bytes) -> None:
    """Fold the versions an answer reports into the gateway's knowledge of the island."""
    served = _header_int(r.headers, HEADER_END)
    if served is None:
        served = _header_int(r.headers, HEADER_START)
    latest = None
    if r.status_code in (409, 503):
        try:
            body = jsonsafe.loads(
                content, what="island refusal", max_bytes=1 << 20, max_depth=_MAX_ANSWER_DEPTH
            )
        except ConfigError:
            body = None
        if isinstance(body, dict):
            s, lt = body.get("served"), body.get("latest")
            served = s if isinstance(s, int) and not isinstance(s, bool) else served
            latest = lt if isinstance(lt, int) and not isinstance(lt, bool) else None
    gw.observe_response(island, r.status_code, served=served, latest=latest)


async def forward(
    gw: Gateway,
    client: httpx.AsyncClient,
    method: str,
    path: str,
    content: bytes | None,
    headers: dict[str, str],
    c: Constraint,
    *,
    stream: bool = False,
    annotate: bool = True,
) -> Response:
    """Send a request to the best island, retrying elsewhere on refusal or failure."""
    t0 = time.perf_counter()
    if gw.draining:  # shutting down: the caller goes to another gateway
        refused = error_response(
            503,
            "the gateway is shutting down; send the request to another gateway",
            "not_ready",
            served=None,
            latest=gw.latest(),
        )
        gw.metrics.answer(refused.status_code, time.perf_counter() - t0)
        return refused
    tried: list[str] = []
    last: _Refusal | None = None
    rotate = gw.rotation()
    for attempt in range(gw.config.max_attempts):
        view = gw.choose(c, tried, None if last is None else last.status, rotate)
        if view is None:
            break
        if attempt:
            gw.metrics.retries.inc()
            if view.name in tried:  # the only island: give it a moment
                await asyncio.sleep(gw.config.retry_backoff_s)
        tried.append(view.name)
        result = await _attempt(
            gw,
            client,
            view.name,
            method,
            f"{view.url}{path}",
            content,
            headers,
            stream=stream,
            annotate=annotate,
        )
        if isinstance(result, Response):
            gw.metrics.answer(result.status_code, time.perf_counter() - t0)
            return result
        last = result
    answer = _give_up(gw, last, tried)
    event(
        log,
        "refused",
        status=answer.status_code,
        path=path,
        tried=",".join(tried),
        error=None if last is None else last.error,
    )
    gw.metrics.answer(answer.status_code, time.perf_counter() - t0)
    return answer


def _give_up(gw: Gateway, last: _Refusal | None, tried: list[str]) -> Response:
    if last is not None and last.status:
        return Response(last.content, status_code=last.status, headers=last.headers)
    detail = f": {last.error}" if last is not None else ""
    return error_response(
        503,
        f"no island could be reached (tried {', '.join(tried) or 'none'}){detail}",
        "not_ready",
        served=None,
        latest=gw.latest(),
        reason="no island reachable",
    )


async def _attempt(
    gw: Gateway,
    client: httpx.AsyncClient,
    island: str,
    method: str,
    url: str,
    content: bytes | None,
    headers: dict[str, str],
    *,
    stream: bool,
    annotate: bool,
) -> Response | _Refusal:
    with gw.admit(island) as slot:
        req = client.build_request(method, url, content=content, headers=headers)
        try:
            r = await _send_watched(gw, client, req, island, stream)
        except httpx.HTTPError as e:
            gw.observe_failure(island, f"{type(e).__name__}: {e}")
            gw.metrics.attempt(island, None)
            return _Refusal(island, 0, error=f"{island}: {type(e).__name__}: {e}")
        except _Abandoned as e:
            gw.metrics.attempt(island, None)
            return _Refusal(island, 0, error=f"{island}: {e}")
        gw.metrics.attempt(island, r.status_code)
        if stream and r.status_code == 200:
            return _stream(gw, island, r, annotate, slot.hand_off())
        body = await r.aread()
        await r.aclose()
        _learn(gw, island, r, body)
        if r.status_code in RETRYABLE:
            return _Refusal(island, r.status_code, body, _kept(r.headers, island))
        if annotate and r.status_code == 200:
            body = add_island(body, island)
        return Response(body, status_code=r.status_code, headers=_kept(r.headers, island))


class _Abandoned(Exception):
    """The island stopped answering while a request waited for its answer's head."""


async def _send_watched(
    gw: Gateway, client: httpx.AsyncClient, req: httpx.Request, island: str, stream: bool
) -> httpx.Response:
    """``client.send``, given up (:class:`_Abandoned`; the request is then tried on another
    island) when the island is found unreachable — its ``/version`` poll failed — after the
    request was sent and before its answer's head came: a process that accepts connections
    and never answers (stopped, wedged) would otherwise hold the request for as long as the
    caller waits. A generation that takes long is not given up while the island answers
    its polls (a non-streamed answer's head comes only with its whole body)."""
    sent = time.monotonic()
    task = asyncio.ensure_future(client.send(req, stream=stream))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=gw.config.poll_s)
            if done:
                return task.result()
            if gw.failed_since(island, sent):
                raise _Abandoned(
                    "stopped answering (its /version poll failed) while the request waited "
                    "for an answer; tried elsewhere"
                )
    finally:
        if not task.done():
            task.cancel()


def _stream(gw: Gateway, island: str, r: httpx.Response, annotate: bool, slot: Slot) -> OwnedStream:
    """Pass a sidecar's SSE stream through; the last data event gets ``rollpatch.island``.
    The stream owns ``slot`` (the island's in-flight count) and ``r`` until it ends."""
    _learn(gw, island, r, b"")

    def last_event(line: bytes, done: bool) -> bytes:
        return _last_event(line, island, annotate)

    def failed(e: Exception) -> bytes:  # the island went away mid-stream: too late to retry
        gw.observe_failure(island, f"stream: {type(e).__name__}: {e}")
        message = f"island {island} failed mid-stream: {e}"
        return sse_data({"error": {"message": message, "type": "island_error", "code": 502}})

    async def close() -> None:
        await r.aclose()
        slot.release()

    lines = _watched_lines(gw, island, r.aiter_lines())
    events = relay_sse(lines, last_event, failures=(httpx.HTTPError,), on_failure=failed)
    return OwnedStream(events, close, headers=_kept(r.headers, island))


async def _watched_lines(gw: Gateway, island: str, lines: AsyncIterator[str]) -> AsyncIterator[str]:
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


def _last_event(line: bytes, island: str, annotate: bool) -> bytes:
    if not annotate:
        return line + b"\n\n"
    return b"data: " + add_island(line[5:].strip(), island) + b"\n\n"
