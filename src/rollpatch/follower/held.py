"""The follower's verified version: the one version it reports, and the only owner of it.

A version is reported only while the engine holds it *and* the follower checked the
engine's digest against that version's manifest on the board: a failed fetch, decode or
commit can never advance it, and an engine whose bits are not what it claims has none until
a keyframe boots it again (docs/follower.md). Guarded by the follower record's condition,
which waiters of :meth:`Held.wait_for` sleep on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..engines import EngineAdapter
from ..errors import RollpatchError, VerificationError, VersionNotFoundError
from ..manifest import Manifest
from .record import Record

log = logging.getLogger("rollpatch.follower")

__all__ = ["Held"]


class Held:
    """The engine's version as the follower verified it (None: unknown)."""

    def __init__(
        self, engine: EngineAdapter, rec: Record, manifest: Callable[[int], Manifest], run: str
    ) -> None:
        self._engine, self._rec, self._manifest, self._run = engine, rec, manifest, run
        self._cond: threading.Condition = rec.cond
        self._version: int | None = None

    @property
    def version(self) -> int | None:
        """The verified version, while the engine still reports holding it."""
        v = self._version
        return v if v is not None and self._engine.version == v else None

    def wait_for(self, version: int, timeout: float) -> bool:
        """Block until the verified version is at least ``version``; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (v := self.version) is None or v < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))  # engine.version may change without us
            return True

    def verified_have(self) -> int | None:
        """The engine's version if its digest is that version's target on this board.

        Not yet reported as the version when nothing was (an engine that booted from an
        older checkpoint, an elastic join): it becomes so once caught up, or on ``have`` if
        the catch-up fails (:meth:`confirm`).
        """
        v, digest = self._engine.version, self._engine.digest
        if v is None or digest is None:
            return None
        try:
            m = self._manifest(v)
        except VersionNotFoundError:
            return None
        if digest != m.target:
            log.warning(
                "%s: engine claims version %d but holds other bits; booting from a keyframe",
                self._run,
                v,
            )
            self.forget()
            return None
        with self._cond:
            if self._version is not None:
                self._version = v
                self._cond.notify_all()
        return v

    def forget(self) -> None:
        """The engine's bits are not what it claims: no version until a keyframe boots it."""
        self.drop("reboots")

    def confirm(self, have: int | None) -> None:
        """Report ``have`` as the version if the engine still verifiably holds it."""
        if have is None or self._engine.version != have:
            return
        try:
            ok = self._engine.digest == self._manifest(have).target
        except RollpatchError:
            return
        if ok:
            self.set(have)

    def commit(self, write: Callable[[], None], want: int, target: str, before: int | None) -> None:
        """``write`` (a commit, under the gate), then ``want`` is the version if the engine
        holds ``target``; else :class:`VerificationError`, and ``before`` stays only if the
        engine still says so."""
        write()
        if self._engine.version != want or self._engine.digest != target:
            self.keep_if_held(before)
            raise VerificationError(
                "engine does not hold the target digest after the commit",
                run=self._run,
                version=want,
                engine=self._engine.name,
            )
        self.set(want)

    def set(self, version: int) -> None:
        """``version`` is verified (a commit checked the engine's digest against it)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def keep_if_held(self, before: int | None) -> None:
        """A commit failed its check: ``before`` stays only if the engine still says so."""
        with self._cond:
            self._version = before if self._engine.version == before else None

    def drop(self, counter: str) -> None:
        """No verified version (``counter`` counts why: "audits", the live words differ from the
        held version; "reboots", the engine's bits are not what it claims)."""
        with self._cond:
            self._version = None
            self._rec.counts[counter] += 1
            self._cond.notify_all()
