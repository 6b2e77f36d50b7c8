"""Publishers still open at interpreter exit are closed, and what they hold pending is
published (errors printed: at exit no caller is left to raise to)."""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Publisher

__all__ = ["close_at_exit"]

_LIVE: weakref.WeakSet[Publisher] = weakref.WeakSet()


def close_at_exit(pub: Publisher) -> None:
    """Close ``pub`` at interpreter exit if it is still open then."""
    _LIVE.add(pub)
    _hook()


def _hook() -> None:
    """Have :func:`_close_all` run at interpreter exit *before* Python's thread pools stop
    taking work. ``concurrent.futures`` refuses new work from a ``threading`` exit callback
    it registers on import, and those callbacks run before ``atexit``'s, newest first: one
    registered after it (here, when a publisher starts) runs before it. As a plain
    ``atexit`` hook, every version still pending at exit failed ("cannot schedule new
    futures after interpreter shutdown") and was lost."""
    global _HOOKED
    if _HOOKED:
        return
    import concurrent.futures.thread  # noqa: F401 (its exit callback first: ours runs before)

    try:
        threading._register_atexit(_close_all)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # another Python, or already shutting down
        atexit.register(_close_all)
    _HOOKED = True


_HOOKED = False


def _close_all() -> None:
    """Publish what is pending at interpreter exit; report, never hide, errors."""
    for pub in list(_LIVE):
        try:
            pub.close()
        except Exception as e:  # noqa: BLE001 (at exit no caller is left to raise to)
            print(f"rollpatch: publisher for run {pub.run!r} failed: {e}", file=sys.stderr)
