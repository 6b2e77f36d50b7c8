"""What the relay may hold in memory to serve objects its cache disk refuses.

A full or read-only cache disk does not stop a relay: a verified object the disk cannot take
is served from memory. Objects up to ``stream_chunk_bytes`` are read whole anyway (at most
``upstream_workers`` at once); a larger one (a keyframe, gigabytes) is held only within
``RelayConfig.uncached_bytes`` in all, from its upstream read until the last answer that
sends it lets go of it. One that does not fit is answered 503 (its clients retry, or use
another source) instead of growing the relay's memory without bound: before session 44 every
large object read whole once the disk refused it, up to ``upstream_workers`` of them at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from ..errors import TransientStoreError

__all__ = ["MemoryBudget"]

T = TypeVar("T")


class MemoryBudget:
    """Bytes taken and given back by the holders of objects served from memory. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes taken and not yet given back."""
        with self._lock:
            return self._held

    def claim(self, key: str, n: int) -> None:
        """Take ``n`` bytes for object ``key`` if they fit under :attr:`limit`, else raise
        :class:`TransientStoreError` (the relay answers 503)."""
        with self._lock:
            held = self._held
            if held + n <= self.limit:
                self._held = held + n
                return
        raise TransientStoreError(
            f"the relay's cache disk refuses writes and this {n:,}-byte object does not fit "
            f"in its memory for uncached objects ({held:,} of {self.limit:,} bytes held)",
            hint="free or fix the relay's cache disk (--cache), or raise --uncached-bytes",
            key=key,
        )

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken before."""
        with self._lock:
            self._held = max(self._held - n, 0)

    def held_while(self, key: str, n: int, fetch: Callable[[], T]) -> T:
        """``fetch()`` of object ``key`` (``n`` bytes) with ``n`` bytes claimed (:meth:`claim`)
        for it, given back when what it returns is collected (the last answer sending it let
        go of it) or when it raises."""
        self.claim(key, n)
        try:
            held = fetch()
        except BaseException:
            self.give(n)
            raise
        weakref.finalize(held, self.give, n)
        return held
