"""Context groups: partition a tensor's elements by a context the decoder can compute.

The chance that a served element changes depends on its rounding gap, i.e. on the exponent
of its *old* value, which the decoder knows. Elements are grouped by that context
(docs/patch-format.md §4) and each group's changed slots are coded with their own density.

Everything is done chunk by chunk (cache-sized): the context of a chunk is recomputed when
needed instead of materialising tensor-sized temporaries, and ranks inside a chunk come from
numpy's stable radix argsort on uint8 contexts.
"""

from __future__ import annotations

import numpy as np

from ..errors import PatchDecodeError
from ..kinds import MIN_CONTEXT_ELEMENTS, Kind, single_context

__all__ = ["CHUNK", "MIN_CONTEXT_ELEMENTS", "Groups"]

#: Elements per chunk (cache-friendly for the radix argsort).
CHUNK = 1 << 18


class Groups:
    """Contexts of one tensor's elements, with rank ↔ position maps per context."""

    def __init__(self, kind: Kind, elements: np.ndarray) -> None:
        self.elements = elements
        self.n = int(elements.size)
        self.single = single_context(kind, self.n)
        self.ncontexts = 1 if self.single else 1 << kind.ctx_bits
        dt = elements.dtype
        self._shift = dt.type(kind.ctx_shift)
        self._mask = dt.type((1 << kind.ctx_bits) - 1)
        self.nchunks = -(-self.n // CHUNK)

    def ctx(self, values: np.ndarray) -> np.ndarray:
        """Context (uint8) of each element value."""
        if self.single:
            return np.zeros(values.size, dtype=np.uint8)
        return ((values >> self._shift) & self._mask).astype(np.uint8)

    def _chunk(self, i: int) -> np.ndarray:
        return self.ctx(self.elements[i * CHUNK : (i + 1) * CHUNK])

    def split(self, positions: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Encoder side, one pass: (context sizes, per-context sorted ranks, their contexts).

        Returns ``sizes`` (elements per context), ``ranks`` (one array per context with a
        change, in increasing context order) and ``ids`` (those contexts).
        """
        if self.single:
            sizes = np.array([self.n], dtype=np.int64)
            ids = np.array([0] if positions.size else [], dtype=np.int64)
            return sizes, ([positions.astype(np.int64)] if positions.size else []), ids
        c = self.ncontexts
        running = np.zeros(c, dtype=np.int64)
        bounds = np.searchsorted(positions, np.arange(self.nchunks + 1, dtype=np.int64) * CHUNK)
        mark = np.zeros(CHUNK, dtype=bool)
        hit_ctx, hit_rank = [], []
        for i in range(self.nchunks):
            ctx = self._chunk(i)
            lo, hi = bounds[i], bounds[i + 1]
            if hi == lo:
                running += np.bincount(ctx, minlength=c)
                continue
            order = np.argsort(ctx, kind="stable")
            ends = _segment_ends(ctx, order, c)
            counts = np.diff(ends, prepend=0)
            local = positions[lo:hi] - i * CHUNK
            mark[local] = True
            # indices into the context-sorted chunk of the changed elements: grouped by
            # context, ascending — the rank inside the context is the offset in its segment
            hits = np.flatnonzero(mark[: ctx.size][order])
            mark[local] = False
            g = np.searchsorted(ends, hits, side="right")
            hit_ctx.append(g)
            hit_rank.append(running[g] + hits - (ends[g] - counts[g]))
            running += counts
        if not hit_ctx:
            return running, [], np.zeros(0, dtype=np.int64)
        g = np.concatenate(hit_ctx)
        r = np.concatenate(hit_rank)
        order = np.argsort(g.astype(np.uint8), kind="stable")
        per_ctx = np.bincount(g, minlength=c)
        ids = np.flatnonzero(per_ctx)
        return running, np.split(r[order], np.cumsum(per_ctx[ids])[:-1]), ids

    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Decoder side, pass 1: (elements per context, chunks × contexts counts)."""
        if self.single:
            return np.array([self.n], dtype=np.int64), np.zeros((0, 1), dtype=np.int64)
        counts = np.zeros((self.nchunks, self.ncontexts), dtype=np.int64)
        for i in range(self.nchunks):
            counts[i] = np.bincount(self._chunk(i), minlength=self.ncontexts)
        return counts.sum(axis=0), counts

    def join(self, ids: np.ndarray, ranks: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
        """Decoder side, pass 2: sorted positions from per-context ranks (validated)."""
        if self.single:
            return ranks[0] if ranks else np.zeros(0, dtype=np.int64)
        cum = np.cumsum(counts, axis=0)
        seg = np.cumsum(counts, axis=1) - counts
        chunks, idxs = [], []
        for g, r in zip(ids, ranks):
            chunk = np.searchsorted(cum[:, g], r, side="right")
            if chunk.size and chunk[-1] >= self.nchunks:
                raise PatchDecodeError("rank beyond its context", context=int(g))
            chunks.append(chunk)
            idxs.append(seg[chunk, g] + r - (cum[chunk, g] - counts[chunk, g]))
        if not chunks:
            return np.zeros(0, dtype=np.int64)
        chunk = np.concatenate(chunks)
        idx = np.concatenate(idxs)
        by_chunk = np.argsort(chunk, kind="stable")
        chunk, idx = chunk[by_chunk], idx[by_chunk]
        pos = np.empty(idx.size, dtype=np.int64)
        bounds = np.searchsorted(chunk, np.arange(self.nchunks + 1))
        mark = np.zeros(CHUNK, dtype=bool)
        for i in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[i], bounds[i + 1]
            order = np.argsort(self._chunk(int(i)), kind="stable")
            hit = order[idx[lo:hi]]
            mark[hit] = True  # sort the chunk's positions by marking them
            pos[lo:hi] = np.flatnonzero(mark) + i * CHUNK
            mark[hit] = False
        return pos


def _segment_ends(ctx: np.ndarray, order: np.ndarray, c: int) -> np.ndarray:
    """End of each context's segment in the sorted chunk (binary search: no bincount pass)."""
    n = ctx.size
    targets = np.arange(1, c + 1)
    lo = np.zeros(c, dtype=np.int64)
    hi = np.full(c, n, dtype=np.int64)
    while True:
        live = lo < hi
        if not live.any():
            return lo
        mid = (lo + hi) // 2
        val = ctx[order[np.minimum(mid, n - 1)]].astype(np.int64)
        below = live & (val < targets)
        lo = np.where(below, mid + 1, lo)
        hi = np.where(live & ~below, mid, hi)
