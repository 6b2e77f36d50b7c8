"""The commit gate: how weight commits and in-flight requests share one engine.

Commit modes:

- ``drain``: stop admitting, let in-flight requests finish, apply, resume admitting. A
  response's start and end versions are always equal.
- ``pause``: pause the engine between tokens (in-flight requests keep their place), apply,
  resume; a response that spans the commit reports ``version_start < version_end``.

Staging (fetch, verify, decode) happens outside the gate, while serving; only the commit
itself holds it. :class:`GatedEngine` wraps an adapter so the follower commits through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

from ..engines.base import EngineAdapter
from ..errors import ConfigError, NotReadyError
from ..patch import Patch
from ..view import View, WordSource

__all__ = ["COMMIT_MODES", "Admission", "CommitGate", "GatedEngine"]

COMMIT_MODES = ("drain", "pause")
T = TypeVar("T")


class Admission:
    """One admitted request's place in the gate: a context manager that releases the slot on
    every way out, exceptions included (a leaked slot would hold every later drain commit).

    ``start`` is the version when admitted. :meth:`release` is idempotent and returns the
    version at the (first) release; a stream that outlives its handler calls
    :meth:`hand_off` and then releases when it ends.
    """

    def __init__(self, gate: CommitGate, start: int | None) -> None:
        self._gate = gate
        self.start = start
        self._lock = threading.Lock()
        self._end: int | None = None
        self._released = False
        self._handed_off = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> int | None:
        """Give the slot back (once); the engine's version at that moment."""
        with self._lock:
            if not self._released:
                self._released = True
                self._end = self._gate._exit()
            return self._end

    def hand_off(self) -> Admission:
        """Leaving the ``with`` block no longer releases: the new owner must :meth:`release`."""
        self._handed_off = True
        return self

    def __enter__(self) -> Admission:  # noqa: PYI034 (typing.Self needs 3.11)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None or not self._handed_off:
            self.release()


class CommitGate:
    """Counts in-flight requests and serialises commits against them."""

    def __init__(self, engine: EngineAdapter, mode: str = "drain") -> None:
        if mode not in COMMIT_MODES:
            raise ConfigError(f"commit mode must be one of {COMMIT_MODES}", mode=mode)
        self.engine = engine
        self.mode = mode
        self._cond = threading.Condition()
        self._inflight = 0
        self._committing = False   # drain mode: admission closed
        self._busy = 0             # any mode: a weight change is running
        self._busy_since: float | None = None  # monotonic start of the running weight change
        self._held: int | None = None  # the verified version when the weight change began
        self.last_pause_s: float | None = None
        self.pauses: list[float] = []

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def admitting(self) -> bool:
        """False while a drain-mode commit holds admission closed."""
        return not self._committing

    def busy_for(self) -> float:
        """Seconds the running weight change (drain wait included) has taken; 0 when none."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def admit(self, timeout: float | None = None) -> Admission:
        """Admit one request (waits while a drain-mode commit runs); use it as a context
        manager. :class:`NotReadyError` when admission stays closed past ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._committing, timeout):
                raise NotReadyError("a weight commit is taking too long; not admitting",
                                    hint="retry shortly; see /version for the commit state")
            self._inflight += 1
            return Admission(self, self.served())

    def served(self) -> int | None:
        """The version whose weights produce tokens now. While a weight change runs, an
        adapter may report none (its bits are changing), but in pause mode the engine makes
        no token until it resumes: what it produced up to now came from the version it held
        when the change began (a failed change restores that version or reports none)."""
        v = self.engine.version
        return self._held if v is None and self._busy else v

    def _exit(self) -> int | None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()
            return self.served()

    def wait_commit(self, timeout: float) -> bool:
        """Wait until no weight change runs (an engine may report no version meanwhile)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    @property
    def busy(self) -> bool:
        return self._busy > 0

    def commit(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a weight change) under the mode's rule; records the pause."""
        with self._cond:
            if self._busy == 0:
                self._held = self.engine.version
            self._busy += 1
            if self._busy_since is None:
                self._busy_since = time.monotonic()
        try:
            return self._commit(fn)
        finally:
            with self._cond:
                self._busy -= 1
                if self._busy == 0:
                    self._busy_since = None
                    self._held = None
                self._cond.notify_all()

    def _commit(self, fn: Callable[[], T]) -> T:
        if self.mode == "drain":
            with self._cond:
                self._cond.wait_for(lambda: not self._committing)
                self._committing = True
                self._cond.wait_for(lambda: self._inflight == 0)
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self._record(time.perf_counter() - t0)
                with self._cond:
                    self._committing = False
                    self._cond.notify_all()
        t0 = time.perf_counter()
        self.engine.pause()
        try:
            return fn()
        finally:
            self.engine.resume()
            self._record(time.perf_counter() - t0)

    def _record(self, seconds: float) -> None:
        self.last_pause_s = seconds
        self.pauses.append(seconds)
        del self.pauses[:-1000]


class GatedEngine(EngineAdapter):
    """An adapter whose weight changes go through a :class:`CommitGate`."""

    def __init__(self, inner: EngineAdapter, gate: CommitGate) -> None:
        self.inner = inner
        self.gate = gate
        self.name = inner.name

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def digest(self) -> str | None:
        return self.inner.digest

    def load(self, view: View, version: int) -> None:
        self.gate.commit(lambda: self.inner.load(view, version))

    def words(self) -> WordSource:
        return self.inner.words()

    def apply(self, patch: Patch, version: int) -> None:
        self.gate.commit(lambda: self.inner.apply(patch, version))

    def decodes_itself(self, n_objects: int) -> bool:
        return self.inner.decodes_itself(n_objects)

    def commit_encoded(self, blobs: Sequence[bytes], base_digest: str, target_digest: str,
                       version: int) -> bool:
        if not self.inner.decodes_itself(len(blobs)):
            return False  # no gate, no pause
        return self.gate.commit(lambda: self.inner.commit_encoded(blobs, base_digest,
                                                                  target_digest, version))

    def close(self) -> None:
        self.inner.close()
