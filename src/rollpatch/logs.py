"""Structured logs for the services (sidecar, relay, gateway): the one owner of their shape.

Every service logs *events* to the ``rollpatch.*`` loggers with :func:`event`: a name
(``commit``, ``refused``, ``catch_up``, ``error``, ...) and flat fields. :func:`configure`
installs one handler on stderr that writes them either as text::

    2026-12-01T10:00:00.123Z INFO rollpatch.sidecar commit run=grpo version=41 pause_s=0.003

or as one JSON object per line (``--log-format json``), for log shippers::

    {"ts": "2026-12-01T10:00:00.123Z", "level": "info", "logger": "rollpatch.sidecar",
     "event": "commit", "run": "grpo", "version": 41, "pause_s": 0.003}

Plain ``log.info("...")`` records from any module come out the same way with
``"event": "log"`` and the text in ``"message"``. Exceptions add ``error`` (``Type: message``);
the traceback only at ``debug`` level.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
from typing import IO, Any, Literal, get_args

__all__ = [
    "LEVELS",
    "Every",
    "LogFormat",
    "Paces",
    "Throttle",
    "add_log_args",
    "configure",
    "event",
]

LogFormat = Literal["text", "json"]
LEVELS = ("critical", "error", "warning", "info", "debug")
_EVENT = "rp_event"
_FIELDS = "rp_fields"
_HANDLER = "rollpatch-structured"
_NUMBERS = re.compile(r"\d+(\.\d+)?")


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` (JSON-serialisable scalars). The record's message
    is ``name k=v ...`` (what any ``logging`` handler prints: before session 42 a library
    user's own handler printed the bare name, ``relay_retry``, an audit); the name and the
    fields ride on the record too (``rp_event``, ``rp_fields``), for :func:`configure`'s
    formats and the CLI's console."""
    if logger.isEnabledFor(level):
        text = " ".join([name, *(f"{k}={_text(v)}" for k, v in fields.items())])
        logger.log(level, "%s", text, extra={_EVENT: name, _FIELDS: fields})


class Every:
    """One log line's pace: :meth:`due` is true at once, then at most once per ``every_s``,
    and counts the calls held back meanwhile (:attr:`held`: the line may say "N more since").
    The one pacer of the publisher's repeated warnings (coalesced versions, a stalled
    version, an outage, an unrenewed lease, a large step), and of each kind of
    :class:`Throttle`'s events. Not locked: one owner calls it (under its own lock where several threads do)."""

    def __init__(self, every_s: float, clock: Any = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._last: float | None = None
        #: Calls held back since the last line :meth:`due` allowed.
        self.held = 0
        #: What the last line said of :attr:`held` (read right after a true :meth:`due`).
        self.said_held = 0

    def due(self) -> bool:
        """Whether a line may be said now (then it is counted as said)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            self.held += 1
            return False
        self._last, self.said_held, self.held = now, self.held, 0
        return True

    def reset(self) -> None:
        """The next :meth:`due` is true (a new episode: an outage that begins again)."""
        self._last, self.held = None, 0


class Paces:
    """One :class:`Every` per kind (at most ``max_kinds``, forgotten all at once past it: a
    kind made of unusual text cannot grow it without bound). Thread-safe: the one per-kind
    pacer of :class:`Throttle` and of the library lines :func:`configure` paces."""

    def __init__(self, every_s: float, clock: Any = time.monotonic, max_kinds: int = 256) -> None:
        self.every_s, self._clock, self.max_kinds = every_s, clock, max_kinds
        self._lock = threading.Lock()
        self._by_kind: dict[Any, Every] = {}

    def due(self, kind: Any) -> int | None:
        """None when a line of ``kind`` is held back now; else how many were held back since
        the last one (the line is counted as said)."""
        with self._lock:
            pace = self._by_kind.get(kind)
            if pace is None:
                if len(self._by_kind) >= self.max_kinds:
                    self._by_kind.clear()
                pace = self._by_kind[kind] = Every(self.every_s, self._clock)
            return pace.said_held if pace.due() else None


class Throttle:
    """Per-request events (a refusal, a wait to catch up) at most once per ``every_s`` per
    kind (the event's name and a key: a reason with its numbers taken out); those held back
    are counted and said on the next line of their kind (``repeated=N``). A re-sync under
    hundreds of requests a second otherwise logged one line per request."""

    #: Kinds remembered at most (a reason with unusual text cannot grow it without bound).
    MAX_KINDS = 256

    def __init__(
        self, logger: logging.Logger, every_s: float = 10.0, clock: Any = time.monotonic
    ) -> None:
        self.logger, self.every_s = logger, every_s
        self._paces = Paces(every_s, clock, self.MAX_KINDS)

    def event(self, name: str, key: str, level: int = logging.INFO, **fields: Any) -> None:
        held = self._paces.due((name, _NUMBERS.sub("N", key)[:200]))
        if held is None:
            return
        if held:
            fields["repeated"] = held  # held back since the last line of this kind
        event(self.logger, name, level, **fields)


class _Formatter(logging.Formatter):
    def __init__(self, fmt: LogFormat, debug: bool, service: str | None = None) -> None:
        super().__init__()
        self.fmt, self.debug = fmt, debug
        #: Which process said it, in every JSON line (merged logs of many services).
        self.origin = {} if service is None else {"service": service, "pid": os.getpid()}

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts += f".{int(record.msecs):03d}Z"
        name = getattr(record, _EVENT, None)
        fields: dict[str, Any] = dict(getattr(record, _FIELDS, None) or {})
        if name is None:
            name, fields = "log", {"message": record.getMessage()}
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            fields["error"] = f"{type(exc).__name__}: {exc}"
            if self.debug:
                fields["traceback"] = self.formatException(record.exc_info)
        level = record.levelname.lower()
        if self.fmt == "json":
            return json.dumps(
                {
                    "ts": ts,
                    "level": level,
                    "logger": record.name,
                    "event": name,
                    **self.origin,
                    **fields,
                },
                default=str,
            )
        text = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return f"{ts} {level.upper()} {record.name} {name}" + (f" {text}" if text else "")


def _text(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record, not as it was when configured: a
    process that swaps stderr (test captures, redirections) never leaves the handler on a
    closed stream."""

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


def configure(
    level: str = "info",
    fmt: LogFormat = "text",
    stream: IO[str] | None = None,
    *,
    service: str | None = None,
) -> logging.Logger:
    """Send the ``rollpatch`` loggers to ``stream`` (stderr) at ``level`` in ``fmt``; every
    JSON line names ``service`` (``sidecar``, ``relay``, ``gateway``) and the process id.

    Idempotent: calling it again replaces the handler it installed before.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)} (got {level!r})")
    if fmt not in get_args(LogFormat):
        raise ValueError(f"log format must be text or json (got {fmt!r})")
    root = logging.getLogger("rollpatch")
    for h in list(root.handlers):
        if h.get_name() == _HANDLER:
            root.removeHandler(h)
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.set_name(_HANDLER)
    handler.setFormatter(_Formatter(fmt, level == "debug", service))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
    # the HTTP server's own lines (start, stop, a malformed request) in the same format, not
    # its plain text beside JSON lines; one kind of warning at most once a minute (a scanner
    # sending garbage made one line per request: an audit, session 43, L5)
    web = logging.getLogger("uvicorn")
    for h in list(web.handlers):
        if h.get_name() == _HANDLER:
            web.removeHandler(h)
    web.addHandler(handler)
    web.propagate = False
    for name in ("uvicorn.error", "uvicorn.access"):
        sub = logging.getLogger(name)
        sub.handlers = [h for h in sub.handlers if h.get_name() == _HANDLER]
        sub.propagate = True
        if not any(isinstance(f, _Paced) for f in sub.filters):
            sub.addFilter(_Paced())
    if fmt == "json" or not sys.stderr.isatty():  # nor a library's progress bars (the
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # engine's weights load)
    return root


class _Paced(logging.Filter):
    """A library's WARNING lines (the HTTP server's "Invalid HTTP request received.", one per
    bad request) each said at most once a minute by their text, the next one with how many
    were held back."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self._paces = Paces(every_s, max_kinds=64)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, _EVENT, None) is not None:
            return True
        held = self._paces.due(str(record.msg)[:200])
        if held:
            record.msg = f"{record.msg} ({held} more since the last such line)"
        return held is not None


def add_log_args(p: argparse.ArgumentParser, *, default_level: str | None = "info") -> None:
    """``--log-level`` (unless ``default_level`` is None: the parser has one) and
    ``--log-format`` (text or json), for every service."""
    g = p.add_argument_group("logging")
    if default_level is not None:
        g.add_argument(
            "--log-level",
            default=default_level,
            choices=LEVELS,
            help=f"least severe event logged (default {default_level})",
        )
    g.add_argument(
        "--log-format",
        default="text",
        choices=get_args(LogFormat),
        help="text lines, or one JSON object per line (default text)",
    )
