"""Recycled host buffers for the served snapshot's words.

Every host snapshot casts the masters into a new served view (BF16: 2 bytes per parameter),
and the view of two versions back is freed once the pipeline has moved on. Freshly allocated
memory is paged in by the cast itself: at 100M parameters that is ~50k page faults per
version, which made ``publish()`` 3-4x slower than the cast's own work (measured: 0.17-0.22 s
vs 0.05 s once the pages were reused). :class:`WordPool` keeps the words of the snapshots it
handed out and gives one back only when nothing else references it, so the next snapshot
writes into memory that is already mapped.

"Nothing else references it" is exact, not a heuristic: the pool owns each array, and every
numpy view of it (reshape, dtype view, slice) holds the owner as its ``base``, as does
``torch.from_numpy`` and any exported buffer; so while any tensor, view, patch or caller still
uses the words, the owner's reference count is above the pool's own reference.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["WordPool"]

#: ``sys.getrefcount`` of an array held only by the pool's list (the list + the call's argument).
_FREE_REFS = 2


class WordPool:
    """Word buffers per tensor name, reused once free.

    ``per_name``: arrays kept per name. Two cover the steady state (the previous view, the
    pipeline's base, and the snapshot being cast); when all are in use (a snapshot waiting in
    the queue) a new array is allocated and not kept. So the pool holds at most ``per_name``
    served views, one more than a publisher between versions holds anyway.
    """

    def __init__(self, per_name: int = 2) -> None:
        self.per_name = per_name
        self._arrays: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        #: Arrays handed out again (pages reused) and newly allocated, for tests and stats.
        self.reused = 0
        self.allocated = 0

    def take(self, name: str, n: int, dtype: np.dtype | type = np.uint16) -> np.ndarray:
        """A flat ``dtype`` array of ``n`` elements that nothing else references (contents
        undefined: the caller overwrites every element)."""
        dt = np.dtype(dtype)
        with self._lock:
            arrays = self._arrays.setdefault(name, [])
            for i in range(len(arrays)):
                if sys.getrefcount(arrays[i]) != _FREE_REFS:
                    continue  # still part of a view somebody holds
                if arrays[i].size == n and arrays[i].dtype == dt:
                    self.reused += 1
                    return arrays[i]
                del arrays[i]  # the tensor changed shape or kind: drop the stale buffer
                break
            out = np.empty(n, dt)
            self.allocated += 1
            if len(arrays) < self.per_name:
                arrays.append(out)
            return out

    def clear(self) -> None:
        """Forget every buffer (those in use stay valid: their users hold them)."""
        with self._lock:
            self._arrays.clear()
