"""Prometheus metric shapes shared by the services (sidecar, gateway).

One owner for what both export the same way:

- :class:`Registry`: a private ``prometheus_client`` registry per service object (several
  sidecars or gateways in one process, as in tests and the demo, stay apart), with typed
  builders and :meth:`Registry.render`; :data:`CONTENT_TYPE` is what ``/metrics`` answers.
  It renders no ``*_created`` series (prometheus_client's default doubles every counter's
  and histogram's series with one; its switch is process-wide, so the registry drops them).
- :class:`Total`: a cumulative value kept elsewhere (a follower's counters) and read whole,
  exported as a counter (``{name}_total``).
- :class:`VersionGauges`: the ``served_version`` / ``latest_version`` / ``lag_versions``
  triple (one series per island on the gateway, one on a sidecar); :func:`lag_value`.
- :data:`Outcome` and :func:`outcome`: the labels of a request's outcome, from its status.

``prometheus_client`` (the ``web`` extra) is imported when a :class:`Registry` is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from prometheus_client.metrics_core import Metric

__all__ = [
    "CONTENT_TYPE",
    "OUTCOMES",
    "Outcome",
    "Registry",
    "Total",
    "VersionGauges",
    "lag_value",
    "outcome",
]

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
        self._totals: _Totals | None = None

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

    def total(self, name: str, doc: str) -> Total:
        """A counter ``{name}_total`` whose value is set whole (:class:`Total`)."""
        if self._totals is None:
            self._totals = _Totals()
            self.registry.register(self._totals)
        return self._totals.add(Total(name, doc))

    def render(self) -> bytes:
        """Everything in the registry as Prometheus text (:data:`CONTENT_TYPE`), without
        ``*_created`` series."""
        from prometheus_client import generate_latest

        return generate_latest(_Uncreated(self.registry))


class Total:
    """A cumulative value owned elsewhere (a follower's counters, a connection pool's count),
    exported as a Prometheus counter: :meth:`set` the value (never lower while the process
    lives) or :meth:`set_function` to read it at each scrape. ``prometheus_client.Counter``
    only adds, so these were gauges before (audit G-F6)."""

    __slots__ = ("_fn", "_value", "doc", "name")

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self._value = 0.0
        self._fn: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self._value = float(value)

    def set_function(self, fn: Callable[[], float]) -> None:
        self._fn = fn

    def get(self) -> float:
        return float(self._fn()) if self._fn is not None else self._value


class _Totals:
    """The collector of a registry's :class:`Total` values (read at each scrape)."""

    def __init__(self) -> None:
        self._totals: list[Total] = []

    def add(self, total: Total) -> Total:
        self._totals.append(total)
        return total

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        for t in self._totals:
            yield CounterMetricFamily(t.name, t.doc, value=t.get())


class _Uncreated:
    """A registry seen without its ``*_created`` samples (what ``render`` writes)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


def lag_value(served: int | None, latest: int | None) -> float:
    """What ``lag_versions`` says: ``latest - served`` (never below 0); with nothing served
    and LATEST known, ``latest + 1`` (every version is missing: a lag alert fires); with
    LATEST unknown, NaN (no alert can say how far behind it is)."""
    if latest is None:
        return math.nan
    if served is None:
        return float(latest + 1)
    return float(max(0, latest - served))


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
        lag: float | None,
        *,
        unknown: int | None = None,
        **labels: str,
    ) -> None:
        """Set the series (of ``labels``). An unknown served or latest version is written as
        ``unknown`` (None: left as it was); a lag of None is left as it was (the sidecar
        always passes one: :func:`lag_value`)."""
        for gauge, value in ((self.served, served), (self.latest, latest)):
            if value is None:
                value = unknown
            if value is not None:
                (gauge.labels(**labels) if labels else gauge).set(value)
        if lag is not None:
            (self.lag.labels(**labels) if labels else self.lag).set(lag)
