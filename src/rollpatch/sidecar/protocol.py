"""The sidecar protocol is :mod:`rollpatch.protocol` (a neutral module the gateway shares);
its names are re-exported here for the sidecar's imports."""

from __future__ import annotations

from ..protocol import (
    ACTIONS,
    DEFAULT_WAIT_S,
    HEADER_END,
    HEADER_START,
    Action,
    Decision,
    annotate_body,
    annotate_sse_line,
    decide,
    label_body,
    parse_constraint,
)

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
