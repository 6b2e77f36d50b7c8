"""One SGLang rank's parameters in checkpoint coordinates: stage while serving, scatter under
the pause (numpy only; no torch, no SGLang).

:class:`HeldWeights` lends every checkpoint tensor as a zero-copy numpy view of the runtime
parameter that holds it (fused ``qkv_proj`` / ``gate_up_proj`` rows, a rank's TP slice; the
arithmetic is :mod:`rollpatch.engines.vllm.layout`'s, shared because SGLang's parallel layers
split tensors exactly as vLLM's do) and keeps per-tensor digests of what it verified.

A commit is two phases:

1. :meth:`HeldWeights.stage` — **while SGLang serves** (no write, reads only): validate every
   tensor of the patch (known name, kind, shape, strictly increasing in-range int64
   positions, the kind's words), check the base digests, check the old elements against the
   live words, turn checkpoint positions into runtime offsets, and *prove* the update: each
   touched tensor's rp.sum128 state after the write follows from the changed words alone
   (:func:`rollpatch.engines.sumchange.sum_delta`, O(changed)) and must give the patch's target
   digest; the target root is checked too. The result, a :class:`~.update.Staged`
   update, holds per runtime parameter the offsets, old and new words, ready to scatter
   (the per-tensor checks and the merge of writes are :mod:`.update`'s).
2. :meth:`HeldWeights.commit` — **under the pause**, O(changed): the old words at the offsets
   must still be there, scatter the new words, read the written offsets back and compare. On a
   mismatch the old words are written back and read back; the digests move to the targets only
   when every read-back matched.

With ``mode="double_buffer"`` (:data:`~rollpatch.engines.staged.WriteMode`), staging also
builds, for every touched runtime parameter, a second buffer (fresh storage from the engine
glue's :class:`~.buffers.Buffers`, filled by :func:`~.buffers.second_buffers` in one pass: the
live words copied, the old words checked, the staged words written and read back); the
commit then only exchanges storages (O(1) per parameter, undone on failure) and hands back
the storage it replaced, to be released after the pause
(:func:`rollpatch.engines.writing.release`).

Nothing writes the parameters but :meth:`commit` and :meth:`load`, so the cached digests stay
true between commits; :meth:`audit` re-hashes everything (for a background check).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ...errors import (
    BaseMismatchError,
    EngineError,
    TargetMismatchError,
)
from ...kinds import Kind
from ...patch import DeltaOp, DropOp, Patch, TensorPatch
from ...view import (
    DEFAULT_DIGEST,
    Tensor,
    View,
    root_digest,
    sum128,
    sum128_digest,
    sum_add,
    tensor_digest,
)
from ..fit import changed_tensor_set
from ..staged import AuditCursor, WriteMode, checked_writes
from ..sumchange import sum_delta
from ..vllm.layout import ParamSpec, Placement, blocks, locate, placements
from ..vllm.tensorblocks import extract
from ..writing import numpy_access, write_params
from .buffers import Buffers, exchange, second_buffers
from .update import Staged, check_keyframe, merge_writes

__all__ = ["HeldWeights", "Staged"]

_M64 = (1 << 64) - 1
_MODES = ("in_place", "double_buffer")


class HeldWeights:
    """A rank's runtime parameters as a checkpoint-coordinate view (module docstring).

    ``params``: runtime parameter name → its words, a writable 2-D numpy array *sharing the
    parameter's memory* (C-contiguous rows). ``specs`` / ``kinds``: the layout and element kind
    of each runtime parameter. ``rank`` / ``tp``: this rank's place (every tensor must be whole
    on this rank: TP > 1 needs a gather, which is not built). ``buffers``: the glue's
    :class:`~.buffers.Buffers` (None: double-buffered commits are refused).
    """

    #: Whether this rank may hold blocks of tensors (:class:`~.ranked.RankWeights`, TP > 1).
    splits = False

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        specs: Sequence[ParamSpec],
        kinds: Mapping[str, Kind],
        *,
        rank: int = 0,
        tp: int = 1,
        buffers: Buffers | None = None,
    ) -> None:
        self.params, self.rank, self.tp = dict(params), rank, tp
        self.specs = tuple(specs)
        self._buffers = buffers
        self._place: dict[str, Placement] = {}
        self._kind: dict[str, Kind] = {}
        for spec in specs:
            for pl in placements(spec, rank, tp):
                if not pl.whole and not self.splits:
                    raise EngineError(
                        "tensor is split over tensor-parallel ranks: this rank's "
                        "weights are a RankWeights",
                        tensor=pl.name,
                        tp=tp,
                        hint="docs/sglang.md, tensor parallelism",
                    )
                a = self.params[spec.param]
                if a.shape != pl.param_shape or not a.flags.c_contiguous:
                    raise EngineError(
                        "runtime parameter differs from its derived layout",
                        param=spec.param,
                        shape=a.shape,
                        derived=pl.param_shape,
                    )
                self._place[pl.name] = pl
                self._kind[pl.name] = kinds[spec.param]
        self._digests: dict[str, str] = {}
        self._sums: dict[str, tuple[int, int]] = {}  # rp.sum128 states behind _digests
        self._audit_cursor = AuditCursor()
        self.staged: dict[str, Staged] = {}
        self._access = numpy_access(self.params)
        #: The last staging's phases (ms): ``prove`` (checks and digests), ``layout``
        #: (runtime offsets, merged per parameter), ``buffers`` (double-buffered copies).
        self.last_stage_ms: dict[str, float] = {}

    # -- reading -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._place)

    def __contains__(self, name: object) -> bool:
        return name in self._place

    def placement(self, name: str) -> Placement:
        """Where this rank holds checkpoint tensor ``name`` (EngineError if unknown)."""
        return self._pl(name)

    def _pl(self, name: str) -> Placement:
        try:
            return self._place[name]
        except KeyError:
            raise EngineError(
                "the engine holds no such checkpoint tensor",
                tensor=name,
                hint="the served view and the model disagree on names",
            ) from None

    def kind_of(self, name: str) -> Kind:
        self._pl(name)
        return self._kind[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape (whole, also where this rank holds a block)."""
        return self._pl(name).shape

    def __getitem__(self, name: str) -> Tensor:
        """The tensor's live words (a view of the parameter where the block is contiguous)."""
        pl = self._pl(name)
        block = extract(pl, self.params[pl.param])
        flat = block.reshape(-1) if block.flags.c_contiguous else np.ascontiguousarray(block)
        return Tensor(self._kind[name], pl.shape, flat.reshape(-1))

    def view(self, names: Sequence[str] | None = None) -> View:
        """A :class:`View` of the live words (of ``names``), with the verified digests."""
        v = View({n: self[n] for n in (self.names() if names is None else names)})
        for n in v:
            if n in self._digests:
                v.set_digest(n, self._digests[n])
        return v

    def digest_of(self, name: str, *, fresh: bool = False) -> str:
        if fresh or name not in self._digests:
            t = self[name]
            self._sums[name] = sum128(t.data)
            self._digests[name] = sum128_digest(t.dtype, t.shape, t.nbytes, self._sums[name])
        return self._digests[name]

    def state_of(self, name: str) -> tuple[int, int]:
        """The tensor's verified rp.sum128 state (behind :meth:`digest_of`)."""
        self.digest_of(name)
        return self._sums[name]

    def digests(self, *, fresh: bool = False) -> dict[str, str]:
        return {n: self.digest_of(n, fresh=fresh) for n in self.names()}

    def root(self) -> str:
        return root_digest(self.digests())

    def audit(self, budget: int) -> dict[str, object]:
        """Re-hash up to ``budget`` bytes of live words (:class:`AuditCursor`: round-robin)
        and compare with the verified digests; the names that differ are ``mismatched``."""
        out, wrapped = self._audit_cursor.take(self.names(), lambda n: self[n].nbytes, budget)
        spent = sum(self[n].nbytes for n in out)
        bad = [
            n
            for n in out
            if n in self._digests
            and self._digests[n] != tensor_digest(self[n].dtype, self[n].shape, self[n].data)
        ]
        return {"tensors": len(out), "nbytes": spent, "mismatched": bad, "wrapped": wrapped}

    # -- staging (reads only) ----------------------------------------------------------------

    def _check(self, tp: TensorPatch) -> tuple[TensorPatch, tuple[int, int], str]:
        """The tensor patch as a delta checked against the live words
        (:func:`~rollpatch.engines.staged.checked_writes`: the native core checks it and sums
        its rp.sum128 change in one pass that writes nothing), its target state and digest."""
        if isinstance(tp.change, DropOp) or tp.name not in self._place:
            raise changed_tensor_set(tp.name, tp.op)
        live = self[tp.name]
        pos, old, new, change = checked_writes(tp, live)
        state = sum_add(self.state_of(tp.name), change or sum_delta(live.data, pos, new))
        delta = TensorPatch(
            tp.name, live.kind, live.shape, tp.base_digest, tp.target_digest, DeltaOp(pos, old, new)
        )
        return delta, state, sum128_digest(live.dtype, live.shape, live.nbytes, state)

    def stage(self, patch: Patch, mode: WriteMode = "in_place") -> Staged:
        """Validate and prove ``patch`` against the live words; nothing live is written
        (``double_buffer``: the touched parameters' second buffers are built and written)."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, not {mode!r}")
        if mode == "double_buffer" and self._buffers is None:
            raise EngineError(
                "double-buffered commits need the engine glue's buffers",
                hint="use the in-place commit (writes='in_place')",
            )
        t0 = time.perf_counter()
        if self.root() != patch.base:
            raise BaseMismatchError(
                "engine root digest is not the patch's base",
                expected=patch.base[:16],
                actual=self.root()[:16],
                hint="the engine is on another version; plan a new path",
            )
        if patch.digest != DEFAULT_DIGEST:  # target states come from the changed words alone
            raise BaseMismatchError(
                "the patch's digests are not rp.sum128",
                digest=patch.digest,
                hint="a patch-format 1 board: load a keyframe (docs/patch-format.md)",
            )
        checked = [self._check(patch.tensors[n]) for n in sorted(patch.tensors)]
        deltas = [tp for tp, _, _ in checked]
        digests = dict(self.digests())
        states: dict[str, tuple[int, int]] = {}
        per_param: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.staged = {}  # one staged update at a time (a dropped one frees its buffers)
        for tp, state, got in checked:
            if tp.base_digest != digests[tp.name]:
                raise BaseMismatchError("tensor is not the patch's base", tensor=tp.name)
            states[tp.name] = state
            if got != tp.target_digest:
                raise TargetMismatchError(
                    "the staged update does not give the target tensor", tensor=tp.name
                )
            digests[tp.name] = got
        if root_digest(digests) != patch.target:
            raise TargetMismatchError("the staged update does not give the target root")
        t1 = time.perf_counter()
        for tp in deltas:
            ch, pl = tp.changes(), self._place[tp.name]
            start = self._run(pl)  # one run of the parameter: the positions, shifted
            if start is not None:
                rows = ch.positions if start == 0 else ch.positions + start
                per_param.setdefault(pl.param, []).append((rows, ch.old, ch.new))
                continue
            held, offsets = locate(pl, ch.positions)
            per_param.setdefault(pl.param, []).append((offsets, ch.old[held], ch.new[held]))
        staged = Staged(
            secrets.token_hex(8),
            patch.base,
            patch.target,
            {tp.name: digests[tp.name] for tp in deltas},
            states,
        )
        staged.writes.update(merge_writes(per_param))
        t2 = time.perf_counter()
        if mode == "double_buffer":
            assert self._buffers is not None
            staged.buffers = second_buffers(self._buffers, self.params, staged.writes)
        self.last_stage_ms = {
            "prove": (t1 - t0) * 1e3,
            "layout": (t2 - t1) * 1e3,
            "buffers": (time.perf_counter() - t2) * 1e3,
        }
        self.staged = {staged.token: staged}
        return staged

    def _run(self, pl: Placement) -> int | None:
        """Where the tensor's words start in its parameter when they are one run of it (the
        parameter's row-major order is the tensor's), else None."""
        if pl.sub is not None or not pl.whole or pl.param_shape[1] != pl.cols:
            return None
        return pl.dst_start * pl.cols if pl.dim == 0 else 0

    # -- writing (under the pause) -----------------------------------------------------------

    def commit(self, token: str, repack: Callable[[set[str]], None] = lambda p: None) -> Staged:
        """Scatter a staged update, read it back; O(changed). Raises, restored, on mismatch."""
        staged = self.staged.pop(token, None)
        if staged is None:
            raise EngineError(
                "no staged update with this token", token=token, hint="stage the patch again"
            )
        self._check_base(staged)
        if staged.buffers is not None:
            assert self._buffers is not None
            staged.retired = exchange(self._buffers, self.params, staged.buffers)
            staged.buffers = None
        else:
            self._scatter(staged, repack)
        self._record(staged)
        return staged

    def _check_base(self, staged: Staged) -> None:
        if self.root() != staged.base:
            raise BaseMismatchError(
                "the engine moved since the update was staged",
                expected=staged.base[:16],
                actual=self.root()[:16],
            )

    def _record(self, staged: Staged) -> None:
        self._digests.update(staged.digests)
        self._sums.update(staged.states)

    def _forget(self) -> None:
        """The words are unknown: drop every verified digest."""
        self._digests.clear()
        self._sums.clear()

    def _scatter(self, staged: Staged, repack: Callable[[set[str]], None]) -> None:
        try:  # old words checked as overwritten, slice by slice, read back; on every core
            write_params(self._access, staged.writes, parallel=True)
            repack(set(staged.writes))
        except BaseException:
            flat = {p: self.params[p].reshape(-1) for p in staged.writes}
            for p, w in staged.writes.items():
                flat[p][w.prepared] = w.old
            repack(set(staged.writes))
            lost = [
                p
                for p, w in staged.writes.items()
                if not np.array_equal(flat[p][w.prepared], w.old)
            ]
            if lost:
                self._forget()
                raise EngineError(
                    "could not restore the base after a failed commit: the "
                    "engine holds unknown bits",
                    param=lost[0],
                    restored=False,
                    hint="reload a keyframe",
                ) from None
            raise

    def load(self, view: View, repack: Callable[[set[str]], None] = lambda p: None) -> str:
        """Overwrite every tensor with ``view`` (validated whole first); returns the root."""
        check_keyframe(view, {n: (self._kind[n], pl.shape) for n, pl in self._place.items()})
        names = set(view)
        self.staged.clear()
        self._forget()
        for name in sorted(names):
            pl = self._place[name]
            src, dst = blocks(pl)
            if pl.length:
                self.params[pl.param][dst] = view[name].data.reshape(pl.rows, pl.cols)[src]
        repack({self._place[n].param for n in names})
        return self._loaded()

    def _loaded(self) -> str:
        """After a keyframe load: the verified digests, re-hashed; the root."""
        return root_digest(self.digests(fresh=True))
