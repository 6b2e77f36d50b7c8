"""The manifests a reader verified, by (run, version): least recently used dropped past a
bound. Manifests are immutable, so a cached one is reused as it is; a run whose manifests
changed under the cache (published again under its name, versions replaced after a key
rotation) is dropped whole (:meth:`ManifestCache.forget`)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .document import Manifest

__all__ = ["ManifestCache"]


class ManifestCache:
    """A thread-safe LRU of verified manifests, at most ``size`` of them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._by_key: OrderedDict[tuple[str, int], Manifest] = OrderedDict()

    def get(self, run: str, n: int) -> Manifest | None:
        with self._lock:
            m = self._by_key.get((run, n))
            if m is not None:
                self._by_key.move_to_end((run, n))
            return m

    def put(self, m: Manifest, run: str, n: int) -> None:
        with self._lock:
            self._by_key[(run, n)] = m
            while len(self._by_key) > self.size:
                self._by_key.popitem(last=False)

    def drop(self, run: str, n: int) -> None:
        with self._lock:
            self._by_key.pop((run, n), None)

    def forget(self, run: str) -> dict[int, Manifest]:
        """Drop the run's manifests; what was cached, by version."""
        with self._lock:
            return {n: self._by_key.pop((r, n)) for r, n in list(self._by_key) if r == run}

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
