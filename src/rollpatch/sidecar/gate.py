"""The commit gate, as the sidecar uses it: admission of requests and the commit sequence.

The gate itself lives in :mod:`rollpatch.follower.commit` (one owner of the commit
sequence: admission, drain or pause, write, resume, one pause figure); the sidecar creates
one per engine, hands it to its follower, and admits every proxied request through it.
:class:`GatedEngine` remains for callers that drive an adapter without a follower.
"""

from __future__ import annotations

from ..engines.base import EngineAdapter
from ..follower.commit import COMMIT_MODES, Admission, CommitGate, CommitMode, CommitRecord
from ..patch import Patch
from ..view import View, WordSource

__all__ = ["COMMIT_MODES", "Admission", "CommitGate", "CommitMode", "CommitRecord", "GatedEngine"]


class GatedEngine(EngineAdapter):
    """An adapter whose weight changes run through a :class:`CommitGate` (``gate.run``)."""

    def __init__(self, inner: EngineAdapter, gate: CommitGate) -> None:
        self.inner = inner
        self.gate = gate
        self.name = inner.name

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def digest(self) -> str | None:
        return self.inner.digest

    @property
    def pauses_itself(self) -> bool:
        return self.inner.pauses_itself

    def load(self, view: View, version: int) -> None:
        self.gate.run(lambda: self.inner.load(view, version))

    def words(self) -> WordSource:
        return self.inner.words()

    def apply(self, patch: Patch, version: int) -> None:
        self.gate.run(lambda: self.inner.apply(patch, version))

    def close(self) -> None:
        self.inner.close()
