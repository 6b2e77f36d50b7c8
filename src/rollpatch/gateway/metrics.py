"""Prometheus metrics of one gateway (a private registry per gateway; shapes shared with the
sidecar in :mod:`rollpatch.serving.metrics`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..serving.metrics import OUTCOMES, Registry, VersionGauges, outcome
from .routing import IslandView, fleet_latest

__all__ = ["OUTCOMES", "GatewayMetrics", "outcome"]


class GatewayMetrics:
    """Attempts per island and outcome, retries, answers by status, island versions."""

    def __init__(self) -> None:
        self._reg = r = Registry()
        self.registry = r.registry
        self.attempts = r.counter(
            "rollpatch_gateway_requests",
            "requests sent to an island, by outcome",
            ["island", "outcome"],
        )
        self.retries = r.counter("rollpatch_gateway_retries", "attempts after the first one")
        self.answers = r.counter(
            "rollpatch_gateway_responses", "responses to callers by status", ["code"]
        )
        self.conflicts = r.counter(
            "rollpatch_gateway_conflicts",
            "409s answered to callers (no island could satisfy the constraint)",
        )
        self.latency = r.histogram(
            "rollpatch_gateway_request_seconds", "time to the response head, retries included"
        )
        self.versions = VersionGauges.build(
            r,
            "rollpatch_gateway_island_",
            (
                "version the island serves (-1: none)",
                "LATEST the island last reported (-1: unknown)",
            ),
            ["island"],
        )
        self.reachable = r.gauge(
            "rollpatch_gateway_island_reachable",
            "1 when the last poll or request reached the island",
            ["island"],
        )
        self.inflight = r.gauge(
            "rollpatch_gateway_island_inflight", "requests in flight there", ["island"]
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
        newest = fleet_latest(islands)
        for i in islands:
            lag = None if i.served is None or newest is None else max(newest - i.served, 0)
            self.versions.set(i.served, i.latest, lag, unknown=-1, island=i.name)
            self.reachable.labels(island=i.name).set(1 if i.reachable else 0)
            self.inflight.labels(island=i.name).set(i.inflight)
        return self._reg.render()
