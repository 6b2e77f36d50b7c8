"""Change rates per routed expert and per router, for mixture-of-experts checkpoints.

An expert is named by its layer (the last all-digit name segment before ``experts``, -1 when
there is none) and its index: the digit segment after ``experts`` (``mlp.experts.7.up_proj``),
or, for fused tensors (``mlp.experts.gate_up_proj`` of shape ``[experts, ...]``), the slice of
the leading dimension a changed element falls in. An expert's count sums every tensor of it
(gate, up, down, and quantised scales). Routers are the ``router`` group of
:func:`rollpatch.analysis.groups.tensor_group`, counted per layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..patch.model import DeltaOp, Patch
from ..view import Tensor
from .groups import _EXPERTS, tensor_group
from .results import ratio

__all__ = ["ExpertRate", "ExpertStep", "expert_of", "expert_step", "layer_of"]

#: quantiles of the per-expert changed share reported per transition
QUANTILES: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9, 1.0)


def layer_of(segs: list[str], end: int) -> int:
    """The last all-digit segment before ``end`` (the layer index), or -1."""
    for s in reversed(segs[:end]):
        if s.isdigit():
            return int(s)
    return -1


def expert_of(name: str) -> tuple[int, int | None] | None:
    """``(layer, expert)`` of a routed-expert tensor (expert None: fused), else None."""
    segs = name.lower().split(".")
    at = next((i for i, s in enumerate(segs) if s in _EXPERTS), None)
    if at is None:
        return None
    nxt = segs[at + 1] if at + 1 < len(segs) else ""
    return layer_of(segs, at), int(nxt) if nxt.isdigit() else None


@dataclass(frozen=True)
class ExpertRate:
    """One expert (or one layer's router, ``expert`` -1) over one transition."""

    layer: int
    expert: int
    elements: int
    changed: int

    @property
    def changed_frac(self) -> float | None:
        return ratio(self.changed, self.elements)

    @property
    def label(self) -> str:
        return f"L{self.layer}.E{self.expert}" if self.expert >= 0 else f"L{self.layer}.router"

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "expert": self.expert,
            "elements": self.elements,
            "changed": self.changed,
            "changed_frac": self.changed_frac,
        }


@dataclass(frozen=True)
class ExpertStep:
    """Per-expert and per-router counts of one transition under one format."""

    experts: tuple[ExpertRate, ...]
    routers: tuple[ExpertRate, ...]

    def quantiles(self) -> dict[str, float]:
        """Quantiles over experts of their changed share (keys ``q0``, ``q10``... ``q100``)."""
        fr = np.array([e.changed / e.elements for e in self.experts if e.elements])
        if fr.size == 0:
            return {}
        return {f"q{round(100 * q)}": float(np.quantile(fr, q)) for q in QUANTILES}

    def extremes(self, n: int = 3) -> tuple[list[ExpertRate], list[ExpertRate]]:
        """The ``n`` most changed experts (most first) and the ``n`` least (least first)."""
        ranked = sorted(
            (e for e in self.experts if e.elements),
            key=lambda e: (-e.changed / e.elements, e.layer, e.expert),
        )
        return ranked[:n], ranked[::-1][:n]

    def to_json(self) -> dict[str, Any]:
        most, least = self.extremes()
        return {
            "experts": len(self.experts),
            "quantiles": self.quantiles(),
            "most_changed": [e.to_json() for e in most],
            "least_changed": [e.to_json() for e in least],
            "routers": [r.to_json() for r in self.routers],
            "per_expert": [e.to_json() for e in self.experts],
        }


def expert_step(old: Mapping[str, Tensor], patch: Patch) -> ExpertStep | None:
    """Count elements and changes per expert and per router; None when there are no experts."""
    elements: dict[tuple[int, int], int] = defaultdict(int)
    changed: dict[tuple[int, int], int] = defaultdict(int)
    r_elements: dict[int, int] = defaultdict(int)
    r_changed: dict[int, int] = defaultdict(int)
    for name, t in old.items():
        tp = patch.tensors.get(name)
        if tensor_group(name) == "router":
            segs = name.lower().split(".")
            layer = layer_of(segs, len(segs))
            r_elements[layer] += t.n_elements
            r_changed[layer] += tp.n_changed if tp is not None else 0
            continue
        key = expert_of(name)
        if key is None:
            continue
        layer, e = key
        if e is not None:
            elements[layer, e] += t.n_elements
            changed[layer, e] += tp.n_changed if tp is not None else 0
            continue
        n_exp = t.shape[0] if t.shape else 1
        per = t.n_elements // max(n_exp, 1)
        for i in range(n_exp):
            elements[layer, i] += per
        if tp is None:
            continue
        if isinstance(tp.change, DeltaOp):
            hit = np.bincount(tp.change.positions // max(per, 1), minlength=n_exp)
            for i in range(n_exp):
                changed[layer, i] += int(hit[i])
        else:  # a full or dropped tensor: every element counts as changed
            for i in range(n_exp):
                changed[layer, i] += per
    if not elements:
        return None
    return ExpertStep(
        tuple(ExpertRate(k[0], k[1], elements[k], changed[k]) for k in sorted(elements)),
        tuple(ExpertRate(k, -1, r_elements[k], r_changed[k]) for k in sorted(r_elements)),
    )
