"""Prometheus metric shapes shared by the services (sidecar, gateway).

One owner for what both export the same way:

- :class:`Registry`: a private ``prometheus_client`` registry per service object (several
  sidecars or gateways in one process, as in tests and the demo, stay apart), with typed
  builders and :meth:`Registry.render`; :data:`CONTENT_TYPE` is what ``/metrics`` answers.
- :class:`VersionGauges`: the ``served_version`` / ``latest_version`` / ``lag_versions``
  triple (one series per island on the gateway, one on a sidecar).
- :data:`Outcome` and :func:`outcome`: the labels of a request's outcome, from its status.

``prometheus_client`` (the ``web`` extra) is imported when a :class:`Registry` is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

__all__ = ["CONTENT_TYPE", "OUTCOMES", "Outcome", "Registry", "VersionGauges", "outcome"]

#: The ``Content-Type`` of a ``/metrics`` answer (Prometheus text exposition 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4"

#: What became of one request or attempt: ``proxied`` (the sidecar passed it to its engine),
#: ``ok`` (< 400), ``conflict`` (409), ``unavailable`` (503), ``engine_error`` (502),
#: ``unreachable`` (no answer), ``client_error`` (other 4xx), ``error`` (other 5xx);
#: ``client_gone``: the client hung up before its answer (the engine's request ended too).
Outcome = Literal[
    "ok",
    "proxied",
    "client_gone",
    "conflict",
    "unavailable",
    "unreachable",
    "engine_error",
    "client_error",
    "error",
]
#: The outcomes a status can map to (:func:`outcome`), in the docs' order.
OUTCOMES: tuple[Outcome, ...] = (
    "ok",
    "conflict",
    "unavailable",
    "unreachable",
    "engine_error",
    "client_error",
    "error",
)


def outcome(status: int | None) -> Outcome:
    """The outcome label of an answer with ``status`` (None: unreachable)."""
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


class Registry:
    """A private Prometheus registry and the metrics built in it."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        from prometheus_client import Counter

        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        from prometheus_client import Gauge

        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float] | None = None) -> Histogram:
        from prometheus_client import Histogram

        if buckets is None:
            return Histogram(name, doc, registry=self.registry)
        return Histogram(name, doc, buckets=tuple(buckets), registry=self.registry)

    def render(self) -> bytes:
        """Everything in the registry as Prometheus text (:data:`CONTENT_TYPE`)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


@dataclass(frozen=True)
class VersionGauges:
    """``{prefix}served_version``, ``{prefix}latest_version`` and ``{prefix}lag_versions``."""

    served: Gauge
    latest: Gauge
    lag: Gauge

    @classmethod
    def build(
        cls, reg: Registry, prefix: str, docs: tuple[str, str], labels: Sequence[str] = ()
    ) -> VersionGauges:
        """The three gauges in ``reg``; ``docs``: the help of the served and latest ones."""
        return cls(
            reg.gauge(f"{prefix}served_version", docs[0], labels),
            reg.gauge(f"{prefix}latest_version", docs[1], labels),
            reg.gauge(f"{prefix}lag_versions", "latest - served", labels),
        )

    def set(
        self,
        served: int | None,
        latest: int | None,
        lag: int | None,
        *,
        unknown: int | None = None,
        **labels: str,
    ) -> None:
        """Set the series (of ``labels``). An unknown served or latest version is written as
        ``unknown`` (None: left as it was); an unknown lag is always left as it was."""
        for gauge, value in ((self.served, served), (self.latest, latest)):
            if value is None:
                value = unknown
            if value is not None:
                (gauge.labels(**labels) if labels else gauge).set(value)
        if lag is not None:
            (self.lag.labels(**labels) if labels else self.lag).set(lag)
