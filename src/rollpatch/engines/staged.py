"""Staged updates: a patch turned, while the engine serves, into writes proven to reach the target.

A commit has two halves (docs/engines.md, *Staging and the pause*):

1. **stage** (no pause; reads only the tensors the patch touches):
   :func:`stage_patch` checks the patch's base against the digests the engine holds, turns
   ``full`` ops into deltas against the held words, checks every old element against the held
   words, and computes each touched tensor's target rp.sum128 state **from the changed words
   alone** (:func:`.sumchange.sum_delta`, O(changed)), then compares the target digests and the target
   root with the patch's. The result, a :class:`StagedUpdate`, is a set of sparse writes
   (positions, old and new words per tensor) that provably turn the held words into the
   target.
2. **commit** (under the pause; writes only): each engine scatters the new words, reads the
   written positions back (O(changed)), and records the proven target states. Nothing under
   the pause reads an unchanged weight.

What this cannot see — a word that changed behind the engine's back at a position no patch
touches — is the background audit's job (:class:`rollpatch.follower.audit.Auditor`).
Every kind is staged in O(changed) with the native core (its dry ``apply``: the old words
checked and the change summed in one pass that writes nothing), non-packed kinds without it
(:func:`.sumchange.sum_delta`, numpy); packed kinds (nibbles) without the core and patches whose digests
are not rp.sum128 fall back to hashing a staged copy of each touched tensor (outside the
pause, one tensor at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..errors import BaseMismatchError, IncompatibleModelError, PatchError, TargetMismatchError
from ..kinds import Kind
from ..patch import DeltaOp, DropOp, FullOp, Patch, TensorPatch
from ..patch.ops import gather, scatter
from ..view import Tensor, root_digest, sum128_digest, sum_add, tensor_digest
from .fit import FIXED_MODEL, changed_tensor_set
from .sumchange import SumState, dry_change, sum_delta

__all__ = [
    "AuditCursor",
    "AuditReport",
    "EncodedStep",
    "StagedTensor",
    "StagedUpdate",
    "WriteMode",
    "check_delta",
    "checked_writes",
    "stage_patch",
]


#: How a staged update reaches the weights: ``in_place`` (scattered under the pause; memory:
#: the staged update) or ``double_buffer`` (a second buffer of each touched parameter built
#: while serving, exchanged under the pause in O(1) per parameter; memory: + the touched
#: parameters until the commit). docs/engines.md, *Staging and the pause*.
WriteMode = Literal["in_place", "double_buffer"]


@dataclass(frozen=True)
class EncodedStep:
    """One step of a plan as published: every shard's wire-format patch object, bound to the
    whole views ``base`` → ``target`` (root digests)."""

    blobs: tuple[bytes, ...]
    base: str
    target: str


@dataclass(frozen=True)
class AuditReport:
    """One audit slice: tensors re-hashed, their bytes, and the names whose live digest
    differs from the held version's (empty: all good). ``wrapped``: a full pass ended."""

    tensors: int
    nbytes: int
    mismatched: tuple[str, ...]
    wrapped: bool


class AuditCursor:
    """Round-robin over tensor names, ``budget`` bytes at a time (at least one tensor)."""

    def __init__(self) -> None:
        self._next = 0

    def take(
        self, names: list[str], size: Callable[[str], int], budget: int
    ) -> tuple[list[str], bool]:
        if not names:
            return [], True
        out: list[str] = []
        spent, wrapped = 0, False
        while len(out) < len(names) and (
            (budget > 0 and not out) or spent + size(names[self._next % len(names)]) <= budget
        ):  # at least one tensor per slice, none at budget 0 (a heartbeat: ownership only)
            name = names[self._next % len(names)]
            out.append(name)
            spent += size(name)
            self._next = (self._next + 1) % len(names)
            wrapped = wrapped or self._next == 0
        return out, wrapped


@dataclass(frozen=True, eq=False)
class StagedTensor:
    """One tensor's proven writes: ``positions`` (int64, increasing, checkpoint element
    indices), the ``old`` and ``new`` elements, and the state/digest they lead to."""

    name: str
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    target_digest: str
    target_state: SumState | None  # None: not an rp.sum128 digest (re-hash after writing)

    @property
    def changed(self) -> int:
        return int(self.positions.size)


@dataclass(eq=False)
class StagedUpdate:
    """A patch staged against an engine's held words: ``base`` → ``target`` (root digests).

    ``tensors`` holds only tensors with at least one changed element; ``digests`` are every
    touched tensor's target digest (empty deltas included). ``payload`` is where an engine
    keeps its own form of the writes (vLLM: runtime-parameter offsets).
    """

    base: str
    target: str
    tensors: dict[str, StagedTensor]
    digests: dict[str, str]
    payload: dict[str, object] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        """Changed elements (as the engine that staged it counted them)."""
        n = self.payload.get("changed")
        return n if isinstance(n, int) else sum(t.changed for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes the staged writes hold (positions + old + new words)."""
        n = self.payload.get("nbytes")
        return (
            n
            if isinstance(n, int)
            else sum(
                t.positions.nbytes + t.old.nbytes + t.new.nbytes for t in self.tensors.values()
            )
        )


def checked_writes(
    tp: TensorPatch, held: Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray, SumState | None]:
    """``tp``'s writes into ``held`` (the engine's words of that tensor), checked before any
    is made: the layout (:class:`BaseMismatchError`), a full tensor turned into its changed
    elements, the delta's arrays (int64 positions strictly increasing and in range, the
    kind's words: :class:`PatchError`) and the held words at the positions
    (:class:`BaseMismatchError`). Returns (positions, old, new, change): the rp.sum128 change
    the writes make, from one native pass that writes nothing (:func:`dry_change`), or None
    without the core (then positions and old words were checked in numpy)."""
    if tp.kind != held.kind or tp.shape != held.shape:
        raise (IncompatibleModelError if isinstance(tp.change, FullOp) else BaseMismatchError)(
            "tensor layout differs from the engine's",
            tensor=tp.name,
            kind=tp.kind.name,
            shape=tp.shape,
        )
    match tp.change:
        case DeltaOp(pos, old, new):
            pass
        case FullOp(tensor):
            if tensor.kind != held.kind or tensor.shape != held.shape:
                raise IncompatibleModelError(
                    "full tensor's layout differs from the engine's",
                    tensor=tp.name,
                    hint=FIXED_MODEL,
                )
            cur, full = held.elements(), tensor.elements()
            pos = np.flatnonzero(cur != full).astype(np.int64)
            old, new = cur[pos].copy(), full[pos].copy()
        case DropOp():
            raise IncompatibleModelError(
                "the version drops a tensor the engine's model has",
                tensor=tp.name,
                hint=FIXED_MODEL,
            )
    check_delta(tp.name, pos, old, new, held.kind, held.n_elements, positions=False)
    change = dry_change(held.kind, held.data, pos, old, new, tp.name)
    if change is None:
        check_delta(tp.name, pos, old, new, held.kind, held.n_elements)
        if not np.array_equal(gather(held, pos), old):
            raise BaseMismatchError("old elements differ from the engine's words", tensor=tp.name)
    return pos, old, new, change


def check_delta(
    name: str,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    kind: Kind,
    n_elements: int,
    *,
    positions: bool = True,
) -> None:
    """A delta's positions ``pos`` are int64, strictly increasing and in
    ``range(n_elements)`` (unless not ``positions``); its ``old`` and ``new`` elements are
    ``kind``'s words, one each."""
    if (
        pos.dtype != np.int64
        or pos.ndim != 1
        or old.dtype != kind.elem_dtype
        or new.dtype != kind.elem_dtype
        or old.shape != pos.shape
        or new.shape != pos.shape
    ):
        raise PatchError("positions must be int64 and elements the kind's words", tensor=name)
    if (
        positions
        and pos.size
        and (
            pos[0] < 0
            or pos[-1] >= n_elements
            or (pos.size > 1 and not bool((np.diff(pos) > 0).all()))
        )
    ):
        raise PatchError("positions out of range or not strictly increasing", tensor=name)


def stage_patch(
    patch: Patch,
    held: Callable[[str], Tensor],
    digests: Mapping[str, str],
    state: Callable[[str], SumState],
    *,
    known: Mapping[str, SumState] | None = None,
    vouched: Mapping[str, SumState] | None = None,
    parallel: bool = False,
) -> StagedUpdate:
    """Prove ``patch`` against the engine's held words (module docstring, step 1).

    ``held(name)``: the tensor's current words (read only at touched positions for non-packed
    kinds); ``digests``: every held tensor's digest (cached by the engine); ``state(name)``:
    a held tensor's rp.sum128 state; ``known``: target states the caller already proved for
    exactly these writes (a decoder that wrote them into a copy of the held tensor and
    measured the change), used instead of recomputing them; ``vouched``: for deltas whose
    old words the caller compared with the held words itself, the rp.sum128 change of their
    writes (a TP rank that decoded the tensor over the gathered words, ``.vllm.tpdecode``):
    those tensors are not read (``held`` not called); ``parallel``: the tensors on
    :func:`rollpatch.native.threads` threads (``held`` and ``state`` may then be called from
    any of them; not where reading a tensor is a collective). Raises
    :class:`BaseMismatchError` / :class:`PatchError` / :class:`TargetMismatchError` (the
    first tensor's in name order); touches nothing.
    """
    if root_digest(digests, patch.digest) != patch.base:
        raise BaseMismatchError(
            "engine root digest is not the patch's base",
            expected=patch.base[:16],
            hint="the engine is on another version; plan a new path",
        )

    def one(name: str) -> tuple[str, StagedTensor | None]:
        return _prove(patch, name, held, digests, state, known, vouched)

    names = sorted(patch.tensors)
    if parallel:
        from .. import native

        proved = native.parallel_map(one, names)
    else:
        proved = [one(name) for name in names]
    after = dict(digests)
    out: dict[str, StagedTensor] = {}
    for name, (digest, st) in zip(names, proved, strict=True):
        after[name] = digest
        if st is not None:
            out[name] = st
    if root_digest(after, patch.digest) != patch.target:
        raise TargetMismatchError("staged writes do not reach the target root")
    return StagedUpdate(patch.base, patch.target, out, {n: after[n] for n in patch.tensors})


def _prove(
    patch: Patch,
    name: str,
    held: Callable[[str], Tensor],
    digests: Mapping[str, str],
    state: Callable[[str], SumState],
    known: Mapping[str, SumState] | None,
    vouched: Mapping[str, SumState] | None,
) -> tuple[str, StagedTensor | None]:
    """One tensor of :func:`stage_patch`: its target digest, and its staged writes (None when
    it writes nothing)."""
    tp = patch.tensors[name]
    if isinstance(tp.change, DropOp) or name not in digests:
        raise changed_tensor_set(name, tp.op)
    if tp.base_digest != digests[name]:
        raise BaseMismatchError("tensor is not the patch's base", tensor=name)
    sums = patch.digest == "rp.sum128.v1"
    vouch = vouched.get(name) if sums and vouched is not None else None
    if vouch is not None and isinstance(tp.change, DeltaOp):  # old words checked by the caller
        pos, old, new = tp.changes()
        check_delta(name, pos, old, new, tp.kind, tp.n_elements)
        to = sum_add(state(name), vouch)
        nbytes = int(np.prod(tp.shape, dtype=np.int64)) * tp.kind.word_dtype.itemsize
        return _proven(tp, sum128_digest(tp.kind.dtype, tp.shape, nbytes, to), pos, old, new, to)
    t = held(name)
    pos, old, new, change = checked_writes(tp, t)
    st = known.get(name) if sums and known is not None else None
    if sums and st is None and change is not None:
        st = sum_add(state(name), change)
    if st is not None:
        digest = sum128_digest(t.dtype, t.shape, t.nbytes, st)
    else:
        digest, st = _target(patch, t, name, pos, new, state)
    return _proven(tp, digest, pos, old, new, st)


def _proven(
    tp: TensorPatch,
    digest: str,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    st: SumState | None,
) -> tuple[str, StagedTensor | None]:
    """The tensor's staged writes once its digest after them is the patch's target."""
    if digest != tp.target_digest:
        raise TargetMismatchError("staged writes do not reach the tensor's target", tensor=tp.name)
    return digest, (StagedTensor(tp.name, pos, old, new, digest, st) if pos.size else None)


def _target(
    patch: Patch,
    t: Tensor,
    name: str,
    pos: np.ndarray,
    new: np.ndarray,
    state: Callable[[str], SumState],
) -> tuple[str, SumState | None]:
    if patch.digest == "rp.sum128.v1" and not t.kind.packed:
        st = sum_add(state(name), sum_delta(t.data, pos, new))
        return sum128_digest(t.dtype, t.shape, t.nbytes, st), st
    copy = t.copy()  # fallback: one staged copy of this tensor, hashed outside the pause
    scatter(copy, pos, new)
    return tensor_digest(copy.dtype, copy.shape, copy.data, patch.digest), None
