"""Reading request bodies within bounds (the sidecar and the gateway read theirs here).

A body is read only up to ``max_bytes`` (``Content-Length`` is checked first, then the bytes
actually received), within ``timeout_s``, then parsed as strict JSON by
:func:`rollpatch.jsonsafe.loads` (no ``NaN``/``Infinity``, nesting bounded). Every refusal is
a :class:`ConfigError` (400) or a :class:`LimitError` (413, or 408 for a slow sender), so a
hostile body never reaches the engine, never holds an admission slot and never becomes a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import jsonsafe
from ..config import check_fields, setting
from ..errors import ConfigError, LimitError

if TYPE_CHECKING:  # the web extra is imported only by the apps that use these functions
    from starlette.requests import Request

__all__ = [
    "BodyLimits",
    "parse_json_object",
    "read_asgi_json",
    "read_body",
    "read_json_object",
    "refusal_status",
]

MiB = 1 << 20
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class BodyLimits:
    """Bounds on one request body (validated)."""

    max_bytes: int = setting(
        16 * MiB, lo=1, hi=1 << 34, help="largest request body accepted (413 above it)"
    )
    max_depth: int = setting(64, lo=1, hi=512, help="deepest JSON nesting accepted (400 above it)")
    timeout_s: float = setting(
        60.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds a client may take to send a request body (408 after that)",
    )

    def __post_init__(self) -> None:
        check_fields(self)


def refusal_status(e: ConfigError) -> int:
    """The HTTP status for a refused body: 413 too large, 408 too slow, else 400."""
    if isinstance(e, LimitError):
        return 408 if e.context.get("limit") == "time" else 413
    return 400


def _check_declared(declared: str | bytes | None, max_bytes: int) -> None:
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise LimitError(
            f"request body of {int(declared):,} bytes is over the limit of {max_bytes:,}",
            limit="size",
        )


def _over(max_bytes: int) -> LimitError:
    return LimitError(f"request body is over the limit of {max_bytes:,} bytes", limit="size")


async def _read(request: Request, max_bytes: int) -> bytes:
    _check_declared(request.headers.get("content-length"), max_bytes)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _over(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


async def _receive(scope: Scope, receive: Receive, max_bytes: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length":
            _check_declared(value, max_bytes)
            break
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # nobody is left to answer
            raise ConfigError("the client left before its request body was received")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _over(max_bytes)
        if chunk:
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _within(limits: BodyLimits, reading: Awaitable[bytes]) -> bytes:
    try:
        if _timeout is not None:  # a deadline on this task: no task of its own per request
            async with _timeout(limits.timeout_s):
                return await reading
        return await asyncio.wait_for(reading, limits.timeout_s)
    except asyncio.TimeoutError:
        raise LimitError(
            f"request body not received within {limits.timeout_s:g} s", limit="time"
        ) from None


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The raw body, at most ``limits.max_bytes``, received within ``limits.timeout_s``."""
    return await _within(limits, _read(request, limits.max_bytes))


async def read_asgi_json(
    scope: Scope, receive: Receive, limits: BodyLimits
) -> tuple[bytes, dict[str, Any]]:
    """:func:`read_json_object` on the ASGI channel itself (a hot path's: no request object,
    no stream generator), with the same bounds and refusals."""
    raw = await _within(limits, _receive(scope, receive, limits.max_bytes))
    return raw, parse_json_object(raw, limits)


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


def parse_json_object(raw: bytes, limits: BodyLimits) -> dict[str, Any]:
    """Strict, bounded JSON that must be an object (ConfigError otherwise)."""
    body = jsonsafe.loads(
        raw,
        what="request body",
        error=ConfigError,
        max_bytes=limits.max_bytes,
        max_depth=limits.max_depth,
    )
    if not isinstance(body, dict):
        raise ConfigError("request body must be a JSON object")
    return body


async def read_json_object(request: Request, limits: BodyLimits) -> tuple[bytes, dict[str, Any]]:
    """Read and parse a JSON-object body within ``limits``: ``(raw bytes, object)``."""
    raw = await read_body(request, limits)
    return raw, parse_json_object(raw, limits)
