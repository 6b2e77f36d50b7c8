"""Objects found corrupt, remembered so that the next plans go around them.

Objects are content-addressed and re-putting identical bytes is a no-op, so a corrupt stored
copy stays corrupt until someone deletes it; a reader that kept planning through it would
never move again (found by bench/soak.py: a follower, then a publisher resuming). Entries
expire after ``ttl_s`` (an operator may have repaired the object) and the memory is bounded.
Followers keep one :class:`BadObjects` across syncs; a publisher resuming uses a fresh one.

When no path avoids the remembered objects, they are tried again (an operator may have
repaired one), on a backoff: at once, then after 1, 2, 4, … s, at most ``recheck_s`` apart. A
follower used to download the same corrupt object again on every sync while no sound path
existed (found by the soak: one island fetched it 5–7 times before the publisher's new
keyframe appeared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import NoPathError, ObjectIntegrityError

__all__ = ["FALLBACK_TRIES", "BadObjects", "newest_reachable", "plan_around"]

T = TypeVar("T")
#: Earlier versions a follower with nothing verified tries when the newest is unreachable.
FALLBACK_TRIES = 4


class BadObjects:
    """Keys of objects that failed verification, each for ``ttl_s`` seconds. When nothing
    else is left, a key may be tried again (:meth:`due`): at once the first time, then after
    1, 2, 4, … seconds, at most ``recheck_s`` apart (a re-check that finds it still corrupt
    does not restart the schedule)."""

    def __init__(
        self, *, ttl_s: float = 600.0, max_keys: int = 1024, recheck_s: float = 60.0
    ) -> None:
        if not ttl_s > 0 or not recheck_s >= 0 or max_keys < 1:
            raise ValueError("ttl_s > 0, recheck_s >= 0 and max_keys >= 1 are required")
        self.ttl_s, self.max_keys, self.recheck_s = ttl_s, max_keys, recheck_s
        self._until: dict[str, float] = {}
        self._recheck: dict[str, tuple[float, float]] = {}  # key -> (next re-check, interval)
        self._lock = threading.Lock()

    def add(self, key: str) -> bool:
        """Remember ``key``; False if it was already remembered (and still is)."""
        now = time.monotonic()
        with self._lock:
            fresh = self._until.get(key, 0.0) <= now
            self._until[key] = now + self.ttl_s
            if fresh:
                self._recheck[key] = (now, 0.0)
            if len(self._until) > self.max_keys:  # forget the oldest
                oldest = min(self._until, key=self._until.__getitem__)
                del self._until[oldest]
                self._recheck.pop(oldest, None)
            return fresh

    def due(self, keys: frozenset[str]) -> frozenset[str]:
        """Those of ``keys`` whose re-check time has come; the next one is scheduled."""
        now = time.monotonic()
        with self._lock:
            out = []
            for k in keys:
                at, interval = self._recheck.get(k, (0.0, 0.0))
                if at <= now:
                    interval = min(self.recheck_s, max(1.0, 2 * interval))
                    self._recheck[k] = (now + interval, interval)
                    out.append(k)
            return frozenset(out)

    def keys(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, t in self._until.items() if t <= now]:
                del self._until[k]
                self._recheck.pop(k, None)
            return frozenset(self._until)


def plan_around(
    bad: BadObjects,
    run: str,
    run_plan: Callable[[frozenset[str]], T],
    *,
    log: logging.Logger,
    tries: int = 4,
) -> T:
    """``run_plan(avoid)`` with the objects ``bad`` remembers avoided; when one of the plan's
    objects is corrupt, remember it and plan around it (at most ``tries`` plans). With no way
    around, the objects remembered from earlier calls are tried again (they may have been
    repaired; on :meth:`BadObjects.due`'s backoff: until a re-check is due,
    :class:`ObjectIntegrityError` naming them, without a download), and an object found corrupt in this call is the error."""
    avoid = bad.keys()
    corrupt: ObjectIntegrityError | None = None
    no_path: NoPathError | None = None
    for _ in range(tries):
        try:
            return run_plan(avoid)
        except ObjectIntegrityError as e:
            key = e.context.get("key")
            if not isinstance(key, str) or key in avoid:
                raise
            bad.add(key)
            avoid, corrupt = avoid | {key}, e
            log.warning("%s: object %s is corrupt; planning around it", run, key)
        except NoPathError as e:
            if corrupt is not None:
                raise corrupt from e  # no way around: the corruption is the cause
            if not avoid:
                raise
            no_path = e
            due = bad.due(avoid)
            if not due:  # no re-check due yet: no download of a known-bad object
                raise ObjectIntegrityError(
                    "every path uses an object found corrupt (checked again after a backoff)",
                    run=run,
                    avoiding=sorted(avoid),
                ) from e
            log.info(
                "%s: no path around %d corrupt object(s); checking %s again",
                run,
                len(avoid),
                ", ".join(sorted(due)),
            )
            avoid = avoid - due
    if corrupt is not None:
        raise corrupt
    assert no_path is not None
    raise no_path


def newest_reachable(
    bad: BadObjects,
    run: str,
    below: list[int],
    run_plan: Callable[[int, frozenset[str]], T],
    *,
    log: logging.Logger,
    tries: int = FALLBACK_TRIES,
) -> T | None:
    """For an engine that holds nothing verified and cannot reach the version it wants (every
    path uses a corrupt object): ``run_plan(version, avoid)`` for the newest of ``below``
    (earlier versions, ascending) that it reaches, trying at most ``tries`` of them; None when
    none is reached. A version behind serves every request that allows it, labelled as
    what it is; nothing served refused them all (found by an audit, session 38: a booting
    island behind a relay that served one rotten object stayed at none)."""
    for version in reversed(below[-tries:]):

        def to(avoid: frozenset[str], v: int = version) -> T:
            return run_plan(v, avoid)

        try:
            out = plan_around(bad, run, to, log=log)
        except (ObjectIntegrityError, NoPathError):
            continue
        log.warning(
            "%s: no sound path to the newest version (a corrupt object); serving version %d "
            "meanwhile",
            run,
            version,
        )
        return out
    return None
