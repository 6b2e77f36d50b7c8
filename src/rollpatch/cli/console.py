"""Log records of one-shot commands (``cast``, ``status``, ``pull``, ...) on stderr, one line
each, with their fields: ``rollpatch: WARNING relay_retry store=http://... attempt=1 ...``.

Without a handler, Python printed a structured event (:func:`rollpatch.logs.event`) as its
bare name (``relay_retry``), its context lost (an audit, session 41, G-F7). The services
configure their own structured logs (``--log-format``: :func:`rollpatch.logs.configure`) and
get none of this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["console_logging", "verbose"]

_LOGGER = "rollpatch"
#: The handler installed by :func:`console_logging` while a command runs.
_installed: list[logging.Handler] = []


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = dict(getattr(record, "rp_fields", None) or {})
        text = getattr(record, "rp_event", None) or record.getMessage()  # (an event's
        if fields:  # message holds its fields too: logs.event)
            text += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f" error={_text(f'{type(exc).__name__}: {exc}')}"
        return f"rollpatch: {record.levelname} {text}"


def _text(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class _Stderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (tests swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


@contextlib.contextmanager
def console_logging(level: int = logging.WARNING) -> Iterator[None]:
    """While the command runs, records of the ``rollpatch`` loggers at ``level`` or above
    go to stderr (unless a handler is configured there already); restored after."""
    logger = logging.getLogger(_LOGGER)
    if logger.handlers:
        yield
        return
    handler = _Stderr()
    handler.setFormatter(_Formatter())
    handler.setLevel(level)
    logger.addHandler(handler)
    _installed.append(handler)
    try:
        yield
    finally:
        _installed.remove(handler)
        logger.removeHandler(handler)


def verbose() -> None:
    """Let INFO records through too (``pull -v``), for the rest of the command."""
    for h in _installed:
        h.setLevel(logging.INFO)
