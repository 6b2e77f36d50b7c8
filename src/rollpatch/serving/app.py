"""What every proxying service's app is built from: its upstream client, the lifespan that
closes it, and the error handlers that keep a bare 500 (or a traceback) from any client.

:func:`upstream_client` is the one place the services' connection limits to their upstream
(an engine, islands) are written; :func:`closing` is the lifespan that closes it when the
server stops (:func:`~rollpatch.serving.server.serve_app` runs lifespans);
:func:`install_error_handlers` maps a :class:`~rollpatch.errors.ConfigError` to its refusal
status (400, 408, 413) and anything unexpected to a logged ``500 internal_error`` body.
fastapi and httpx (the ``web`` extra) are imported when these are called.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from .body import refusal_status
from .responses import error_response

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

__all__ = [
    "closing",
    "config_refusal",
    "install_error_handlers",
    "internal_error",
    "upstream_client",
]


def upstream_client(
    *,
    connect_s: float,
    max_connections: int | None,
    keepalive_expiry_s: float = 5.0,
    base_url: str = "",
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """An async client to a service's upstream: no read timeout (generations take as long as
    they take), ``connect_s`` to connect, at most ``max_connections`` (None: no bound) with 64
    kept alive for ``keepalive_expiry_s``."""
    import httpx

    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(None, connect=connect_s),
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=64,
            keepalive_expiry=keepalive_expiry_s,
        ),
    )


class _Closable(Protocol):
    async def aclose(self) -> None: ...


def closing(
    *clients: _Closable,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: nothing at start, each client's ``aclose()`` at shutdown."""

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        for client in clients:
            await client.aclose()

    return lifespan


def config_refusal(e: ConfigError) -> Any:
    """The answer to a refused request: its refusal status (400, 408, 413)."""
    return error_response(refusal_status(e), str(e), "invalid_request_error")


def internal_error(log: logging.Logger, service: str, e: BaseException) -> Any:
    """The answer to anything unexpected: logged with its traceback, a 500 body without it."""
    log.error("%s: unexpected error", service, exc_info=e)
    return error_response(500, f"internal error: {type(e).__name__}", "internal_error")


def route_error(app: FastAPI, service: str, method: str, path: str, e: Any) -> Any:
    """The answer to a path the app has no route for (404), or a method its route does not
    take (405): an OpenAI-style error that names the routes this service does serve, not
    Starlette's bare ``{"detail": "Not Found"}``. Other HTTP errors keep their status and
    detail in the same body."""
    from starlette.routing import Route

    status = int(e.status_code)
    if status not in (404, 405):
        return error_response(status, str(e.detail), "invalid_request_error", retryable=False)
    served = sorted(
        f"{m} {r.path_format}"
        for r in app.routes
        if isinstance(r, Route) and r.include_in_schema
        for m in sorted(r.methods or ())
        if m != "HEAD"
    )
    what = (
        f"no route {method} {path[:200]}"
        if status == 404
        else (f"{path[:200]} does not take {method}")
    )
    return error_response(
        status,
        f"{what}: the {service} serves {', '.join(served)}",
        "not_found_error" if status == 404 else "invalid_request_error",
        retryable=False,
    )


def install_error_handlers(app: FastAPI, log: logging.Logger, service: str) -> None:
    """ConfigError → its refusal status; any other exception → a logged 500 body (the
    handlers are :func:`config_refusal` and :func:`internal_error`, which an ASGI handler
    outside the app uses too)."""
    from fastapi import Request
    from starlette.exceptions import HTTPException

    @app.exception_handler(ConfigError)
    async def _config_error(_: Request, e: ConfigError) -> Any:
        return config_refusal(e)

    @app.exception_handler(HTTPException)
    async def _no_route(request: Request, e: HTTPException) -> Any:
        return route_error(app, service, request.method, request.url.path, e)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> Any:
        return internal_error(log, service, e)
