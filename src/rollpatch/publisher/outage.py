"""Riding out a store outage (``PublisherConfig.outage_s``).

A store that stops answering (S3 down, a network partition, a relay restarting) makes the
version in progress fail with :class:`~rollpatch.errors.TransientStoreError` once the store
client's own retries are spent (botocore: 5 attempts, a few seconds). Before session 41 that
stopped the publisher for good and every later ``publish()`` raised it; a trainer had to
build a new :class:`~rollpatch.publisher.Publisher` itself (docs/publisher.md). Now the
publisher does what that new one would do: it keeps the failed snapshot (newer ones still
coalesce it away), waits (0.5 s doubling up to 30 s), and resumes from the board's LATEST
once the store answers, exactly as a publisher started on the run resumes (a manifest that
was written before LATEST failed is rolled forward; the base is rebuilt from the board).
Only after ``outage_s`` seconds of failures does it stop with the store's error.

Sharded publishers stop at once, as before: their ranks would have to agree on each retry.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import TransientStoreError
from ..logs import Every, event

__all__ = ["OUTAGE_LOG_S", "Outage", "is_outage"]

log = logging.getLogger("rollpatch.publisher")
T = TypeVar("T")

#: Seconds between two WARNINGs about the same outage (the first at once).
OUTAGE_LOG_S = 60.0
_FIRST_WAIT_S = 0.5
_MAX_WAIT_S = 30.0


def is_outage(e: BaseException) -> bool:
    """Whether ``e`` says the store is unreachable or overloaded (safe to retry later)."""
    return isinstance(e, TransientStoreError)


class Outage:
    """One publisher's store outages: when the current one began, how long to wait before
    the next try, and when to give up (``limit_s``: 0 at the first failure, None never)."""

    def __init__(
        self,
        run: str,
        limit_s: float | None,
        cond: threading.Condition,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``cond``: notified when the publisher closes (a wait ends then)."""
        self.run, self._clock, self._cond = run, clock, cond
        self.limit_s = math.inf if limit_s is None else limit_s
        self.since: float | None = None  # the current outage's first failure
        self._tries = 0
        self._pace = Every(OUTAGE_LOG_S, clock)
        #: Outages ridden out (the store answered again before ``limit_s``).
        self.ridden = 0

    def ride(
        self,
        error: BaseException,
        version: int | None,
        attempt: Callable[[], tuple[int | None, T]],
        *,
        closing: Callable[[], bool],
    ) -> tuple[int | None, T]:
        """After ``error`` (an outage) failed ``version``: wait the backoff and ``attempt`` the
        resume until it succeeds; raises the last error once over the limit or when
        ``closing()``, or any other error the attempt raises."""
        while True:
            wait = self.wait(error, version)
            with self._cond:
                if wait is not None and not closing():
                    self._cond.wait(wait)  # close() notifies
                if wait is None or closing():
                    raise self.over_limit(error)
            try:
                out = attempt()
            except BaseException as e:  # an outage again: waits more
                if not is_outage(e):
                    raise
                error = e
                continue
            self.resumed(out[0])
            return out

    def wait(self, error: BaseException, version: int | None) -> float | None:
        """Seconds to wait before the next try after ``error``; None: give up (over the limit).
        Logs a WARNING when an outage begins, then at most one per :data:`OUTAGE_LOG_S`."""
        now = self._clock()
        if self.since is None:
            self.since, self._tries = now, 0
            self._pace.reset()  # the first line of an outage at once
        elapsed = now - self.since
        if elapsed >= self.limit_s:
            return None
        w = min(_MAX_WAIT_S, _FIRST_WAIT_S * 2**self._tries)
        self._tries += 1
        w = min(w, self.limit_s - elapsed)
        if self._pace.due():
            event(
                log,
                "store_unreachable",
                logging.WARNING,
                run=self.run,
                error_type=type(error).__name__,
                error=str(error),
                version=version,  # not published yet; publish() goes on accepting versions
                retrying_for_s=None if self.limit_s == math.inf else self.limit_s,  # outage_s
                elapsed_s=round(elapsed, 1),
            )
        return w

    def over_limit(self, error: BaseException) -> BaseException:
        """The error the publisher stops with: over ``limit_s``, or closed during an outage."""
        if self.since is None or not self.limit_s or not isinstance(error, TransientStoreError):
            return error
        elapsed = self._clock() - self.since
        why = (
            f"more than outage_s={self.limit_s:g}: the publisher stopped"
            if elapsed >= self.limit_s
            else "when the publisher closed"
        )
        return TransientStoreError(
            f"{error.message} (the store was unreachable for {elapsed:.0f} s, {why})",
            hint="a new Publisher on the run resumes from the board's LATEST",
            **error.context,
        )

    def resumed(self, top: int | None) -> None:
        """The store answered again: the publisher resumed from ``top``."""
        if self.since is None:
            return
        event(
            log,
            "store_back",
            logging.WARNING,
            run=self.run,
            outage_s=round(self._clock() - self.since, 1),
            resumed_from=top,
        )

    def elapsed(self) -> float | None:
        """Seconds since the current outage began (None: the store answers)."""
        return None if self.since is None else self._clock() - self.since

    def ended(self) -> None:
        """A version became durable: the current outage (if any) is over."""
        if self.since is not None:
            self.ridden += 1
            self.since = None
