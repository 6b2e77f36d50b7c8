"""Bounded, strict JSON for untrusted bytes (manifests, LATEST, request bodies, file headers).

Python's :func:`json.loads` accepts ``NaN``/``Infinity``, turns ``1e400`` into ``inf``, keeps
lone surrogates (``"\\ud800"``), lets the last of duplicate keys win, and recurses once per
nesting level (``RecursionError`` on ``[[[[...``). :func:`loads` refuses all of these before
anything uses the result, and raises one typed rollpatch error chosen by the caller::

    doc = jsonsafe.loads(raw, what="manifest", error=ManifestError, max_bytes=16 << 20)

Limits are checked in this order, each without recursion: size, UTF-8, nesting depth (a
bracket count outside string literals), then parsing with non-finite numbers, integers over
:data:`MAX_INT_DIGITS` digits, duplicate keys and lone surrogates refused.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .errors import ConfigError, RollpatchError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "MAX_INT_DIGITS",
    "JsonLimitError",
    "loads",
    "nesting_depth",
]

#: Default cap on a document's size in bytes.
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
#: Default cap on nesting (``{"a": [1]}`` has depth 2).
DEFAULT_MAX_DEPTH = 64
#: Integers longer than this (in digits) are refused (Python's own cap is 4300).
MAX_INT_DIGITS = 64

# a JSON string literal, unrolled so the regex engine never backtracks across it
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))


class JsonLimitError(Exception):
    """Internal: why a document was refused (mapped to the caller's error class)."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of ``raw`` outside string literals (no recursion).

    Works on UTF-8 bytes directly: multi-byte sequences never contain ASCII brackets or quotes.
    """
    arr = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)
    opens = (arr == _OPEN[0]) | (arr == _OPEN[1])
    marks = np.flatnonzero(opens | (arr == _CLOSE[0]) | (arr == _CLOSE[1]))
    if marks.size == 0:
        return 0
    steps = np.where(opens[marks], 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())


def _constant(name: str) -> Any:
    raise JsonLimitError(f"{name} is not valid JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonLimitError(f"number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonLimitError(f"integer of {len(text)} digits is out of range")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonLimitError(f"duplicate key {key[:80]!r}")
        out[key] = value
    return out


def _parse(raw: bytes | bytearray | memoryview | str, max_bytes: int, max_depth: int) -> Any:
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise JsonLimitError(
            f"{len(data):,} bytes is over the limit of {max_bytes:,}", too_large=True
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonLimitError(f"not UTF-8 (byte {e.start})") from None
    # the brackets counted anywhere bound the depth: most bodies need no nesting scan (whose
    # numpy set-up was ~0.1 ms per request, a tenth of the sidecar's budget)
    if data.count(b"[") + data.count(b"{") > max_depth:
        depth = nesting_depth(data)
        if depth > max_depth:
            raise JsonLimitError(f"nested {depth} deep, over the limit of {max_depth}")
    try:
        doc = json.loads(
            text,
            parse_constant=_constant,
            parse_float=_float,
            parse_int=_int,
            object_pairs_hook=_object,
        )
    except json.JSONDecodeError as e:
        raise JsonLimitError(
            f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (ValueError, RecursionError) as e:  # RecursionError: depth check is the guard
        raise JsonLimitError(f"not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(data):  # rare: only then re-encode to find lone surrogates
        try:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise JsonLimitError("a string holds a lone UTF-16 surrogate") from None
    return doc


def loads(
    raw: bytes | bytearray | memoryview | str,
    *,
    what: str = "JSON document",
    error: type[RollpatchError] = ConfigError,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    **context: Any,
) -> Any:
    """Parse untrusted JSON strictly and within bounds, or raise ``error`` (with ``context``).

    The raised error's context has ``limit="size"`` when the document is too large (so an
    HTTP layer can answer 413 instead of 400).
    """
    try:
        return _parse(raw, max_bytes, max_depth)
    except JsonLimitError as e:
        if e.too_large:
            context["limit"] = "size"
        raise error(f"{what} refused: {e}", **context) from None
