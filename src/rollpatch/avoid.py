"""Objects found corrupt, remembered so that the next plans go around them.

Objects are content-addressed and re-putting identical bytes is a no-op, so a corrupt stored
copy stays corrupt until someone deletes it; a reader that kept planning through it would
never move again (found by bench/soak.py: a follower, then a publisher resuming). Entries
expire after ``ttl_s`` (an operator may have repaired the object) and the memory is bounded.
Followers keep one :class:`BadObjects` across syncs; a publisher resuming uses a fresh one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import NoPathError, ObjectIntegrityError

__all__ = ["BadObjects", "plan_around"]

T = TypeVar("T")


class BadObjects:
    """Keys of objects that failed verification, each for ``ttl_s`` seconds."""

    def __init__(self, *, ttl_s: float = 600.0, max_keys: int = 1024) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, key: str) -> bool:
        """Remember ``key``; False if it was already remembered (and still is)."""
        now = time.monotonic()
        with self._lock:
            fresh = self._until.get(key, 0.0) <= now
            self._until[key] = now + self.ttl_s
            if len(self._until) > self.max_keys:  # forget the oldest
                oldest = min(self._until, key=self._until.__getitem__)
                del self._until[oldest]
            return fresh

    def keys(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, t in self._until.items() if t <= now]:
                del self._until[k]
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
    repaired), and an object found corrupt in this call is the error."""
    avoid = bad.keys()
    corrupt: ObjectIntegrityError | None = None
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
            avoid = frozenset()
    assert corrupt is not None
    raise corrupt
