"""One worker's runtime parameters read and written in checkpoint coordinates (numpy only).

:class:`RuntimeWeights` is the engine-independent core of the vLLM worker extension: given the
layout (:mod:`.layout`) and an :class:`Access` to the parameters' words, it lends checkpoint
tensors (zero-copy where a rank holds a whole tensor as one contiguous block), keeps
per-tensor digests, and commits patches all-or-nothing:

1. validate every tensor of the patch (known name, kind, shape, sorted in-range positions,
   element dtypes) and the base digests — nothing is written before all pass;
2. check the old elements against what the engine holds;
3. write the new elements of every tensor (only the positions this rank holds), then let the
   engine rebuild derived buffers of the touched parameters (CPU: oneDNN packed weights);
4. re-read the touched tensors in checkpoint coordinates, hash them, compare with the target
   digests and the root; on a mismatch write the old elements back, rebuild, re-verify the base,
   and raise :class:`~rollpatch.errors.TargetMismatchError`.

With tensor parallelism every rank runs the same steps on the same patch; reading a checkpoint
tensor is then a collective (``Access.gather``), so tensors are always read in sorted order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import BaseMismatchError, EngineError, PatchError, TargetMismatchError, ViewError
from ...kinds import Kind
from ...patch import Patch, TensorPatch
from ...view import Tensor, View, root_digest, tensor_digest
from .layout import ParamSpec, Placement, assemble, blocks, extract, locate, placements

__all__ = ["Access", "RuntimeWeights"]


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


@dataclass
class _Entry:
    kind: Kind
    spec: ParamSpec
    mine: Placement
    ranks: list[Placement] = field(default_factory=list)


class RuntimeWeights:
    """A worker's parameters as a checkpoint-coordinate view (see the module docstring)."""

    def __init__(self, specs: Sequence[ParamSpec], kinds: Mapping[str, Kind], access: Access,
                 *, rank: int = 0, tp: int = 1) -> None:
        self.access, self.rank, self.tp = access, rank, tp
        if tp > 1 and access.gather is None:
            raise EngineError("tensor parallelism needs a gather", tp=tp)
        self._entries: dict[str, _Entry] = {}
        for spec in specs:
            every = [placements(spec, r, tp) for r in range(tp)]
            for i, pl in enumerate(every[rank]):
                self._entries[pl.name] = _Entry(kinds[spec.param], spec, pl,
                                                [every[r][i] for r in range(tp)])
        self._digests: dict[str, str] = {}

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
            raise EngineError("the engine holds no such checkpoint tensor", tensor=name,
                              hint="the served view and the model disagree on names") from None

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

    def digest_of(self, name: str, *, fresh: bool = False) -> str:
        if fresh or name not in self._digests:
            t = self[name]
            self._digests[name] = tensor_digest(t.dtype, t.shape, t.data)
        return self._digests[name]

    def digests(self, *, fresh: bool = False) -> dict[str, str]:
        return {n: self.digest_of(n, fresh=fresh) for n in self.names()}

    def root(self) -> str:
        return root_digest(self.digests())

    # -- writing -----------------------------------------------------------------------------

    def _write(self, name: str, positions: np.ndarray, values: np.ndarray) -> None:
        pl = self._entries[name].mine
        held, offsets = locate(pl, positions)
        if offsets.size:
            self.access.write(pl.param, offsets, values[held])

    def _touch(self, names: Iterable[str]) -> None:
        self.access.repack({self._entries[n].mine.param for n in names})

    def _check_delta(self, tp: TensorPatch) -> None:
        e = self._entry(tp.name)
        if tp.kind != e.kind or tp.shape != e.mine.shape:
            raise BaseMismatchError("tensor layout differs from the engine's", tensor=tp.name,
                                    kind=tp.kind.name, shape=tp.shape,
                                    engine_kind=e.kind.name, engine_shape=e.mine.shape)
        pos, old, new = tp.positions, tp.old, tp.new
        assert pos is not None and old is not None and new is not None
        if pos.dtype != np.int64 or pos.ndim != 1 or old.dtype != e.kind.elem_dtype \
                or new.dtype != e.kind.elem_dtype:
            raise PatchError("positions must be int64 and elements the kind's words",
                             tensor=tp.name)
        if pos.size and (pos[0] < 0 or pos[-1] >= e.mine.n_elements
                         or (pos.size > 1 and not (np.diff(pos) > 0).all())):
            raise PatchError("positions out of range or not strictly increasing",
                             tensor=tp.name)

    def _as_delta(self, tp: TensorPatch) -> TensorPatch:
        """A ``full`` op of an existing tensor, as the delta against what the engine holds."""
        if tp.op == "drop" or tp.name not in self._entries:
            raise BaseMismatchError("patch adds or drops a tensor; the model cannot change",
                                    tensor=tp.name, op=tp.op,
                                    hint="self-heal from a keyframe of this architecture")
        if tp.op == "delta":
            return tp
        assert tp.tensor is not None
        if tp.tensor.kind != self._entries[tp.name].kind or tp.tensor.shape != tp.shape:
            raise BaseMismatchError("full tensor's layout differs from the engine's",
                                    tensor=tp.name)
        cur, new = self[tp.name].data, tp.tensor.data
        if new.shape != cur.shape:
            raise BaseMismatchError("full tensor's size differs", tensor=tp.name)
        pos = np.flatnonzero(cur != new).astype(np.int64)
        return TensorPatch(tp.name, "delta", tp.kind, tp.shape, tp.base_digest,
                           tp.target_digest, pos, cur[pos].copy(), new[pos].copy())

    def commit(self, patch: Patch) -> dict[str, str]:
        """Apply ``patch`` all-or-nothing (module docstring); returns the touched digests."""
        if self.root() != patch.base:
            raise BaseMismatchError("engine root digest is not the patch's base",
                                    expected=patch.base[:16], actual=self.root()[:16],
                                    hint="the engine is on another version; plan a new path")
        deltas = [self._as_delta(patch.tensors[n]) for n in sorted(patch.tensors)]
        for tp in deltas:
            self._check_delta(tp)
            if tp.base_digest != self.digest_of(tp.name):
                raise BaseMismatchError("tensor is not the patch's base", tensor=tp.name)
        for tp in deltas:
            assert tp.positions is not None and tp.old is not None
            if not np.array_equal(self[tp.name].data[tp.positions], tp.old):
                raise BaseMismatchError("old elements differ from the patch's base",
                                        tensor=tp.name)
        base = {tp.name: self._digests[tp.name] for tp in deltas}
        try:
            for tp in deltas:
                assert tp.positions is not None and tp.new is not None
                self._write(tp.name, tp.positions, tp.new)
                self._digests.pop(tp.name, None)
            self._touch(base)
            got = {tp.name: self.digest_of(tp.name) for tp in deltas}
            bad = [tp.name for tp in deltas if got[tp.name] != tp.target_digest]
            if bad or self.root() != patch.target:
                raise TargetMismatchError("engine does not hold the target after writing",
                                          tensor=bad[0] if bad else None, mismatched=len(bad))
        except BaseException:
            self._undo(deltas, base)
            raise
        return got

    def _undo(self, deltas: list[TensorPatch], base: dict[str, str]) -> None:
        for tp in deltas:
            assert tp.positions is not None and tp.old is not None
            self._write(tp.name, tp.positions, tp.old)
            self._digests.pop(tp.name, None)
        self._touch(base)
        lost = sorted(n for n, d in base.items() if self.digest_of(n) != d)
        if lost:
            raise EngineError("could not restore the base after a failed commit: the engine "
                              "holds unknown bits", tensor=lost[0], restored=False,
                              hint="reload a keyframe")

    def load(self, view: View) -> str:
        """Overwrite every tensor with ``view`` (validated whole first); returns the root."""
        names = set(view)
        if names != set(self._entries):
            missing, extra = sorted(set(self._entries) - names), sorted(names - set(self._entries))
            raise ViewError("keyframe tensor names differ from the engine's",
                            missing=missing[:3] or None, unexpected=extra[:3] or None,
                            n_missing=len(missing), n_unexpected=len(extra))
        for name in sorted(names):
            t, e = view[name], self._entries[name]
            if t.kind != e.kind or t.shape != e.mine.shape:
                raise ViewError("keyframe tensor layout differs from the engine's", tensor=name,
                                kind=t.kind.name, shape=t.shape, engine_kind=e.kind.name,
                                engine_shape=e.mine.shape)
        self._digests.clear()
        for name in sorted(names):
            pl = self._entries[name].mine
            src, dst = blocks(pl)
            if pl.length:
                block = view[name].data.reshape(pl.rows, pl.cols)[src]
                self.access.write_block(pl.param, dst, block)
        self._touch(names)
        for name in sorted(names):
            self.digest_of(name)
        return self.root()
