"""HTTP byte ranges as the relay serves them: one ``bytes=A-B`` / ``bytes=A-`` range or the
whole object (RFC 9110), 416 for what it cannot satisfy."""

from __future__ import annotations

import re

__all__ = ["RangeNotSatisfiable", "parse_range"]

_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{0,19})")


class RangeNotSatisfiable(Exception):
    """Internal: answer 416."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(first, last)`` inclusive for a single ``bytes=A-B`` / ``bytes=A-`` range; None to
    answer the whole object (no header, another unit, or a malformed one, as RFC 9110 allows);
    raises :class:`RangeNotSatisfiable` for ``A >= size``, suffix and multi-range requests.
    """
    if header is None or not header.strip().startswith("bytes="):
        return None
    spec = header.strip()
    if "," in spec or spec.startswith("bytes=-"):
        raise RangeNotSatisfiable(spec)
    match = _RANGE.fullmatch(spec)
    if match is None:
        return None
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    if last < first and match.group(2):
        return None
    if first >= size:
        raise RangeNotSatisfiable(spec)
    return first, min(last, size - 1)
