"""The request protocol: version constraints in requests, versions in responses.

A neutral module (it imports nothing of ours but errors and types: no engine, follower or
codec), shared by the sidecar, which enforces it, and the gateway, which routes by it.

Request: body field ``"rollpatch": {"min_version", "exact_version", "max_lag", "wait_s"}`` or
headers ``X-Rollpatch-Min-Version``, ``-Exact-Version``, ``-Max-Lag``, ``-Wait-S`` (the body
wins field by field). The field is stripped before the request reaches the engine.
Response: body field ``"rollpatch": {"version_start", "version_end"}`` (the final chunk of a
stream) and headers ``X-Rollpatch-Version-Start`` / ``-End``, which say the same; an MoE
engine's ``spans`` (the version of each run of ``routed_experts`` rows) are kept when its
versions are trusted, and ``routed_experts`` itself passes through unaltered.

The sidecar's own bounds are the version served when the request was admitted and the one
served when its answer was complete. What an engine says of the versions that produced an
answer narrows them when it lies within them: the built-in engine's ``rollpatch`` field, or
SGLang's ``metadata`` (``weight_version`` when the answer finished, per-token
``weight_versions`` spans when a commit landed during it; SGLang builds it from the first
choice, so only an answer of one choice is narrowed). A commit landing after an answer's last
token but before the sidecar saw the answer complete is then not in its label. A stream's
start is in its headers before its last chunk: there only the end is narrowed.
"""

from __future__ import annotations

import json
import re
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
    "label_body",
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
#: The largest version a constraint may name (int64), and the longest wait (seconds).
_MAX_VERSION, _MAX_WAIT_S = (1 << 63) - 1, 3600.0
_HEADERS = {
    "min_version": "x-rollpatch-min-version",
    "exact_version": "x-rollpatch-exact-version",
    "max_lag": "x-rollpatch-max-lag",
    "wait_s": "x-rollpatch-wait-s",
}
_HEADER_NAMES = {h: "-".join(p.capitalize() for p in h.split("-")) for h in _HEADERS.values()}
_DIGITS = re.compile(r"[0-9]{1,40}")  # a header's version: plain decimal digits
_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")  # a header's wait_s


def _number(field: str, value: Any, where: str | None = None) -> int | float | None:
    """``value`` of constraint ``field``; ``where`` names its source in errors (default: the
    body's ``rollpatch.FIELD``; a header's name when it came from one). Typed, not coerced:
    in the body a version is a JSON integer (``"1"``, ``1.0`` and ``true`` are refused); a
    header holds plain decimal digits (``1_0``, ``+0``, `` 1`` are refused, where ``int()``
    would read 10, 0 and 1: found by an audit, session 39)."""
    if value is None:
        return None
    where = where or f"rollpatch.{field}"
    what = "a number of seconds" if field == "wait_s" else "a whole number"
    if isinstance(value, str):
        pattern = _SECONDS if field == "wait_s" else _DIGITS
        if where.startswith("rollpatch.") or not pattern.fullmatch(value):
            raise ConfigError(f"{where} must be {what}", value=value[:40])
        value = float(value) if field == "wait_s" else int(value)
    floats_ok = field == "wait_s"
    if isinstance(value, bool) or not isinstance(value, (int, float) if floats_ok else int):
        raise ConfigError(f"{where} must be {what}", value=value)
    # the same bounds in a header as in the body (serving/schema.py)
    hi = _MAX_WAIT_S if field == "wait_s" else _MAX_VERSION
    if not 0 <= value <= hi:
        raise ConfigError(f"{where} must be between 0 and {hi}", value=value)
    if field != "wait_s":
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where} must be {what}", value=value)
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
        if field in raw:
            values[field] = _number(field, raw[field])
        else:  # a bad header is named as the header the caller sent
            values[field] = _number(field, lower.get(header), _HEADER_NAMES[header])
    return Constraint(**values)  # type: ignore[arg-type]


def _versions(start: int | None, end: int | None) -> dict[str, int | None]:
    return {"version_start": start, "version_end": end}


def annotate_body(raw: bytes, start: int | None, end: int | None) -> bytes:
    """:func:`label_body`'s body."""
    return label_body(raw, start, end)[0]


def label_body(
    raw: bytes, start: int | None, end: int | None, *, fixed_start: bool = False
) -> tuple[bytes, int | None, int | None]:
    """Add/keep the ``rollpatch`` versions in a JSON response body; return it with the
    versions written (for the headers).

    ``start``/``end``: the sidecar's bounds, narrowed by what the engine says (module
    docstring); ``fixed_start``: ``start`` was already sent (a stream's headers). The engine's
    bytes are kept as they came (parsed to check them, never re-encoded): the versions are
    spliced in before the object's closing brace, or the body is left alone when the engine's
    own versions stand; only an engine ``rollpatch`` field the sidecar overrides re-encodes.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw, start, end
    if not isinstance(body, dict):
        return raw, start, end
    merged = _merge(body, start, end, fixed_start)
    s, e = merged["version_start"], merged["version_end"]
    if "rollpatch" in body:
        if body["rollpatch"] == merged:
            return raw, s, e
    else:
        head = raw.rstrip()
        # UTF-8 (the only encoding spliced: json.loads also reads UTF-16/32, whose bytes
        # have NULs beside the braces)
        if head.lstrip()[:1] == b"{" and head[-1:] == b"}":
            sep = b"," if body else b""
            tail = raw[len(head) :]
            spliced = head[:-1] + sep + b'"rollpatch":' + json.dumps(merged).encode() + b"}"
            return spliced + tail, s, e
    body["rollpatch"] = merged
    return json.dumps(body).encode(), s, e


def _merge(body: dict[str, Any], start: int | None, end: int | None, fixed: bool) -> dict[str, Any]:
    engine = body.get("rollpatch")
    said = _own_versions(engine) if "rollpatch" in body else _sglang_versions(body)
    if said is None or start is None or end is None:
        return _versions(start, end)
    s, e = said
    if fixed:
        s = start
    if not start <= s <= e <= end:
        return _versions(start, end)
    out: dict[str, Any] = _versions(s, e)
    spans = engine.get("spans") if isinstance(engine, dict) else None
    # which version routed which routed_experts rows
    if isinstance(spans, list) and all(
        isinstance(x, dict) and _is_int(x.get("version")) and s <= x["version"] <= e for x in spans
    ):
        out["spans"] = spans
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _own_versions(engine: Any) -> tuple[int, int] | None:
    """The built-in engine's ``rollpatch`` field."""
    if isinstance(engine, dict):
        s, e = engine.get("version_start"), engine.get("version_end")
        if isinstance(s, int) and isinstance(e, int) and _is_int(s) and _is_int(e):
            return s, e
    return None


def _sglang_versions(body: dict[str, Any]) -> tuple[int, int] | None:
    """SGLang's ``metadata`` of an answer of one choice: the first span's version (the
    finishing one without spans) and the finishing one, when every tag is a version."""
    meta, choices = body.get("metadata"), body.get("choices")
    if not isinstance(meta, dict) or not isinstance(choices, list) or len(choices) != 1:
        return None
    spans = meta.get("weight_versions") or []
    if not isinstance(spans, list):
        return None
    tags = [
        x.get("version") if isinstance(x, dict) else x[0] if isinstance(x, list) and x else None
        for x in spans
    ]
    tags.append(meta.get("weight_version"))
    if not all(isinstance(t, str) and t.isascii() and t.isdecimal() and len(t) < 20 for t in tags):
        return None
    versions = [int(str(t)) for t in tags]
    if versions != sorted(versions):
        return None
    return versions[0], versions[-1]


def annotate_sse_line(line: bytes, start: int | None, end: int | None) -> bytes:
    """Rewrite one ``data: {...}`` SSE line (the last chunk) with the versions."""
    if not line.startswith(b"data:"):
        return line
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return line
    return b"data: " + label_body(payload, start, end, fixed_start=True)[0]


@dataclass(frozen=True)
class Decision:
    """What to do with a request: ``proxy``, ``wait`` (catch up to ``need``), or refuse."""

    action: Action
    need: int | None = None
    reason: str = ""
    #: A refusal no retry can change (versions only move forward).
    final: bool = False


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
                final=True,
            )
    elif served >= need:
        return Decision("proxy")
    if latest is None or need > latest:
        return Decision(
            "conflict", need, f"version {need} is not published yet (latest is {latest})"
        )
    return Decision("wait", need, f"catching up from {served} to {need}")
