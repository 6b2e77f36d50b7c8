"""The HTTP edge kit (rollpatch.serving): the server lifecycle and the shared error bodies.

Servers are real (uvicorn on loopback via ``serve_app``); the client is httpx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from fastapi import FastAPI

from rollpatch.serving import serve_app
from rollpatch.serving.responses import error_response


def test_the_apps_lifespan_runs_start_and_stop() -> None:
    """What an app opens at build time (the sidecar's and the gateway's upstream clients) is
    closed in its lifespan; the server must run it (it used to be off by default)."""
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    server = serve_app(app, name="lifespan-test")
    try:
        assert events == ["startup"]  # before serve_app returned, i.e. before any request
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    finally:
        server.stop()
    assert events == ["startup", "shutdown"]


async def _plain_asgi(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that knows only HTTP (no lifespan support), like a bare engine stub."""
    if scope["type"] != "http":
        raise RuntimeError(f"unsupported scope {scope['type']}")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"plain"})


def test_an_app_without_lifespan_support_is_still_served() -> None:
    server = serve_app(_plain_asgi, name="plain-test")
    try:
        r = httpx.get(f"{server.url}/", timeout=10)
        assert (r.status_code, r.content) == (200, b"plain")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("status", "retry"), [(400, None), (409, "1"), (500, None), (502, None), (503, "1")]
)
def test_error_bodies_are_openai_style(status: int, retry: str | None) -> None:
    r = error_response(status, "why", "some_kind", served=3, latest=5)
    assert r.status_code == status
    assert r.headers.get("retry-after") == retry
    assert json.loads(bytes(r.body)) == {
        "error": {"message": "why", "type": "some_kind", "code": status},
        "served": 3,
        "latest": 5,
    }
