"""One worker's runtime parameters read and written in checkpoint coordinates (numpy only).

:class:`RuntimeWeights` is the engine-independent core of the vLLM worker extension: given the
layout (:mod:`.layout`) and an :class:`Access` to the parameters' words, it lends checkpoint
tensors (zero-copy where a rank holds a whole tensor as one contiguous block), keeps
per-tensor digests and rp.sum128 states, and commits patches in two halves:

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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, ViewError
from ...kinds import Kind
from ...patch import Patch
from ...view import Tensor, View, root_digest, sum128, sum128_digest
from ..sglang.slices import ranks_state
from ..staged import AuditCursor, AuditReport, StagedUpdate, stage_patch
from .layout import (
    ParamSpec,
    Placement,
    assemble,
    extract,
    placements,
    write_blocks,
)
from .writes import (
    Access,
    ParamWrites,
    Settler,
    WriteMode,
    exchange_buffers,
    lay_out,
    undo_writes,
    write_params,
)

__all__ = ["Access", "RuntimeWeights"]


@dataclass
class _Entry:
    kind: Kind
    spec: ParamSpec
    mine: Placement
    ranks: list[Placement] = field(default_factory=list)


def _kernels(staged: StagedUpdate) -> dict[str, Any]:
    """The kernels a commit replaced (``install`` left them in the staged ``prebuilt``), one
    entry each, to be freed after the pause one at a time."""
    got = staged.payload.pop("prebuilt", None)
    return {f"kernel:{m}": k for m, k in got.items()} if isinstance(got, dict) else {}


class RuntimeWeights:
    """A worker's parameters as a checkpoint-coordinate view (see the module docstring)."""

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
        #: The token of the last staged commit :meth:`undo_last` can undo (set by the glue).
        self.undo_token: str | None = None
        #: At TP > 1, the last in-place commit's writes and the digests before it, until the
        #: next change of the words: :meth:`undo_last` puts them back when another rank's
        #: commit failed (the engine-core hook asks every rank, :mod:`.core`).
        self._undo: tuple[dict[str, ParamWrites], dict[str, Any]] | None = None
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
            flat = assemble(e.ranks, self.access.gather(e.mine.param, local))
        return Tensor(e.kind, e.mine.shape, flat.reshape(-1))

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

    def digests(self, *, fresh: bool = False) -> dict[str, str]:
        return {n: self.digest_of(n, fresh=fresh) for n in self.names()}

    def root(self) -> str:
        return root_digest(self.digests())

    # -- writing -----------------------------------------------------------------------------

    def _touch(self, names: Iterable[str]) -> None:
        self.access.repack({self._entries[n].mine.param for n in names})

    def commit(self, patch: Patch) -> dict[str, str]:
        """Stage and write ``patch`` at once (:meth:`stage`, :meth:`commit_staged`)."""
        return self.commit_staged(self.stage(patch))

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

    # -- staged commits (docs/vllm.md, *Staging and the pause*) ---------------------------

    def stage(
        self,
        patch: Patch,
        *,
        prebuild: bool = True,
        known: Mapping[str, tuple[int, int]] | None = None,
        mode: WriteMode = "in_place",
        consume: bool = False,
        mark: Callable[[str], None] = lambda phase: None,
    ) -> StagedUpdate:
        """Prove ``patch`` against the held words (O(changed) digests) and lay its writes out
        per runtime parameter, in the form the pause scatters (no word is written).

        ``prebuild``: also build the touched modules' derived buffers (CPU packed weights)
        now, to be swapped in under the pause (memory: + their packed size until the commit);
        False: they are re-packed inside the pause. ``known``: target rp.sum128 states the
        caller proved for exactly these writes (:mod:`rollpatch.engines.catchup`), not
        recomputed. ``mode``: :data:`.writes.WriteMode` (``double_buffer``: also build each
        touched parameter's second buffer now; the CPU at TP = 1 only). ``consume``: the caller
        gives ``patch`` up (its tensors are cleared): its arrays are released as they are laid
        out, so staging holds about one staged update instead of two. ``mark(phase)`` is
        called as each phase ends (``prove``, ``layout``, ``buffers``, ``prebuild``: the
        worker's memory trace)."""
        acc = self.access
        if mode == "double_buffer" and (acc.buffer is None or acc.exchange is None):
            raise EngineError(
                "double-buffered commits need the CPU at TP = 1",
                tp=self.tp,
                hint="use the in-place commit (writes='in_place')",
            )
        if self.tainted is not None:
            raise BaseMismatchError(
                "the engine holds unknown bits (audit)", tensor=self.tainted, hint="load a keyframe"
            )
        prepare = self.access.prepare or (lambda param, offsets: offsets)
        t0 = time.perf_counter()
        held, state = self.__getitem__, self.state_of  # TP > 1: reads are collectives, in order
        staged = stage_patch(patch, held, self.digests(), state, known=known, parallel=self.tp == 1)
        t1 = time.perf_counter()
        mark("prove")
        if consume and isinstance(patch.tensors, dict):
            patch.tensors.clear()  # the staged tensors hold the only references now
        lay_out(staged, self.placement, prepare)
        t2 = time.perf_counter()
        mark("layout")
        writes = {
            p: (w.prepared, w.old, w.new)
            for p, w in staged.payload.items()
            if isinstance(w, ParamWrites)
        }
        buffers = None
        if mode == "double_buffer":
            assert acc.buffer is not None
            buffers = {p: acc.buffer(p, *w) for p, w in writes.items()}
            staged.payload["buffers"] = buffers
        t3 = time.perf_counter()
        mark("buffers")
        if acc.prebuild is not None and (prebuild or buffers is not None):
            staged.payload["prebuilt"] = acc.prebuild(writes, buffers)
        mark("prebuild")
        self.last_stage_phases = {
            "prove_ms": (t1 - t0) * 1e3,
            "layout_ms": (t2 - t1) * 1e3,
            "buffers_ms": (t3 - t2) * 1e3,
            "prebuild_ms": (time.perf_counter() - t3) * 1e3,
        }
        staged.payload["nbytes"] = sum(
            w.prepared.nbytes + w.old.nbytes + w.new.nbytes
            for w in staged.payload.values()
            if isinstance(w, ParamWrites)
        )
        return staged

    def commit_staged(self, staged: StagedUpdate) -> dict[str, str]:
        """Write ``staged`` (:func:`.writes.write_params`: one checked, read-back scatter per
        runtime parameter, in parallel on the CPU), swap in the touched modules' prebuilt
        kernels or rebuild their derived buffers, record the proven digests. Reads no
        unchanged weight. Kernel-only parameters whose kernel was prebuilt are served by that
        kernel from the swap on; their own words are written after the pause
        (:class:`.writes.Settler`). On any failure the old words are written back."""
        self.settler.wait()
        self._undo = None
        if self.root() != staged.base:
            raise BaseMismatchError(
                "the engine moved since the update was staged",
                expected=staged.base[:16],
                actual=self.root()[:16],
            )
        acc = self.access
        writes = {p: w for p, w in staged.payload.items() if isinstance(w, ParamWrites)}
        got = staged.payload.get("prebuilt")
        prebuilt: dict[str, Any] | None = got if isinstance(got, dict) else None
        buffers = staged.payload.get("buffers")
        if isinstance(buffers, dict):
            self.last_phases, retired = exchange_buffers(acc, buffers, prebuilt, set(writes))
            staged.payload.pop("buffers")
            retired.update(_kernels(staged))
            self._record(staged)
            self.settler.start(acc, {}, self._settle_failed, retired)
            return dict(staged.digests)
        later = {
            p: w
            for p, w in writes.items()
            if prebuilt is not None
            and acc.install is not None
            and acc.kernel_only is not None
            and p.rpartition(".")[0] in prebuilt
            and acc.kernel_only(p)
        }
        now = {p: w for p, w in writes.items() if p not in later}
        t0 = time.perf_counter()
        try:
            n = write_params(acc, now, parallel=True)
        except BaseException:
            # the failed write put the old words back wherever it started, also over a word
            # that was not the old one (why it failed): the kernels must hold what the words do
            acc.repack(set(now))
            raise
        t1 = time.perf_counter()
        try:
            installed = (
                acc.install(prebuilt)  # kernels built from exactly these words
                if prebuilt is not None and acc.install is not None
                else set()
            )
            acc.repack({p for p in writes if p.rpartition(".")[0] not in installed})
        except BaseException:
            scatter = acc.scatter or (lambda param, off, values: acc.write(param, off, values))
            for param, w in now.items():
                scatter(param, w.prepared, w.old)
            acc.repack(set(now))
            raise
        t2 = time.perf_counter()
        self.last_phases = {
            "write_ms": (t1 - t0) * 1e3,
            "derived_ms": (t2 - t1) * 1e3,
            "threads": float(n),
            "written_after": float(len(later)),
        }
        if self.tp > 1:  # undoable (undo_last): every write, those after the pause too
            before = {n: (self._digests.get(n), self._states.get(n)) for n in staged.digests}
            self._undo = (dict(writes), before)
        self._record(staged)
        retired = {p: staged.payload.pop(p) for p in writes}  # freed after the pause
        retired.update(_kernels(staged))
        self.settler.start(acc, later, self._settle_failed, retired)
        return dict(staged.digests)

    def undo_last(self) -> bool:
        """Put back the words and digests of the last in-place commit at TP > 1 (its new words
        checked, the old ones written and read back, the touched modules re-packed); False
        when there is none to undo (this rank's own commit failed and restored itself, or
        the words changed since). The engine-core hook calls it on every rank when some rank's
        commit failed, so that all ranks hold the previous version again."""
        undo, self._undo = self._undo, None
        if undo is None:
            return False
        self.settler.wait()  # the kernel-only words written after the pause are in place
        writes, before = undo
        undo_writes(self.access, writes)
        for name, (digest, state) in before.items():
            self._forget(name)
            if digest is not None:
                self._digests[name] = digest
            if state is not None:
                self._states[name] = state
        return True

    def _record(self, staged: StagedUpdate) -> None:
        """The proven digests (and rp.sum128 states) of a committed update."""
        for name, d in staged.digests.items():
            st = staged.tensors.get(name)
            if st is not None and st.target_state is None:
                self._forget(name)  # not an rp.sum128 patch: re-hashed on the next read
                continue
            self._digests[name] = d
            if st is not None and st.target_state is not None:
                self._states[name] = st.target_state

    def _settle_failed(self, param: str, message: str) -> None:
        if self.tainted is None:
            self.tainted = param  # its words no longer match the served kernel or digest

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
