"""Request coalescing: at most one upstream fetch per key, however many clients ask.

The first request for an uncached key starts one fetch in a worker pool; later requests wait
on the same :class:`~concurrent.futures.Future`, so N islands asking at once cost one WAN
transfer. A waiter that gives up cannot cancel the fetch the others wait on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ..errors import StoreError
from .metrics import Metrics

__all__ = ["Flights"]

T = TypeVar("T")


class Flights:
    """At most one running fetch per flight key; everyone else asking waits on its future."""

    def __init__(self, metrics: Metrics) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, Future[object]] = {}
        self._metrics = metrics

    def join(
        self,
        flight: Hashable,
        kind: str,
        lookup: Callable[[], T | None],
        fetch: Callable[[], T],
        pool: ThreadPoolExecutor,
    ) -> Future[T]:
        """A future of ``lookup()`` if it has an answer, else of the one ``fetch()`` in flight.

        ``lookup`` runs under the flights lock: a fetch publishes its result (to the cache)
        before it leaves the in-flight table, so no request can miss both and fetch twice.
        """
        with self._lock:
            running = self._inflight.get(flight)
            if running is not None:
                self._metrics.inc("rollpatch_relay_coalesced_waits_total", kind=kind)
                return running  # type: ignore[return-value]
            hit = lookup()
            if hit is not None:
                self._metrics.inc("rollpatch_relay_cache_hits_total", kind=kind)
                done: Future[T] = Future()
                done.set_result(hit)
                return done
            self._metrics.inc("rollpatch_relay_cache_misses_total", kind=kind)
            future: Future[T] = Future()
            # running: a waiter that gives up (a client hanging up cancels its asyncio
            # wrapper, which cancels the source) cannot cancel the fetch the others wait on
            future.set_running_or_notify_cancel()
            self._inflight[flight] = future  # type: ignore[assignment]
        try:
            pool.submit(self._run, flight, fetch, future)
        except RuntimeError as e:  # the pool is shut down: the relay is stopping
            self._finish(flight)
            future.set_exception(StoreError(f"relay is stopping ({e})"))
        return future

    def _run(self, flight: Hashable, fetch: Callable[[], T], future: Future[T]) -> None:
        try:
            result = fetch()
        except BaseException as e:  # noqa: BLE001 (every waiter re-raises it from result())
            self._finish(flight)
            future.set_exception(e)
            return
        self._finish(flight)
        future.set_result(result)

    def _finish(self, flight: Hashable) -> None:
        with self._lock:
            self._inflight.pop(flight, None)
