"""The gateway's HTTP app: OpenAI routes forwarded to islands, plus status routes.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming passed through),
``GET /v1/models``, ``/health``, ``/ready``, ``/islands``, ``/metrics``. Statuses: whatever the chosen
sidecar answered; ``409``/``503`` from the last island tried when none could serve; ``503``
from the gateway when no island could be reached; ``400`` for a malformed request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import ConfigError
from ..protocol import parse_constraint
from ..serving.app import closing, config_refusal, install_error_handlers, upstream_client
from ..serving.body import read_json_object
from ..serving.metrics import CONTENT_TYPE as METRICS_TYPE
from ..serving.responses import error_response
from ..serving.schema import openapi_body, validate_body
from ..types import Constraint
from .core import Gateway
from .health import fresh_count, not_ready_reason, ready_islands
from .proxy import forward

__all__ = ["create_app"]

_PROXIED = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADER_PREFIX = "x-rollpatch-"
log = logging.getLogger("rollpatch.gateway")


def create_app(gw: Gateway) -> FastAPI:
    """Build the FastAPI app around a started :class:`Gateway`."""
    auth = (
        {}
        if gw.config.island_token is None
        else {"authorization": f"Bearer {gw.config.island_token}"}
    )
    client = upstream_client(
        headers=auth, connect_s=gw.config.connect_timeout_s, max_connections=None
    )
    app = FastAPI(
        title="rollpatch gateway", docs_url=None, redoc_url=None, lifespan=closing(client)
    )
    install_error_handlers(app, log, "gateway")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        views = gw.views()
        return {
            "status": "ok",
            "islands": len(views),
            "reachable": sum(1 for v in views if v.reachable),
            "serving": sum(1 for v in views if v.reachable and v.served is not None),
            "fresh": fresh_count(gw.routable(), gw.config.latest_max_age_s, time.monotonic()),
            "latest": gw.latest(),
        }

    @app.get("/ready")
    async def ready() -> JSONResponse:
        islands, latest = gw.routable(), gw.latest()
        reason = (
            "the gateway is shutting down"
            if gw.draining
            else not_ready_reason(islands, latest, gw.fleet_run())
        )
        if reason is not None:
            return error_response(503, reason, "not_ready", reason=reason)
        ready = [v.name for v in ready_islands(islands, latest)]
        return JSONResponse({"ready": True, "islands": ready, "latest": latest})

    @app.get("/islands")
    async def islands() -> dict[str, Any]:
        return {"latest": gw.latest(), "run": gw.fleet_run(), "islands": gw.describe()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            gw.metrics.render(gw.views(), gw.excluded()), media_type=METRICS_TYPE
        )

    @app.get("/v1/models")
    async def models() -> Response:
        return await forward(
            gw, client, "GET", "/v1/models", None, {}, Constraint(), annotate=False
        )

    for path in _PROXIED:
        app.add_api_route(
            path, _make_route(gw, client, path), methods=["POST"], openapi_extra=openapi_body(path)
        )
    return app


def _make_route(gw: Gateway, client: httpx.AsyncClient, path: str) -> Any:
    async def route(request: Request) -> Response:
        # strict and bounded: a body no island would accept is refused here, not 3 times there
        t0 = time.perf_counter()
        try:
            raw, body = await read_json_object(request, gw.config.body)
            typed = validate_body(path, body)
            # parse a copy: the sidecar needs the rollpatch field (and headers) as sent
            constraint = parse_constraint(dict(body), request.headers)
        except ConfigError as e:  # counted among the answers, as the islands' are
            refused = config_refusal(e)
            gw.metrics.answer(refused.status_code, time.perf_counter() - t0)
            return refused
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower().startswith(_FORWARDED_HEADER_PREFIX)
        }
        headers["content-type"] = "application/json"
        return await forward(
            gw,
            client,
            "POST",
            path,
            raw,
            headers,
            constraint,
            stream=bool(typed.stream),
            gone=request.is_disconnected,
        )

    return route
