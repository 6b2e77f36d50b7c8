"""The request protocol: version constraints in requests, versions in responses.

A neutral module (it imports nothing of ours but errors and types: no engine, follower or
codec), shared by the sidecar, which enforces it, and the gateway, which routes by it.

Request: body field ``"rollpatch": {"min_version", "exact_version", "max_lag", "wait_s"}`` or
headers ``X-Rollpatch-Min-Version``, ``-Exact-Version``, ``-Max-Lag``, ``-Wait-S`` (the body
wins field by field). The field is stripped before the request reaches the engine.
Response: body field ``"rollpatch": {"version_start", "version_end"}`` (the final chunk of a
stream) and headers ``X-Rollpatch-Version-Start`` / ``-End``; an MoE engine's ``spans`` (the
version of each run of ``routed_experts`` rows) are kept when its versions are trusted, and
``routed_experts`` itself passes through unaltered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError
from .types import Constraint

__all__ = [
    "ACTIONS",
    "DEFAULT_WAIT_S",
    "HEADER_END",
    "HEADER_START",
    "Action",
    "Decision",
    "annotate_body",
    "annotate_sse_line",
    "decide",
    "parse_constraint",
]

#: What to do with a request: serve it, let the engine catch up first, or refuse it (409:
#: the constraint cannot be met by waiting; 503: nothing is served yet).
Action = Literal["proxy", "wait", "conflict", "unavailable"]
ACTIONS: tuple[Action, ...] = ("proxy", "wait", "conflict", "unavailable")
HEADER_START = "X-Rollpatch-Version-Start"
HEADER_END = "X-Rollpatch-Version-End"
#: How long a request may wait for catch-up when it names no ``wait_s``.
DEFAULT_WAIT_S = 30.0
_HEADERS = {
    "min_version": "x-rollpatch-min-version",
    "exact_version": "x-rollpatch-exact-version",
    "max_lag": "x-rollpatch-max-lag",
    "wait_s": "x-rollpatch-wait-s",
}


def _number(field: str, value: Any) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value) if field == "wait_s" else int(value)
        except ValueError:
            raise ConfigError(f"rollpatch.{field} must be a number", value=value) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"rollpatch.{field} must be a number", value=value)
    if field != "wait_s":
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"rollpatch.{field} must be an integer", value=value)
        return int(value)
    return float(value)


def parse_constraint(body: dict[str, Any], headers: Mapping[str, str]) -> Constraint:
    """Pop the ``rollpatch`` field from ``body`` and merge it with the headers."""
    raw = body.pop("rollpatch", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict) or set(raw) - set(_HEADERS):
        raise ConfigError(
            "the rollpatch field must be an object with min_version, exact_version, max_lag, wait_s"
        )
    lower = {k.lower(): v for k, v in headers.items()}
    values = {}
    for field, header in _HEADERS.items():
        v = raw.get(field, lower.get(header))
        values[field] = _number(field, v)
    return Constraint(**values)  # type: ignore[arg-type]


def _versions(start: int | None, end: int | None) -> dict[str, int | None]:
    return {"version_start": start, "version_end": end}


def annotate_body(raw: bytes, start: int | None, end: int | None) -> bytes:
    """Add/keep the ``rollpatch`` versions in a JSON response body.

    An engine that reports its own versions (the built-in one does) is trusted when they
    agree with the sidecar's bounds; otherwise the sidecar's view is written. The engine's
    bytes are kept as they came (parsed to check them, never re-encoded): the versions are
    spliced in before the object's closing brace, or the body is left alone when the engine's
    own versions stand; only an engine ``rollpatch`` field the sidecar overrides re-encodes.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw
    if not isinstance(body, dict):
        return raw
    merged = _merge(body.get("rollpatch"), start, end)
    if "rollpatch" in body:
        if body["rollpatch"] == merged:
            return raw
    else:
        head = raw.rstrip()
        # UTF-8 (the only encoding spliced: json.loads also reads UTF-16/32, whose bytes
        # have NULs beside the braces)
        if head.lstrip()[:1] == b"{" and head[-1:] == b"}":
            sep = b"," if body else b""
            tail = raw[len(head) :]
            return head[:-1] + sep + b'"rollpatch":' + json.dumps(merged).encode() + b"}" + tail
    body["rollpatch"] = merged
    return json.dumps(body).encode()


def _merge(engine: Any, start: int | None, end: int | None) -> dict[str, Any]:
    if isinstance(engine, dict):
        s, e = engine.get("version_start"), engine.get("version_end")
        if (
            isinstance(s, int)
            and isinstance(e, int)
            and start is not None
            and end is not None
            and start <= s <= e <= end
        ):
            out: dict[str, Any] = _versions(s, e)
            spans = engine.get("spans")  # which version routed which routed_experts rows
            if isinstance(spans, list) and all(
                isinstance(x, dict) and isinstance(x.get("version"), int) and s <= x["version"] <= e
                for x in spans
            ):
                out["spans"] = spans
            return out
    return _versions(start, end)


def annotate_sse_line(line: bytes, start: int | None, end: int | None) -> bytes:
    """Rewrite one ``data: {...}`` SSE line (the last chunk) with the versions."""
    if not line.startswith(b"data:"):
        return line
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return line
    return b"data: " + annotate_body(payload, start, end)


@dataclass(frozen=True)
class Decision:
    """What to do with a request: ``proxy``, ``wait`` (catch up to ``need``), or refuse."""

    action: Action
    need: int | None = None
    reason: str = ""


def decide(c: Constraint, served: int | None, latest: int | None) -> Decision:
    """The protocol's core rule, as a pure function (tested exhaustively)."""
    if served is None:
        return Decision("unavailable", reason="the engine has not loaded a version yet")
    need = c.lowest_acceptable(latest)
    if c.exact_version is not None:
        if served == c.exact_version:
            return Decision("proxy")
        if served > c.exact_version:
            return Decision(
                "conflict",
                reason=f"exact version {c.exact_version} is older than "
                f"the served version {served}; versions only move forward",
            )
    elif served >= need:
        return Decision("proxy")
    if latest is None or need > latest:
        return Decision(
            "conflict", need, f"version {need} is not published yet (latest is {latest})"
        )
    return Decision("wait", need, f"catching up from {served} to {need}")
