"""The engine-adapter interface the follower commits through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

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

    def commit_encoded(self, blobs: Sequence[bytes], base_digest: str, target_digest: str,
                       version: int) -> bool:
        """Optional: commit one step's wire-format patch objects, decoded by the engine itself.

        ``blobs`` are every shard's patch object of one step ``base_digest`` → ``target_digest``
        (root digests of the whole views). An engine that can decode against its own words
        (vLLM: inside its workers) overrides this, so the follower need not decode against
        :meth:`words` (for an out-of-process engine, every touched tensor crossing processes);
        the contract of :meth:`apply` holds, and it returns True. The default returns False
        at once, touching nothing: the follower then decodes and calls :meth:`apply`.
        """
        return False

    def decodes_itself(self, n_objects: int) -> bool:
        """Whether :meth:`commit_encoded` would take a step of ``n_objects`` patch objects
        (asked before pausing, so engines that decline pay no pause)."""
        return False

    def pause(self) -> None:
        """Stop generation for a commit (engines that generate override this)."""

    def resume(self) -> None:
        """Resume generation after a commit."""

    def close(self) -> None:
        """Release resources."""
