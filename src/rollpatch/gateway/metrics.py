"""Prometheus metrics of one gateway (a private registry per gateway; shapes shared with the
sidecar in :mod:`rollpatch.serving.metrics`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from ..serving.metrics import OUTCOMES, Registry, VersionGauges, lag_value, outcome
from .routing import IslandView, fleet_latest, fleet_newest

__all__ = ["GATEWAY_OUTCOMES", "LATENCY_BUCKETS", "OUTCOMES", "GatewayMetrics", "outcome"]

#: Attempts the gateway itself ends, beyond the sidecar's outcomes: ``bad_label`` (a 200
#: whose version labels break the constraint, are missing or unreadable, or whose body is not
#: JSON), ``too_large`` (over ``max_answer_bytes`` / ``max_event_bytes``), ``client_gone``
#: (the caller hung up before the answer's head came).
GATEWAY_OUTCOMES = ("bad_label", "too_large", "client_gone")
#: Seconds to the response head: Prometheus' defaults, then up to 5 min. A request waits for
#: catch-up (``wait_s``, per island tried) or for a wedged island's poll to fail; with the
#: defaults alone every request slower than 10 s fell in ``+Inf``.
LATENCY_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(30.0, 60.0, 120.0, 300.0),
)


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
            "rollpatch_gateway_request_seconds",
            "time to the response head, retries included",
            LATENCY_BUCKETS,
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
        self.other_run = r.gauge(
            "rollpatch_gateway_island_other_run",
            "1 when the island follows another run than the fleet's (it gets no requests)",
            ["island"],
        )
        self.fleet = r.gauge(
            "rollpatch_gateway_fleet_latest_version",
            "the fleet's LATEST (-1: unknown): basis=median routes requests, basis=newest "
            "is what island lags are measured from",
            ["basis"],
        )

    def attempt(self, island: str, status: int | None) -> None:
        """Count one attempt (``status`` None: the island could not be reached)."""
        self.attempts.labels(island=island, outcome=outcome(status)).inc()

    def refused(self, island: str, kind: str) -> None:
        """Count one attempt the gateway ended (``kind``: one of :data:`GATEWAY_OUTCOMES`)."""
        self.attempts.labels(island=island, outcome=kind).inc()

    def answer(self, status: int, seconds: float) -> None:
        self.answers.labels(code=str(status)).inc()
        self.latency.observe(seconds)
        if status == 409:
            self.conflicts.inc()

    def render(self, islands: Sequence[IslandView], other_run: Collection[str] = ()) -> bytes:
        """Prometheus text, island gauges refreshed from ``islands`` (``other_run``: those
        that follow another run, left out of the fleet's LATEST)."""
        fleet = [i for i in islands if i.name not in other_run]
        median, newest = fleet_latest(fleet), fleet_newest(fleet)
        self.fleet.labels(basis="median").set(-1 if median is None else median)
        self.fleet.labels(basis="newest").set(-1 if newest is None else newest)
        for i in islands:
            # another run's island: no lag against this fleet's LATEST (NaN); one that holds
            # no version lags by every version (serving.metrics.lag_value; before session 41
            # its series kept its old value, or was never written)
            lag = math.nan if i.name in other_run else lag_value(i.served, newest)
            self.versions.set(i.served, i.latest, lag, unknown=-1, island=i.name)
            self.reachable.labels(island=i.name).set(1 if i.reachable else 0)
            self.inflight.labels(island=i.name).set(i.inflight)
            self.other_run.labels(island=i.name).set(1 if i.name in other_run else 0)
        return self._reg.render()
