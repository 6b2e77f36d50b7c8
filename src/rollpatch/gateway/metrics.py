"""Prometheus metrics of one gateway (a private registry per gateway)."""

from __future__ import annotations

from collections.abc import Sequence

from .routing import IslandView, fleet_latest

__all__ = ["OUTCOMES", "GatewayMetrics"]

#: Outcomes of one attempt at one island.
OUTCOMES = ("ok", "conflict", "unavailable", "unreachable", "engine_error", "client_error", "error")


class GatewayMetrics:
    """Attempts per island and outcome, retries, answers by status, island versions."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.attempts = Counter(
            "rollpatch_gateway_requests",
            "requests sent to an island, by outcome",
            ["island", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "rollpatch_gateway_retries", "attempts after the first one", registry=r
        )
        self.answers = Counter(
            "rollpatch_gateway_responses", "responses to callers by status", ["code"], registry=r
        )
        self.conflicts = Counter(
            "rollpatch_gateway_conflicts",
            "409s answered to callers (no island could satisfy the constraint)",
            registry=r,
        )
        self.latency = Histogram(
            "rollpatch_gateway_request_seconds",
            "time to the response head, retries included",
            registry=r,
        )
        self.served = Gauge(
            "rollpatch_gateway_island_served_version",
            "version the island serves (-1: none)",
            ["island"],
            registry=r,
        )
        self.latest = Gauge(
            "rollpatch_gateway_island_latest_version",
            "LATEST the island last reported (-1: unknown)",
            ["island"],
            registry=r,
        )
        self.lag = Gauge(
            "rollpatch_gateway_island_lag_versions", "latest - served", ["island"], registry=r
        )
        self.reachable = Gauge(
            "rollpatch_gateway_island_reachable",
            "1 when the last poll or request reached the island",
            ["island"],
            registry=r,
        )
        self.inflight = Gauge(
            "rollpatch_gateway_island_inflight", "requests in flight there", ["island"], registry=r
        )

    def attempt(self, island: str, status: int | None) -> None:
        """Count one attempt (``status`` None: the island could not be reached)."""
        self.attempts.labels(island=island, outcome=outcome(status)).inc()

    def answer(self, status: int, seconds: float) -> None:
        self.answers.labels(code=str(status)).inc()
        self.latency.observe(seconds)
        if status == 409:
            self.conflicts.inc()

    def render(self, islands: Sequence[IslandView]) -> bytes:
        """Prometheus text, island gauges refreshed from ``islands``."""
        from prometheus_client import generate_latest

        newest = fleet_latest(islands)
        for i in islands:
            self.served.labels(island=i.name).set(-1 if i.served is None else i.served)
            self.latest.labels(island=i.name).set(-1 if i.latest is None else i.latest)
            if i.served is not None and newest is not None:
                self.lag.labels(island=i.name).set(max(newest - i.served, 0))
            self.reachable.labels(island=i.name).set(1 if i.reachable else 0)
            self.inflight.labels(island=i.name).set(i.inflight)
        return generate_latest(self.registry)


def outcome(status: int | None) -> str:
    """The outcome label of an attempt that got ``status`` (None: unreachable)."""
    if status is None:
        return "unreachable"
    if status < 400:
        return "ok"
    if status == 409:
        return "conflict"
    if status == 503:
        return "unavailable"
    if status == 502:
        return "engine_error"
    return "client_error" if status < 500 else "error"
