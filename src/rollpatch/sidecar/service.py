"""The sidecar service: one engine, its follower, the commit gate, and what they report."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..board import Board
from ..engines.base import EngineAdapter
from ..errors import ConfigError, RollpatchError
from ..follower import Follower, FollowerConfig
from ..logs import event
from ..serving.body import BodyLimits
from .gate import COMMIT_MODES, CommitGate, CommitMode
from .metrics import SidecarMetrics

__all__ = ["Sidecar", "SidecarConfig"]

log = logging.getLogger("rollpatch.sidecar")


@dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    """Sidecar settings (validated)."""

    #: ``drain`` (finish in-flight requests, then commit) or ``pause`` (pause mid-generation).
    commit_mode: CommitMode = "drain"
    #: Drain mode: how long a commit waits for in-flight requests before it pauses the engine
    #: instead (None: no bound). Counted in ``rollpatch_drain_timeouts``.
    drain_timeout_s: float | None = 30.0
    #: Bearer token required by state-changing admin routes (None: no auth; bind to loopback).
    admin_token: str | None = None
    #: How long a request may wait to be admitted while a drain-mode commit runs.
    admit_timeout_s: float = 120.0
    #: How old the cached LATEST may be before a request that needs a newer one re-reads it.
    latest_ttl_s: float = 0.25
    #: Requests with ``max_lag`` are refused (503, another island may answer) while LATEST
    #: has not been read from the board for this long: a stale LATEST would pass them on an
    #: island that cannot see how far behind it is.
    latest_max_age_s: float = 5.0
    #: Bounds on request bodies: size (413), JSON nesting depth (400), receive time (408).
    body: BodyLimits = field(default_factory=BodyLimits)
    #: Timeout of the engine probe behind ``/ready`` (an engine that does not answer within
    #: it makes the sidecar not ready).
    ready_probe_s: float = 2.0
    follower: FollowerConfig | None = None

    def __post_init__(self) -> None:
        if self.commit_mode not in COMMIT_MODES:
            raise ConfigError(
                f"commit_mode must be one of {COMMIT_MODES}",
                field="commit_mode",
                value=self.commit_mode,
            )
        if self.drain_timeout_s is not None and not 0 <= self.drain_timeout_s <= 86400:
            raise ConfigError(
                "drain_timeout_s must be in [0, 86400] or None", field="drain_timeout_s"
            )
        if not 0 < self.admit_timeout_s <= 3600:
            raise ConfigError("admit_timeout_s must be in (0, 3600]", field="admit_timeout_s")
        if not 0 <= self.latest_ttl_s <= 60:
            raise ConfigError("latest_ttl_s must be in [0, 60]", field="latest_ttl_s")
        if not self.latest_ttl_s < self.latest_max_age_s <= 3600:
            raise ConfigError(
                "latest_max_age_s must be in (latest_ttl_s, 3600]", field="latest_max_age_s"
            )
        if not isinstance(self.body, BodyLimits):
            raise ConfigError("body must be a BodyLimits", field="body")
        if not 0 < self.ready_probe_s <= 60:
            raise ConfigError("ready_probe_s must be in (0, 60]", field="ready_probe_s")


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
        self.board = Board(board) if isinstance(board, str) else board
        self.run = run
        self.engine = engine
        self.engine_url = engine_url
        self.gate = CommitGate(
            engine, self.config.commit_mode, drain_timeout_s=self.config.drain_timeout_s
        )
        self.follower = Follower(self.board, run, engine, self.config.follower, gate=self.gate)
        self.metrics = SidecarMetrics()
        self.follower.on_commit.append(self._on_commit)
        self._latest: tuple[float, int | None] = (0.0, None)
        self._latest_read_at: float | None = None  # the last successful read of LATEST
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start following LATEST in the background (the engine becomes ready after boot)."""
        self.follower.start()

    def stop(self) -> None:
        self.follower.stop()

    def latest(self, refresh: bool = False) -> int | None:
        """LATEST as seen recently (re-read when older than ``latest_ttl_s`` or asked)."""
        now = time.monotonic()
        with self._lock:
            seen_at, value = self._latest
        status_latest = self.follower.status().latest
        if status_latest is not None and (value is None or status_latest > value):
            value = status_latest
        if refresh or value is None or now - seen_at > self.config.latest_ttl_s:
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
        """Seconds since LATEST was last read from the board (inf: never)."""
        with self._lock:
            read_at = self._latest_read_at
        return math.inf if read_at is None else time.monotonic() - read_at

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
            bytes_fetched=st.bytes_fetched,
        )
        self.metrics.pause.observe(pause_s)
        last = self.gate.last
        if last is not None:
            self.metrics.drain.observe(last.drain_s)
        self.metrics.drain_timeouts.set(self.gate.drain_timeouts)
        self.metrics.update(self.follower.status())

    def not_ready_reason(self) -> str | None:
        """Why the island cannot serve now (None: it can, as far as the sidecar knows).

        Not ready while no verified version is loaded, or while one weight change has held
        the gate longer than ``admit_timeout_s`` (requests would be refused meanwhile; a
        slot that is never given back shows up here instead of hanging every caller).
        The engine probe is the HTTP app's part (``/ready``).
        """
        if self.follower.version is None:
            if self.follower.status().audits and self.engine.version is None:
                return "the audit found live weights that differ from the version; re-syncing"
            return "no verified version loaded yet"
        stuck = self.gate.busy_for()
        if stuck > self.config.admit_timeout_s:
            what = "admission closed" if not self.gate.admitting else "engine paused"
            return (
                f"a weight commit has run for {stuck:.0f} s ({what}, "
                f"{self.gate.inflight} in flight)"
            )
        return None

    def describe(self) -> dict[str, Any]:
        """What ``/version`` reports."""
        s = self.follower.status()
        self.metrics.update(s)
        return {
            "run": self.run,
            "served": s.version,
            "digest": self.engine.digest,
            "state": s.state.name,
            "latest": self.latest(),
            "lag": s.lag,
            "commit_mode": self.gate.mode,
            "inflight": self.gate.inflight,
            "last_error": s.last_error,
            "bytes_fetched": s.bytes_fetched,
            "commits": s.commits,
            "last_pause_s": self.gate.last_pause_s,
            "last_drain_s": None if self.gate.last is None else self.gate.last.drain_s,
            "drain_timeouts": self.gate.drain_timeouts,
            "audit_mismatches": s.audits,
            "last_stage_s": s.last_stage_s,
        }
