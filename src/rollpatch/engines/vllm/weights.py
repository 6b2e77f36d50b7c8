"""One worker's runtime parameters read and written in checkpoint coordinates (numpy only).

:class:`RuntimeWeights` is the engine-independent core of the vLLM worker extension: given the
layout (:mod:`.layout`) and an :class:`Access` to the parameters' words, it lends checkpoint
tensors (zero-copy where a rank holds a whole tensor as one contiguous block), keeps
per-tensor digests and rp.sum128 states, and commits patches in two halves (the staged-commit
half is :class:`.commits.StagedCommits`, a base class of :class:`RuntimeWeights`):

1. :meth:`RuntimeWeights.stage` (while the engine serves; nothing written): validate every
   tensor of the patch (known name, kind, shape, sorted in-range positions, element dtypes),
   the base digests and the old elements against what the engine holds; prove the target
   digests from the changed words alone (:mod:`rollpatch.engines.staged`); lay the writes out
   per runtime parameter (storage offsets, old and new words);
2. :meth:`RuntimeWeights.commit_staged` (under the pause): one scatter per runtime parameter,
   rebuild of the touched modules' derived buffers (CPU: oneDNN packed weights, or a swap of
   kernels prebuilt while staging), read-back of the written positions; on any failure the old
   words are written back. Nothing in it reads an unchanged weight. Parameters served only
   through a swapped-in kernel have their own words written after the pause
   (:mod:`.writes`). :meth:`RuntimeWeights.audit` re-hashes live tensors a slice at
   a time, to catch what the read-back cannot (a word changed where no patch wrote).

With tensor parallelism every rank runs the same steps on the same patch; reading a checkpoint
tensor is then a collective (``Access.gather``), so tensors are always read in sorted order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import EngineError, ViewError
from ...kinds import Kind
from ...patch import Patch
from ...view import Tensor, View, root_digest, sum128, sum128_digest
from ..ownership import Ownership
from ..sglang.slices import aligned, combine_state, partial_state
from ..staged import AuditCursor, AuditReport
from .commits import StagedCommits
from .layout import ParamSpec, Placement, placements
from .tensorblocks import assemble, assemble_blocks, block_shape, extract, write_blocks
from .writes import (
    Access,
    ParamWrites,
    Settler,
)

__all__ = ["Access", "RuntimeWeights", "ranks_state"]


@dataclass
class _Entry:
    kind: Kind
    spec: ParamSpec
    mine: Placement
    ranks: list[Placement] = field(default_factory=list)


class RuntimeWeights(StagedCommits):
    """A worker's parameters as a checkpoint-coordinate view (see the module docstring; the
    staged commits: :class:`.commits.StagedCommits`)."""

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        kinds: Mapping[str, Kind],
        access: Access,
        *,
        rank: int = 0,
        tp: int = 1,
    ) -> None:
        self.access, self.rank, self.tp = access, rank, tp
        #: This state's identity, new in every worker process: the adapter compares it at each
        #: audit, so an engine restarted under a sidecar (its boot checkpoint's words, not the
        #: version the sidecar labels) is found out, not served under the old label.
        self.boot = secrets.token_hex(8)
        #: Commits, loads and undos made on this state (by any adapter): part of
        #: :attr:`identity`, so that an adapter's audit finds words another adapter wrote.
        self.writes = 0
        #: The adapter driving this state (:mod:`rollpatch.engines.ownership`: one sidecar
        #: per engine; checked by :func:`.ops.check_owner`).
        self.ownership = Ownership("vLLM")
        if tp > 1 and access.gather is None:
            raise EngineError("tensor parallelism needs a gather", tp=tp)
        self._entries: dict[str, _Entry] = {}
        for spec in specs:
            every = [placements(spec, r, tp) for r in range(tp)]
            for i, pl in enumerate(every[rank]):
                self._entries[pl.name] = _Entry(
                    kinds[spec.param], spec, pl, [every[r][i] for r in range(tp)]
                )
        self._digests: dict[str, str] = {}
        self._states: dict[str, tuple[int, int]] = {}
        self._cursor = AuditCursor()
        #: The last :meth:`commit_staged`'s phases in ms (``scatter``, ``derived``: the
        #: touched modules' derived buffers, ``readback``), for the pause breakdown.
        self.last_phases: dict[str, float] = {}
        #: The last :meth:`stage`'s phases in ms (``prove``, ``layout``, ``prebuild``).
        self.last_stage_phases: dict[str, float] = {}
        #: Set when an audit found live words that differ from the held digests: the engine
        #: holds unknown bits until a keyframe is loaded (patches are refused meanwhile).
        self.tainted: str | None = None
        #: Staging jobs by token (the worker glue's; see :mod:`.worker`).
        self.jobs: dict[str, Any] = {}
        #: At TP > 1, the last in-place commit's writes and the digests before it, until the
        #: next change of the words: :meth:`undo_last` puts them back when another rank's
        #: commit failed (the engine-core hook asks every rank, :mod:`.core`).
        self._undo: tuple[str, dict[str, ParamWrites], dict[str, Any]] | None = None
        #: Kernel-only parameters' words written after a commit's pause (:mod:`.writes`).
        self.settler = Settler()

    # -- reading -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def placement(self, name: str) -> Placement:
        return self._entry(name).mine

    def kind_of(self, name: str) -> Kind:
        return self._entry(name).kind

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise EngineError(
                "the engine holds no such checkpoint tensor",
                tensor=name,
                hint="the served view and the model disagree on names",
            ) from None

    def __getitem__(self, name: str) -> Tensor:
        """The tensor's words in checkpoint coordinates (a collective when TP > 1)."""
        e = self._entry(name)
        self.settler.wait()
        local = self.access.read(e.mine.param)
        if self.tp == 1:
            data = extract(e.mine, local)
            flat = data.reshape(-1) if data.flags.c_contiguous else np.ascontiguousarray(data)
        else:
            assert self.access.gather is not None
            sent, block = self._sent(e, local)
            flat = self._joined(e, self.access.gather(e.mine.param, sent), block)
        return Tensor(e.kind, e.mine.shape, flat.reshape(-1))

    @staticmethod
    def _sent(e: _Entry, param: np.ndarray) -> tuple[np.ndarray, bool]:
        """What this rank sends of ``e``'s tensor in a gather: its block (contiguous) where
        every rank's block has one shape (the transports move one shape from every rank),
        else its whole parameter; and which of the two. A parameter that fuses several
        checkpoint tensors (qkv, gate_up) is then not sent once per tensor it holds."""
        if len({block_shape(pl) for pl in e.ranks}) == 1:
            return np.ascontiguousarray(extract(e.mine, param)), True
        return param, False

    @staticmethod
    def _joined(e: _Entry, parts: list[np.ndarray], block: bool) -> np.ndarray:
        """The checkpoint tensor (flat) from every rank's part as :meth:`_sent` sent it."""
        return assemble_blocks(e.ranks, parts) if block else assemble(e.ranks, parts)

    @property
    def splits_decoding(self) -> bool:
        """At TP > 1, whether each touched tensor can be decoded by one rank and shared
        (:meth:`gather_to`, :meth:`share`; :mod:`.tpdecode`)."""
        return self.tp > 1 and self.access.gather_to is not None and self.access.share is not None

    def gather_to(
        self, name: str, dst: int, timings: dict[str, float] | None = None
    ) -> Callable[[], Tensor | None]:
        """The tensor's words in checkpoint coordinates on rank ``dst`` only (None on the
        others): a collective, as :meth:`__getitem__` at TP > 1, started now and finished
        by calling what it returns (so the next can travel while one is decoded). Adds the
        finish's ms to ``timings``: ``gather_wait_ms`` (the transfers' end), ``assemble_ms``."""
        e = self._entry(name)
        assert self.access.gather_to is not None
        self.settler.wait()
        sent, block = self._sent(e, self.access.read(e.mine.param))
        done = self.access.gather_to(e.mine.param, sent, dst)
        ms = timings if timings is not None else {}

        def tensor() -> Tensor | None:
            t0 = time.perf_counter()
            parts = done()
            t1 = time.perf_counter()
            ms["gather_wait_ms"] = ms.get("gather_wait_ms", 0.0) + (t1 - t0) * 1e3
            if parts is None:
                return None
            out = Tensor(e.kind, e.mine.shape, self._joined(e, parts, block))
            ms["assemble_ms"] = ms.get("assemble_ms", 0.0) + (time.perf_counter() - t1) * 1e3
            return out

        return tensor

    def share(self, data: bytes | None, src: int, size: int) -> memoryview:
        """Rank ``src``'s ``data`` on every rank as ``size`` bytes (a collective)."""
        assert self.access.share is not None
        return self.access.share(data, src, size)

    @property
    def delivers(self) -> bool:
        """At TP > 1, whether :meth:`deliver` can run for the calling thread."""
        d = self.access.delivers
        return self.tp > 1 and self.access.deliver is not None and d is not None and d()

    def deliver(self, parts: list[bytes], sizes: list[int]) -> list[memoryview]:
        """``parts[q]`` to each rank ``q``, point to point; what each rank sent this one
        (``sizes[q]`` bytes from rank ``q``), in rank order (a collective)."""
        assert self.access.deliver is not None
        return self.access.deliver(parts, sizes)

    def rank_placements(self, name: str) -> Sequence[Placement]:
        """Where every rank holds checkpoint tensor ``name`` (rank order; known to all)."""
        return self._entry(name).ranks

    def state_of(self, name: str) -> tuple[int, int]:
        """The held tensor's rp.sum128 state (cached; updated in O(changed) by commits)."""
        if name not in self._states:
            self.digest_of(name)
        return self._states[name]

    def digest_of(self, name: str, *, fresh: bool = False) -> str:
        if fresh or name not in self._digests:
            st = self._live_state(name)
            self._states[name] = st
            self._digests[name] = self._digest(name, st)
        return self._digests[name]

    @property
    def nbytes(self) -> int:
        """The bytes of every checkpoint tensor's words, as a view of them holds."""
        return sum(self._nbytes(n) for n in self.names())

    def _nbytes(self, name: str) -> int:
        e = self._entry(name)
        words = e.mine.n_elements // 2 if e.kind.packed else e.mine.n_elements
        return words * e.kind.word_dtype.itemsize

    def _digest(self, name: str, state: tuple[int, int]) -> str:
        e = self._entry(name)
        return sum128_digest(e.kind.dtype, e.mine.shape, self._nbytes(name), state)

    def _live_state(self, name: str) -> tuple[int, int]:
        """The tensor's rp.sum128 state from the live words; at TP > 1 from the ranks' block
        sums where it can (:func:`ranks_state`: no words cross between ranks), else gathered."""
        e = self._entry(name)
        if self.tp > 1:
            assert self.access.gather is not None
            self.settler.wait()
            local, gather = self.access.read(e.mine.param), self.access.gather
            st = ranks_state(name, e.ranks, e.mine, local, lambda a: gather(e.mine.param, a))
            if st is not None:
                return st
        return sum128(self[name].data)

    @property
    def identity(self) -> str:
        """What the adapter's audit compares with the identity its version was set under: the
        process's (a restart) and its writes (a second adapter's commits and loads, whose
        digests would otherwise pass the first one's audit; a bit flip behind every digest
        is the audit's hashes' to find)."""
        return f"{self.boot}.{self.writes}"

    def digests(self, *, fresh: bool = False) -> dict[str, str]:
        return {n: self.digest_of(n, fresh=fresh) for n in self.names()}

    def root(self) -> str:
        return root_digest(self.digests())

    # -- writing -----------------------------------------------------------------------------

    def _touch(self, names: Iterable[str]) -> None:
        self.access.repack({self._entries[n].mine.param for n in names})

    def commit(self, patch: Patch, *, undo_key: str = "") -> dict[str, str]:
        """Stage and write ``patch`` at once (:meth:`stage`, :meth:`commit_staged`)."""
        return self.commit_staged(self.stage(patch), undo_key=undo_key)

    def load(self, view: View) -> str:
        """Overwrite every tensor with ``view`` (validated whole first); returns the root."""
        names = set(view)
        if names != set(self._entries):
            missing, extra = sorted(set(self._entries) - names), sorted(names - set(self._entries))
            raise ViewError(
                "keyframe tensor names differ from the engine's",
                missing=missing[:3] or None,
                unexpected=extra[:3] or None,
                n_missing=len(missing),
                n_unexpected=len(extra),
            )
        for name in sorted(names):
            t, e = view[name], self._entries[name]
            if t.kind != e.kind or t.shape != e.mine.shape:
                raise ViewError(
                    "keyframe tensor layout differs from the engine's",
                    tensor=name,
                    kind=t.kind.name,
                    shape=t.shape,
                    engine_kind=e.kind.name,
                    engine_shape=e.mine.shape,
                )
        self.writes += 1
        self.settler.wait()
        self._undo = None
        self._digests.clear()
        self._states.clear()
        self.tainted = None
        for name in sorted(names):
            pl = self._entries[name].mine
            for dst, block in write_blocks(pl, view[name].data):  # experts: slot-relative
                self.access.write_block(pl.param, dst, block)
        self._touch(names)
        for name in sorted(names):
            self.digest_of(name)
        return self.root()

    def _forget(self, name: str) -> None:
        self._digests.pop(name, None)
        self._states.pop(name, None)

    def audit(self, budget: int) -> AuditReport:
        """Re-hash up to ``budget`` bytes of live tensors, round-robin, against the held
        digests; a mismatch marks the engine :attr:`tainted` (a collective at TP > 1).
        Nothing is hashed while words are still being written after a pause: at TP 1 this
        slice is skipped (the audit runs between generation steps and must not wait for
        them); at TP > 1 it waits for them (every rank must take part alike)."""
        if self.settler.busy:
            if self.tp == 1:
                return AuditReport(0, 0, (), False)
            self.settler.wait()  # TP > 1, a collective: every rank must audit alike
        names, wrapped = self._cursor.take(
            self.names(),
            lambda n: self._entry(n).mine.n_elements * self._entry(n).kind.elem_dtype.itemsize,
            budget,
        )
        bad, nbytes = [], 0
        for name in names:
            nbytes += self._nbytes(name)
            try:
                live: str | None = self._digest(name, self._live_state(name))
            except EngineError:  # TP > 1: ranks' replicas of a block differ (all ranks alike)
                live = None
            if name in self._digests and live != self._digests[name]:
                bad.append(name)
        if bad and self.tainted is None:
            self.tainted = bad[0]
        return AuditReport(len(names), nbytes, tuple(bad), wrapped)


def ranks_state(
    name: str,
    ranks: Sequence[Placement],
    mine: Placement,
    param: np.ndarray,
    gather: Callable[[np.ndarray], list[np.ndarray]],
) -> tuple[int, int] | None:
    """One tensor's rp.sum128 state at TP > 1 from every rank's block sum, inside a
    collective (vLLM's worker: ``gather`` is the TP all-gather, every rank calls this for the
    same tensor): this rank sums the words of its block (``mine`` of ``param``) at their
    indices in the tensor, the ranks exchange the five integers of each block, and the
    distinct blocks must tile the tensor (:func:`combine_state`). None, with no collective
    on any rank, where some rank's block (``ranks``: every rank's placement, known to all
    alike) is an expert's or does not start and end on 8-byte words: gather the words."""
    size = param.itemsize
    if not all(pl.sub is None and aligned(pl, size) for pl in ranks):
        return None
    got = gather(np.array(partial_state(mine, param), dtype=np.uint64))
    return combine_state(name, [g.tolist() for g in got], mine.shape)
