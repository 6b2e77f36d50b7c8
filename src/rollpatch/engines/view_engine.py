"""An in-process engine: holds a :class:`View` (tests, ``rollpatch pull``, staging checks)."""

from __future__ import annotations

import threading

from ..errors import EngineError
from ..patch import Patch, apply
from ..view import View, WordSource
from .base import EngineAdapter

__all__ = ["ViewEngine"]


class ViewEngine(EngineAdapter):
    """Holds a view in memory; applies patches in place with :func:`rollpatch.patch.apply`."""

    name = "view"

    def __init__(self) -> None:
        self._view: View | None = None
        self._version: int | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def digest(self) -> str | None:
        return None if self._view is None else self._view.digest()

    @property
    def view(self) -> View:
        if self._view is None:
            raise EngineError("no view loaded", engine=self.name)
        return self._view

    def load(self, view: View, version: int) -> None:
        with self._lock:
            self._view, self._version = view, version

    def words(self) -> WordSource:
        return self.view

    def apply(self, patch: Patch, version: int) -> None:
        with self._lock:
            apply(self.view, patch)  # verified; rolled back on mismatch
            self._version = version
