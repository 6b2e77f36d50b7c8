"""``memory://NAME``: a process-local, thread-safe store for tests.

Stores opened with the same name share one namespace within the process, so a test can hand a
URI to two components and have them see each other's writes. Nothing survives the process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..errors import AlreadyExistsError, NotFoundError
from .base import ObjectInfo, Store, cas_lost, check_bounds, too_large

__all__ = ["MemoryStore"]


@dataclass
class _Namespace:
    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, tuple[bytes, int, float]] = field(default_factory=dict)  # data, gen, mtime
    generation: int = 0


_NAMESPACES: dict[str, _Namespace] = {}
_REGISTRY_LOCK = threading.Lock()


class MemoryStore(Store):
    """Dict-backed store; every operation holds the namespace's lock, so all are atomic."""

    def __init__(self, name: str = "default") -> None:
        with _REGISTRY_LOCK:
            self._ns = _NAMESPACES.setdefault(name, _Namespace())
        self.name = name
        self.uri = f"memory://{name}"

    @staticmethod
    def reset(name: str) -> None:
        """Forget everything stored under ``name`` (test isolation)."""
        with _REGISTRY_LOCK:
            ns = _NAMESPACES.get(name)
        if ns is not None:
            with ns.lock:
                ns.objects.clear()

    def _lookup(self, key: str) -> bytes:
        item = self._ns.objects.get(key)
        if item is None:
            raise NotFoundError("no such object", key=key, store=self.uri)
        return item[0]

    def _store(self, key: str, data: bytes) -> None:
        self._ns.generation += 1
        self._ns.objects[key] = (data, self._ns.generation, time.time())

    def _get(self, key: str) -> bytes:
        with self._ns.lock:
            return self._lookup(key)

    def _get_bounded(self, key: str, max_bytes: int) -> bytes:
        with self._ns.lock:
            size = len(self._lookup(key))
        if size > max_bytes:
            raise too_large(key, self.uri, size, max_bytes)
        return self._get(key)  # (a subclass's own reads, as for any get)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        with self._ns.lock:
            data = self._lookup(key)
        check_bounds(key, start, end, len(data))
        return data[start:end]

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        copy = bytes(data)
        with self._ns.lock:
            if if_absent and key in self._ns.objects:
                raise AlreadyExistsError(
                    "object exists and published objects are immutable", key=key, store=self.uri
                )
            self._store(key, copy)

    def _list(self, prefix: str) -> list[str]:
        with self._ns.lock:
            return sorted(k for k in self._ns.objects if k.startswith(prefix))

    def _delete(self, key: str) -> None:
        with self._ns.lock:
            self._ns.objects.pop(key, None)

    def _head(self, key: str) -> ObjectInfo | None:
        with self._ns.lock:
            item = self._ns.objects.get(key)
        if item is None:
            return None
        return ObjectInfo(key=key, size=len(item[0]), etag=f"g{item[1]}", modified=item[2])

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        with self._ns.lock:
            item = self._ns.objects.get(key)
            current = None if item is None else item[0]
            if current != expected:
                raise cas_lost(key, self.uri, current)
            self._store(key, data)
