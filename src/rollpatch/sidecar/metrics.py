"""Prometheus metrics of one sidecar (a private registry per sidecar)."""

from __future__ import annotations

from typing import Any

__all__ = ["SidecarMetrics"]


class SidecarMetrics:
    """Versions, lag, bytes fetched, apply/pause durations, requests by outcome."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.served = Gauge(
            "rollpatch_served_version", "verified version the engine serves", registry=r
        )
        self.latest = Gauge("rollpatch_latest_version", "LATEST seen on the board", registry=r)
        self.lag = Gauge("rollpatch_lag_versions", "latest - served", registry=r)
        self.bytes_fetched = Gauge(
            "rollpatch_bytes_fetched", "bytes fetched from the board (cumulative)", registry=r
        )
        self.commits = Gauge("rollpatch_commits", "verified commits (cumulative)", registry=r)
        self.pause = Histogram(
            "rollpatch_commit_pause_seconds",
            "engine pause per commit",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        self.drain = Histogram(
            "rollpatch_commit_drain_seconds",
            "admission closed before a drain-mode commit's write",
            buckets=(0.001, 0.01, 0.1, 1, 5, 30, 120),
            registry=r,
        )
        self.drain_timeouts = Gauge(
            "rollpatch_drain_timeouts",
            "drain commits that hit the drain deadline and paused instead (cumulative)",
            registry=r,
        )
        self.requests = Counter(
            "rollpatch_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.latency = Histogram("rollpatch_proxy_seconds", "proxied request duration", registry=r)

    def request(self, outcome: str, seconds: float | None = None) -> None:
        self.requests.labels(outcome=outcome).inc()
        if seconds is not None:
            self.latency.observe(seconds)

    def update(self, status: Any) -> None:
        """Refresh gauges from a FollowerStatus."""
        if status.version is not None:
            self.served.set(status.version)
        if status.latest is not None:
            self.latest.set(status.latest)
        if status.lag is not None:
            self.lag.set(status.lag)
        self.bytes_fetched.set(status.bytes_fetched)
        self.commits.set(status.commits)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
