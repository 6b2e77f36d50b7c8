"""Which version the follower's background loop syncs to, and what it must match.

- **Exact versions first.** A caller waiting for an exact version (a request's
  ``exact_version``: :meth:`Follower.wait_for` with ``exact=True``) is registered here while it
  waits; the loop then syncs to the lowest such version above the engine's instead of
  LATEST, so the request is served by the version it asked for (before, the loop synced past
  it to LATEST and the request was refused as "older than the served version").
- **LATEST and its manifest agree.** The ``target`` digest LATEST named when read is kept;
  a sync to that version requires its manifest to name the same target
  (:func:`rollpatch.follower.failures.check_latest_target`).

Guarded by the follower record's condition (the caller holds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from threading import Condition

from ..latest import Pointer

__all__ = ["Targets"]


class Targets:
    """The exact versions waited for, and LATEST's ``(version, target)`` as last read."""

    def __init__(self, cond: Condition) -> None:
        self._cond = cond
        self._wanted: list[int] = []
        #: LATEST's ``(version, target)`` as last read (None: not read, or nothing published).
        self.latest: tuple[int, str] | None = None

    def read(self, p: Pointer | None) -> None:
        """LATEST as just read (the caller holds the condition)."""
        self.latest = None if p is None else (p.version, p.target)

    @contextmanager
    def wanted(self, version: int) -> Iterator[None]:
        """``version`` is waited for exactly while the block runs."""
        with self._cond:
            self._wanted.append(version)
        try:
            yield
        finally:
            with self._cond:
                self._wanted.remove(version)

    def next(self, latest: int, current: int | None) -> int:
        """The version to sync to: the lowest one waited for exactly above ``current``, if
        not above ``latest``; else ``latest``."""
        with self._cond:
            above = [v for v in self._wanted if current is None or v > current]
        return min([latest, *above])
