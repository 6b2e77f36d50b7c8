"""The wait between two reads of a board's LATEST by a relay's watch (:mod:`.watch`), cut short
by inotify on a directory board (:mod:`rollpatch.store.notify`)."""

from __future__ import annotations

import threading

from ..store.base import Store
from ..store.file import FileStore
from ..store.notify import KeyWatch

__all__ = ["Notice"]


class Notice:
    """The wait between two reads of LATEST on a board: ``watch_s``, cut short the moment a
    directory board's LATEST is written (inotify, when available). Reads every ``watch_s``
    go on regardless: writers on other hosts of a network file system raise no event."""

    def __init__(self, upstream: Store, key: str, closed: threading.Event) -> None:
        self._store = upstream if isinstance(upstream, FileStore) else None
        self._key, self._closed = key, closed
        self._watch: KeyWatch | None = None

    def wait(self, timeout: float) -> bool:
        """Whether the relay is closing (after up to ``timeout`` s, sooner if LATEST moved)."""
        if self._watch is not None and self._watch.broken:
            self.close()  # the folder went away or events were lost: open it again
        if self._watch is None and self._store is not None:
            self._watch = self._store.watch(self._key)  # None until the run's folder exists
        if self._watch is None:
            return self._closed.wait(timeout)
        self._watch.wait(timeout)
        return self._closed.is_set()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
