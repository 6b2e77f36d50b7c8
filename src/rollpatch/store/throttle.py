"""A link emulator: a store wrapper that adds round-trip latency and a bandwidth cap.

Used by ``rollpatch demo`` to put an *emulated* WAN between a board and a regional relay on
one machine. Nothing here is a real network: every call on the wrapped store runs at local
speed, then the wrapper holds the caller as long as the same call would have taken over a
link with ``latency_s`` of round-trip time and ``bandwidth_bps`` bits per second.

Model (deliberately simple, and documented so numbers can be read against it):

- every call costs one round trip (``latency_s``); concurrent calls overlap their latency;
- then its payload (a ``get``'s answer, a ``put``'s body, a listing's keys) crosses the link.
  Transfers in flight share the bandwidth equally (processor sharing, as TCP flows roughly
  do), so a small read is not stuck behind a large one, and N parallel transfers take as long
  in total as one of N times the size. Each direction (down, up) has the full bandwidth;
- a failing call (not found, conflict) still pays its round trip.

:class:`FairLink` is the bandwidth model alone, pure and clock-free, so tests can check it
exactly; clock and sleep of :class:`ThrottledStore` are injectable for the same reason.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ConfigError
from .base import Keys, ObjectInfo, Store

__all__ = ["FairLink", "ThrottleStats", "ThrottledStore"]

T = TypeVar("T")


#: Bytes left under which a transfer counts as finished (float rounding).
_DONE = 1e-6


class FairLink:
    """Processor-sharing model of one link direction: transfers in flight split ``rate``
    (bytes per second) equally. Pure: the caller supplies the times. Not thread-safe."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._left: dict[int, float] = {}
        self._t: float | None = None

    def advance(self, now: float) -> None:
        """Move the model to time ``now``: drain the transfers in flight."""
        if self._t is not None and now > self._t:
            budget = (now - self._t) * self.rate
            while budget > 0 and self._left:
                n = len(self._left)
                smallest = min(self._left.values())
                step = min(smallest, budget / n)
                for k in list(self._left):
                    self._left[k] -= step
                    if self._left[k] <= _DONE:
                        del self._left[k]
                budget -= step * n
        self._t = now if self._t is None else max(self._t, now)

    def add(self, key: int, nbytes: float, now: float) -> None:
        """Start transferring ``nbytes`` under ``key`` at ``now``."""
        self.advance(now)
        if nbytes > _DONE:
            self._left[key] = float(nbytes)

    def done(self, key: int) -> bool:
        return key not in self._left

    def eta(self, key: int) -> float:
        """Seconds until ``key`` finishes if no other transfer starts meanwhile."""
        mine = self._left.get(key)
        if mine is None:
            return 0.0
        return sum(min(left, mine) for left in self._left.values()) / self.rate


@dataclass(frozen=True)
class ThrottleStats:
    """What crossed the emulated link so far (cumulative)."""

    calls: int
    """Calls made on the wrapped store (each paid one round trip)."""
    bytes_down: int
    """Payload bytes read through the link (``get``, ``get_range``, ``list``)."""
    bytes_up: int
    """Payload bytes written through the link (``put``, ``cas``)."""
    delay_s: float
    """Seconds the callers were held, summed over calls (latency + transfer)."""


def _check(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > 0 if name == "bandwidth_bps" else value >= 0)
    )
    if not ok:
        rule = "> 0 (or None: unlimited)" if name == "bandwidth_bps" else ">= 0"
        raise ConfigError(
            f"ThrottledStore.{name} must be a finite number {rule}", field=name, value=value
        )


class ThrottledStore(Store):
    """``inner`` behind an emulated link of ``latency_s`` round trip and ``bandwidth_bps``.

    ``bandwidth_bps`` is in bits per second (``None``: no cap). Thread-safe. Closing the
    wrapper does not close ``inner`` (the caller owns it).
    """

    def __init__(
        self,
        inner: Store,
        bandwidth_bps: float | None,
        latency_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(inner, Store):
            raise ConfigError(
                "ThrottledStore.inner must be a Store", field="inner", value=type(inner).__name__
            )
        _check("bandwidth_bps", bandwidth_bps, allow_none=True)
        _check("latency_s", latency_s, allow_none=False)
        self.inner = inner
        self.bandwidth_bps = None if bandwidth_bps is None else float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.writable = inner.writable
        self.uri = inner.uri
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        rate = math.inf if self.bandwidth_bps is None else self.bandwidth_bps / 8
        self._down, self._up = FairLink(rate), FairLink(rate)
        self._ids = itertools.count()
        self._calls = self._bytes_down = self._bytes_up = 0
        self._delay = 0.0

    @property
    def stats(self) -> ThrottleStats:
        """A consistent snapshot of the link's counters."""
        with self._lock:
            return ThrottleStats(self._calls, self._bytes_down, self._bytes_up, self._delay)

    def __repr__(self) -> str:
        bw = "unlimited" if self.bandwidth_bps is None else f"{self.bandwidth_bps:g} bit/s"
        return f"ThrottledStore({self.inner!r}, {bw}, {self.latency_s:g} s)"

    # -- the link ------------------------------------------------------------------------------

    def _through(self, fn: Callable[[], T], size: Callable[[T], int], *, up: int = 0) -> T:
        """Run ``fn`` on the inner store, then hold the caller as the link would have."""
        t0 = self._clock()
        try:
            result = fn()
        except BaseException:
            self._hold(t0, 0, 0)
            raise
        self._hold(t0, size(result), up)
        return result

    def _hold(self, t0: float, down: int, up: int) -> None:
        """Sleep until the round trip (from ``t0``) and then the transfer are over."""
        wait = t0 + self.latency_s - self._clock()
        if wait > 0:
            self._sleep(wait)
        link, nbytes = (self._up, up) if up else (self._down, down)
        key = next(self._ids)
        with self._lock:
            self._calls += 1
            self._bytes_down += down
            self._bytes_up += up
            if self.bandwidth_bps is not None:
                link.add(key, nbytes, self._clock())
        while self.bandwidth_bps is not None:
            with self._lock:
                link.advance(self._clock())
                if link.done(key):
                    break
                eta = link.eta(key)
            self._sleep(max(eta, 1e-9))  # newcomers may slow us: re-check on waking
        with self._lock:
            self._delay += self._clock() - t0

    # -- store hooks (arguments already validated by Store) ------------------------------------

    def _get(self, key: str) -> bytes:
        return self._through(lambda: self.inner.get(key), len)

    def _get_bounded(self, key: str, max_bytes: int) -> bytes:
        return self._through(lambda: self.inner.get(key, max_bytes=max_bytes), len)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self._through(lambda: self.inner.get_range(key, start, end), len)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._through(
            lambda: self.inner.put(key, data, if_absent=if_absent), lambda _: 0, up=data.nbytes
        )

    def _list(self, prefix: str) -> Keys:
        # a listing's payload: the keys, one line each (what a JSON or XML page roughly costs)
        return self._through(
            lambda: self.inner.list(prefix), lambda keys: sum(len(k.encode()) + 1 for k in keys)
        )

    def _delete(self, key: str) -> None:
        self._through(lambda: self.inner.delete(key), lambda _: 0)

    def _head(self, key: str) -> ObjectInfo | None:
        return self._through(lambda: self.inner.head(key), lambda _: 0)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self._through(
            lambda: self.inner.cas(key, data, expected=expected), lambda _: 0, up=len(data)
        )
