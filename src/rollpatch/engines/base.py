"""The engine-adapter interface the follower commits through."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..patch import Patch
from ..view import View, WordSource

__all__ = ["EngineAdapter"]


class EngineAdapter(ABC):
    """Holds one served view inside an engine and changes it only through verified commits.

    Contract: ``version``/``digest`` describe bits the adapter has verified (never a version
    it has not); :meth:`apply` is all-or-nothing — on any failure the engine keeps its
    previous bits and version (or the adapter raises and reports ``version`` None: not ready).
    """

    name: str = "engine"

    @property
    @abstractmethod
    def version(self) -> int | None:
        """The verified version held, or None before the first load / after a failed apply."""

    @property
    @abstractmethod
    def digest(self) -> str | None:
        """Root digest of the held view (verified), or None."""

    @abstractmethod
    def load(self, view: View, version: int) -> None:
        """Replace the held weights with ``view`` (a keyframe), verified, as ``version``."""

    @abstractmethod
    def words(self) -> WordSource:
        """Read-only access to the held tensors by name (the patch decoder's context)."""

    @abstractmethod
    def apply(self, patch: Patch, version: int) -> None:
        """Apply a decoded patch in place (verified, rolled back on failure) → ``version``."""

    def pause(self) -> None:
        """Stop generation for a commit (engines that generate override this)."""

    def resume(self) -> None:
        """Resume generation after a commit."""

    def close(self) -> None:
        """Release resources."""
