"""The staged-commit half of :class:`~.weights.RuntimeWeights` (numpy only): stage while the
engine serves, write under the pause, undo a commit another rank could not make (TP > 1).
See :mod:`.weights` for the two halves of a commit; this class holds no state of its own
(the attributes it names are :class:`~.weights.RuntimeWeights`')."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import BaseMismatchError, EngineError
from ...patch import Patch
from ..staged import StagedUpdate, stage_patch
from .layout import Placement
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

__all__ = ["StagedCommits"]


def _kernels(staged: StagedUpdate) -> dict[str, Any]:
    """The kernels a commit replaced (``install`` left them in the staged ``prebuilt``), one
    entry each, to be freed after the pause one at a time."""
    got = staged.payload.pop("prebuilt", None)
    return {f"kernel:{m}": k for m, k in got.items()} if isinstance(got, dict) else {}


class StagedCommits:
    """Staged commits over a worker's checkpoint-coordinate view (mixed into
    :class:`~.weights.RuntimeWeights`, which provides what is declared here)."""

    access: Access
    tp: int
    settler: Settler
    tainted: str | None
    writes: int
    last_phases: dict[str, float]
    last_stage_phases: dict[str, float]
    _digests: dict[str, str]
    _states: dict[str, tuple[int, int]]
    _undo: tuple[str, dict[str, ParamWrites], dict[str, Any]] | None
    placement: Callable[[str], Placement]
    digests: Callable[..., dict[str, str]]
    root: Callable[[], str]
    _forget: Callable[[str], None]
    state_of: Callable[[str], tuple[int, int]]
    __getitem__: Callable[[str], Any]

    # -- staged commits (docs/vllm.md, *Staging and the pause*) ---------------------------

    def stage(
        self,
        patch: Patch,
        *,
        prebuild: bool = True,
        known: Mapping[str, tuple[int, int]] | None = None,
        vouched: Mapping[str, tuple[int, int]] | None = None,
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
        recomputed. ``vouched``: rp.sum128 changes of deltas whose old words a rank checked
        when it decoded them (TP > 1, :mod:`.tpdecode`): those tensors are not gathered again.
        ``mode``: :data:`.writes.WriteMode` (``double_buffer``: also build each
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
        staged = stage_patch(
            patch,
            held,
            self.digests(),
            state,
            known=known,
            vouched=vouched,
            parallel=self.tp == 1,
        )
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

    def commit_staged(self, staged: StagedUpdate, *, undo_key: str = "") -> dict[str, str]:
        """Write ``staged`` (:func:`.writes.write_params`: one checked, read-back scatter per
        runtime parameter, in parallel on the CPU), swap in the touched modules' prebuilt
        kernels or rebuild their derived buffers, record the proven digests. Reads no
        unchanged weight. Kernel-only parameters whose kernel was prebuilt are served by that
        kernel from the swap on; their own words are written after the pause
        (:class:`.writes.Settler`). On any failure the old words are written back."""
        self.writes += 1  # whoever commits: this state's identity changes (RuntimeWeights)
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
            self._undo = (undo_key, dict(writes), before)
        self._record(staged)
        retired = {p: staged.payload.pop(p) for p in writes}  # freed after the pause
        retired.update(_kernels(staged))
        self.settler.start(acc, later, self._settle_failed, retired)
        return dict(staged.digests)

    def undo_last(self, undo_key: str = "") -> bool:
        """Put back the words and digests of the last in-place commit at TP > 1 if it was the
        one committed with ``undo_key`` (its new words checked, the old ones written and read
        back, the touched modules re-packed); False when there is none to undo (this rank's
        own commit failed and restored itself, or the words changed since). The engine-core
        hook calls it on every rank when some rank's commit failed, so that all ranks hold
        the previous version again."""
        if self._undo is None or self._undo[0] != undo_key:
            return False
        self.writes += 1
        _, writes, before = self._undo
        self._undo = None
        self.settler.wait()  # the kernel-only words written after the pause are in place
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
