"""The adapter's arena at TP > 1 (:mod:`.tpencoded`): the whole tensors of a batch, gathered
from SGLang's ranks for their owners to decode, in one shared-memory file the adapter keeps
from one staging to the next and each rank maps once (:func:`.owned.arena_words`). Fresh
pages of shared memory, allocated, zeroed and faulted in by every rank at every staging,
held the gather to about 1.3 GB/s; what one staging leaves in the arena is never read by the
next, whose blocks tile every tensor again (:func:`.tp.covered`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["Arena"]


class Arena:
    """One file in shared memory (named by ``fresh``) that holds a batch's whole tensors,
    kept for the next staging; replaced by a larger one when a batch needs more;
    :meth:`close` unlinks it. At most :data:`.tpencoded.BATCH_BYTES` (or the largest
    tensor) of shared memory while the adapter lives."""

    ALIGN = 64

    def __init__(self, fresh: Callable[[str], Path]) -> None:
        self._fresh = fresh
        self.path: Path | None = None
        self.nbytes = 0

    def fit(self, nbytes: int) -> Path:
        """The arena, at least ``nbytes`` long."""
        if self.path is None or nbytes > self.nbytes:
            self.close()
            path = self._fresh("arena")
            with open(path, "xb") as f:  # sized first: the ranks map it
                f.truncate(nbytes)
            self.path, self.nbytes = path, nbytes
        return self.path

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path, self.nbytes = None, 0
