"""The sidecar's HTTP app: OpenAI routes proxied under version constraints, plus admin routes.

Status codes: 200/4xx pass through from the engine with versions attached; ``409`` when the
constraint cannot be met (``{served, latest, reason}`` + ``Retry-After``); ``503`` while the
engine holds no verified version; ``502`` when the engine cannot be reached. Nothing becomes a
bare 500: rollpatch errors map to statuses by class.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import NotReadyError, RollpatchError
from ..logs import event
from ..serving.admission import admit_async
from ..serving.app import closing, install_error_handlers, upstream_client
from ..serving.body import read_json_object
from ..serving.metrics import CONTENT_TYPE as METRICS_TYPE
from ..serving.responses import error_response
from ..serving.schema import openapi_body, validate_body
from ..serving.streaming import OwnedStream, relay_sse
from .gate import Admission
from .protocol import (
    DEFAULT_WAIT_S,
    HEADER_END,
    HEADER_START,
    annotate_body,
    annotate_sse_line,
    decide,
    parse_constraint,
)
from .service import Sidecar

__all__ = ["create_app"]

log = logging.getLogger("rollpatch.sidecar")

_PROXIED = ("/v1/completions", "/v1/chat/completions")


def create_app(sc: Sidecar) -> FastAPI:
    """Build the FastAPI app around a running :class:`Sidecar`."""
    # keep-alive shorter than uvicorn's 5 s so the engine never closes a connection we reuse
    client = upstream_client(
        base_url=sc.engine_url, connect_s=5, max_connections=100, keepalive_expiry_s=2.0
    )
    app = FastAPI(
        title="rollpatch sidecar", docs_url=None, redoc_url=None, lifespan=closing(client)
    )
    install_error_handlers(app, log, "sidecar")  # ConfigError: its refusal; others: 500

    @app.exception_handler(RollpatchError)
    async def _rollpatch_error(_: Request, e: RollpatchError) -> JSONResponse:
        if isinstance(e, NotReadyError):
            return error_response(503, str(e), "not_ready")
        return error_response(502, str(e), "rollpatch_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        reason = sc.not_ready_reason()
        if reason is None:
            reason = await _probe_engine(client, sc.config.ready_probe_s)
        if reason is not None:
            return error_response(503, reason, "not_ready")
        return JSONResponse({"ready": True, "version": sc.follower.version})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return await asyncio.to_thread(sc.describe)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(sc.metrics.render(), media_type=METRICS_TYPE)

    @app.post("/admin/sync")
    async def admin_sync(request: Request) -> JSONResponse:
        denied = _check_token(sc, request)
        if denied is not None:
            return denied
        v = await asyncio.to_thread(sc.follower.sync)
        return JSONResponse({"version": v})

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get("/v1/models")
        return Response(
            r.content, status_code=r.status_code, media_type=r.headers.get("content-type")
        )

    for path in _PROXIED:
        app.add_api_route(
            path, _make_proxy(sc, client, path), methods=["POST"], openapi_extra=openapi_body(path)
        )
    return app


def _check_token(sc: Sidecar, request: Request) -> JSONResponse | None:
    if sc.config.admin_token is None:
        return None
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {sc.config.admin_token}".encode()):
        return error_response(401, "admin routes need the bearer token", "unauthorized")
    return None


async def _probe_engine(client: httpx.AsyncClient, timeout: float) -> str | None:
    """None when the engine answers HTTP at all (any status), else why not."""
    try:
        await client.get("/health", timeout=timeout)
    except httpx.HTTPError as e:
        return f"engine unreachable: {type(e).__name__}: {e}"
    return None


def _make_proxy(sc: Sidecar, client: httpx.AsyncClient, path: str) -> Any:
    async def proxy(request: Request) -> Response:
        _, body = await read_json_object(request, sc.config.body)
        typed = validate_body(path, body)
        constraint = parse_constraint(body, request.headers)
        refused = await _satisfy(sc, constraint)
        if refused is not None:
            return refused
        timeout = sc.config.admit_timeout_s
        with await admit_async(lambda: sc.gate.admit(timeout)) as slot:
            d = decide(constraint, slot.start, await asyncio.to_thread(sc.latest))
            if d.action != "proxy":  # moved on while we were admitted (exact_version raced)
                sc.metrics.request("conflict")
                return _conflict(sc, slot.start, d.reason)
            if typed.stream:
                return await _stream(sc, client, path, body, slot)
            return await _once(sc, client, path, body, slot)

    return proxy


async def _satisfy(sc: Sidecar, c: Any) -> Response | None:
    """Wait for catch-up when the constraint allows it; a response when it must refuse."""
    served = sc.follower.version
    if served is None and sc.gate.busy:  # mid-commit an engine may report no version
        await asyncio.to_thread(sc.gate.wait_commit, sc.config.admit_timeout_s)
        for _ in range(100):  # the follower records the verified version just after
            served = sc.follower.version
            if served is not None:
                break
            await asyncio.sleep(0.01)
    # LATEST may be read through a slow relay: never block the event loop on it
    latest = await asyncio.to_thread(sc.latest)
    age = sc.latest_age()
    if c.max_lag is not None and served is not None and age > sc.config.latest_max_age_s:
        # the board is unreachable: how far behind this island is cannot be known
        sc.metrics.request("unavailable")
        return error_response(
            503,
            f"LATEST has not been read for {age:.0f} s (the board is "
            "unreachable): max_lag cannot be checked",
            "not_ready",
            served=served,
            latest=latest,
        )
    d = decide(c, served, latest)
    if d.action == "conflict" and d.need is not None:
        latest = await asyncio.to_thread(sc.latest, True)
        d = decide(c, served, latest)
    if d.action == "proxy":
        return None
    if d.action == "unavailable":
        sc.metrics.request("unavailable")
        event(log, "refused", status=503, reason=d.reason, served=None, latest=latest)
        return error_response(503, d.reason, "not_ready", served=None, latest=latest)
    if d.action == "wait":
        wait_s = DEFAULT_WAIT_S if c.wait_s is None else c.wait_s
        assert d.need is not None
        if wait_s > 0:
            event(log, "catch_up", served=served, need=d.need, latest=latest, wait_s=wait_s)
        if wait_s > 0 and await asyncio.to_thread(sc.follower.wait_for, d.need, wait_s):
            return None
        reason = d.reason + (
            " (caller asked not to wait)" if wait_s == 0 else f" did not finish within {wait_s:g}s"
        )
        sc.metrics.request("conflict")
        return _conflict(sc, served, reason)
    sc.metrics.request("conflict")
    return _conflict(sc, served, d.reason)


def _conflict(sc: Sidecar, served: int | None, reason: str) -> JSONResponse:
    event(log, "refused", status=409, reason=reason, served=served, latest=sc.latest_seen())
    return error_response(
        409, reason, "version_conflict", served=served, latest=sc.latest_seen(), reason=reason
    )


def _headers(start: int | None, end: int | None) -> dict[str, str]:
    out = {HEADER_START: str(start)}
    if end is not None:
        out[HEADER_END] = str(end)
    return out


async def _once(
    sc: Sidecar, client: httpx.AsyncClient, path: str, body: dict[str, Any], slot: Admission
) -> Response:
    """One non-streaming answer; the caller's ``with`` releases ``slot`` on every path."""
    start = slot.start
    t0 = time.perf_counter()
    try:
        try:
            r = await client.post(path, json=body)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # a pooled connection closed under us before any response byte: generation is
            # side-effect free, so one retry on a fresh connection is safe
            r = await client.post(path, json=body)
    except httpx.HTTPError as e:
        sc.metrics.request("engine_error")
        return error_response(502, f"engine unreachable: {type(e).__name__}: {e}", "engine_error")
    end = slot.release()
    sc.metrics.request("proxied", time.perf_counter() - t0)
    content = annotate_body(r.content, start, end) if r.status_code == 200 else r.content
    return Response(
        content,
        status_code=r.status_code,
        headers=_headers(start, end),
        media_type=r.headers.get("content-type", "application/json"),
    )


async def _stream(
    sc: Sidecar, client: httpx.AsyncClient, path: str, body: dict[str, Any], slot: Admission
) -> Response:
    """A streamed answer; on success the stream takes ``slot`` over (:meth:`hand_off`) and
    releases it when the response ends (:class:`~rollpatch.serving.streaming.OwnedStream`)."""
    start = slot.start
    t0 = time.perf_counter()
    try:
        req = client.build_request("POST", path, json=body)
        r = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        sc.metrics.request("engine_error")
        return error_response(502, f"engine unreachable: {type(e).__name__}: {e}", "engine_error")
    if r.status_code != 200:
        try:
            content = await r.aread()
        except httpx.HTTPError as e:
            sc.metrics.request("engine_error")
            return error_response(502, f"engine failed: {type(e).__name__}: {e}", "engine_error")
        finally:
            await r.aclose()
        end = slot.release()
        sc.metrics.request("proxied", time.perf_counter() - t0)
        return Response(
            content,
            status_code=r.status_code,
            headers=_headers(start, end),
            media_type=r.headers.get("content-type"),
        )

    def last_event(line: bytes, done: bool) -> bytes:
        # the versions the whole stream ran under are known once [DONE] released the slot
        return annotate_sse_line(line, start, slot.release()) + b"\n\n" if done else line + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in relay_sse(r.aiter_lines(), last_event, on_done=slot.release):
                yield event
        finally:
            sc.metrics.request("proxied", time.perf_counter() - t0)

    async def close() -> None:
        slot.release()
        await r.aclose()

    # in drain mode without a drain deadline no commit can land while the stream is admitted
    # (end == start is known); past a deadline the commit pauses instead, so it may
    end_hdr = start if sc.gate.mode == "drain" and sc.gate.drain_timeout_s is None else None
    slot.hand_off()  # the stream releases it (close), however the response ends
    return OwnedStream(events(), close, headers=_headers(start, end_hdr))
