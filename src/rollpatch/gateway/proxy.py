"""Forwarding one request through the gateway: pick, send, retry elsewhere, annotate.

A request goes to the island :meth:`Gateway.choose` names. ``409`` (cannot satisfy), ``503``
(not ready), ``502`` (its engine is down) and connection failures are retried on another
island, up to ``max_attempts``; anything else is the answer. When no island can, the last
sidecar refusal is returned as it came (or a gateway ``503`` when none could be reached).
Successful answers say which island served them: header ``X-Rollpatch-Island`` and body field
``rollpatch.island`` (the final chunk of a stream); the sidecar's versions pass through, once
checked against the constraint (:mod:`.answers`: a bad answer is a ``502``, tried elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from .. import jsonsafe
from ..errors import ConfigError
from ..protocol import HEADER_END, HEADER_START
from ..serving.admission import Slot
from ..serving.responses import error_body, error_message, error_response
from ..serving.streaming import OwnedStream, relay_sse, sse_data
from ..types import Constraint
from .answers import (
    MAX_ANSWER_DEPTH,
    BadAnswer,
    StreamLabels,
    check_answer,
    read_bounded,
    stream_lines,
)
from .core import Gateway
from .routing import IslandView
from .watch import Abandoned, ClientGone, Gone, watched, watched_lines

__all__ = ["HEADER_ISLAND", "RETRYABLE", "add_island", "forward"]

HEADER_ISLAND = "X-Rollpatch-Island"
#: Sidecar statuses that another island may answer better.
RETRYABLE = frozenset({409, 502, 503})
#: Longest island reason said in a ``refused`` line (a sidecar's reason is a sentence).
MAX_REASON_CHARS = 300
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
    if jsonsafe.nesting_depth(raw) > MAX_ANSWER_DEPTH:
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
                content, what="island refusal", max_bytes=1 << 20, max_depth=MAX_ANSWER_DEPTH
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
    gone: Gone | None = None,
) -> Response:
    """Send a request to the best island, retrying elsewhere on refusal or failure.

    ``annotate``: an inference route, whose answers are labelled (checked, and given
    ``rollpatch.island``); ``gone``: asks whether the caller hung up, while an island is
    waited for (the request is then given up, and its in-flight count with it)."""
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
        fleet = gw.latest()
        # the island's LATEST only moves forward: an honest one never answers below
        # latest - max_lag with the lower of what it and the fleet reported (a max_lag check)
        latest = None if view.latest is None or fleet is None else min(view.latest, fleet)
        try:
            result = await _attempt(
                gw,
                client,
                view,
                method,
                f"{view.url}{path}",
                content,
                headers,
                c,
                latest,
                stream=stream,
                annotate=annotate,
                gone=gone,
            )
        except ClientGone:
            gw.metrics.refused(view.name, "client_gone")
            gw.metrics.answer(499, time.perf_counter() - t0)
            return Response(status_code=499)  # nobody reads it
        if isinstance(result, Response):
            gw.metrics.answer(result.status_code, time.perf_counter() - t0)
            return result
        last = result
    answer = _give_up(gw, last, tried)
    reason = _reason(last)
    # one line per status and reason every 10 s: a re-sync refuses hundreds a second
    gw.said.event(
        "refused",
        f"{answer.status_code} {reason}",
        logging.WARNING if answer.status_code >= 500 else logging.INFO,
        status=answer.status_code,
        reason=reason,
        path=path,
        tried=",".join(tried),
    )
    gw.metrics.answer(answer.status_code, time.perf_counter() - t0)
    return answer


def _reason(last: _Refusal | None) -> str:
    """Why the last island refused, from its answer's body (its error message, else its
    ``reason``), else how the attempt failed; at most :data:`MAX_REASON_CHARS`."""
    if last is None:
        return "no island to try"
    body = None
    if last.content:
        try:
            body = jsonsafe.loads(
                last.content, what="refusal", max_bytes=1 << 20, max_depth=MAX_ANSWER_DEPTH
            )
        except ConfigError:
            body = None
    said = error_message(body) or (body.get("reason") if isinstance(body, dict) else None)
    reason = said if isinstance(said, str) and said else last.error or f"HTTP {last.status}"
    return reason[:MAX_REASON_CHARS]


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


def _bad_answer(gw: Gateway, island: str, e: BadAnswer) -> _Refusal:
    """An answer the gateway does not pass on: counted, logged, the island penalized, and a
    ``502`` ready for the caller should no other island answer."""
    gw.metrics.refused(island, e.kind)
    gw.penalize(island, f"bad answer ({e.kind}): {e}")
    gw.said.event(
        "bad_answer",
        f"{island} {e.kind}",
        logging.WARNING,
        island=island,
        outcome=e.kind,
        error=str(e),
    )
    message = f"island {island} gave an answer the gateway refused: {e}"
    body = json.dumps(error_body(502, message, "island_error", reason=e.kind)).encode()
    headers = {"content-type": "application/json", HEADER_ISLAND: island}
    return _Refusal(island, 502, body, headers, error=f"{island}: {e}")


def _unreachable(gw: Gateway, island: str, e: Exception) -> _Refusal:
    if isinstance(e, httpx.HTTPError):
        gw.observe_failure(island, f"{type(e).__name__}: {e}")
        error = f"{island}: {type(e).__name__}: {e}"
    else:
        error = f"{island}: {e}"
    gw.metrics.attempt(island, None)
    return _Refusal(island, 0, error=error)


async def _attempt(
    gw: Gateway,
    client: httpx.AsyncClient,
    view: IslandView,
    method: str,
    url: str,
    content: bytes | None,
    headers: dict[str, str],
    c: Constraint,
    latest: int | None,
    *,
    stream: bool,
    annotate: bool,
    gone: Gone | None,
) -> Response | _Refusal:
    island = view.name
    with gw.admit(island) as slot:
        req = client.build_request(method, url, content=content, headers=headers)
        try:
            r = await watched(gw, island, client.send(req, stream=True), gone)
        except (httpx.HTTPError, Abandoned) as e:
            return _unreachable(gw, island, e)
        kept = False
        try:
            if stream and r.status_code == 200:
                labels = StreamLabels(c, latest) if annotate else None
                if labels is not None:
                    labels.head(r.headers)  # before the caller sees a byte: still retryable
                gw.metrics.attempt(island, 200)
                kept = True
                return _stream(gw, island, r, labels, annotate, slot.hand_off())
            read = read_bounded(r, gw.config.max_answer_bytes, "answer")
            body = await watched(gw, island, read, gone)
            if annotate and r.status_code == 200:
                body = _labelled(check_answer(r.headers, body, c, latest), island)
        except BadAnswer as e:
            return _bad_answer(gw, island, e)
        except (httpx.HTTPError, Abandoned) as e:
            return _unreachable(gw, island, e)
        finally:
            if not kept:
                await r.aclose()
        gw.metrics.attempt(island, r.status_code)
        _learn(gw, island, r, body)
        if r.status_code in RETRYABLE:
            return _Refusal(island, r.status_code, body, _kept(r.headers, island))
        return Response(body, status_code=r.status_code, headers=_kept(r.headers, island))


def _labelled(body: dict[str, object], island: str) -> bytes:
    """A checked answer (its ``rollpatch`` field a dict) with ``rollpatch.island`` added."""
    rp = body["rollpatch"]
    assert isinstance(rp, dict)
    body["rollpatch"] = {**rp, "island": island}
    return json.dumps(body).encode()


def _stream(
    gw: Gateway,
    island: str,
    r: httpx.Response,
    labels: StreamLabels | None,
    annotate: bool,
    slot: Slot,
) -> OwnedStream:
    """Pass a sidecar's SSE stream through; the last data event gets ``rollpatch.island``.
    The stream owns ``slot`` (the island's in-flight count) and ``r`` until it ends. Lines are
    bounded (``max_event_bytes``) and labelled events checked (``labels``): a bad one ends the
    stream with an error event, never ``[DONE]``."""
    _learn(gw, island, r, b"")

    def last_event(line: bytes, done: bool) -> bytes:
        return _last_event(line, island, annotate)

    def failed(e: Exception) -> bytes:  # too late to retry: part of the answer was sent
        if isinstance(e, BadAnswer):
            gw.metrics.refused(island, e.kind)
            gw.penalize(island, f"bad answer ({e.kind}) mid-stream: {e}")
            message = f"island {island} gave a stream the gateway refused: {e}"
        else:  # the island went away mid-stream
            gw.observe_failure(island, f"stream: {type(e).__name__}: {e}")
            message = f"island {island} failed mid-stream: {e}"
        gw.said.event(
            "stream_failed",
            f"{island} {type(e).__name__}",
            logging.WARNING,
            island=island,
            error=f"{type(e).__name__}: {e}",
        )
        return sse_data({"error": {"message": message, "type": "island_error", "code": 502}})

    async def close() -> None:
        await r.aclose()
        slot.release()

    lines = watched_lines(gw, island, stream_lines(r.aiter_bytes(), gw.config.max_event_bytes))
    if labels is not None:
        lines = labels.lines(lines)
    events = relay_sse(lines, last_event, failures=(httpx.HTTPError, BadAnswer), on_failure=failed)
    return OwnedStream(events, close, headers=_kept(r.headers, island))


def _last_event(line: bytes, island: str, annotate: bool) -> bytes:
    if not annotate:
        return line + b"\n\n"
    return b"data: " + add_island(line[5:].strip(), island) + b"\n\n"
