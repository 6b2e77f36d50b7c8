"""diff: the patch between two views, and the changes between two tensors (one owner for
both the publisher's folded and skip patches and the engines' catch-up compare)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import native
from ..view import DEFAULT_DIGEST, DigestAlgo, Tensor, View
from .model import DeltaOp, DropOp, FullOp, Patch, TensorPatch
from .ops import gather, same_layout

__all__ = ["changed_positions", "changes", "diff"]

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]
#: ``empty(n, dtype)``: room for n positions, old and new elements; ``trim(room, n)``: the
#: room cut to its first n (a caller's arena gives back the rest; by default, copied out)
Empty = Callable[[int, Any], Arrays]
Trim = Callable[[Arrays, int], tuple[np.ndarray, ...]]

_RESERVE = 1 << 28  # elements: above, a reservation of the worst case could be refused


def changed_positions(a: Tensor, b: Tensor) -> np.ndarray:
    """Sorted int64 positions of the elements where two same-layout tensors differ."""
    core = native.core
    if core is not None:
        n = a.n_elements
        return np.frombuffer(
            core.diff(native.kind_tuple(a.kind, 0), a.data, b.data, 0, n), dtype=np.int64
        )
    ea, eb = (a.elements(), b.elements()) if a.kind.packed else (a.data, b.data)
    return np.flatnonzero(ea != eb).astype(np.int64)


def _fresh(n: int, dtype: Any) -> Arrays:
    return np.empty(n, np.int64), np.empty(n, dtype), np.empty(n, dtype)


def _copied(room: Arrays, n: int) -> tuple[np.ndarray, ...]:
    return tuple(x[:n].copy() for x in room)


def changes(
    a: Tensor, b: Tensor, *, empty: Empty = _fresh, trim: Trim = _copied
) -> tuple[np.ndarray, ...]:
    """(positions, old, new) where two same-layout tensors differ. The native ``diff`` (a
    64-byte compare per step, the differing lanes compressed out) writes into the worst case
    reserved by ``empty`` (pages it does not touch are never faulted in), cut by ``trim``.
    Kinds of 8 bits and more take the differing words in the compare's pass too; 4-bit codes,
    and tensors past ``_RESERVE`` (the core's own growing buffer), by two gathers after it,
    each another pass over a tensor (16.8M BF16 words at 8% changed, one thread: 18.4 ms with
    the gathers, 9.3 with the words in the pass)."""
    core, n = native.core, a.n_elements
    if core is None or n == 0:
        pos = changed_positions(a, b)
        return pos, gather(a, pos), gather(b, pos)
    kt, dt = native.kind_tuple(a.kind, n), a.kind.elem_dtype
    if n > _RESERVE:
        found = np.frombuffer(core.diff(kt, a.data, b.data, 0, n), np.int64)
        room = empty(found.size, dt)
        room[0][:] = found
        return _gathered(core, kt, a, b, room, found.size)
    room = empty(n, dt)
    if not a.kind.packed:
        return trim(room, core.diff(kt, a.data, b.data, 0, n, n, *room))
    k = core.diff(kt, a.data, b.data, 0, n, n, room[0])
    return trim(_gathered(core, kt, a, b, room, k), k)  # filled before the trim copies them


def _gathered(core: Any, kt: Any, a: Tensor, b: Tensor, room: Arrays, k: int) -> Arrays:
    """``room``'s first ``k`` positions' elements of ``a`` and ``b`` gathered into its old
    and new arrays; returns ``room``."""
    pos = room[0][:k]
    core.gather(kt, a.data, pos, room[1][:k])
    core.gather(kt, b.data, pos, room[2][:k])
    return room


def diff(a: View, b: View, *, digest: DigestAlgo = DEFAULT_DIGEST) -> Patch:
    """The patch that turns view ``a`` into view ``b``, bit for bit."""
    tensors: dict[str, TensorPatch] = {}
    for name in sorted(set(a) | set(b)):
        if name not in b:
            ta = a[name]
            tensors[name] = TensorPatch(
                name, ta.kind, ta.shape, a.tensor_digest(name, digest), None, DropOp()
            )
            continue
        tb = b[name]
        if name not in a or not same_layout(a[name], tb):
            base = a.tensor_digest(name, digest) if name in a else None
            tensors[name] = TensorPatch(
                name, tb.kind, tb.shape, base, b.tensor_digest(name, digest), FullOp(tb.copy())
            )
            continue
        ta = a[name]
        pos, old, new = changes(ta, tb)
        if pos.size == 0:
            continue
        tensors[name] = TensorPatch(
            name,
            ta.kind,
            ta.shape,
            a.tensor_digest(name, digest),
            b.tensor_digest(name, digest),
            DeltaOp(pos, old, new),
        )
    return Patch(a.digest(digest), b.digest(digest), tensors, digest=digest)
