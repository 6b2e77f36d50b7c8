"""How the demo's processes talk: JSON events, one per line, marked so that stray output from
libraries on the same stream can never be mistaken for one; and a parent watchdog.

Children write events to stdout (:func:`emit`); the orchestrator reads them
(:func:`parse_event`) and writes commands to a child's stdin. A child treats end of file on its
stdin as "the parent is gone" (:func:`watch_parent`), so no child outlives the orchestrator,
even when the orchestrator is killed without a chance to clean up.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MARK", "emit", "parse_event", "watch_parent"]

#: Prefix of an event line.
MARK = "@rollpatch-demo "
_LOCK = threading.Lock()


def emit(kind: str, **fields: Any) -> None:
    """Write one event (``{"ev": kind, ...}``) to stdout and flush it."""
    line = MARK + json.dumps({"ev": kind, **fields}, separators=(",", ":"), default=str)
    with _LOCK:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):  # the orchestrator is gone: nobody to tell
            pass


def parse_event(line: str) -> dict[str, Any] | None:
    """The event on ``line``, or None when the line is not one (library noise)."""
    if not line.startswith(MARK):
        return None
    try:
        ev = json.loads(line[len(MARK) :])
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) and isinstance(ev.get("ev"), str) else None


def watch_parent(
    on_command: Callable[[dict[str, Any]], None] | None, on_eof: Callable[[], None]
) -> threading.Thread:
    """Read JSON commands from stdin in a daemon thread; call ``on_eof`` when stdin closes."""

    def loop() -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line or on_command is None:
                continue
            try:
                cmd = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(cmd, dict):
                on_command(cmd)
        on_eof()

    t = threading.Thread(target=loop, name="rollpatch-demo-parent", daemon=True)
    t.start()
    return t
