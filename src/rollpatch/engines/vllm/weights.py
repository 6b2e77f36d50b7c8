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
   rebuild of the touched modules' derived buffers (CPU: oneDNN packed weights), read-back of
   the written positions; on any failure the old words are written back. Nothing in it
   reads an unchanged weight. :meth:`RuntimeWeights.audit` re-hashes live tensors a slice at
   a time, to catch what the read-back cannot (a word changed where no patch wrote).

With tensor parallelism every rank runs the same steps on the same patch; reading a checkpoint
tensor is then a collective (``Access.gather``), so tensors are always read in sorted order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, TargetMismatchError, ViewError
from ...kinds import Kind
from ...native import threads
from ...patch import Patch
from ...view import Tensor, View, root_digest, sum128, sum128_digest
from ..staged import AuditCursor, AuditReport, StagedUpdate, stage_patch
from .layout import ParamSpec, Placement, assemble, extract, locate, placements, write_blocks

__all__ = ["Access", "RuntimeWeights"]

#: Positions written then read back at a time under the pause (a slice's words stay in cache).
_SLICE = 1 << 16


@dataclass
class Access:
    """How the core reaches one worker's parameters (implemented by the engine glue).

    ``read(param)``: the parameter's words as a numpy array of its logical 2-D shape — a view
    of the parameter's memory where possible (CPU), else a host copy (GPU).
    ``write(param, offsets, values)``: store words at row-major logical ``offsets``
    (stride-aware). ``write_block(param, index, block)``: store a 2-D block at a pair of
    slices (keyframe loads: no per-element offsets). ``repack(params)``: rebuild derived buffers after writing those
    parameters. ``gather(param, local)``: every rank's copy of ``param`` (TP > 1), in rank
    order. ``aliases``: True when ``read`` returns views, so lent tensors can be zero-copy.
    """

    read: Callable[[str], np.ndarray]
    write: Callable[[str, np.ndarray, np.ndarray], None]
    write_block: Callable[[str, tuple[slice, slice], np.ndarray], None]
    repack: Callable[[set[str]], None] = lambda params: None
    gather: Callable[[str, np.ndarray], list[np.ndarray]] | None = None
    aliases: bool = False
    prepare: Callable[[str, np.ndarray], np.ndarray] | None = None
    scatter: Callable[[str, np.ndarray, np.ndarray], None] | None = None
    read_at: Callable[[str, np.ndarray], np.ndarray] | None = None
    #: Optional (CPU): derived buffers built before the pause from the staged words
    #: (``prebuild({param: (prepared, new)})``), swapped in under it (``install(prebuilt)``
    #: → the modules installed), so the pause does not re-pack whole modules.
    prebuild: Callable[[dict[str, tuple[np.ndarray, np.ndarray]]], Any] | None = None
    install: Callable[[Any], set[str]] | None = None
    #: Optional: ``swap(param, prepared, old, new)`` checks that the words at ``prepared``
    #: (increasing storage offsets) are ``old`` and writes ``new``, in one pass, all or
    #: nothing (raises :class:`BaseMismatchError`); else the commit scatters blindly.
    swap: Callable[[str, np.ndarray, np.ndarray, np.ndarray], None] | None = None


@dataclass
class _ParamWrites:
    """One runtime parameter's staged writes (every checkpoint tensor fused into it)."""

    prepared: np.ndarray
    old: np.ndarray
    new: np.ndarray


def _increasing(w: _ParamWrites) -> _ParamWrites:
    """The writes in storage order (done while staging: the pause then writes and reads
    memory front to back, and a one-pass check-and-write can rely on it)."""
    if w.prepared.size > 1 and not bool(np.all(w.prepared[1:] > w.prepared[:-1])):
        order = np.argsort(w.prepared, kind="stable")
        w = _ParamWrites(w.prepared[order], w.old[order], w.new[order])
    return w


@dataclass
class _Entry:
    kind: Kind
    spec: ParamSpec
    mine: Placement
    ranks: list[Placement] = field(default_factory=list)


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
            t = self[name]
            st = sum128(t.data)
            self._states[name] = st
            self._digests[name] = sum128_digest(t.dtype, t.shape, t.nbytes, st)
        return self._digests[name]

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
    ) -> StagedUpdate:
        """Prove ``patch`` against the held words (O(changed) digests) and lay its writes out
        per runtime parameter, in the form the pause scatters (no word is written).

        ``prebuild``: also build the touched modules' derived buffers (CPU packed weights)
        now, to be swapped in under the pause (memory: + their packed size until the commit);
        False: they are re-packed inside the pause. ``known``: target rp.sum128 states the
        caller proved for exactly these writes (:mod:`rollpatch.engines.catchup`), not recomputed."""
        if self.tainted is not None:
            raise BaseMismatchError(
                "the engine holds unknown bits (audit)", tensor=self.tainted, hint="load a keyframe"
            )
        prepare = self.access.prepare or (lambda param, offsets: offsets)
        t0 = time.perf_counter()
        staged = stage_patch(patch, self.__getitem__, self.digests(), self.state_of, known=known)
        t1 = time.perf_counter()
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for name, st in staged.tensors.items():
            pl = self._entries[name].mine
            held, offsets = locate(pl, st.positions)
            if offsets.size:
                parts.setdefault(pl.param, []).append((offsets, st.old[held], st.new[held]))
        staged.payload["changed"] = staged.changed
        for param, chunks in parts.items():
            offsets, old, new = (np.concatenate([c[i] for c in chunks]) for i in range(3))
            staged.payload[param] = _increasing(_ParamWrites(prepare(param, offsets), old, new))
        t2 = time.perf_counter()
        if self.access.prebuild is not None and prebuild:
            staged.payload["prebuilt"] = self.access.prebuild(
                {
                    p: (w.prepared, w.new)
                    for p, w in staged.payload.items()
                    if isinstance(w, _ParamWrites)
                }
            )
        self.last_stage_phases = {
            "prove_ms": (t1 - t0) * 1e3,
            "layout_ms": (t2 - t1) * 1e3,
            "prebuild_ms": (time.perf_counter() - t2) * 1e3,
        }
        # the writes now live per parameter; keep only the proven states per tensor
        empty = np.empty(0, np.int64)
        staged.tensors = {
            n: replace(st, positions=empty, old=st.old[:0], new=st.new[:0])
            for n, st in staged.tensors.items()
        }
        staged.payload["nbytes"] = sum(
            w.prepared.nbytes + w.old.nbytes + w.new.nbytes
            for w in staged.payload.values()
            if isinstance(w, _ParamWrites)
        )
        return staged

    def commit_staged(self, staged: StagedUpdate) -> dict[str, str]:
        """Write ``staged`` (one scatter per runtime parameter, the old words checked as they
        are overwritten where the access can), read the written positions back, rebuild the
        touched modules' derived buffers, record the proven digests. Reads no unchanged
        weight. Parameters are written in parallel on the CPU (:func:`rollpatch.native.threads`)
        and in slices of :data:`_SLICE` positions, each read back while in cache. On any failure
        the old words are written back."""
        if self.root() != staged.base:
            raise BaseMismatchError(
                "the engine moved since the update was staged",
                expected=staged.base[:16],
                actual=self.root()[:16],
            )
        acc = self.access
        writes = {p: w for p, w in staged.payload.items() if isinstance(w, _ParamWrites)}
        scatter = acc.scatter or (lambda param, off, values: acc.write(param, off, values))
        read_at = acc.read_at or (lambda param, off: acc.read(param).reshape(-1)[off])
        write = acc.swap or (lambda param, off, old, new: scatter(param, off, new))
        started: list[str] = []

        def one(param: str) -> None:
            """Write, then read back, a slice at a time (the slice is still in cache)."""
            w = writes[param]
            started.append(param)
            for i in range(0, w.prepared.size, _SLICE):
                s = slice(i, i + _SLICE)
                write(param, w.prepared[s], w.old[s], w.new[s])
                if not np.array_equal(read_at(param, w.prepared[s]), w.new[s]):
                    raise TargetMismatchError("read-back of written weights differs", param=param)

        t0 = time.perf_counter()
        try:
            n = min(threads(), len(writes)) if acc.aliases else 1
            if n > 1:  # generation is held: the writes are the only work, on every core
                with ThreadPoolExecutor(n, thread_name_prefix="rollpatch-write") as pool:
                    list(pool.map(one, writes))
            else:
                for param in writes:
                    one(param)
            t1 = time.perf_counter()
            prebuilt = staged.payload.get("prebuilt")
            installed = (
                acc.install(prebuilt)  # kernels built from exactly these words
                if prebuilt is not None and acc.install is not None
                else set()
            )
            acc.repack({p for p in writes if p.rpartition(".")[0] not in installed})
            t2 = time.perf_counter()
        except BaseException:
            for param in started:  # words not reached yet are the old ones already
                scatter(param, writes[param].prepared, writes[param].old)
            acc.repack(set(started))
            raise
        self.last_phases = {
            "write_ms": (t1 - t0) * 1e3,
            "derived_ms": (t2 - t1) * 1e3,
            "threads": float(n),
        }
        for name, d in staged.digests.items():
            st = staged.tensors.get(name)
            if st is not None and st.target_state is None:
                self._forget(name)  # not an rp.sum128 patch: re-hashed on the next read
                continue
            self._digests[name] = d
            if st is not None and st.target_state is not None:
                self._states[name] = st.target_state
        return dict(staged.digests)

    def audit(self, budget: int) -> AuditReport:
        """Re-hash up to ``budget`` bytes of live tensors, round-robin, against the held
        digests; a mismatch marks the engine :attr:`tainted` (a collective at TP > 1)."""
        names, wrapped = self._cursor.take(
            self.names(),
            lambda n: self._entry(n).mine.n_elements * self._entry(n).kind.elem_dtype.itemsize,
            budget,
        )
        bad, nbytes = [], 0
        for name in names:
            t = self[name]
            nbytes += t.nbytes
            live = sum128_digest(t.dtype, t.shape, t.nbytes, sum128(t.data))
            if name in self._digests and live != self._digests[name]:
                bad.append(name)
        if bad and self.tainted is None:
            self.tainted = bad[0]
        return AuditReport(len(names), nbytes, tuple(bad), wrapped)
