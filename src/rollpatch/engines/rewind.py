"""Rewind records: what an engine keeps of its own commits so that it can rebuild an older
version's words and catch up from there by one folded patch (docs/engines.md, *What reaches
it*).

A replica that followed a run from an anchor *a* committed every step since: each staged
update's ``positions`` and ``old`` words are exactly *a*'s words (or a later version's) at the
positions that step changed. Kept per committed version (references to the staged arrays, no
copies), they rebuild any touched tensor's words at a retained version — a copy of the live
tensor with the records' old words scattered in, newest record first, so that each position
ends with the oldest record's word — and the publisher's folded patch from the anchor can be
decoded against them: one decode instead of a chain of step patches.

What a record proves: with each record goes the rp.sum128 state of every tensor it touched
*before* its commit (the engine's proven state). Rebuilding a tensor measures the exact sum
change of the words it scatters (the native ``apply``), so the rebuilt words' state is the
live state plus that change; it must equal the recorded state of the version rewound to, or
the rebuild is refused (a record that no longer holds the engine's words is caught before
anything is decoded from it). The decode then proves the target digests as from the held
version. Memory per record: 8 bytes (int64 position) + one element per changed word.

Held by one engine (:class:`RewindLog`); records are oldest -> newest, dropped oldest first
when over ``max_bytes`` (0: none kept), before the newest anchor evidence (:meth:`prune`;
with none seen yet, all but the last ``UNSEEN_KEEP``), and all at once on a load, a failed commit or an audit mismatch (:meth:`clear`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..view import Tensor, sum128_digest, sum_add
from .staged import StagedTensor

__all__ = ["REWIND_MAX_BYTES", "UNSEEN_KEEP", "Record", "Rewind", "RewindLog", "merge_positions"]

SumState = tuple[int, int]

#: Default cap on the bytes of retained records (positions + old words).
REWIND_MAX_BYTES = 256 << 20
#: Records kept before any anchor evidence: a fold from anchor ``a`` is first published with
#: ``a + 2``, so the two commits since ``a`` are what its first evidence needs; a board with
#: neither folds nor skip patches never gives any, and its records would serve no plan.
UNSEEN_KEEP = 2


@dataclass(frozen=True, eq=False)
class Record:
    """One committed update ``version`` -> the next: its base and target root digests, each
    touched tensor's (positions, old words) as staged, and their rp.sum128 states before it."""

    version: int
    root: str
    target: str
    undo: Mapping[str, tuple[np.ndarray, np.ndarray]]
    states: Mapping[str, SumState]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + o.nbytes for p, o in self.undo.values())


def merge_positions(parts: list[np.ndarray]) -> np.ndarray:
    """The sorted union of increasing int64 position arrays (a stable sort merges the sorted
    runs in linear time; duplicates dropped)."""
    parts = [p for p in parts if p.size]
    if not parts:
        return np.empty(0, np.int64)
    if len(parts) == 1:
        return parts[0]
    out = np.sort(np.concatenate(parts), kind="stable")
    if out.size > 1:
        keep = np.empty(out.size, bool)
        keep[0] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        out = out[keep]
    return out


@dataclass(frozen=True, eq=False)
class Rewind:
    """The records from ``version`` on (oldest first): how to rebuild its words."""

    version: int
    root: str
    records: tuple[Record, ...]

    def names(self) -> set[str]:
        """Tensors changed since ``version`` (their words must be rebuilt)."""
        return {n for r in self.records for n in r.undo}

    def state(self, name: str, live: Callable[[str], SumState]) -> SumState:
        """``name``'s rp.sum128 state at ``version``: the oldest record touching it holds it;
        untouched since, it is the live state."""
        for r in self.records:
            if name in r.undo:
                return r.states[name]
        return live(name)

    def digest(self, t: Tensor, name: str, live: Callable[[str], SumState]) -> str:
        return sum128_digest(t.dtype, t.shape, t.nbytes, self.state(name, live))

    def prepare(
        self, name: str, live: Tensor, work: Tensor, live_state: SumState
    ) -> tuple[SumState, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Turn ``work`` (a copy of ``live``) into ``version``'s words: scatter each record's
        old words, newest first. Returns the rebuilt words' state (the live state plus the
        exact change of every scattered word, measured by the native core) and the rebuild as
        a change: (positions written, sorted and unique; the live words there; the rebuilt
        words there)."""
        from .. import native

        core = native.require()
        kt = native.kind_tuple(work.kind, work.n_elements)
        mine = [r.undo[name] for r in self.records if name in r.undo]
        st = live_state
        if len(mine) == 1:  # one record: the live words are the ones it overwrites
            pos, old = mine[0]
            was = np.empty(pos.size, old.dtype)
            core.gather(kt, live.data, pos, was)
            st = sum_add(st, core.apply(kt, work.data, pos, was, old))
            return st, (pos, was, old)
        for pos, old in reversed(mine):
            cur = np.empty(pos.size, old.dtype)
            core.gather(kt, work.data, pos, cur)
            st = sum_add(st, core.apply(kt, work.data, pos, cur, old))
        every = merge_positions([p for p, _ in mine])
        was = np.empty(every.size, work.kind.elem_dtype)
        now = np.empty(every.size, work.kind.elem_dtype)
        core.gather(kt, live.data, every, was)
        core.gather(kt, work.data, every, now)
        return st, (every, was, now)


class RewindLog:
    """An engine's retained records (module docstring). Thread-safe."""

    def __init__(self, *, max_bytes: int = REWIND_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._records: list[Record] = []
        self._floor: int | None = None  # the newest anchor evidence
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._records)

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self,
        version: int,
        root: str,
        target: str,
        tensors: Mapping[str, StagedTensor],
        state: Callable[[str], SumState | None],
    ) -> None:
        """Keep the commit of ``tensors`` from ``version`` (root digest ``root``) to the view
        ``target`` (``state(name)``: the tensor's rp.sum128 state before the commit, None if
        it was not known). A tensor without a known state breaks the rewind: every record is
        dropped instead."""
        if self.max_bytes == 0:
            return
        states: dict[str, SumState] = {}
        for name in tensors:
            st = state(name)
            if st is None:
                self.clear()
                return
            states[name] = st
        undo = {n: (t.positions, t.old) for n, t in tensors.items()}
        rec = Record(version, root, target, undo, states)
        with self._lock:
            if self._records and (
                self._records[-1].version >= version or self._records[-1].target != root
            ):
                self._records.clear()  # not a continuation of what is kept
            self._records.append(rec)
            self._trim()

    def _trim(self) -> None:
        if self._floor is not None:
            self._records = [r for r in self._records if r.version >= self._floor]
        else:  # no fold or skip patch seen (yet): a fold's first evidence comes 2 versions on
            del self._records[:-UNSEEN_KEEP]
        total = sum(r.nbytes for r in self._records)
        while self._records and total > self.max_bytes:
            total -= self._records.pop(0).nbytes

    def prune(self, anchor: int) -> None:
        """Anchor evidence (a fold's base seen in a manifest): records older than ``anchor``
        are no longer needed (no later fold starts below it)."""
        with self._lock:
            if self._floor is None or anchor > self._floor:
                self._floor = anchor
            self._trim()

    def clear(self) -> None:
        """Drop every record (and the anchor evidence: a load may go back in the run)."""
        with self._lock:
            self._records.clear()
            self._floor = None

    def rewindable(self) -> dict[int, str]:
        """Version -> root digest of every version whose words can be rebuilt (the bases of
        the retained records; the held version is not listed)."""
        with self._lock:
            return {r.version: r.root for r in self._records}

    def rewind(self, root: str, held: str) -> Rewind | None:
        """The records from the retained version whose root digest is ``root``; None if none,
        or if the newest record does not end at ``held`` (the live root digest)."""
        with self._lock:
            if not self._records or self._records[-1].target != held:
                return None
            for i, r in enumerate(self._records):
                if r.root == root:
                    return Rewind(r.version, r.root, tuple(self._records[i:]))
        return None
