"""Reading request bodies within bounds (the sidecar and the gateway read theirs here).

A body is read only up to ``max_bytes`` (``Content-Length`` is checked first, then the bytes
actually received), within ``timeout_s``, then parsed as strict JSON by
:func:`rollpatch.jsonsafe.loads` (no ``NaN``/``Infinity``, nesting bounded). Every refusal is
a :class:`ConfigError` (400) or a :class:`LimitError` (413, or 408 for a slow sender), so a
hostile body never reaches the engine, never holds an admission slot and never becomes a 500.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import jsonsafe
from ..errors import ConfigError, LimitError

if TYPE_CHECKING:  # the web extra is imported only by the apps that use these functions
    from starlette.requests import Request

__all__ = ["BodyLimits", "parse_json_object", "read_body", "read_json_object", "refusal_status"]

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class BodyLimits:
    """Bounds on one request body (validated)."""

    #: Largest body accepted, in bytes (413 above it).
    max_bytes: int = 16 * MiB
    #: Deepest JSON nesting accepted (400 above it).
    max_depth: int = 64
    #: Seconds the client may take to send the whole body (408 after that).
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_bytes, bool)
            or not isinstance(self.max_bytes, int)
            or not 1 <= self.max_bytes <= 1 << 34
        ):
            raise ConfigError(
                "max_bytes must be an integer in [1, 16 GiB]",
                field="max_bytes",
                value=self.max_bytes,
            )
        if (
            isinstance(self.max_depth, bool)
            or not isinstance(self.max_depth, int)
            or not 1 <= self.max_depth <= 512
        ):
            raise ConfigError(
                "max_depth must be an integer in [1, 512]", field="max_depth", value=self.max_depth
            )
        if (
            not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or not 0 < self.timeout_s <= 3600
        ):
            raise ConfigError(
                "timeout_s must be in (0, 3600]", field="timeout_s", value=self.timeout_s
            )


def refusal_status(e: ConfigError) -> int:
    """The HTTP status for a refused body: 413 too large, 408 too slow, else 400."""
    if isinstance(e, LimitError):
        return 408 if e.context.get("limit") == "time" else 413
    return 400


async def _read(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise LimitError(
            f"request body of {int(declared):,} bytes is over the limit of {max_bytes:,}",
            limit="size",
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise LimitError(f"request body is over the limit of {max_bytes:,} bytes", limit="size")
        parts.append(chunk)
    return b"".join(parts)


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The raw body, at most ``limits.max_bytes``, received within ``limits.timeout_s``."""
    try:
        return await asyncio.wait_for(_read(request, limits.max_bytes), limits.timeout_s)
    except asyncio.TimeoutError:
        raise LimitError(
            f"request body not received within {limits.timeout_s:g} s", limit="time"
        ) from None


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
