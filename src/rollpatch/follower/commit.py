"""The commit sequence, owned in one place: admission, drain or pause, write, resume.

:class:`CommitGate` is the only component that pauses an engine for a weight change. The
follower stages a commit while the engine serves, then hands the gate a *write* (the
engine's :meth:`~rollpatch.engines.EngineAdapter.commit_staged`: scatter, refresh derived
buffers, reset caches, read back); the gate runs it under its mode's rule and records **one
pause figure** per commit, which the follower, the sidecar's metrics and ``/version`` all
report.

Modes (:data:`CommitMode`):

- ``pause``: pause the engine between tokens (in-flight requests keep their place), write,
  resume; a response that spans the commit reports ``version_start < version_end``.
- ``drain``: stop admitting, let in-flight requests finish, write, admit again; a response's
  start and end versions are equal. The drain waits at most ``drain_timeout_s``; past it the
  commit switches to pause mode for this once (``drain_timeouts`` counts it), so one long
  generation cannot hold a version back indefinitely.

*pause* is the time generation is held for the write: from the engine's pause (or, in drain
mode, from the moment the last in-flight request finished) to its resume; for an engine that
:attr:`~rollpatch.engines.EngineAdapter.pauses_itself`, the write call itself (the gate does
not pause it; the engine holds generation within that call). *drain* is the time admission
was closed before that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from ..engines.base import EngineAdapter
from ..errors import ConfigError, NotReadyError
from ..serving.admission import Slot

__all__ = ["COMMIT_MODES", "Admission", "CommitGate", "CommitMode", "CommitRecord"]

log = logging.getLogger("rollpatch.follower")

CommitMode = Literal["drain", "pause"]
COMMIT_MODES: tuple[str, ...] = get_args(CommitMode)
T = TypeVar("T")


@dataclass(frozen=True)
class CommitRecord:
    """One commit as the gate ran it: ``pause_s`` (generation held for the write),
    ``drain_s`` (admission closed before it), ``mode`` (the rule used: a drain past its
    deadline is recorded as ``pause``), ``ok`` (the write returned)."""

    pause_s: float
    drain_s: float
    mode: CommitMode
    ok: bool


class Admission(Slot):
    """One admitted request's place in the gate: a context manager that releases the slot on
    every way out, exceptions included (a leaked slot would hold every later drain commit).

    ``start`` is the version when admitted. :meth:`release` is idempotent and returns the
    version at the (first) release; a stream that outlives its handler calls
    :meth:`hand_off` and then releases when it ends (the edge kit's
    :class:`~rollpatch.serving.admission.Slot`).
    """

    def __init__(self, gate: CommitGate, start: int | None) -> None:
        super().__init__(gate._exit)
        self.start = start

    def release(self) -> int | None:
        """Give the slot back (once); the engine's version at that moment."""
        end: int | None = super().release()
        return end


class CommitGate:
    """Counts in-flight requests and runs every weight change of one engine (module docstring).

    ``drain_timeout_s``: how long a drain commit waits for in-flight requests before it
    switches to pause mode (None: no bound).
    """

    def __init__(
        self,
        engine: EngineAdapter,
        mode: CommitMode = "pause",
        *,
        drain_timeout_s: float | None = 30.0,
    ) -> None:
        if mode not in COMMIT_MODES:
            raise ConfigError(f"commit mode must be one of {COMMIT_MODES}", mode=mode)
        if drain_timeout_s is not None and not 0 <= drain_timeout_s <= 86400:
            raise ConfigError(
                "drain_timeout_s must be in [0, 86400] or None",
                field="drain_timeout_s",
                value=drain_timeout_s,
            )
        self.engine = engine
        self.mode: CommitMode = mode
        self.drain_timeout_s = drain_timeout_s
        self._cond = threading.Condition()
        self._run_lock = threading.Lock()  # one weight change at a time
        self._inflight = 0
        self._committing = False  # drain mode: admission closed
        self._busy = 0  # any mode: a weight change is running
        self._busy_since: float | None = None
        self._held: int | None = None  # the verified version when the weight change began
        self.last: CommitRecord | None = None
        self.pauses: list[float] = []
        self.drain_timeouts = 0
        #: Why the served version is not vouched for now (None: it is): contact with a remote
        #: engine was lost, and it may have restarted from its boot checkpoint since.
        self.suspect: str | None = None

    # -- contact with the engine -------------------------------------------------------------

    def suspend(self, why: str) -> None:
        """Serve no version (no request is labelled with one) until :meth:`confirm`: the
        engine was unreachable, so the words behind its version may be another's by now
        (``why``: what put them in doubt, said in the refusals and /ready)."""
        with self._cond:
            if self.suspect is None:
                log.warning(
                    "engine %s: %s; serving nothing until it is re-checked", self.engine.name, why
                )
            self.suspect = why
            self._cond.notify_all()

    def contact(self, answered: bool) -> None:
        """The audit's word on the engine: it answered (:meth:`confirm`), or not (suspend)."""
        if answered:
            self.confirm()
        else:
            self.lost("the audit could not reach it")

    def taken(self) -> None:
        """Another adapter drives the engine now (one sidecar per engine): said as such, not as
        a lost contact (found by a re-check, session 40)."""
        self.suspend(
            "another rollpatch adapter (a second sidecar?) drives the engine now; this one "
            "serves nothing until it holds it again"
        )

    def lost(self, why: str) -> None:
        """A remote engine did not answer (``why``): it may restart with its checkpoint's words."""
        self.suspend(f"contact with the engine was lost ({why})")

    def mismatched(self) -> None:
        """An audit found live words that differ from the version: an adapter must then hold
        none; one that keeps it (against its contract) serves nothing all the same, until a
        verified commit or a clean audit."""
        if self.engine.version is not None:
            log.error("engine %s kept its version after a mismatch (a bug)", self.engine.name)
            self.suspend("the audit found live words that differ from its version")

    def confirm(self) -> None:
        """The engine answered an identity check (the audit), or took a verified commit."""
        with self._cond:
            if self.suspect is not None:
                log.info(
                    "engine %s: re-checked; serving its verified version again", self.engine.name
                )
            self.suspect = None
            self._cond.notify_all()

    # -- admission -----------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def admitting(self) -> bool:
        """False while a drain-mode commit holds admission closed."""
        return not self._committing

    @property
    def last_pause_s(self) -> float | None:
        """The pause of the most recent commit (the one figure reported everywhere)."""
        return None if self.last is None else self.last.pause_s

    def busy_for(self) -> float:
        """Seconds the running weight change (drain wait included) has taken; 0 when none."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def admit(self, timeout: float | None = None) -> Admission:
        """Admit one request (waits while a drain-mode commit runs); use it as a context
        manager. :class:`NotReadyError` when admission stays closed past ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._committing, timeout):
                raise NotReadyError(
                    "a weight commit is taking too long; not admitting",
                    hint="retry shortly; see /version for the commit state",
                )
            self._inflight += 1
            return Admission(self, self._served())

    def served(self) -> int | None:
        """The version whose weights produce tokens now.

        While a weight change runs the engine makes no token (paused or drained) until it
        resumes, so what it produced came from the version it held when the change began;
        read under the gate's lock, so a change that ends between two reads cannot turn a
        served version into none.
        """
        with self._cond:
            return self._served()

    def _served(self) -> int | None:
        if self.suspect is not None:
            return None
        v = self.engine.version
        return self._held if v is None and self._busy else v

    def _exit(self) -> int | None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()
            return self._served()

    def wait_commit(self, timeout: float) -> bool:
        """Wait until no weight change runs."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    @property
    def busy(self) -> bool:
        return self._busy > 0

    # -- the commit sequence -------------------------------------------------------------------

    def run(self, write: Callable[[], T]) -> T:
        """Run ``write`` (one weight change) under the mode's rule; records :attr:`last`."""
        with self._run_lock:
            with self._cond:
                self._held = self.engine.version
                self._busy += 1
                self._busy_since = time.monotonic()
            try:
                return self._run(write)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._busy_since = None
                    self._held = None
                    self._cond.notify_all()

    def _run(self, write: Callable[[], T]) -> T:
        t_close = time.perf_counter()
        mode = self.mode
        if mode == "drain":
            with self._cond:
                self._committing = True
                drained = self._cond.wait_for(lambda: self._inflight == 0, self.drain_timeout_s)
            if not drained:
                mode = "pause"
                self.drain_timeouts += 1
        ok = False
        pause = mode == "pause" and not self.engine.pauses_itself
        t0 = time.perf_counter()
        try:
            if pause:
                self.engine.pause()
            try:
                out = write()
                ok = True
                with self._cond:  # a verified commit: the engine answered, and holds it
                    self.suspect = None
                return out
            finally:
                if pause:
                    self.engine.resume()
        finally:
            t1 = time.perf_counter()
            with self._cond:
                self._committing = False
                self._cond.notify_all()
            self._record(CommitRecord(t1 - t0, t0 - t_close, mode, ok))

    def _record(self, rec: CommitRecord) -> None:
        self.last = rec
        self.pauses.append(rec.pause_s)
        del self.pauses[:-1000]
