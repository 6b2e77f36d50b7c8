"""What a follower reports: its state, last error, the LATEST it read, counters and timings.

One condition variable guards all of it; the follower guards its verified version with the
same one, so a status snapshot and ``wait_for`` see them move together.
"""

from __future__ import annotations

import threading
import time

from ..errors import NoPathError
from ..types import ObjectRef
from .config import FollowerState, FollowerStatus

__all__ = ["PastWanted", "Record"]


class PastWanted(NoPathError):
    """sync(want) below the engine's verified version: refused, recorded as no failure."""

    def __init__(self, have: int, want: int, run: str) -> None:
        super().__init__(
            "the engine is past the wanted version; versions only move forward",
            run=run,
            have=have,
            want=want,
        )


class Record:
    """The follower's reportable state (thread-safe through ``cond``, a re-entrant lock)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.state = FollowerState.IDLE
        self.error: BaseException | None = None
        #: The version LATEST named when last read (None: never read, or nothing published).
        self.latest: int | None = None
        #: When LATEST was last read (time.monotonic(); None: never).
        self.latest_at: float | None = None
        #: The failure of the last read that was retried (cleared when a sync succeeds).
        self.retry_error: BaseException | None = None
        self.counts = {
            "bytes": 0,
            "objects": 0,
            "commits": 0,
            "reboots": 0,
            "retries": 0,
            "audits": 0,
            "failures": 0,
            "adoptions": 0,
        }
        self.timings: dict[str, float | None] = {"commit": None, "fetch": None, "stage": None}
        #: The committed version's manifest ``created`` (None: no commit yet).
        self.served_created: float | None = None

    def set(self, state: FollowerState, **kw: BaseException | None) -> None:
        """Enter ``state``; ``error=`` replaces the last error (None clears it)."""
        with self.cond:
            self.state = state
            if "error" in kw:
                self.error = kw["error"]
                if self.error is None:
                    self.retry_error = None
            self.cond.notify_all()

    def count(self, **by: int) -> None:
        """Add to counters (``bytes=``, ``objects=``, ``commits=``, ...), waking waiters."""
        with self.cond:
            for name, n in by.items():
                self.counts[name] += n
            self.cond.notify_all()

    def retried(self, e: BaseException) -> None:
        """A read failed with ``e`` and is tried again."""
        with self.cond:
            self.counts["retries"] += 1
            self.retry_error = e
            self.cond.notify_all()

    def committed(self, pause_s: float, created: float) -> None:
        """A verified commit that paused the engine ``pause_s``, of a version whose manifest
        was ``created`` (Unix seconds)."""
        with self.cond:
            self.timings["commit"] = pause_s
            self.served_created = created
            self.counts["commits"] += 1
            self.cond.notify_all()

    def fetched(self, ref: ObjectRef) -> None:
        """An object (or a keyframe shard read whole) arrived, verified."""
        self.count(bytes=ref.size, objects=1)

    def timing(self, what: str, t0: float) -> None:
        """Record the seconds since ``t0`` (``time.monotonic``) as the last ``what``."""
        with self.cond:
            self.timings[what] = time.monotonic() - t0

    def status(self, version: int | None) -> FollowerStatus:
        """A consistent snapshot, with ``version`` as the verified version."""
        with self.cond:
            latest, err, c, t = self.latest, self.error, self.counts, self.timings
            retry = self.retry_error
            return FollowerStatus(
                state=self.state,
                version=version,
                latest=latest,
                lag=None if version is None or latest is None else max(0, latest - version),
                last_error=None if err is None else f"{type(err).__name__}: {err}",
                error_type=None if err is None else type(err).__name__,
                bytes_fetched=c["bytes"],
                objects_fetched=c["objects"],
                commits=c["commits"],
                reboots=c["reboots"],
                retries=c["retries"],
                last_commit_s=t["commit"],
                last_fetch_s=t["fetch"],
                last_stage_s=t["stage"],
                audits=c["audits"],
                failures=c["failures"],
                adoptions=c["adoptions"],
                latest_age_s=None if self.latest_at is None else time.monotonic() - self.latest_at,
                last_retry_error=None if retry is None else f"{type(retry).__name__}: {retry}",
                served_created=None if version is None else self.served_created,
            )
