"""The relay's short-lived memory caches (LATEST bytes, listings, the ETags of corrupt copies):
a value per name until its expiry, thread-safe, bounded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["MAX_TTL_ENTRIES", "TtlTable"]

T = TypeVar("T")

#: Values one table holds at most (all fresh: the oldest insertions go first).
MAX_TTL_ENTRIES = 4096


@dataclass(frozen=True)
class _Timed(Generic[T]):
    value: T
    expires: float


class TtlTable(Generic[T]):
    """Name -> value until a monotonic expiry time."""

    def __init__(self) -> None:
        self._items: dict[str, _Timed[T]] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> T | None:
        """The value, if it has not expired."""
        with self._lock:
            item = self._items.get(name)
        return item.value if item is not None and time.monotonic() < item.expires else None

    def put(self, name: str, value: T, expires: float) -> None:
        with self._lock:
            self._items[name] = _Timed(value, expires)
            now = time.monotonic()  # expired values go at once: a blob may be 16 MiB
            for stale in [k for k, v in self._items.items() if v.expires <= now]:
                del self._items[stale]
            while len(self._items) > MAX_TTL_ENTRIES:  # all fresh: the oldest go
                del self._items[next(iter(self._items))]
