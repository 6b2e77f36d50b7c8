"""What a relay learned upstream of each run's newest version (its manifest and step-patch
keys), so that its long-polls can say what it already holds (``&have=``, docs/relay.md,
"Push") and an upstream relay does not push those bytes across the WAN again. The record
outlives a run's watch (a restarted watch asks with ``after=-1``) and is bounded."""

from __future__ import annotations

import threading

from ..store.push import MAX_HAVE, have_token
from .cache import DiskCache

__all__ = ["MAX_RECORDED", "Learned"]

#: Runs recorded at once (the least recently learned is forgotten first).
MAX_RECORDED = 256


class Learned:
    """LATEST key -> the keys of the newest version learned upstream (at most MAX_HAVE)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, list[str]] = {}

    def learn(self, key: str, keys: list[str]) -> None:
        """Remember ``keys`` as the newest version's objects learned upstream for ``key``."""
        keys = list(dict.fromkeys(keys))[:MAX_HAVE]
        if not keys:
            return
        with self._lock:
            self._keys.pop(key, None)
            if len(self._keys) >= MAX_RECORDED:
                del self._keys[next(iter(self._keys))]  # the least recent
            self._keys[key] = keys

    def have(self, key: str, cache: DiskCache) -> list[str]:
        """The ``have`` tokens of a long-poll of ``key``: those keys this relay holds verified
        in ``cache``."""
        with self._lock:
            keys = self._keys.get(key, [])
        tokens = [have_token(k) for k in keys if cache.lookup(k) is not None]
        return [t for t in tokens if t is not None][:MAX_HAVE]
