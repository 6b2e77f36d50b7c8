"""apply and compose on decoded patches (diff: :mod:`.differ`).

``apply`` never leaves a view with unknown bits: it validates everything and checks the base
digests before writing, verifies the target digests after, and undoes its writes on mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from .. import native
from ..errors import BaseMismatchError, PatchError, TargetMismatchError
from ..view import DigestAlgo, Tensor, View, sum_add
from .model import DeltaOp, DropOp, FullOp, Patch, TensorPatch

__all__ = ["InPlaceDelta", "apply", "compose", "gather", "scatter", "write_verified"]


def gather(t: Tensor, positions: np.ndarray) -> np.ndarray:
    """Elements of ``t`` at ``positions`` (nibbles for packed kinds)."""
    core = native.core
    if core is not None and positions.dtype == np.int64 and positions.flags.c_contiguous:
        out = np.empty(positions.size, dtype=t.kind.elem_dtype)
        core.gather(native.kind_tuple(t.kind, 0), t.data, positions, out)
        return out
    if not t.kind.packed:
        return t.data[positions]
    b = t.data[positions >> 1]
    return np.where(positions & 1, b >> 4, b & 0x0F).astype(np.uint8)


def scatter(
    t: Tensor, positions: np.ndarray, values: np.ndarray, old: np.ndarray | None = None
) -> tuple[int, int] | None:
    """Write elements in place (read-modify-write of bytes for packed kinds).

    With ``old`` and the native core, the old elements are checked first (nothing is
    written unless all match), the writes run without the GIL, and the change of the
    tensor's rp.sum128 state is returned (computed from the words before and after).
    """
    core = native.core
    if core is not None and old is not None and positions.dtype == np.int64:
        da, db = core.apply(
            native.kind_tuple(t.kind, 0),
            t.data,
            np.ascontiguousarray(positions),
            np.ascontiguousarray(old, dtype=t.kind.elem_dtype),
            np.ascontiguousarray(values, dtype=t.kind.elem_dtype),
        )
        return int(da), int(db)
    if not t.kind.packed:
        t.data[positions] = values
        return None
    for parity, keep, shift in ((0, 0xF0, 0), (1, 0x0F, 4)):
        sel = (positions & 1) == parity
        idx = positions[sel] >> 1
        t.data[idx] = (t.data[idx] & keep) | (values[sel].astype(np.uint8) << shift)
    return None


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Same kind and shape. Kinds come from one registry: identity first (the dataclass's
    compare builds two tuples, ~1 us, on every tensor of every encode and apply)."""
    return (a.kind is b.kind or a.kind == b.kind) and a.shape == b.shape


def _check_applicable(view: View, patch: Patch, verify: bool) -> None:
    algo = patch.digest
    for name, tp in patch.tensors.items():
        if isinstance(tp.change, (DeltaOp, DropOp)) and name not in view:
            raise BaseMismatchError("the view lacks a tensor the patch changes", tensor=name)
        if isinstance(tp.change, DeltaOp):
            t = view[name]
            if t.kind != tp.kind or t.shape != tp.shape:
                raise BaseMismatchError(
                    "tensor layout differs from the patch's base",
                    tensor=name,
                    kind=t.kind.name,
                    shape=t.shape,
                )
            positions = tp.change.positions
            if positions.size and (positions[0] < 0 or positions[-1] >= t.n_elements):
                raise PatchError("patch position out of range", tensor=name)
        if isinstance(tp.change, FullOp) and tp.base_digest is None and name in view:
            raise BaseMismatchError("the patch adds a tensor the view already has", tensor=name)
        if verify and name in view:
            view.invalidate(name)
        if (
            name in view
            and tp.base_digest is not None
            and view.tensor_digest(name, algo) != tp.base_digest
        ):
            raise BaseMismatchError(
                "tensor is not the patch's base",
                tensor=name,
                hint="the engine is on another version; plan a new path",
            )
    if view.digest(algo) != patch.base:
        raise BaseMismatchError(
            "view root digest is not the patch's base",
            expected=patch.base[:16],
            actual=view.digest(algo)[:16],
        )
    if native.core is not None:
        return  # the native scatter checks every old element as it writes, all or nothing
    for name, tp in patch.tensors.items():
        ch = tp.change
        if isinstance(ch, DeltaOp) and not np.array_equal(gather(view[name], ch.positions), ch.old):
            raise BaseMismatchError("old elements differ from the patch's base", tensor=name)


class InPlaceDelta(Protocol):
    """A delta that decodes and writes itself into a view tensor in one pass (the native
    v2 decoder): all or nothing per tensor; returns the decoded patch and the rp.sum128
    change of the tensor (None when unknown).

    ``hashed``: when true, :meth:`write` also hashes every word of the tensor as it reads it
    (before its writes) and :attr:`state_after` is then the tensor's rp.sum128 state after
    the write (words as read + the change written): the re-hash, done in the same pass."""

    name: str
    base_digest: str | None
    target_digest: str | None
    hashed: bool
    state_after: tuple[int, int] | None

    def write(self, t: Tensor) -> tuple[TensorPatch, tuple[int, int] | None]: ...


def apply(
    view: View,
    patch: Patch,
    *,
    inplace: bool = True,
    verify: bool = False,
    incremental: bool = False,
) -> View:
    """Apply ``patch`` to ``view`` (in place by default, else to a copy) and return it.

    Checks the base (cached digests; ``verify=True`` re-hashes the touched tensors first)
    before writing anything; re-hashes every touched tensor after writing (rp.sum128, at
    memory speed) and checks it and the root against the target; on a mismatch restores the
    previous bits and raises :class:`TargetMismatchError`.

    ``incremental=True`` instead updates the touched tensors' rp.sum128 states from the
    words before and after each write, in O(change): exact for what the patch wrote, blind to
    words that changed elsewhere behind the view's back. Only for callers that audit the live
    words in the background.
    """
    if not inplace:
        view = view.copy()
    _check_applicable(view, patch, verify)
    write_verified(
        view,
        list(patch.tensors.values()),
        patch.target,
        patch.digest,
        incremental=incremental and not verify,
    )
    return view


def write_verified(
    view: View,
    items: list[TensorPatch | InPlaceDelta],
    target: str,
    algo: DigestAlgo,
    *,
    incremental: bool,
) -> None:
    """Write checked transitions into ``view``, then verify every touched tensor and the
    root against the target; on any error put every written tensor back and re-raise.

    Callers have checked the base (layouts, base digests, root) before."""
    incremental = incremental and algo == "rp.sum128.v1" and native.core is not None
    undo: list[tuple[str, TensorPatch, Tensor | None, str | None]] = []
    done: list[TensorPatch] = []
    try:
        for item in items:
            name = item.name
            prev = view.get(name)
            digest = view.tensor_digest(name, algo) if prev is not None else None
            is_delta = not isinstance(item, TensorPatch) or isinstance(item.change, DeltaOp)
            state = view.sum_state(name) if incremental and is_delta and prev is not None else None
            delta: tuple[int, int] | None = None
            if not isinstance(item, TensorPatch) or isinstance(item.change, DeltaOp):
                if prev is None:  # callers checked the base: a delta's tensor is in the view
                    raise BaseMismatchError(
                        "the view lacks a tensor the patch changes", tensor=name
                    )
                if isinstance(item, TensorPatch):
                    tp, ch = item, item.changes()
                    delta = scatter(prev, ch.positions, ch.new, ch.old)  # all or nothing
                else:
                    item.hashed = item.hashed and not incremental and algo == "rp.sum128.v1"
                    tp, delta = item.write(prev)  # all or nothing
                    if item.hashed and item.state_after is not None:
                        state, delta = item.state_after, (0, 0)  # re-hashed in the pass
                undo.append((name, tp, prev, digest))
            else:
                tp = item
                undo.append((name, tp, prev, digest))
                if isinstance(tp.change, FullOp):
                    view[name] = tp.change.tensor.copy()
                else:
                    del view[name]
            done.append(tp)
            if isinstance(tp.change, DeltaOp):
                if state is not None and delta is not None:
                    view.update_sum_state(name, sum_add(state, delta))
                else:
                    view.invalidate(name)
        kept = ((tp.name, tp.target_digest) for tp in done if not isinstance(tp.change, DropOp))
        check_targets(view, kept, target, algo)
    except BaseException:
        _undo(view, undo, algo)
        raise


def check_targets(
    view: View, tensors: Iterable[tuple[str, str | None]], target: str, algo: DigestAlgo
) -> None:
    """After the writes: each (tensor, target digest) in order, then the root, against the
    view's digests (TargetMismatchError for the first that differs)."""
    for name, want in tensors:
        if view.tensor_digest(name, algo) != want:
            raise TargetMismatchError(
                "tensor does not match the target after applying", tensor=name
            )
    if view.digest(algo) != target:
        raise TargetMismatchError("view root digest does not match the target")


def _undo(
    view: View, undo: list[tuple[str, TensorPatch, Tensor | None, str | None]], algo: DigestAlgo
) -> None:
    for name, tp, prev, digest in reversed(undo):
        if isinstance(ch := tp.change, DeltaOp) and prev is not None:
            scatter(prev, ch.positions, ch.old)
        if prev is None:
            if name in view:
                del view[name]
        else:
            view[name] = prev
            if digest is not None:
                view.set_digest(name, digest, algo)


def _compose_delta(
    name: str, p: TensorPatch, pc: DeltaOp, q: TensorPatch, qc: DeltaOp
) -> TensorPatch | None:
    if p.kind != q.kind or p.shape != q.shape or p.target_digest != q.base_digest:
        raise PatchError("patches do not chain for this tensor", tensor=name)
    if (
        native.core is not None
        and pc.positions.dtype == qc.positions.dtype == np.int64
        and pc.old.dtype == pc.new.dtype == qc.old.dtype == qc.new.dtype
    ):  # one O(n) merge of the two sorted lists
        cap = pc.positions.size + qc.positions.size
        rp = np.empty(cap, dtype=np.int64)
        ro, rn = np.empty(cap, dtype=pc.old.dtype), np.empty(cap, dtype=pc.old.dtype)
        arrs = [np.ascontiguousarray(a) for a in (pc.positions, pc.old, pc.new)]
        arrs += [np.ascontiguousarray(a) for a in (qc.positions, qc.old, qc.new)]
        n = native.core.compose(pc.old.dtype.itemsize, *arrs, rp, ro, rn)
        if n < 0:
            raise PatchError("patches disagree on intermediate elements", tensor=name)
        if n == 0:
            if p.base_digest != q.target_digest:
                raise PatchError("composed delta is empty but digests differ", tensor=name)
            return None
        trim = n < cap * 3 // 4  # a kept accumulator should not hold much unused room
        rp, ro, rn = ((x[:n].copy() if trim else x[:n]) for x in (rp, ro, rn))
        return TensorPatch(
            name, p.kind, p.shape, p.base_digest, q.target_digest, DeltaOp(rp, ro, rn)
        )
    pos = np.concatenate([pc.positions, qc.positions])  # sort-merge: np.union1d is ~100x slower
    pos.sort(kind="stable")
    pos = pos[np.r_[True, pos[1:] != pos[:-1]]]
    ip = np.searchsorted(pos, pc.positions)
    iq = np.searchsorted(pos, qc.positions)
    in_p = np.zeros(pos.size, dtype=bool)
    in_p[ip] = True
    mid = np.empty(pos.size, dtype=pc.new.dtype)
    mid[ip] = pc.new
    shared = in_p[iq]
    if not np.array_equal(mid[iq[shared]], qc.old[shared]):
        raise PatchError("patches disagree on intermediate elements", tensor=name)
    old = np.empty(pos.size, dtype=pc.old.dtype)
    old[iq] = qc.old
    old[ip] = pc.old
    new = mid
    new[iq] = qc.new
    keep = old != new
    if not keep.any():
        if p.base_digest != q.target_digest:
            raise PatchError("composed delta is empty but digests differ", tensor=name)
        return None
    return TensorPatch(
        name,
        p.kind,
        p.shape,
        p.base_digest,
        q.target_digest,
        DeltaOp(pos[keep].astype(np.int64), old[keep], new[keep]),
    )


def _compose_one(name: str, p: TensorPatch | None, q: TensorPatch | None) -> TensorPatch | None:
    if p is None:
        return q
    if q is None:
        return p
    match p.change, q.change:
        case DeltaOp() as pc, DeltaOp() as qc:
            return _compose_delta(name, p, pc, q, qc)
        case _, DropOp():
            if p.base_digest is None:
                return None
            return TensorPatch(name, p.kind, p.shape, p.base_digest, None, DropOp())
        case _, FullOp():
            return TensorPatch(name, q.kind, q.shape, p.base_digest, q.target_digest, q.change)
        case FullOp(tensor), DeltaOp() as qc:  # full then delta: fold the delta into the tensor
            t = tensor.copy()
            scatter(t, qc.positions, qc.new)
            return TensorPatch(name, t.kind, t.shape, p.base_digest, q.target_digest, FullOp(t))
    raise PatchError("patches do not chain: delta after drop", tensor=name)


def compose(first: Patch, second: Patch) -> Patch:
    """One patch equal to applying ``first`` then ``second``; needs no view.

    For delta tensors the result is exactly ``diff(a, c)``.
    """
    if first.digest != second.digest:
        raise PatchError(
            "patches use different digest algorithms", first=first.digest, second=second.digest
        )
    if first.target != second.base:
        raise PatchError(
            "patches do not chain: first.target != second.base",
            first=first.target[:16],
            second=second.base[:16],
        )
    out: dict[str, TensorPatch] = {}
    for name in sorted(set(first.tensors) | set(second.tensors)):
        tp = _compose_one(name, first.tensors.get(name), second.tensors.get(name))
        if tp is not None:
            out[name] = tp
    meta = dict(first.meta)
    meta.update(second.meta)
    return Patch(first.base, second.target, out, meta, first.digest)
