"""The follower: keeps one engine on the board's versions of a run (docs/follower.md).

``sync`` is one pass of the state machine IDLE → FETCHING → STAGING → COMMITTING → IDLE (ERROR
on failure); ``start`` runs it whenever LATEST moves. The follower's version is only ever one
the engine holds *and* the follower checked against the board (engine digest == manifest
target): a failed fetch, decode or apply never advances it. Here: the state machine, the commit
and one poll; beside it :mod:`.held`, :mod:`.stage`, :mod:`.record`, :mod:`.watch`, :mod:`.fetch`,
:mod:`.commit` (the gate), :mod:`.audit`, :mod:`.adopt`, and :mod:`rollpatch.avoid` (detours).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..avoid import BadObjects, newest_reachable, plan_around
from ..board import Board, Plan
from ..engines import EngineAdapter
from ..engines.fit import ModelTensors
from ..engines.staged import AuditReport
from ..errors import (
    BaseMismatchError,
    IncompatibleModelError,
    ManifestError,
    NotReadyError,
    ObjectIntegrityError,
    RollpatchError,
    TargetMismatchError,
    VersionNotFoundError,
)
from ..manifest import Manifest
from ..trust import Trust
from ..types import ObjectRef, check_run
from ..view import View
from .adopt import Adopter
from .audit import Auditor
from .commit import CommitGate
from .config import FollowerConfig, FollowerState, FollowerStatus
from .failures import FailureLog, Unfit, missing_version
from .fetch import FetchPool, Retrier, RetryingStore, fetch_objects, trusted_board
from .held import Held
from .lineage import cache_was_stale
from .record import PastWanted, Record
from .stage import (
    EarlyDecode,
    anchor_evidence,
    check_keyframe_fit,
    check_size,
    refused_hop,
    stage_plan,
)
from .targets import Targets
from .watch import LatestHint, WakeEvent, Watcher

__all__ = ["CommitCallback", "Follower"]

log = logging.getLogger("rollpatch.follower")

#: ``(version, pause_s)`` after every verified commit.
CommitCallback = Callable[[int, float], None]
#: Engine bits that are not the plan's base: reboot from a keyframe.
_WRONG_BITS = (BaseMismatchError, TargetMismatchError)


class Follower:
    """Watches a run on a board and commits its versions into ``engine``, verified.

    Thread-safe: ``sync`` calls are serialised; ``status``, ``version`` and ``wait_for`` may
    be called from any thread. ``on_commit`` holds callbacks called with ``(version,
    pause_s)`` after each verified commit, on the syncing thread (an exception in one is
    logged, not raised; a callback must not call :meth:`sync`).
    """

    def __init__(
        self,
        board: str | Board,
        run: str,
        engine: EngineAdapter,
        config: FollowerConfig | None = None,
        *,
        gate: CommitGate | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.board = trusted_board(board, trust, f"follower of {run!r}")
        self.run = check_run(run)
        self.engine = engine
        self.config = config if config is not None else FollowerConfig()
        #: The one owner of the commit sequence (pause mode unless the caller's gate says
        #: otherwise); the sidecar passes the gate it admits requests through.
        self.gate = gate if gate is not None else CommitGate(engine, "pause")
        self.auditor = Auditor.configured(
            engine, self.config, self.gate, on_mismatch=self._on_audit_mismatch
        )
        self.on_commit: list[CommitCallback] = []
        #: The plan of the most recent sync that planned (for reports such as ``pull``).
        self.last_plan: Plan | None = None
        self._rec = Record()
        self._cond = self._rec.cond
        self._sync_lock = threading.Lock()
        self._abort = threading.Event()  # interrupts retry sleeps while stopping
        self._wake = WakeEvent()  # polls LATEST now (ends a long-poll in progress)
        self._held = Held(engine, self._rec, self._manifest, self.run)
        self._retrier = Retrier(self.config, self._abort, self._on_retry)
        self._fetchers = FetchPool(self.config.fetch_workers)  # reused from sync to sync
        self._watcher = Watcher(
            f"rollpatch-follower-{self.run}",
            self._poll,
            self._poll_failed,
            poll_s=self.config.poll_s,
            join_s=self.config.timeout_s + 5.0,
            wake=self._wake,
            abort=self._abort,
            hint=LatestHint(self.board.store, self.run, push_bytes=self.config.push_bytes),
            seen=lambda: self._rec.latest,
        )
        self._bad = BadObjects()  # corrupt objects: plans go around them
        self._failures = FailureLog(log, self.run)  # one log line per failure, not per retry
        self._unfit = Unfit()  # keyframes the engine's model cannot hold
        self._targets = Targets(self._cond)  # exact versions waited for; LATEST's target
        # LATEST, manifests and plans are read through a board whose store retries each read
        self._reader = Board(RetryingStore(self.board.store, self._retrier), trust=self.board.trust)
        self._adopter = Adopter.configured(
            engine, self._reader, self.run, self._manifest, self._rec, self.config
        )

    # -- reporting -----------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The verified version the engine holds (None: unknown, or being re-checked)."""
        return None if self.gate.suspect is not None else self._held.version

    def engine_unreachable(self, why: str) -> None:
        """A request could not reach a remote engine (it may restart with its checkpoint's
        words): no version is served until the audit (or its heartbeat) re-checks it."""
        if self.engine.remote:
            self.gate.lost(why)

    def status(self) -> FollowerStatus:
        """A consistent snapshot of state, versions, counters and timings."""
        with self._cond:
            return self._rec.status(self.version)

    def wait_for(self, version: int, timeout: float, *, exact: bool = False) -> bool:
        """Block until the verified version is at least ``version``; False on timeout. Wakes
        the background loop to poll LATEST at once (without :meth:`start`, another thread must
        call :meth:`sync`). ``exact``: the caller wants ``version`` itself (a request's
        ``exact_version``): meanwhile the loop syncs to it, not past it to LATEST."""
        with self._targets.wanted(version) if exact else contextlib.nullcontext():
            self._wake.set()
            return self._held.wait_for(version, timeout)

    # -- synchronous catch-up ------------------------------------------------------------------

    def sync(self, want: int | None = None) -> int:
        """Bring the engine to ``want`` (default: LATEST); returns its verified version. Raises
        (ERROR recorded, with the reason) when it cannot be reached verified: the engine stays
        on its last good version. A ``want`` below it raises :class:`NoPathError` (no ERROR)."""
        with self._sync_lock:
            try:
                v = self._sync(want)
            except PastWanted:
                raise  # the caller asked for the past; nothing failed
            except NotReadyError as e:
                if self._abort.is_set():  # stopping: the engine was not touched
                    self._rec.set(FollowerState.IDLE)
                else:
                    self._fail(e)
                raise
            except BaseException as e:
                self._fail(e)
                raise
            self._rec.set(FollowerState.IDLE, error=None)
            self._failures.cleared()
            if self._adopter is not None:
                self._adopter.reset()
            return v

    def _sync(self, want: int | None) -> int:
        confirmed = self.version
        if want is not None and confirmed is not None and want < confirmed:
            raise PastWanted(confirmed, want, self.run)
        from_latest = want is None
        if want is None:
            want = self._read_latest()
            if want is None:
                raise VersionNotFoundError("nothing is published on this run yet", run=self.run)
        try:
            return self._sync_to(want)
        except VersionNotFoundError as e:
            if e.context.get("version") != want:
                raise
            held = None if from_latest else self._reader.versions(self.run)
            raise missing_version(self.run, want, held) from None

    def _sync_to(self, want: int) -> int:
        have = self._held.verified_have()
        adopter = self._adopter
        if have is None and adopter is not None and adopter.attempt(want, self._rec.latest):
            have = self._held.verified_have()  # the adopted version, checked as any other
        if have is not None and have >= want:
            self._held.confirm(have)
            if have > want:
                raise PastWanted(have, want, self.run)
            return want
        try:
            return plan_around(
                self._bad, self.run, lambda avoid: self._run_plan(have, want, avoid), log=log
            )
        except _WRONG_BITS as e:
            plan = self.last_plan
            if have is None or plan is None or not plan.steps or plan.steps[0].is_keyframe:
                raise
            msg = "%s@%d: engine bits are not the plan's base (%s); rebooting from a keyframe"
            log.warning(msg, self.run, have, e)
            self._held.forget()
            return self._run_plan(None, want)
        except ObjectIntegrityError:  # nothing held: the newest version it reaches, if any
            can = have is None and self.config.fallback_older  # else no board read
            below = [v for v in self._reader.versions(self.run) if v < want] if can else []
            reach = partial(self._run_plan, None)  # (version, avoid)
            older = newest_reachable(self._bad, self.run, below, reach, log=log)
            if older is None:
                self._held.confirm(have)
                raise
            return older
        except BaseException as e:
            if cache_was_stale(self._reader, self.run, have, e, log):  # then: the engine's
                return self._sync_to(want)  # version against the fresh manifest, once
            self._held.confirm(have)  # the catch-up failed; the engine still holds ``have``
            raise

    def _run_plan(
        self, have: int | None, want: int, avoid: frozenset[str] = frozenset(), rewind: bool = True
    ) -> int:
        # older versions the engine can rebuild from its own commits: zero-cost starts (passed
        # only when there are any: a reader that predates them plans as before)
        sources = self.engine.rewindable() if rewind and have is not None else {}
        kw = {"sources": sources} if sources else {}
        plan = self._reader.plan(self.run, have, want, avoid=avoid, **kw)
        self.last_plan = plan
        check_size(plan, self.config.max_stage_bytes)
        manifests = {
            n: self._manifest(n) for s in plan.steps for n in (s.to, s.base) if n is not None
        }
        self._targets.check(manifests[want])
        boot = manifests[plan.steps[0].to] if plan.steps and plan.steps[0].is_keyframe else None
        model = self.engine.model_tensors() if boot is not None else None  # read now
        if boot is not None:  # found unfit for this model before: not fetched again
            self._unfit.check(boot, model)
        try:
            self._stage_commit(plan, manifests, have, want, avoid, model)
        except IncompatibleModelError as e:
            if boot is not None:
                self._unfit.note(boot, e, model)
            raise
        anchor = anchor_evidence(manifests[want])
        if anchor is not None:  # records older than a fold's base are no longer needed
            self.engine.note_anchor(anchor)
        return want

    def _stage_commit(
        self,
        plan: Plan,
        manifests: dict[int, Manifest],
        have: int | None,
        want: int,
        avoid: frozenset[str],
        model: ModelTensors | None,
    ) -> None:
        """Fetch, stage and commit ``plan`` (the rewind retried as a chain when refused;
        ``model``: the engine's tensors when booting, checked against the keyframe's headers
        before anything is fetched)."""
        if model is not None:
            check_keyframe_fit(self._reader, self.engine, manifests[plan.steps[0].to], model)
        self._rec.set(FollowerState.FETCHING)
        t0 = time.monotonic()
        early = EarlyDecode.for_plan(self.engine, plan, manifests, have)
        try:
            # keyframe objects are streamed while staging (tensor by tensor), not fetched whole
            blobs = fetch_objects(
                self.board,
                (r for s in plan.steps if not s.is_keyframe for r in s.objects),
                self._retrier,
                self._rec.fetched,
                None if early is None else early.arrived,  # shard objects decode on arrival
                workers=self._fetchers,
            )
            self._rec.timing("fetch", t0)
            self._rec.set(FollowerState.STAGING)
            t0 = time.monotonic()
            pre = None if early is None else early.results()  # decoded on arrival
            try:
                write = stage_plan(
                    self.engine, plan, manifests, blobs, have, want, self._fetch_view, pre, model
                )
            except RollpatchError as e:
                if plan.rewinds:  # nothing was written: the engine still holds ``have``
                    log.warning("%s@%s: rewind refused (%s); planning without", self.run, have, e)
                    del blobs
                    self._run_plan(have, want, avoid, rewind=False)
                    return
                if not isinstance(e, (*_WRONG_BITS, ManifestError)):
                    raise
                bad = refused_hop(e, self.engine, plan, manifests, have)
                if bad is not None:  # the object is wrong, not the engine: plan around it
                    raise bad from e
                raise
        finally:
            if early is not None:
                early.close()
        self._rec.timing("stage", t0)
        del blobs
        self._rec.set(FollowerState.COMMITTING)
        self._commit(write, want, manifests[want])

    def _commit(self, write: Callable[[], None], want: int, m: Manifest) -> None:
        """Run ``write`` through the commit gate (the one owner of the pause), check that the
        engine holds ``m``'s target, and record the version before the gate lets go."""
        before = self.version
        self.gate.run(lambda: self._held.commit(write, want, m.target, before))
        pause_s = self.gate.last_pause_s or 0.0
        self._rec.committed(pause_s, m.created)
        for callback in list(self.on_commit):
            try:
                callback(want, pause_s)
            except Exception:  # a subscriber's bug must not undo a verified commit
                log.exception("on_commit callback failed for %s@%d", self.run, want)

    def _on_audit_mismatch(self, report: AuditReport) -> None:
        """Live words differ from the held version: not ready, re-sync (from a keyframe, not
        by adoption, unless the engine restarted: :meth:`.adopt.Adopter.audit_found`)."""
        if self._adopter is not None:
            self._adopter.audit_found(report)
        self._held.drop("audits")
        self.gate.mismatched()
        self._wake.set()

    # -- board reads ---------------------------------------------------------------------------

    def _read_latest(self) -> int | None:
        # LATEST as it reads now, not the highest ever seen: a bad value that was repaired
        # (a pointer far ahead of any manifest) must not stay the follower's target
        p = self._reader.latest(self.run)
        with self._cond:
            version = self._rec.latest = self._targets.read(p)
            self._rec.latest_at = time.monotonic()
        return version

    def _manifest(self, n: int) -> Manifest:
        return self._reader.manifest(self.run, n)

    # -- background loop ---------------------------------------------------------------------

    def start(self) -> None:
        """Watch LATEST every ``poll_s`` in a daemon thread and sync when it moves."""
        self._watcher.start()
        self.auditor.start()

    def stop(self) -> None:
        """Stop the background threads (a commit in progress completes first)."""
        self.auditor.stop()
        self._watcher.stop()
        self._fetchers.discard_idle(self._sync_lock)  # made again by the next sync

    def _poll(self) -> None:
        """One poll of the background loop: sync when LATEST is ahead of the engine."""
        latest = self._read_latest()
        current = self.version
        if latest is not None and (current is None or latest > current):
            self.sync(self._targets.next(latest, current))  # an exact version waited for first
        elif latest is not None and self._rec.state is FollowerState.ERROR:
            self._rec.set(FollowerState.IDLE, error=None)  # caught up again: healthy
            self._failures.cleared()

    def _poll_failed(self, e: Exception) -> None:
        if self._rec.error is not e:  # sync has recorded its own failure already
            self._fail(e)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _fail(self, e: BaseException) -> None:
        self._failures.failed(e)
        self._rec.count(failures=1)
        self._rec.set(FollowerState.ERROR, error=e)

    def _fetch_view(self, ref: ObjectRef, into: Any = None) -> View:
        """A keyframe shard read tensor by tensor (each ranged read retried), verified."""
        view = self._reader.fetch_view(ref, into=into)
        self._rec.fetched(ref)
        return view

    def _on_retry(self, e: BaseException) -> None:
        log.info("%s: retrying after %s: %s", self.run, type(e).__name__, e)
        self._rec.retried(e)
