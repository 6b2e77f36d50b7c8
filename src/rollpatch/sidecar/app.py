"""The sidecar's HTTP app: OpenAI routes proxied under version constraints, plus admin routes.

Status codes: 200/4xx pass through from the engine with versions attached; ``409`` when the
constraint cannot be met (``{served, latest, reason}`` + ``Retry-After``); ``503`` while the
engine holds no verified version; ``502`` when the engine cannot be reached. Nothing becomes a
bare 500: rollpatch errors map to statuses by class. The proxied routes run in front of
FastAPI (:mod:`.proxy`, the hot path); FastAPI serves the admin routes and the schema.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import RollpatchError, VersionNotFoundError
from ..serving.app import closing, install_error_handlers, upstream_client
from ..serving.metrics import CONTENT_TYPE as METRICS_TYPE
from ..serving.responses import error_response
from ..serving.schema import openapi_body
from ..serving.upstream import Upstream
from .paused import paused_behind
from .proxy import PROXIED, ProxyFront, rollpatch_refusal
from .service import Sidecar

__all__ = ["create_app", "engine_refusal"]

log = logging.getLogger("rollpatch.sidecar")


def create_app(sc: Sidecar) -> Any:
    """Build the ASGI app around a running :class:`Sidecar`: the proxied routes'
    :class:`~.proxy.ProxyFront` over the FastAPI app of the others."""
    # keep-alive shorter than uvicorn's 5 s so the engine never closes a connection we reuse;
    # the proxied routes' client also sends once more on a new connection when the engine
    # closed a pooled one before any answer byte, so it may keep them longer
    token = sc.engine.engine_token  # the engine server's --api-key, if it has one
    client = upstream_client(  # admin routes: /ready's probe, /v1/models
        base_url=sc.engine_url,
        connect_s=5,
        max_connections=100,
        keepalive_expiry_s=2.0,
        headers={"Authorization": f"Bearer {token}"} if token else None,
    )
    upstream = Upstream(
        sc.engine_url,
        connect_s=5,
        max_connections=100,
        keepalive_expiry_s=4.0,
        headers=[(b"authorization", f"Bearer {token}".encode())] if token else (),
    )
    sc.metrics.engine_connections.set_function(lambda: upstream.opened)
    app = FastAPI(
        title="rollpatch sidecar",
        docs_url=None,
        redoc_url=None,
        lifespan=closing(client, upstream),
    )
    install_error_handlers(app, log, "sidecar")  # ConfigError: its refusal; others: 500
    front = ProxyFront(sc, app, upstream)

    @app.exception_handler(RollpatchError)
    async def _rollpatch_error(_: Request, e: RollpatchError) -> Response:
        return rollpatch_refusal(e)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        reason = sc.not_ready_reason()
        if reason is None:
            reason = await _probe_engine(client, sc.config.ready_probe_s)
        if reason is None and not sc.gate.busy:  # an engine with neither route says nothing
            reason = await paused_behind(client, sc.config.ready_probe_s)
            if sc.gate.busy:  # a commit of its own began meanwhile: its pause, not another's
                reason = None
        if reason is not None:
            return error_response(503, reason, "not_ready")
        return JSONResponse({"ready": True, "version": sc.follower.version})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return await asyncio.to_thread(sc.describe)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        sc.refresh_metrics()  # the follower's state now (no board read)
        return PlainTextResponse(sc.metrics.render(), media_type=METRICS_TYPE)

    @app.post("/admin/sync")
    async def admin_sync(request: Request) -> JSONResponse:
        denied = _check_token(sc, request)
        if denied is not None:
            return denied
        try:
            v = await asyncio.to_thread(sc.follower.sync)
        except VersionNotFoundError as e:  # nothing to sync to: not the engine's failure (502)
            return error_response(404, str(e), "not_found")
        return JSONResponse({"version": v})

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await client.get("/v1/models")
        except httpx.HTTPError as e:  # as the proxied routes answer it: no traceback
            return error_response(502, f"engine unreachable: {e}", "engine_error")
        return Response(
            r.content, status_code=r.status_code, media_type=r.headers.get("content-type")
        )

    for path in PROXIED:  # served by the front; here for the schema (and as a fallback)
        app.add_api_route(
            path, _delegate(front), methods=["POST"], openapi_extra=openapi_body(path)
        )
    return front


def engine_refusal(status: int) -> str | None:
    """Why an engine that answers ``status`` to the sidecar's ``GET /v1/models`` cannot be
    served through it (None: it can)."""
    if status not in (401, 403):
        return None
    return (
        f"the engine refuses the sidecar's requests (HTTP {status} on /v1/models): a wrong or "
        "missing --engine-token-file (the engine's --api-key)"
    )


def _check_token(sc: Sidecar, request: Request) -> JSONResponse | None:
    if sc.config.admin_token is None:
        return None
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {sc.config.admin_token}".encode()):
        return error_response(401, "admin routes need the bearer token", "unauthorized")
    return None


async def _probe_engine(client: httpx.AsyncClient, timeout: float) -> str | None:
    """None when the engine answers HTTP (any status but a refusal of the sidecar's engine
    token), else why not. ``/v1/models``: an engine's ``--api-key`` covers its OpenAI
    routes only, so its health and weight routes work with a wrong token while every
    request the sidecar proxies gets 401 (found by an audit, session 39)."""
    try:
        r = await client.get("/v1/models", timeout=timeout)
    except httpx.HTTPError as e:
        return f"engine unreachable: {type(e).__name__}: {e}"
    return engine_refusal(r.status_code)


def _delegate(front: ProxyFront) -> Any:
    async def proxy(request: Request) -> Response:
        return _Handled(front)

    return proxy


class _Handled(Response):
    """A response that is the front's handler run on the request's own ASGI channel."""

    def __init__(self, front: ProxyFront) -> None:
        super().__init__()
        self._front = front

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._front.handle(scope, receive, send)
