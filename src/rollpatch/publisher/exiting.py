"""How a publisher ends: ``close()`` publishes what is pending, ``abort()`` drops it without
waiting for the other ranks, and publishers still open at interpreter exit are ended (errors
printed: at exit no caller is left to raise to).

A sharded publisher ended by an exception (``__exit__`` with one) or by interpreter exit is
aborted, not closed: closing agrees on the pending versions with the other ranks, whose
trainers may be blocked in their own collectives waiting for this rank, and the job would
hang until gloo's 30-minute timeout (audit J, H2).
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Publisher
    from .rounds import Pending
    from .sharded import Exchange
    from .signing import LatestHeartbeat
    from .writer import VersionWriter

__all__ = ["Ending", "close_at_exit", "close_exchange"]

_LIVE: weakref.WeakSet[Publisher] = weakref.WeakSet()


class Ending:
    """The :class:`~rollpatch.publisher.Publisher`'s ``close``/``abort`` and context manager
    (a mixin over the publisher's state)."""

    _cond: threading.Condition
    _closing: bool
    _closed: bool
    _aborted: bool
    _error: BaseException | None
    _error_reported: bool
    _pending: Pending
    _worker: threading.Thread | None
    _heartbeat: LatestHeartbeat | None
    _writer: VersionWriter
    _x: Exchange

    def close(self) -> None:
        """Publish what is pending, stop the worker; raises an error not raised before."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
        self._let_go()
        close_exchange(self._x)  # no round can run on it any more
        with self._cond:
            self._closed = True
            if self._error is not None and not self._error_reported:
                self._error_reported = True
                raise self._error

    def abort(self) -> None:
        """Stop now: drop what is pending and start no round with the other ranks (a version
        already in progress ends on its own: its objects may stay as orphans, LATEST stays
        on the last complete version), release the run, and close this rank's exchange, so
        the other ranks raise ``BoardError`` ("rank N aborted") at their next round instead
        of waiting for this one. Never raises the worker's error."""
        with self._cond:
            if self._closed:
                return
            self._closing = self._closed = self._aborted = True
            self._pending.clear()
            self._cond.notify_all()
        closer = getattr(self._x, "abort", None)
        if callable(closer):  # an Exchange of the caller's may have none
            closer()
        self._let_go()
        if self._worker is None or not self._worker.is_alive():  # else the worker does,
            close_exchange(self._x)  # when the round it may be in has ended

    def _let_go(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._writer.lease is not None:
            self._writer.lease.release()

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None and self._x.size > 1:  # the other ranks may never join a round
            self.abort()
        else:
            self.close()


def close_exchange(x: Exchange) -> None:
    """Free the gloo group the publisher made for its exchange, if it made one."""
    from .sharded import GlooExchange

    if isinstance(x, GlooExchange):  # the one this publisher made (not a caller's Exchange)
        x.close()


def close_at_exit(pub: Publisher) -> None:
    """End ``pub`` at interpreter exit if it is still open then."""
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


def end_at_exit(pub: Publisher) -> None:
    """An unsharded publisher publishes what is pending, and so does a sharded one when the
    interpreter exits normally (every rank's exit hook joins the last round); after an
    uncaught exception (``sys.last_value`` is set before the exit hooks run) a sharded one
    is aborted: its peers may wait in their trainers' collectives, and a round would hang."""
    if pub.shards > 1 and getattr(sys, "last_value", None) is not None:
        pub.abort()
    else:
        pub.close()


def _close_all() -> None:
    """End every publisher still open at interpreter exit; report, never hide, errors."""
    for pub in list(_LIVE):
        try:
            end_at_exit(pub)
        except Exception as e:  # noqa: BLE001 (at exit no caller is left to raise to)
            print(f"rollpatch: publisher for run {pub.run!r} failed: {e}", file=sys.stderr)
