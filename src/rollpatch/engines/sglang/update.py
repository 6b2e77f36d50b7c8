"""A staged SGLang update and the pure checks that build it (numpy only).

:func:`as_delta` turns one tensor patch into a validated delta against the live words of a
tensor (layout, positions — :func:`check_delta`, old elements); :func:`check_keyframe` checks
a keyframe's names and layouts; :func:`merge_writes` joins the checkpoint tensors'
runtime offsets into one sorted scatter per runtime parameter; :class:`Staged` is the proven,
ready-to-scatter result that :class:`~.staged.HeldWeights` keeps between stage and commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, PatchError, ViewError
from ...kinds import Kind
from ...patch import DeltaOp, DropOp, FullOp, TensorPatch
from ...view import View
from ..writing import ParamWrites

__all__ = ["Staged", "as_delta", "check_delta", "check_keyframe", "merge_writes"]


@dataclass
class Staged:
    """A verified, ready-to-scatter update from root ``base`` to root ``target``.

    ``buffers``: the double-buffered commit's second buffers (param → the glue's storage),
    built while staging; ``retired``: after such a commit, the storage it replaced (to be
    released after the pause)."""

    token: str
    base: str
    target: str
    digests: dict[str, str]
    states: dict[str, tuple[int, int]]
    writes: dict[str, ParamWrites] = field(default_factory=dict)
    buffers: dict[str, Any] | None = None
    retired: dict[str, Any] = field(default_factory=dict)
    #: TP > 1 (:class:`~.ranked.RankWeights`): this rank's blocks of the touched tensors
    #: after the update and before it (``[dim, start, length, s0, s1]``), and the rank's
    #: write generation it was staged against.
    blocks: dict[str, list[int]] = field(default_factory=dict)
    prev_blocks: dict[str, list[int]] = field(default_factory=dict)
    generation: int = 0

    @property
    def changed(self) -> int:
        return sum(int(w.prepared.size) for w in self.writes.values())

    def summary(self) -> dict[str, object]:
        return {
            "token": self.token,
            "base": self.base,
            "target": self.target,
            "changed": self.changed,
            "params": len(self.writes),
            "nbytes": sum(
                w.prepared.nbytes + w.old.nbytes + w.new.nbytes for w in self.writes.values()
            ),
            "digests": dict(self.digests),
            "buffers": len(self.buffers or {}),
            "blocks": dict(self.blocks),
        }


def as_delta(
    tp: TensorPatch,
    live: np.ndarray,
    kind: Kind,
    shape: tuple[int, ...],
    n_elements: int,
    *,
    checked_later: bool = False,
) -> TensorPatch:
    """``tp`` as a validated delta against ``live`` (the tensor's words, of ``kind`` and
    ``shape``): a full tensor becomes the delta of its changed elements; a delta must have
    strictly increasing in-range int64 positions and old elements equal to the live ones.
    ``checked_later``: the caller checks those two in its own pass over the words (the native
    core's dry ``apply``, which refuses either); only the arrays' types are checked here."""
    if tp.kind != kind or tp.shape != shape:
        raise BaseMismatchError(
            "tensor layout differs from the engine's",
            tensor=tp.name,
            kind=tp.kind.name,
            shape=tp.shape,
            engine_kind=kind.name,
            engine_shape=shape,
        )
    match tp.change:
        case FullOp(tensor):
            if tensor.kind != kind or tensor.data.shape != live.shape:
                raise BaseMismatchError(
                    "full tensor's layout differs from the engine's", tensor=tp.name
                )
            changed = np.flatnonzero(live != tensor.data).astype(np.int64)
            whole = DeltaOp(changed, live[changed].copy(), tensor.data[changed].copy())
            return TensorPatch(tp.name, kind, tp.shape, tp.base_digest, tp.target_digest, whole)
        case DeltaOp(pos, old, new):
            pass
        case DropOp():
            raise BaseMismatchError("the model cannot drop a tensor", tensor=tp.name)
    check_delta(tp.name, pos, old, new, kind, n_elements, positions=not checked_later)
    if not checked_later and not np.array_equal(live[pos], old):
        raise BaseMismatchError("old elements differ from the patch's base", tensor=tp.name)
    return tp


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


def check_keyframe(view: View, layout: Mapping[str, tuple[Kind, tuple[int, ...]]]) -> None:
    """``view`` names exactly the tensors of ``layout`` (name → kind, shape), each of that
    kind and shape."""
    names = set(view)
    if names != set(layout):
        missing, extra = sorted(set(layout) - names), sorted(names - set(layout))
        raise ViewError(
            "keyframe tensor names differ from the engine's",
            missing=missing[:3] or None,
            unexpected=extra[:3] or None,
            n_missing=len(missing),
            n_unexpected=len(extra),
        )
    for name in sorted(names):
        t, (kind, shape) = view[name], layout[name]
        if t.kind != kind or t.shape != shape:
            raise ViewError(
                "keyframe tensor layout differs from the engine's",
                tensor=name,
                kind=t.kind.name,
                shape=t.shape,
                engine_kind=kind.name,
                engine_shape=shape,
            )


def merge_writes(
    per_param: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]],
) -> dict[str, ParamWrites]:
    """Per runtime parameter, its tensors' (offsets, old, new) joined in offset order (each
    part's offsets increasing; parts that follow one another, as the row blocks of a fused
    parameter do, are joined without a sort)."""
    writes: dict[str, ParamWrites] = {}
    for param, given in per_param.items():
        parts = sorted((p for p in given if p[0].size), key=lambda p: int(p[0][0]))
        if not parts:
            continue
        if all(int(a[0][-1]) < int(b[0][0]) for a, b in pairwise(parts)):
            if len(parts) == 1:
                writes[param] = ParamWrites(*parts[0])
            else:
                writes[param] = ParamWrites(
                    *(np.concatenate([p[i] for p in parts]) for i in range(3))
                )
            continue
        offs = np.concatenate([p[0] for p in parts])
        order = np.argsort(offs, kind="stable")
        writes[param] = ParamWrites(
            np.ascontiguousarray(offs[order]),
            np.concatenate([p[1] for p in parts])[order],
            np.concatenate([p[2] for p in parts])[order],
        )
    return writes
