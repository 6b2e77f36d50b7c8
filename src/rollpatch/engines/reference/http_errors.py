"""The reference engine's errors as OpenAI-style JSON answers (:func:`install_errors`): 400
for bad requests, 404 for an unknown model or route, 503 while not ready, 500 otherwise."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import ConfigError, NotReadyError, RollpatchError
from .protocol import error_body

__all__ = ["UnknownModel", "install_errors"]

log = logging.getLogger("rollpatch.engines.reference.server")


class UnknownModel(RollpatchError):
    """The request names a model this server does not serve (404)."""


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status)


def install_errors(app: FastAPI) -> None:
    """Answer every error of ``app`` as OpenAI-style JSON."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return _error(
            400,
            f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
            "invalid_request_error",
            loc,
        )

    @app.exception_handler(ConfigError)
    async def _config(_: Request, exc: ConfigError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.context.get("field"))

    @app.exception_handler(UnknownModel)
    async def _model(_: Request, exc: UnknownModel) -> JSONResponse:
        return _error(404, exc.message, "not_found_error", "model")

    @app.exception_handler(NotReadyError)
    async def _not_ready(_: Request, exc: NotReadyError) -> JSONResponse:
        return _error(503, str(exc), "not_ready")

    @app.exception_handler(RollpatchError)
    async def _engine(_: Request, exc: RollpatchError) -> JSONResponse:
        return _error(500, str(exc), "engine_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in the reference engine")  # a bug: keep the trace
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")
