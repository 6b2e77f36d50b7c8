"""Error bodies, one shape for every service (sidecar, gateway, relay).

``{"error": {"message", "type", "code"}, ...extra}``: OpenAI's shape, ``code`` the HTTP
status, ``type`` a short machine-readable kind, ``extra`` fields beside ``error`` (``served``,
``latest``, ``hint``, the relay's ``code``/``key`` of a corrupt object). :func:`error_body`
builds it (stdlib only); :func:`error_response` sends it with ``Retry-After: 1`` on ``409``
and ``503`` (an OpenAI client may retry: another version, another island, a moment later),
and a refusal no retry can change (``retryable=False``: an exact version older than every
island serves) with ``x-should-retry: false`` instead, which the ``openai`` client obeys (it
retries every 409 otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

__all__ = ["error_body", "error_message", "error_response"]


def error_body(status: int, message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """The error body of a ``status`` answer (``kind`` is its ``type``)."""
    return {"error": {"message": message, "type": kind, "code": status}, **extra}


def error_message(doc: object) -> str | None:
    """The message of an error body: :func:`error_body`'s, or a bare ``{"error": "..."}``
    (what services wrote before); None when there is none."""
    if not isinstance(doc, dict):
        return None
    error = doc.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None


def error_response(
    status: int, message: str, kind: str, *, retryable: bool = True, **extra: Any
) -> JSONResponse:
    """An OpenAI-style error (``kind`` is its ``type``); Retry-After on 409/503, or
    ``x-should-retry: false`` when not ``retryable``."""
    from fastapi.responses import JSONResponse

    headers: dict[str, str] | None = None
    if not retryable:
        headers = {"x-should-retry": "false"}
    elif status in (409, 503):
        headers = {"Retry-After": "1"}
    return JSONResponse(
        error_body(status, message, kind, **extra), status_code=status, headers=headers
    )
