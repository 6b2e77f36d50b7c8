"""Nested pauses of a remote engine's generation (vLLM's ``/pause``, SGLang's
``/pause_generation``): a commit pauses, and so may a caller around it; only the outermost
pause and resume reach the engine."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["NestedPause"]


class NestedPause:
    """``pause()``/``resume()`` counted under ``lock`` (shared with the owner's other calls):
    ``_freeze()`` runs on the first pause, ``_thaw()`` when the last one is undone."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._pauses = 0

    def _freeze(self) -> None:
        raise NotImplementedError

    def _thaw(self) -> None:
        raise NotImplementedError

    def pause(self) -> None:
        with self._lock:
            if self._pauses == 0:
                self._freeze()
            self._pauses += 1

    def resume(self) -> None:
        """Undo one :meth:`pause`; the engine generates again after the outermost one."""
        with self._lock:
            if self._pauses == 1:
                self._thaw()
            self._pauses = max(0, self._pauses - 1)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Paused for the block (nested with :meth:`pause`/:meth:`resume`)."""
        with self._lock:
            self.pause()
            try:
                yield
            finally:
                self.resume()
