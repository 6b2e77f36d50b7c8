"""Prometheus metrics of one sidecar (a private registry per sidecar; shapes shared with the
gateway in :mod:`rollpatch.serving.metrics`).

Cumulative values kept by the follower, the gate, the auditor and the engine pool are
counters (``*_total``) read whole at each scrape (:class:`~rollpatch.serving.metrics.Total`);
none has a ``*_created`` series.
"""

from __future__ import annotations

from typing import Any

from ..serving.metrics import Outcome, Registry, VersionGauges, lag_value

__all__ = ["SidecarMetrics"]


class SidecarMetrics:
    """Versions (-1: none), lag, bytes fetched, apply/pause durations, requests by outcome,
    the live-weights audit."""

    def __init__(self) -> None:
        self._reg = r = Registry()
        self.registry = r.registry
        self.versions = VersionGauges.build(
            r, "rollpatch_", ("verified version the engine serves", "LATEST seen on the board")
        )
        self.bytes_fetched = r.total("rollpatch_bytes_fetched", "bytes fetched from the board")
        self.commits = r.total("rollpatch_commits", "verified commits")
        self.adoptions = r.total(
            "rollpatch_adoptions",
            "versions taken from the words the engine booted with, no keyframe fetched "
            "(--boot adopt)",
        )
        self.failures = r.total("rollpatch_sync_failures", "failed syncs, every retry counted")
        self.failing = r.gauge(
            "rollpatch_sync_failing",
            "1 while the last sync failed (why: /ready and /version's last_error), else 0",
        )
        self.ready = r.gauge(
            "rollpatch_ready",
            "1 while the sidecar can serve (its part of /ready: a verified version loaded, no "
            "commit stuck, not shutting down; the engine's own probe aside), else 0",
        )
        self.served_created = r.gauge(
            "rollpatch_served_published_timestamp_seconds",
            "creation time (Unix s, the publisher's clock) of the served version's manifest; "
            "NaN while none: time() minus it is how old the served policy is",
        )
        self.commit_age = r.histogram(
            "rollpatch_commit_age_seconds",
            "from a version's creation on the board to its commit here (publish -> serving; "
            "two hosts' clocks)",
            (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.latest_age = r.gauge(
            "rollpatch_latest_age_seconds",
            "seconds since LATEST was last read from the board (-1: never); grows while the "
            "board or relay hangs, when nothing else moves: alert on it",
        )
        self.pause = r.histogram(
            "rollpatch_commit_pause_seconds",
            "engine pause per commit",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.drain = r.histogram(
            "rollpatch_commit_drain_seconds",
            "admission closed before a drain-mode commit's write",
            (0.001, 0.01, 0.1, 1, 5, 30, 120),
        )
        self.drain_timeouts = r.total(
            "rollpatch_drain_timeouts",
            "drain commits that hit the drain deadline and paused instead",
        )
        self.requests = r.counter("rollpatch_requests", "requests by outcome", ["outcome"])
        self.latency = r.histogram(
            "rollpatch_proxy_seconds",
            "proxied request duration (a long generation takes minutes)",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.engine_connections = r.total(
            "rollpatch_engine_connections_opened",
            "connections opened to the engine by the proxied routes (keep-alive reuse keeps "
            "it near the peak of concurrent requests)",
        )
        self.audit_slices = r.total(
            "rollpatch_audit_slices", "audit slices the engine re-hashed (live weights)"
        )
        self.audit_bytes = r.total("rollpatch_audit_bytes", "bytes of live weights re-hashed")
        self.audit_passes = r.total(
            "rollpatch_audit_passes", "full rounds of the audit over the model's weights"
        )
        self.audit_mismatches = r.total(
            "rollpatch_audit_mismatches",
            "audits that found live weights other than the served version's (alert on any "
            "increase: the island left rotation and re-synced)",
        )
        self._by_outcome: dict[str, Any] = {}  # the labelled children, looked up once each

    def request(self, outcome: Outcome, seconds: float | None = None) -> None:
        child = self._by_outcome.get(outcome)
        if child is None:
            child = self._by_outcome[outcome] = self.requests.labels(outcome=outcome)
        child.inc()
        if seconds is not None:
            self.latency.observe(seconds)

    def update(self, status: Any, latest: int | None, latest_age_s: float, *, ready: bool) -> None:
        """Refresh gauges from a FollowerStatus, the sidecar's newest known LATEST and its
        age (they also count the LATEST reads of requests: ``Sidecar.refresh_metrics``).
        The lag is :func:`~rollpatch.serving.metrics.lag_value`: ``latest + 1`` while nothing
        is served, NaN while LATEST is unknown, never left at an old value."""
        self.versions.set(status.version, latest, lag_value(status.version, latest), unknown=-1)
        self.bytes_fetched.set(status.bytes_fetched)
        self.commits.set(status.commits)
        self.adoptions.set(status.adoptions)
        self.failures.set(status.failures)
        self.failing.set(0 if status.last_error is None else 1)
        self.latest_age.set(-1 if latest_age_s == float("inf") else round(latest_age_s, 3))
        self.ready.set(1 if ready else 0)
        created = status.served_created
        self.served_created.set(float("nan") if created is None else created)

    def audited(self, auditor: Any, mismatches: int) -> None:
        """The audit's counters from the follower's ``Auditor`` (slices, bytes, passes) and
        the mismatches ``/version`` reports (``audit_mismatches``)."""
        self.audit_slices.set(auditor.slices)
        self.audit_bytes.set(auditor.bytes)
        self.audit_passes.set(auditor.passes)
        self.audit_mismatches.set(mismatches)

    def render(self) -> bytes:
        return self._reg.render()
