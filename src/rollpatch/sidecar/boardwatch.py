"""The sidecar's board watch: says in its log what its metrics show when the board cannot be
followed, with no request or scrape needed.

Every few seconds a thread looks at the sidecar's own state (no board read):

- **LATEST not read for longer than** ``latest_max_age_s`` (a relay that accepts and never
  answers: the follower's read hangs for minutes before a sync fails): ``latest_stale``
  (WARNING, with the age, the follower's last error and its last retried read's), again at
  most once a minute while it lasts; ``latest_fresh`` (INFO, how long it was stale) when a
  read succeeds again;
- **no LATEST for the run** once a read has completed (nothing published yet, or a mistyped
  ``--run``): ``no_latest`` (WARNING, run), at most once a minute.

Before session 43 a sidecar behind a hung relay was silent for 130 s, and one following a
run that does not exist was silent for good (an audit, L2 and L7); ``/ready`` and the gauges
already said it (``rollpatch_latest_age_seconds``, ``rollpatch_ready``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from ..logs import Every, event

if TYPE_CHECKING:
    from .service import Sidecar

__all__ = ["BoardWatch"]

log = logging.getLogger("rollpatch.sidecar")

#: Seconds between two lines of the same condition while it lasts.
REPEAT_S = 60.0


class BoardWatch:
    """The thread that logs ``latest_stale``, ``latest_fresh`` and ``no_latest``."""

    def __init__(self, sc: Sidecar, *, period_s: float | None = None) -> None:
        self.sc = sc
        self.period_s = (
            min(5.0, max(0.1, sc.config.latest_max_age_s / 2)) if period_s is None else period_s
        )
        self._stale = Every(REPEAT_S)
        self._stale_since: float | None = None  # monotonic: when LATEST turned stale
        self._missing = Every(REPEAT_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"rollpatch-boardwatch-{self.sc.run}"
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # a watch must not die of one look
                log.debug("board watch failed", exc_info=True)

    def check(self) -> None:
        """One look at the sidecar's state (also called by tests)."""
        sc = self.sc
        started = sc.started_at
        if started is None or sc.draining:
            return
        age = sc.latest_age()
        if math.isinf(age):  # never read: as old as the sidecar
            age = time.monotonic() - started
        status = sc.follower.status()
        if age > sc.config.latest_max_age_s:
            if self._stale_since is None:
                self._stale_since = time.monotonic() - age
                self._stale.reset()
            if self._stale.due():
                held = {"repeated": self._stale.said_held} if self._stale.said_held else {}
                event(
                    log,
                    "latest_stale",
                    logging.WARNING,
                    run=sc.run,
                    age_s=round(age, 1),
                    max_age_s=sc.config.latest_max_age_s,
                    last_error=status.last_error,
                    last_retry_error=status.last_retry_error,
                    **held,
                )
        elif self._stale_since is not None:
            event(
                log,
                "latest_fresh",
                run=sc.run,
                stale_for_s=round(time.monotonic() - self._stale_since, 1),
            )
            self._stale_since = None
        read = status.latest_age_s is not None
        if read and status.latest is None and status.version is None:
            if self._missing.due():
                event(
                    log,
                    "no_latest",
                    logging.WARNING,
                    run=sc.run,
                    hint="nothing published to this run yet, or another run name (--run)",
                )
        else:
            self._missing.reset()
