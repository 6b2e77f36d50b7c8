"""A skip patch's base view, rebuilt from a later view by undoing the patch composed since.

A skip patch from version ``b`` to ``n`` is coded against ``b``'s words, which the publisher
no longer holds: :func:`rewind` copies each touched tensor of a later view and undoes the
composed change in it, checking the current words where it writes and the result against
``b``'s digests (rp.sum128 in O(change): no tensor is hashed again).

:class:`RewoundBase` is that view rebuilt *ahead* (docs/publisher.md, "A skip patch's base,
rebuilt ahead"): when the worker settles version ``n - 1`` and ``n`` is due for a skip patch
from ``b``, it rewinds the view of ``n - 1`` by the accumulator ``b → n - 1`` while nobody
waits on the publisher.
The build of ``n`` then codes the skip patch straight from it (one fused encode of ``b``'s
view against ``n``'s) instead of composing the step into the accumulator, copying every
touched tensor of ``n`` and undoing ``b → n`` on the way to LATEST: at 100M parameters with
stride 8 that was most of the skip version's time to LATEST.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BoardError, PatchError
from ..patch import Patch
from ..patch.ops import scatter
from ..view import Tensor, View, sum_add

__all__ = ["RewoundBase", "rebuild_ahead", "rewind", "same_layout"]


@dataclass(frozen=True)
class RewoundBase:
    """Version ``base``'s view (``view``, digests known), rebuilt from ``source``, the view of
    version ``through`` (the pipeline's previous view when it was rebuilt)."""

    base: int
    through: int
    source: View
    view: View

    def fits(self, prev: object, prev_version: int | None, view: object) -> bool:
        """Whether a build on ``prev`` (version ``prev_version``) of ``view`` may code its
        skip patch from ``base`` with this view: rebuilt from that very view, and ``view``
        with its layout (else the build composes and rewinds, as without it)."""
        return (
            self.through == prev_version
            and self.source is prev
            and isinstance(view, View)
            and same_layout(self.view, view)
        )


def same_layout(a: View, b: View) -> bool:
    """Whether ``a`` and ``b`` hold the same tensor names, kinds and shapes (a skip patch is
    published only between such views: no tensor added, dropped or reshaped)."""
    return a.keys() == b.keys() and all(
        (a[n].kind, a[n].shape) == (t.kind, t.shape) for n, t in b.items()
    )


def rewind(view: View, composed: Patch, *, version: int, base: int) -> View | None:
    """``view`` (the target of ``composed``) with ``composed`` undone: the view of its base,
    touched tensors copied, the others shared with ``view``. None when ``composed`` adds,
    drops or reshapes a tensor (step patches only). Raises :class:`BoardError` (an internal
    error) when the words or digests disagree with ``composed``; ``version`` and ``base``
    name the skip patch in that error."""
    try:
        inverse = composed.inverse()
    except PatchError:
        return None
    algo = composed.digest
    rewound: dict[str, Tensor] = {}
    states: dict[str, tuple[int, int]] = {}
    for name, tp in inverse.tensors.items():
        ch = tp.changes()  # inverse() holds delta ops only
        t = view[name].copy()
        # the current words checked where they are undone; the sum128 change comes back
        delta = scatter(t, ch.positions, ch.new, ch.old)
        if delta is not None and algo == "rp.sum128.v1":
            states[name] = sum_add(view.sum_state(name), delta)
        rewound[name] = t
    old = View({n: rewound.get(n, t) for n, t in view.items()}, view.metadata)
    for name, st in states.items():  # the rewound digest without hashing the tensor again
        old.update_sum_state(name, st)
    for name in view:
        if name not in rewound:  # unchanged since the base: the current digest is its
            old.set_digest(name, view.tensor_digest(name, algo), algo)
    for name, tp in inverse.tensors.items():
        if old.tensor_digest(name, algo) != tp.target_digest:
            raise BoardError(
                "skip patch does not rewind to its base (internal error)",
                tensor=name,
                version=version,
                base=base,
            )
    if old.digest(algo) != composed.base:
        raise BoardError(
            "skip patch does not rewind to its base root (internal error)",
            version=version,
            base=base,
        )
    return old


def rebuild_ahead(
    prev: View, version: int, accumulators: Sequence[tuple[int, int, Patch | None]]
) -> RewoundBase | None:
    """The base view of version ``version + 1``'s skip patch, rebuilt from ``prev`` (the view
    of ``version``), or None when no skip patch is due then or it cannot be rebuilt.

    ``accumulators``: (stride, base, patch composed from the base to ``version``), those no
    folded patch covers. Of the strides due at ``version + 1`` the smallest base (the
    longest stride: the most changes to undo) is rebuilt; an accumulator that does not end
    at ``prev`` is left to the build (which composes and finds it broken, as before).
    """
    due = sorted(
        (base, acc)
        for s, base, acc in accumulators
        if version + 1 - s == base != version and acc is not None
    )
    if not due:
        return None
    base, acc = due[0]
    if acc.digest != "rp.sum128.v1" or acc.target != prev.digest(acc.digest):
        return None
    view = rewind(prev, acc, version=version + 1, base=base)
    return None if view is None else RewoundBase(base, version, prev, view)
