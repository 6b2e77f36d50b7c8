"""OpenAI-style error bodies, one shape for the sidecar and the gateway.

``{"error": {"message", "type", "code"}, ...extra}`` with ``Retry-After: 1`` on ``409`` and
``503`` (a client may retry: another version, another island, a moment later).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["error_response"]


def error_response(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    """An OpenAI-style error (``kind`` is its ``type``); Retry-After on 409/503."""
    body = {"error": {"message": message, "type": kind, "code": status}, **extra}
    headers = {"Retry-After": "1"} if status in (409, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)
