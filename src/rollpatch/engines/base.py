"""The engine-adapter interface the follower commits through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from ..errors import BaseMismatchError, EngineError
from ..patch import Patch
from ..view import View, WordSource
from .fit import ModelTensors
from .staged import AuditReport, EncodedStep, StagedUpdate

__all__ = ["EngineAdapter", "require_adoptable"]


def require_adoptable(engine: str, digest: str, root: str) -> None:
    """An adoption's check: the root just hashed from the engine's words is ``digest``
    (:class:`BaseMismatchError` otherwise, before anything changes)."""
    if root != digest:
        raise BaseMismatchError(
            "the engine does not hold the expected view",
            engine=engine,
            expected=digest[:16],
            actual=root[:16],
        )


class EngineAdapter(ABC):
    """Holds one served view inside an engine and changes it only through verified commits.

    Contract: ``version``/``digest`` describe bits the adapter has verified (never a version
    it has not); :meth:`apply` is all-or-nothing — on any failure the engine keeps its
    previous bits and version (or the adapter raises and reports ``version`` None: not ready).
    """

    name: str = "engine"
    #: The engine runs in another process that can stop and restart on its own (vLLM,
    #: SGLang): when it does not answer, the words behind its version may be its boot
    #: checkpoint's by the time it answers again (:meth:`Follower.engine_unreachable`).
    remote: bool = False
    #: The bearer token the engine's server wants (vLLM's or SGLang's ``--api-key``): sent
    #: by the adapter on its own calls, and by the sidecar on what it proxies.
    engine_token: str | None = None

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

    def model_tensors(self) -> ModelTensors | None:
        """Optional: every tensor the engine's model holds, name -> (safetensors dtype,
        shape), so the follower refuses a keyframe of another model from its header, before
        fetching it (:mod:`rollpatch.engines.fit`). None: not known (checked at load)."""
        return None

    def boot_digest(self) -> str | None:
        """Optional: the root digest of every word the engine holds now, hashed fresh (an
        engine with no version yet holds the checkpoint it booted from), so the follower can
        adopt a published version whose target it equals instead of fetching a keyframe
        (``FollowerConfig.boot="adopt"``). None: the engine cannot tell."""
        return None

    def claim(self) -> None:
        """Make this adapter the one that drives the engine (one sidecar per engine: refused
        with ``other_adapter`` while another holds it). Engines without the rule accept."""

    def adopt(self, version: int, digest: str) -> None:
        """Take the words the engine holds as ``version``, after hashing them fresh and
        finding ``digest`` (:class:`~rollpatch.errors.BaseMismatchError` otherwise; nothing
        changes then). Engines that cannot hash their words refuse."""
        raise EngineError("this engine cannot adopt the words it booted with", engine=self.name)

    @abstractmethod
    def apply(self, patch: Patch, version: int) -> None:
        """Apply a decoded patch in place (verified, rolled back on failure) → ``version``."""

    def stage(self, patch: Patch, version: int) -> StagedUpdate | None:
        """Optional: prove a decoded ``patch`` against the held words while the engine serves
        (:mod:`rollpatch.engines.staged`), so that :meth:`commit_staged` only writes. None:
        the engine does not stage (the follower then commits with :meth:`apply`)."""
        return None

    def stage_encoded(self, steps: Sequence[EncodedStep], version: int) -> StagedUpdate | None:
        """Optional: stage a chain of wire-format steps that the engine decodes and composes
        against its own words (vLLM: inside its workers; nothing of the model crosses
        processes). ``steps[0]`` starts at the held version, or at one of
        :meth:`rewindable`'s (the engine rebuilds that version's words from its records).
        None: not supported."""
        return None

    def rewindable(self) -> Mapping[int, str]:
        """Older versions (version -> root digest) whose words the engine can rebuild from
        records of its own verified commits (:mod:`rollpatch.engines.rewind`), so that
        :meth:`stage_encoded` takes a chain starting there; the held version is not listed.
        Default: none."""
        return {}

    def note_anchor(self, version: int) -> None:
        """Anchor evidence (a folded patch's base seen in a manifest): no later fold starts
        below ``version``, so records of older versions may go."""

    def commit_staged(self, staged: StagedUpdate, version: int) -> None:
        """Write a staged update (called under the commit gate: writes only, then a read-back
        of the written positions); ``version`` moves only if it verifies. Raises
        :class:`~rollpatch.errors.BaseMismatchError` if the held view is no longer the
        staged base."""
        raise EngineError("this engine does not stage commits", engine=self.name)

    def audit(self, budget_bytes: int) -> AuditReport | None:
        """Optional: re-hash up to ``budget_bytes`` of live weights (round-robin over tensors)
        and compare with the digests of the version held. None: the engine cannot audit."""
        return None

    @property
    def pauses_itself(self) -> bool:
        """True when every weight change of this adapter holds generation by itself for as
        long as it needs (vLLM with its engine-core hook: a staged commit is one engine-core
        call between two forward passes); the commit gate then does not pause around it."""
        return False

    @property
    def kv_across_commit(self) -> str:
        """What a staged commit does to the KV cache of generations in flight: ``keep`` (they
        go on with the new weights over it; their labels span both versions) or
        ``recompute`` (recomputed with the new weights). Reported by the sidecar's
        ``/version``."""
        return "recompute"

    def pause(self) -> None:
        """Stop generation for a commit (engines that generate override this)."""

    def resume(self) -> None:
        """Resume generation after a commit."""

    def close(self) -> None:
        """Release resources."""
