"""A staged SGLang update and the pure checks that build it (numpy only).

:func:`check_keyframe` checks a keyframe's names and layouts (a patch's tensors are checked
against the live words by :func:`rollpatch.engines.staged.checked_writes`); :func:`merge_writes` joins the checkpoint tensors'
runtime offsets into one sorted scatter per runtime parameter; :class:`Staged` is the proven,
ready-to-scatter result that :class:`~.staged.HeldWeights` keeps between stage and commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from ...errors import ViewError
from ...kinds import Kind
from ...view import View
from ..writing import ParamWrites

__all__ = ["Staged", "check_keyframe", "merge_writes"]


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
