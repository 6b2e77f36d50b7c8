"""One SGLang rank's weights under tensor parallelism (``--tp-size`` > 1; numpy only).

:class:`RankWeights` is :class:`~.staged.HeldWeights` for a rank that holds *blocks* of
checkpoint tensors (:mod:`.slices`): it cannot hash a split tensor nor decode a patch against
it, so

- its verified state is, per tensor, the rp.sum128 sum of the words it holds at their global
  indices (:meth:`blocks`); the adapter adds every rank's blocks into the tensors' digests;
- :meth:`stage` takes a *decoded* patch (the follower decoded it against the words the adapter
  gathered from every rank) and keeps the part this rank holds: positions validated against
  the whole tensor, the old words checked against the live ones, each touched block's sum
  moved by the changed words alone (O(changed)); the adapter checks the sums against the
  patch's target digests and root before any rank writes;
- :meth:`commit` scatters and reads back as at TP = 1, guarded by the rank's write
  generation instead of a root; double-buffered (``mode="double_buffer"``), staging built
  the touched parameters' second buffers (the rank's writes checked and read back there) and
  the commit only exchanges storages, O(1) per parameter;
- :meth:`undo` writes the last commit's old words back (checked), or exchanges the replaced
  storage back, for when another rank's commit failed: every rank then holds the previous
  version again. So a double-buffered commit keeps the storage it replaced until the adapter
  saw every rank commit and calls :meth:`release` (after the pause).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, IncompatibleModelError
from ...kinds import Kind
from ...patch import DeltaOp, FullOp, Patch, TensorPatch
from ...view import Tensor, View
from ..fit import FIXED_MODEL
from ..staged import WriteMode, check_delta
from ..sumchange import SumState, dry_change
from ..vllm.layout import Placement, locate, locate_rows, placements
from ..vllm.tensorblocks import extract
from ..writing import ParamWrites, release, write_params
from .buffers import exchange, second_buffers
from .slices import Block, partial_delta, partial_state, word_map
from .staged import HeldWeights
from .update import Staged, merge_writes

__all__ = ["RankWeights"]

_M64 = (1 << 64) - 1


def _release(storage: dict[str, Any]) -> None:
    """Free replaced storage after the pause, off the caller's thread."""
    threading.Thread(target=release, args=(storage,), name="rollpatch-release", daemon=True).start()


class RankWeights(HeldWeights):
    """A TP rank's weights (module docstring); same arguments as :class:`HeldWeights`."""

    splits = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spec_of = {
            pl.name: spec for spec in self.specs for pl in placements(spec, 0, self.tp)
        }
        self._blocks: dict[str, Block] = {}
        self._generation = 0
        self._undo: Staged | None = None

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Tensor:
        pl = self._pl(name)
        if not pl.whole:
            raise EngineError(
                "tensor is split over tensor-parallel ranks; no rank holds it whole",
                tensor=name,
                tp=self.tp,
                hint="gather every rank's block (the adapter's words())",
            )
        return super().__getitem__(name)

    def placement_on(self, name: str, rank: int) -> Placement:
        """Where rank ``rank`` holds checkpoint tensor ``name`` (every rank derives every
        rank's layout from the same metadata)."""
        if rank == self.rank:
            return self._pl(name)
        spec = self._spec_of.get(name)
        if spec is None:
            raise EngineError("the engine holds no such checkpoint tensor", tensor=name)
        return next(pl for pl in placements(spec, rank, self.tp) if pl.name == name)

    def block(self, name: str) -> tuple[np.ndarray, Placement]:
        """This rank's block of ``name`` (2-D, a view of the parameter) and its placement."""
        pl = self._pl(name)
        return extract(pl, self.params[pl.param]), pl

    def blocks(self, *, fresh: bool = False) -> dict[str, Block]:
        """Per tensor: ``[dim, start, length, s0, s1]`` of the block this rank holds."""
        for n in self.names():
            if fresh or n not in self._blocks:
                pl = self._place[n]
                self._blocks[n] = partial_state(pl, self.params[pl.param])
        return dict(self._blocks)

    def digest_of(self, name: str, *, fresh: bool = False) -> str:
        raise EngineError("a TP rank has no whole-tensor digests", tensor=name, hint="blocks()")

    def audit(self, budget: int) -> dict[str, object]:
        """Re-hash up to ``budget`` bytes of held blocks (round-robin) against the verified
        sums; the names that differ are ``mismatched``."""
        out, wrapped = self._audit_cursor.take(
            self.names(), lambda n: self.block(n)[0].nbytes, budget
        )
        spent = sum(self.block(n)[0].nbytes for n in out)
        bad = [
            n
            for n in out
            if n in self._blocks
            and self._blocks[n] != partial_state(self._place[n], self.params[self._place[n].param])
        ]
        return {"tensors": len(out), "nbytes": spent, "mismatched": bad, "wrapped": wrapped}

    # -- staging -----------------------------------------------------------------------------

    def _held_change(
        self, tp: TensorPatch, pl: Placement, kind: Kind
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, SumState]:
        """The patch's changes that fall in this rank's block: their parameter offsets, old
        and new elements (positions validated over the whole tensor, old elements checked
        against the live words), and the change of the block's sum (:func:`partial_delta`;
        for a delta of whole words, the native check's own sum, :func:`word_map`)."""
        if tp.kind != kind or tp.shape != pl.shape:
            raise (IncompatibleModelError if isinstance(tp.change, FullOp) else BaseMismatchError)(
                "tensor layout differs from the engine's",
                tensor=tp.name,
                shape=tp.shape,
                engine_shape=pl.shape,
            )
        param = self.params[pl.param]
        flat = param.reshape(-1)
        match tp.change:
            case FullOp(tensor):
                if tensor.kind != kind or tensor.data.size != pl.n_elements:
                    raise IncompatibleModelError(
                        "full tensor's layout differs", tensor=tp.name, hint=FIXED_MODEL
                    )
                block = self.block(tp.name)[0]
                full = tensor.data.reshape(pl.rows, pl.cols)
                mine = (
                    full[pl.src_start : pl.src_start + pl.length]
                    if pl.dim == 0
                    else (full[:, pl.src_start : pl.src_start + pl.length])
                )
                idx = np.flatnonzero(mine != block)
                r, c = np.divmod(idx, mine.shape[1])
                pos = (
                    (r + pl.src_start) * pl.cols + c
                    if pl.dim == 0
                    else r * pl.cols + c + pl.src_start
                ).astype(np.int64)
                old = np.ascontiguousarray(block).reshape(-1)[idx]
                new = np.ascontiguousarray(mine).reshape(-1)[idx]
            case DeltaOp(pos, old, new):
                check_delta(tp.name, pos, old, new, kind, pl.n_elements)
            case _:
                raise IncompatibleModelError(
                    "the version drops a tensor the engine's model has",
                    tensor=tp.name,
                    hint=FIXED_MODEL,
                )
        rows = locate_rows(pl, pos)  # a block of whole rows: two binary searches
        keep: slice | np.ndarray
        keep, offsets = rows if rows is not None else locate(pl, pos)
        pos, old, new = pos[keep], old[keep], new[keep]
        jmap = word_map(pl, flat.itemsize)
        change = (
            None
            if jmap is None or kind.packed or not pos.size
            else dry_change(kind, flat, offsets, old, new, tp.name, jmap=jmap)
        )  # the old words checked and the block's sum change summed in one native pass
        if change is None:
            if not np.array_equal(flat[offsets], old):
                raise BaseMismatchError("old elements differ from the patch's base", tensor=tp.name)
            change = partial_delta(pl, param, pos, new)
        return offsets, old, new, change

    def stage(self, patch: Patch, mode: WriteMode = "in_place") -> Staged:
        """This rank's part of a decoded patch, validated and its block sums moved; nothing
        is written (the adapter checks the sums of every rank before the commit)."""
        if mode not in ("in_place", "double_buffer"):
            raise ValueError(f"mode must be 'in_place' or 'double_buffer', not {mode!r}")
        if mode == "double_buffer" and self._buffers is None:
            raise EngineError(
                "double-buffered commits need the engine glue's buffers",
                tp=self.tp,
                hint="use the in-place commit (writes='in_place')",
            )
        self.release()  # a commit the adapter never confirmed: its old storage goes now
        t0 = time.perf_counter()
        current = self.blocks()
        staged = Staged(secrets.token_hex(8), patch.base, patch.target, {}, {})
        staged.generation = self._generation
        per_param: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for name in sorted(patch.tensors):
            if name not in self._place:
                raise IncompatibleModelError(
                    "the version adds a tensor; the engine's model cannot change",
                    tensor=name,
                    hint=FIXED_MODEL,
                )
            pl = self._place[name]
            offsets, old, new, (d0, d1) = self._held_change(
                patch.tensors[name], pl, self._kind[name]
            )
            dim, start, length, s0, s1 = current[name]
            staged.prev_blocks[name] = current[name]
            staged.blocks[name] = [dim, start, length, (s0 + d0) & _M64, (s1 + d1) & _M64]
            if offsets.size:
                per_param.setdefault(pl.param, []).append((offsets, old, new))
        t1 = time.perf_counter()
        staged.writes.update(merge_writes(per_param))
        t2 = time.perf_counter()
        if mode == "double_buffer" and staged.writes:  # copies, written and read back
            assert self._buffers is not None
            staged.buffers = second_buffers(self._buffers, self.params, staged.writes)
        self.last_stage_ms = {
            "prove": (t1 - t0) * 1e3,
            "layout": (t2 - t1) * 1e3,
            "buffers": (time.perf_counter() - t2) * 1e3,
        }
        self.staged = {staged.token: staged}
        return staged

    # -- writing -----------------------------------------------------------------------------

    def _check_base(self, staged: Staged) -> None:
        if staged.generation != self._generation:
            raise BaseMismatchError(
                "the engine moved since the update was staged", rank=self.rank, tp=self.tp
            )

    def _record(self, staged: Staged) -> None:
        self._blocks.update(staged.blocks)
        self._generation += 1
        self._undo = staged

    def _forget(self) -> None:
        self._blocks.clear()
        self._undo = None

    def undo(self, token: str) -> dict[str, Any]:
        """Write the last commit's old words back (the new ones checked as overwritten), or
        exchange the storage it replaced back in (double-buffered)."""
        staged = self._undo
        if staged is None or staged.token != token:
            raise EngineError("no such commit to undo on this rank", token=token, rank=self.rank)
        if staged.retired:
            assert self._buffers is not None
            undone = exchange(self._buffers, self.params, staged.retired)
            staged.retired = {}
            _release(undone)
        else:
            writes = {p: ParamWrites(w.prepared, w.new, w.old) for p, w in staged.writes.items()}
            write_params(self._access, writes, parallel=True)
        self._blocks.update(staged.prev_blocks)
        self._generation += 1
        self._undo = None
        return {"undone": staged.changed}

    def release(self) -> dict[str, Any]:
        """The adapter saw every rank commit: the storage the last double-buffered commit
        replaced is freed (in the background), and that commit can no longer be undone."""
        staged, n = self._undo, 0
        if staged is not None and staged.retired:
            retired, staged.retired = staged.retired, {}
            n = len(retired)
            _release(retired)
            self._undo = None
        return {"released": n}

    def load(self, view: View, repack: Callable[[set[str]], None] = lambda p: None) -> str:
        self.release()
        self._undo = None
        self._generation += 1
        return super().load(view, repack)

    def _loaded(self) -> str:
        self._blocks.clear()
        self.blocks(fresh=True)
        return ""
