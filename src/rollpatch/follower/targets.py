"""Which version the follower's background loop syncs to, and what it must match.

- **Exact versions first.** A caller waiting for an exact version (a request's
  ``exact_version``: :meth:`Follower.wait_for` with ``exact=True``) is registered here while it
  waits; the loop then syncs to the lowest such version above the engine's instead of
  LATEST, so the request is served by the version it asked for (before, the loop synced past
  it to LATEST and the request was refused as "older than the served version").
- **LATEST and its manifest agree.** The ``target`` digest LATEST named when read is kept;
  a sync to that version requires its manifest to name the same target (:meth:`Targets.check`).

Guarded by the follower record's condition (the caller holds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from threading import Condition

from ..errors import ManifestError
from ..latest import Pointer
from ..manifest import Manifest

__all__ = ["Targets"]


class Targets:
    """The exact versions waited for, and LATEST's ``(version, target)`` as last read."""

    def __init__(self, cond: Condition) -> None:
        self._cond = cond
        self._wanted: list[int] = []
        #: LATEST's ``(version, target)`` as last read (None: not read, or nothing published).
        self.latest: tuple[int, str] | None = None

    def read(self, p: Pointer | None) -> int | None:
        """LATEST as just read (the caller holds the condition); its version."""
        self.latest = None if p is None else (p.version, p.target)
        return None if p is None else p.version

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

    def check(self, m: Manifest) -> None:
        """Refuse to build ``m``'s version when LATEST, read for that version, names another
        target digest (:class:`ManifestError`): the manifest is not the one LATEST points
        at — a relay cache holding a manifest of an earlier run under the same name (deleted
        and published again), or a board edited by hand. Nothing is fetched or written."""
        latest = self.latest
        if latest is None or latest[0] != m.version or latest[1] == m.target:
            return
        raise ManifestError(
            "LATEST and the version's manifest name different target digests",
            run=m.run,
            version=m.version,
            latest_target=latest[1][:16],
            manifest_target=m.target[:16],
            hint="a relay cache may hold a manifest of an earlier run of this name (a run "
            "deleted and published again): clear the relay's cache, or publish under a new "
            "run name",
        )

    def next(self, latest: int, current: int | None) -> int:
        """The version to sync to: the lowest one waited for exactly above ``current``, if
        not above ``latest``; else ``latest``."""
        with self._cond:
            above = [v for v in self._wanted if current is None or v > current]
        return min([latest, *above])
