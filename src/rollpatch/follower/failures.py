"""What the follower keeps of its failed syncs: its log lines, and the keyframes the engine's
model cannot hold.

- **One line per failure, not per retry.** The background loop retries a failed sync every
  ≤ 30 s for as long as it fails; a failure repeated with the same message is logged again
  at most every :data:`REPEAT_LOG_S`, with how many times it repeated meanwhile (every
  repeat still reaches the status, ``/version`` and ``/ready``). A different failure, or one
  after a successful sync, is logged at once; the sync that ends a run of failures says so
  (``sync_recovered``). A model the engine cannot hold
  (:class:`~rollpatch.errors.IncompatibleModelError`) is logged as an ERROR: no retry fixes
  it.
- **No keyframe fetched twice for nothing.** An :class:`IncompatibleModelError` is
  remembered by the target digest of the keyframe's version (:class:`Unfit`, the last
  :data:`UNFIT_KEEP`): a retry that would boot from the same keyframe raises it again before
  fetching anything (most mismatches are found from the first shard's header; a tensor the
  engine has that the run does not publish only once every shard is read, which is what
  this saves on every retry after the first).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from ..engines.fit import ModelTensors
from ..errors import IncompatibleModelError, RollpatchError, VersionNotFoundError
from ..logs import Every, event
from ..manifest import Manifest

__all__ = [
    "REPEAT_LOG_S",
    "UNFIT_KEEP",
    "FailureLog",
    "Unfit",
    "missing_version",
]

#: Seconds before a failure repeated with the same message is logged again.
REPEAT_LOG_S = 300.0
#: Keyframes remembered as unfit for the engine's model.
UNFIT_KEEP = 8


class FailureLog:
    """Logs ``run``'s failures of ``what`` (a sync, the audit) to ``log`` as the event
    ``{what}_failed`` (run, error_type, error; ``repeated`` and ``since`` for a repeat), each
    message once per ``repeat_s`` (default :data:`REPEAT_LOG_S`, paced by
    :class:`~rollpatch.logs.Every` on ``clock``); ``level``: every line's (default: ERROR for
    an incompatible model, else WARNING). The success that ends a run of failures is the
    event ``{what}_recovered`` (INFO: how long it failed, how many times). Before session 43
    the lines were free text, which alerts had to match by regex (an audit, L6)."""

    def __init__(
        self,
        log: logging.Logger,
        run: str,
        *,
        what: str = "sync",
        level: int | None = None,
        repeat_s: float = REPEAT_LOG_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self._run, self._what, self._level = log, run, what, level
        self._clock = clock
        self._last: str | None = None
        self._pace = Every(repeat_s, clock)  # of the same failure's lines
        self._since = 0.0  # time.time() of the last line, for the message
        self._first: float | None = None  # clock() of this run of failures' first
        self._count = 0  # failures in this run

    def failed(self, e: BaseException) -> None:
        same = _same_as(e)  # what makes two failures the same: not a clock in its context
        if self._first is None:
            self._first = self._clock()
        self._count += 1
        if same != self._last:
            self._pace.reset()  # a different failure is said at once
        self._last = same
        if not self._pace.due():
            self._log.debug(
                "%s: %s failed again: %s: %s", self._run, self._what, type(e).__name__, e
            )
            return
        level = self._level
        if level is None:
            level = logging.ERROR if isinstance(e, IncompatibleModelError) else logging.WARNING
        held = self._pace.said_held
        again = (
            {}
            if not held
            else {
                "repeated": held,  # the same way, since the line before
                "since": time.strftime("%H:%M:%S", time.localtime(self._since)),
            }
        )
        event(
            self._log,
            f"{self._what}_failed",
            level,
            run=self._run,
            error_type=type(e).__name__,
            error=str(e),
            **again,
        )
        self._since = time.time()

    def cleared(self) -> None:
        """A sync succeeded: said when it ends failures; the next failure is logged at once."""
        if self._first is not None:
            event(
                self._log,
                f"{self._what}_recovered",
                run=self._run,
                failed_for_s=round(self._clock() - self._first, 3),
                failures=self._count,
            )
        self._last, self._first, self._count = None, None, 0


def _same_as(e: BaseException) -> str:
    """A failure's identity for the repeat check: its type, message and context less the
    values that are measurements (floats: an expired LATEST's ``expired_s_ago`` grows on
    every retry)."""
    if not isinstance(e, RollpatchError):
        return f"{type(e).__name__}: {e}"
    kept = {k: v for k, v in e.context.items() if not isinstance(v, float)}
    return f"{type(e).__name__}: {e.message} {sorted(kept.items(), key=lambda kv: kv[0])!r}"


class Unfit:
    """Keyframes (by their version's target digest) the engine's model cannot hold, each with
    the model it was found unfit for: an engine restarted with another model (the right one)
    is checked again, not refused from memory until a new keyframe."""

    def __init__(self) -> None:
        self._by_target: OrderedDict[str, tuple[IncompatibleModelError, int | None]] = OrderedDict()

    def check(self, m: Manifest, model: ModelTensors | None) -> None:
        """Raise the remembered error (a new instance) if ``m``'s keyframe was found unfit
        for this ``model`` (the engine's tensors now)."""
        got = self._by_target.get(m.target)
        if got is not None and got[1] == _fingerprint(model):
            e = got[0]
            raise IncompatibleModelError(e.message, hint=e.hint, **e.context)

    def note(self, m: Manifest, e: IncompatibleModelError, model: ModelTensors | None) -> None:
        self._by_target[m.target] = (e, _fingerprint(model))
        self._by_target.move_to_end(m.target)
        while len(self._by_target) > UNFIT_KEEP:
            self._by_target.popitem(last=False)


def _fingerprint(model: ModelTensors | None) -> int | None:
    return None if model is None else hash(tuple(sorted(model.items())))


def missing_version(run: str, want: int, held: list[int] | None) -> VersionNotFoundError:
    """The error for a wanted version with no manifest: asked for by number (``held``: the
    run's versions), say what the run has and why it may be missing; named by LATEST
    (``held`` None), say that LATEST was moved past the manifests."""
    if held is not None:
        has = f"versions {held[0]}..{held[-1]} ({len(held)})" if held else "no versions"
        why = (
            "it is not published yet"
            if not held or want > held[-1]
            else "older ones may have been removed by retention (gc)"
        )
        return VersionNotFoundError(
            f"version {want} is not on the board",
            run=run,
            version=want,
            hint=f"the run has {has}; {why}",
        )
    return VersionNotFoundError(
        f"LATEST names version {want}, which has no manifest on the board",
        run=run,
        version=want,
        hint="LATEST was moved past the manifests (by hand, or by someone who can "
        "write to the store); a signing publisher replaces it, and --trust refuses it",
    )
