"""The sidecar service: one engine, its follower, the commit gate, and what they report."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..board import Board
from ..config import check_fields, setting
from ..engines.base import EngineAdapter
from ..errors import ConfigError, RollpatchError
from ..follower import Follower, FollowerConfig, FollowerStatus
from ..logs import Throttle, event
from ..serving.admission import wait_drained
from ..serving.body import BodyLimits
from ..store import open_reader_store
from .boardwatch import BoardWatch
from .gate import CommitGate, CommitMode
from .metrics import SidecarMetrics

__all__ = ["Sidecar", "SidecarConfig"]

log = logging.getLogger("rollpatch.sidecar")


@dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    """Sidecar settings (validated)."""

    commit_mode: CommitMode = setting(
        "drain",
        help="drain: finish in-flight requests, then commit; pause: pause mid-generation",
    )
    #: Counted in ``rollpatch_drain_timeouts``.
    drain_timeout_s: float | None = setting(
        30.0,
        lo=0.0,
        hi=86400.0,
        help="drain mode: seconds a commit waits for in-flight requests before it pauses the "
        "engine instead",
    )
    #: None: no auth; bind to loopback.
    admin_token: str | None = setting(
        None, help="bearer token required by state-changing admin routes"
    )
    admit_timeout_s: float = setting(
        120.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds a request may wait to be admitted while a drain-mode commit runs",
    )
    latest_ttl_s: float = setting(
        0.25,
        lo=0.0,
        hi=60.0,
        help="seconds the cached LATEST may be reused before a request that needs a newer "
        "one re-reads it",
    )
    #: A stale LATEST would pass ``max_lag`` requests on an island that cannot see how far
    #: behind it is; refused, another island may answer.
    latest_max_age_s: float = setting(
        5.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="requests with max_lag are refused (503) while LATEST has not been read for this "
        "many seconds",
    )
    body: BodyLimits = setting(
        factory=BodyLimits,
        help="bounds on request bodies: size (413), JSON nesting depth (400), receive time (408)",
    )
    ready_probe_s: float = setting(
        2.0,
        lo=0.0,
        lo_open=True,
        hi=60.0,
        help="timeout of the engine probe behind /ready (no answer: not ready)",
    )
    #: A wedged engine (a dead tensor-parallel rank, a collective that never returns) answered
    #: no audit call while /ready stayed 200 and its requests hung (found by an audit,
    #: session 39); the audit's slices are small, so an unanswered one is a symptom.
    engine_stall_s: float = setting(
        10.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds an audit call may go unanswered before the island is not ready",
    )
    follower: FollowerConfig | None = setting(
        None, help="how the sidecar's follower polls and fetches (None: the defaults)"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.latest_ttl_s < self.latest_max_age_s:
            raise ConfigError(
                "SidecarConfig.latest_max_age_s must be greater than latest_ttl_s",
                field="latest_max_age_s",
                value=self.latest_max_age_s,
            )


class Sidecar:
    """Owns the follower (through a gated engine) for one engine serving at ``engine_url``."""

    def __init__(
        self,
        board: str | Board,
        run: str,
        engine: EngineAdapter,
        engine_url: str,
        config: SidecarConfig | None = None,
    ) -> None:
        self.config = config or SidecarConfig()
        self.board = Board(open_reader_store(board)) if isinstance(board, str) else board
        self.run = run
        self.engine = engine
        self.engine_url = engine_url
        self.gate = CommitGate(
            engine, self.config.commit_mode, drain_timeout_s=self.config.drain_timeout_s
        )
        self.follower = Follower(self.board, run, engine, self.config.follower, gate=self.gate)
        self.metrics = SidecarMetrics()
        #: Per-request log events (refusals, waits), at most one line per kind per 10 s.
        self.said = Throttle(log)
        self.follower.on_commit.append(self._on_commit)
        self._latest: tuple[float, int | None] = (0.0, None)
        self._latest_read_at: float | None = None  # the last successful read of LATEST
        self._lock = threading.Lock()
        #: Shutting down (:meth:`drain`): new requests are refused, in-flight ones finish.
        self.draining = False
        self._started_at: float | None = None  # time.monotonic() at start()
        #: Says in the log when LATEST goes unread or the run has none (no request needed).
        self._watch = BoardWatch(self)

    def start(self) -> None:
        """Start following LATEST in the background (the engine becomes ready after boot).
        An engine found paused is resumed first (:func:`.paused.resume_left_paused`), once
        this adapter holds it: a second sidecar, refused, must not resume the owner's pause
        (found by a re-check, session 40)."""
        if self.engine.remote:
            from .paused import resume_left_paused

            try:
                self.engine.claim()
                resume_left_paused(
                    self.engine,
                    self.engine_url,
                    self.engine.engine_token,
                    self.config.ready_probe_s,
                )
            except RollpatchError as e:  # another drives it, or it is not up: syncs say so
                log.info("the engine was not claimed or resumed at start: %s", e)
        self._started_at = time.monotonic()
        self.follower.start()
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()
        self.follower.stop()

    @property
    def started_at(self) -> float | None:
        """``time.monotonic()`` when :meth:`start` ran (None: not started)."""
        return self._started_at

    def drain(self, grace_s: float, stop: threading.Event | None = None) -> bool:
        """Stop taking requests (each is answered 503, ``/ready`` says so, so a gateway
        sends them elsewhere) and wait up to ``grace_s`` for those in flight, streams
        included, to finish; ``stop`` set cuts the wait short. True when none is left."""
        self.draining = True
        return wait_drained(lambda: self.gate.inflight, grace_s, stop)

    def cached_latest(self) -> tuple[bool, int | None]:
        """``(fresh, value)``: LATEST as :meth:`latest` knows it without reading the board;
        ``fresh`` is False when :meth:`latest` would read it (safe on the event loop)."""
        now = time.monotonic()
        with self._lock:
            seen_at, value = self._latest
        status_latest = self.follower.status().latest
        if status_latest is not None and (value is None or status_latest > value):
            value = status_latest
        return value is not None and now - seen_at <= self.config.latest_ttl_s, value

    def latest(self, refresh: bool = False) -> int | None:
        """LATEST as seen recently (re-read when older than ``latest_ttl_s`` or asked)."""
        now = time.monotonic()
        fresh, value = self.cached_latest()
        if refresh or not fresh:
            try:
                p = self.board.latest(self.run)
                value = p.version if p is not None else value
                with self._lock:
                    self._latest_read_at = now
            except RollpatchError:
                pass  # keep the cached value; the follower reports board errors
            with self._lock:
                self._latest = (now, value)
        return value

    def latest_age(self) -> float:
        """Seconds since LATEST was last read from the board, by a request or by the
        follower's loop (inf: never)."""
        with self._lock:
            read_at = self._latest_read_at
        mine = math.inf if read_at is None else time.monotonic() - read_at
        theirs = self.follower.status().latest_age_s
        return mine if theirs is None else min(mine, theirs)

    def latest_seen(self) -> int | None:
        """The most recent LATEST known, without reading the board (safe on the event loop)."""
        with self._lock:
            value = self._latest[1]
        status_latest = self.follower.status().latest
        if status_latest is not None and (value is None or status_latest > value):
            return status_latest
        return value

    def _on_commit(self, version: int, pause_s: float) -> None:
        st = self.follower.status()
        event(
            log,
            "commit",
            run=self.run,
            version=version,
            pause_s=round(pause_s, 6),
            fetch_s=st.last_fetch_s,
            stage_s=st.last_stage_s,
            bytes_fetched_total=st.bytes_fetched,  # since the sidecar started
        )
        self.metrics.pause.observe(pause_s)
        if st.served_created is not None:  # publish -> serving, across two hosts' clocks
            self.metrics.commit_age.observe(max(0.0, time.time() - st.served_created))
        last = self.gate.last
        if last is not None and self.gate.mode == "drain":
            self.metrics.drain.observe(last.drain_s)
        self.metrics.drain_timeouts.set(self.gate.drain_timeouts)
        self.refresh_metrics()

    def not_ready_reason(self) -> str | None:
        """Why the island cannot serve now (None: it can, as far as the sidecar knows).

        Not ready while no verified version is loaded, or while one weight change has held
        the gate longer than ``admit_timeout_s`` (requests would be refused meanwhile; a
        slot that is never given back shows up here instead of hanging every caller).
        The engine probe is the HTTP app's part (``/ready``).
        """
        if self.draining:
            return f"the sidecar is shutting down ({self.gate.inflight} request(s) finishing)"
        if self.gate.suspect is not None:
            return (
                f"{self.gate.suspect}; re-checking that it still holds its verified version (a "
                "restarted engine holds its checkpoint's words) before serving again"
            )
        if self.follower.version is None:
            status = self.follower.status()
            if status.audits and self.engine.version is None:
                return "the audit found live weights that differ from the version; re-syncing"
            if status.last_error is not None:  # why, without reading the sidecar's log
                return f"no verified version loaded yet; the last sync failed: {status.last_error}"
            if status.latest is None and math.isinf(self.latest_age()):
                return self._first_read(status)
            if status.latest is None:  # a read completed and found none
                return (
                    f"no verified version loaded yet: run {self.run!r} has no LATEST on the "
                    "board so far (nothing published yet, or another run name)"
                )
            return "no verified version loaded yet"
        waited = self.follower.auditor.waiting_s()
        if waited > self.config.engine_stall_s:
            return (
                f"the engine has not answered an audit call for {waited:.0f} s (wedged: a dead "
                "tensor-parallel rank, a collective that never returns?)"
            )
        stuck = self.gate.busy_for()
        if stuck > self.config.admit_timeout_s:
            what = "admission closed" if not self.gate.admitting else "engine paused"
            return (
                f"a weight commit has run for {stuck:.0f} s ({what}, "
                f"{self.gate.inflight} in flight)"
            )
        return None

    def _first_read(self, status: FollowerStatus) -> str:
        """Not ready because no read of LATEST has completed yet: the board or relay may be
        slow or unreachable (its retries take seconds), which is not "nothing published"
        (audit G-F4)."""
        since = (
            "" if self._started_at is None else f" ({time.monotonic() - self._started_at:.0f} s)"
        )
        why = (
            "" if status.last_retry_error is None else f"; last attempt: {status.last_retry_error}"
        )
        return (
            "no verified version loaded yet: the first read of the board is in progress"
            f"{since}{why}"
        )

    def refresh_metrics(self) -> tuple[FollowerStatus, int | None, int | None]:
        """The gauges from the follower's status now, with the newest LATEST known and the
        lag from it (what ``/version`` says); returns (status, latest, lag). No board read."""
        s = self.follower.status()
        latest = self.latest_seen()
        lag = None if s.version is None or latest is None else max(0, latest - s.version)
        self.metrics.update(s, latest, self.latest_age(), ready=self.not_ready_reason() is None)
        self.metrics.audited(self.follower.auditor, s.audits)
        return s, latest, lag

    def describe(self) -> dict[str, Any]:
        """What ``/version`` reports: the sidecar's own state, never a board read (a stalled
        board must not hold it); ``latest`` is the newest LATEST known, read ``latest_age_s``
        ago, and ``lag`` is from it (as the metrics say it)."""
        s, latest, lag = self.refresh_metrics()
        age = self.latest_age()
        return {
            "run": self.run,
            "served": s.version,
            "digest": None if s.version is None else self.engine.digest,  # of what is served
            "state": s.state.name,
            "latest": latest,
            "latest_age_s": None if math.isinf(age) else round(age, 3),
            "lag": lag,
            "commit_mode": self.gate.mode,
            "kv_across_commit": self.engine.kv_across_commit,
            "inflight": self.gate.inflight,
            "last_error": s.last_error,
            "sync_failures": s.failures,
            "bytes_fetched": s.bytes_fetched,
            "commits": s.commits,
            "adoptions": s.adoptions,
            "last_pause_s": self.gate.last_pause_s,
            # a drain is a drain-mode figure (pause mode closes no admission to drain)
            "last_drain_s": None
            if self.gate.last is None or self.gate.mode != "drain"
            else self.gate.last.drain_s,
            "drain_timeouts": self.gate.drain_timeouts,
            "audit_mismatches": s.audits,
            # the audit's progress, as rollpatch_audit_* (a slice: one audit call answered)
            "audit_slices": self.follower.auditor.slices,
            "audit_bytes": self.follower.auditor.bytes,
            "last_stage_s": s.last_stage_s,
        }
