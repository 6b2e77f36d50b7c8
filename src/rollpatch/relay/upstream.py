"""The relay's calls to its upstream store: the one place they are counted, and where an
outage upstream is noticed.

Every upstream call of a relay — a fetch, a listing, a HEAD, its watch's read or long-poll of
LATEST — goes through :meth:`UpstreamCalls.call`, which counts it
(``rollpatch_relay_upstream_requests_total{op}``), counts a failure by a bounded reason
(``rollpatch_relay_upstream_errors_total{op,reason}``, :func:`failure_reason`) and logs the
state changes of the upstream: ``upstream_down`` (WARNING) on the first call that finds it
unavailable, ``upstream_up`` (INFO, with the outage's length and how many calls failed) on the
first that succeeds again (one outage line a minute at most: a flapping upstream's next
line says how many were held back). Before, an outage was silent until a client was refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from ..errors import ManifestError, NotFoundError, TooLargeError, TransientStoreError
from ..logs import Every, event
from .metrics import Metrics

__all__ = ["OPS", "REASONS", "UpstreamCalls", "failure_reason"]

T = TypeVar("T")
log = logging.getLogger("rollpatch.relay")

Op = Literal["get", "list", "head", "wait"]
Reason = Literal["transient", "refused", "too_large", "other"]
#: Values of the ``op`` label: ``wait`` is the watch's long-poll of an upstream relay.
OPS: tuple[Op, ...] = ("get", "list", "head", "wait")
#: Values of the ``reason`` label of ``rollpatch_relay_upstream_errors_total``.
REASONS: tuple[Reason, ...] = ("transient", "refused", "too_large", "other")
#: Seconds between two ``upstream_down`` lines of an upstream that keeps failing and answering.
DOWN_LOG_S = 60.0
#: Reasons that say the upstream is unavailable (the others are answers: it is up).
_DOWN: frozenset[str] = frozenset({"transient", "other"})


def failure_reason(err: BaseException) -> Reason | None:
    """The ``reason`` label of an upstream call that raised ``err``; None when it is an answer,
    not a failure (a key absent upstream; an upstream relay that holds no long-polls)."""
    if isinstance(err, (NotFoundError, NotImplementedError)):
        return None
    if isinstance(err, TooLargeError):
        return "too_large"
    if isinstance(err, ManifestError):  # passed on by an upstream relay: corrupt, untrusted
        return "refused"
    if isinstance(err, (TransientStoreError, TimeoutError, ConnectionError)):
        return "transient"
    return "other"


class UpstreamCalls:
    """Counts the calls to one upstream store and tracks whether it is down. Thread-safe."""

    def __init__(
        self, uri: str, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._uri, self._metrics, self._clock = uri, metrics, clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._failed = 0  # calls failed in the current outage
        #: The outages' lines: at most one ``upstream_down`` a minute (an upstream that flaps
        #: between failing and answering said each flip), the next one with how many outages
        #: were held back; an outage whose ``upstream_down`` was held back has no
        #: ``upstream_up`` either.
        self._pace = Every(DOWN_LOG_S, clock)
        self._said = False  # this outage's upstream_down was logged

    @property
    def down(self) -> bool:
        """Whether the last call that settled it found the upstream unavailable."""
        return self._down_since is not None

    def call(self, op: Op, fn: Callable[[str], T], key: str) -> T:
        """``fn(key)``, counted as an upstream call of ``op``; its exception passes through."""
        self._metrics.inc("rollpatch_relay_upstream_requests_total", op=op)
        try:
            result = fn(key)
        except Exception as e:  # counted, then raised as it was
            reason = failure_reason(e)
            if reason is not None:
                self._metrics.inc("rollpatch_relay_upstream_errors_total", op=op, reason=reason)
            if reason in _DOWN:
                self._failure(op, key, e)
            else:
                self._answered()
            raise
        self._answered()
        return result

    def _failure(self, op: str, key: str, err: Exception) -> None:
        with self._lock:
            self._failed += 1
            if self._down_since is not None:
                return  # said once per outage
            self._down_since = self._clock()
            self._said = self._pace.due()
            if not self._said:
                return
            held = {"outages_held": self._pace.said_held} if self._pace.said_held else {}
        event(
            log,
            "upstream_down",
            logging.WARNING,
            upstream=self._uri,
            op=op,
            key=key,
            error=f"{type(err).__name__}: {err}",
            **held,
        )

    def _answered(self) -> None:
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is None:
                return
            seconds, failed = self._clock() - self._down_since, self._failed
            self._down_since, self._failed = None, 0
            if not self._said:
                return
        event(log, "upstream_up", upstream=self._uri, seconds=round(seconds, 3), failed=failed)
