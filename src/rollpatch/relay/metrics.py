"""Relay counters, rendered as Prometheus text (exposition format 0.0.4).

Hand-written rather than ``prometheus_client``: a dozen counters do not justify a dependency,
and one :class:`Metrics` per relay keeps several relays in one process (tests, chains) apart.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["CONTENT_TYPE", "METHODS", "CountRequests", "Metrics"]

#: The ``Content-Type`` of :meth:`Metrics.render`.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_Labels = tuple[tuple[str, str], ...]

#: The methods the relay serves, each its own ``method`` label; any other method a client
#: sends is counted as ``other`` (a label taken from the request grew a series per made-up
#: method: an audit).
METHODS = frozenset({"GET", "HEAD"})

#: name → (type, help). Every series the relay exports is declared here.
_FAMILIES: dict[str, tuple[str, str]] = {
    "rollpatch_relay_requests_total": ("counter", "HTTP requests by route, method and status."),
    "rollpatch_relay_cache_hits_total": ("counter", "Reads answered from the relay's caches."),
    "rollpatch_relay_cache_misses_total": ("counter", "Reads that needed the upstream store."),
    "rollpatch_relay_coalesced_waits_total": (
        "counter",
        "Reads that waited on another request's upstream fetch instead of fetching.",
    ),
    "rollpatch_relay_upstream_requests_total": ("counter", "Calls made to the upstream store."),
    "rollpatch_relay_upstream_errors_total": (
        "counter",
        "Calls to the upstream store that failed, by op and reason (transient, refused, "
        + "too_large, other).",
    ),
    "rollpatch_relay_upstream_latest_age_seconds": (
        "gauge",
        "Seconds since the watch last heard from upstream about LATEST, the oldest over the "
        + "runs watched for long-polls (0: none watched).",
    ),
    "rollpatch_relay_upstream_bytes_total": ("counter", "Object bytes read from upstream."),
    "rollpatch_relay_served_bytes_total": ("counter", "Object bytes sent to clients."),
    "rollpatch_relay_refused_total": (
        "counter",
        "Upstream answers refused (hash mismatch, invalid manifest, too large).",
    ),
    "rollpatch_relay_stale_pointers_total": (
        "counter",
        "Upstream LATEST answers overtaken by a newer LATEST verified while they were read "
        + "(not served; not a refusal).",
    ),
    "rollpatch_relay_unannounced_total": (
        "counter",
        "New versions held back from long-polls: manifest or step patch failed prefetch "
        + "(corrupt, refused, missing, timeout, transient, other).",
    ),
    "rollpatch_relay_pushed_total": (
        "counter",
        "Objects pushed in long-poll answers: received (cached, refused, present) or sent "
        + "(sent; held: left out, the receiver holds it).",
    ),
    "rollpatch_relay_evictions_total": ("counter", "Cache files evicted to stay in bounds."),
    "rollpatch_relay_cache_discarded_total": (
        "counter",
        (
            "Unusable cache files removed: found at start-up, or whose bytes failed their "
            "BLAKE3 when read again (at start, or --recheck after the last check; logged; "
            "the object is fetched again)."
        ),
    ),
    "rollpatch_relay_cache_write_errors_total": (
        "counter",
        "Verified objects the cache disk could not take (full, read only): served uncached.",
    ),
    "rollpatch_relay_uncached_bytes": (
        "gauge",
        "Bytes of objects over --stream-chunk-bytes that the cache disk refused, held in "
        + "memory while answers send them (bounded by --uncached-bytes).",
    ),
    "rollpatch_relay_cache_bytes": ("gauge", "Bytes of cache files on disk."),
    "rollpatch_relay_cache_entries": ("gauge", "Objects in the disk cache."),
}


class Metrics:
    """Thread-safe labelled counters plus gauges read at render time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, _Labels], float] = {}
        self._gauges: dict[str, Callable[[], float]] = {}

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` to the counter ``name`` with ``labels``."""
        if name not in _FAMILIES:
            raise KeyError(f"undeclared metric {name!r}")
        series = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[series] = self._values.get(series, 0) + amount

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """Export ``read()`` as the gauge ``name`` on every render."""
        if name not in _FAMILIES:
            raise KeyError(f"undeclared metric {name!r}")
        self._gauges[name] = read

    def value(self, name: str, **labels: str) -> float:
        """Current value of one counter series (0 if never incremented): for tests and logs."""
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def total(self, name: str) -> float:
        """Sum of a counter over all its label values."""
        with self._lock:
            return sum(v for (n, _), v in self._values.items() if n == name)

    def render(self) -> str:
        """The Prometheus text exposition of every declared family."""
        with self._lock:
            values = dict(self._values)
        gauges = {name: float(read()) for name, read in self._gauges.items()}
        lines: list[str] = []
        for name, (kind, help_text) in _FAMILIES.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if name in gauges:
                lines.append(f"{name} {_number(gauges[name])}")
            for (series, labels), value in sorted(values.items()):
                if series == name:
                    lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _labels(labels: _Labels) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _route(path: str) -> str:
    for prefix, name in (
        ("/v1/objects/", "objects"),
        ("/v1/list", "list"),
        ("/metrics", "metrics"),
        ("/health", "health"),
    ):
        if path.startswith(prefix):
            return name
    return "other"


def _method(method: str) -> str:
    return method if method in METHODS else "other"


class CountRequests:
    """ASGI middleware: ``rollpatch_relay_requests_total{route,method,status}``."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: int) -> None:
            self.metrics.inc(
                "rollpatch_relay_requests_total",
                route=_route(scope["path"]),
                method=_method(scope["method"]),
                status=str(status),
            )

        async def send_counted(message: MutableMapping[str, Any]) -> None:
            nonlocal counted
            if message["type"] == "http.response.start":  # before the client can see it
                counted = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not counted:
                count(500)
