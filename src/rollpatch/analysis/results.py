"""What ``rollpatch analyze`` measures, as plain dataclasses with a JSON form.

Checkpoints are numbered from 0 in the order given; transition ``i`` is checkpoint ``i`` →
``i + 1``. Percentages in the JSON are fractions in [0, 1] (``changed_frac``), bytes are ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .experts import ExpertStep

__all__ = ["Analysis", "FormatStep", "GroupStep", "LagPoint", "PairResult", "ratio"]


def ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is 0 (JSON-safe: never NaN or inf)."""
    return a / b if b else None


@dataclass(frozen=True)
class GroupStep:
    """One tensor group's share of a transition."""

    elements: int
    changed: int
    payload_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "elements": self.elements,
            "changed": self.changed,
            "changed_frac": ratio(self.changed, self.elements),
            "payload_bytes": self.payload_bytes,
        }


@dataclass(frozen=True)
class FormatStep:
    """One transition under one served format.

    ``patch_bytes`` is ``len(rollpatch.patch.encode(diff(old, new), old))``, header included;
    ``bound_bits`` the i.i.d. bound over the whole view, ``bound_tensor_bits`` the same summed
    per tensor; ``xor_bytes`` the XOR+zstd-3 baseline (see :mod:`rollpatch.analysis.bounds`).
    """

    format: str
    elements: int
    changed: int
    view_bytes: int
    patch_bytes: int
    bound_bits: float
    bound_tensor_bits: float
    xor_bytes: int
    groups: dict[str, GroupStep]
    seconds: float = 0.0
    experts: ExpertStep | None = None
    """Per-expert and per-router counts (None: no routed experts in the view)."""

    @property
    def changed_frac(self) -> float | None:
        return ratio(self.changed, self.elements)

    def to_json(self) -> dict[str, Any]:
        return {
            "elements": self.elements,
            "changed": self.changed,
            "changed_frac": self.changed_frac,
            "view_bytes": self.view_bytes,
            "patch_bytes": self.patch_bytes,
            "patch_frac_of_view": ratio(self.patch_bytes, self.view_bytes),
            "bound_bytes": self.bound_bits / 8,
            "bound_tensor_bytes": self.bound_tensor_bits / 8,
            "patch_to_bound": ratio(8 * self.patch_bytes, self.bound_bits),
            "xor_zstd3_bytes": self.xor_bytes,
            "patch_to_xor": ratio(self.patch_bytes, self.xor_bytes),
            "seconds": self.seconds,
            "groups": {g: s.to_json() for g, s in self.groups.items()},
            "experts": self.experts.to_json() if self.experts is not None else None,
        }


@dataclass(frozen=True)
class PairResult:
    """Transition ``index`` → ``index + 1``: every format, and the update/gap statistics."""

    index: int
    formats: dict[str, FormatStep]
    gaps: dict[str, dict[str, Any]]  # grid → GapStats.summary(), plus "groups"

    def to_json(self) -> dict[str, Any]:
        return {
            "from": self.index,
            "to": self.index + 1,
            "formats": {f: s.to_json() for f, s in self.formats.items()},
            "update_over_gap": self.gaps,
        }


@dataclass(frozen=True)
class LagPoint:
    """One patch checkpoint 0 → ``k`` against the ``k`` single-step patches it replaces."""

    k: int
    elements: int
    changed: int
    patch_bytes: int
    steps_changed: int  # sum of the changed counts of transitions 0 .. k-1
    steps_patch_bytes: int  # sum of their patch bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "to": self.k,
            "elements": self.elements,
            "changed": self.changed,
            "changed_frac": ratio(self.changed, self.elements),
            "patch_bytes": self.patch_bytes,
            "sum_of_steps_changed": self.steps_changed,
            "sum_of_steps_changed_frac": ratio(self.steps_changed, self.elements),
            "sum_of_steps_patch_bytes": self.steps_patch_bytes,
            "changed_to_sum": ratio(self.changed, self.steps_changed),
            "patch_bytes_to_sum": ratio(self.patch_bytes, self.steps_patch_bytes),
        }


@dataclass
class Analysis:
    """Everything ``rollpatch analyze`` found over a run of checkpoints."""

    checkpoints: list[str]
    formats: list[str]
    scales: str
    tensors: int
    params: int
    group_params: dict[str, int]
    skipped: dict[str, str] = field(default_factory=dict)  # name → why it was left out
    view_bytes: dict[str, int] = field(default_factory=dict)  # format → served view bytes
    #: quantised format → tensors it quantises (of ``tensors``); plain formats are absent
    quantised: dict[str, int] = field(default_factory=dict)
    pairs: list[PairResult] = field(default_factory=list)
    lags: dict[str, list[LagPoint]] = field(default_factory=dict)  # format → k = 1, 2, 4...
    seconds: float = 0.0

    def totals(self, fmt: str) -> dict[str, Any]:
        """Sums and means of one format over all transitions."""
        steps = [p.formats[fmt] for p in self.pairs]
        n = len(steps)
        patch = sum(s.patch_bytes for s in steps)
        xor = sum(s.xor_bytes for s in steps)
        bound = sum(s.bound_bits for s in steps)
        changed = sum(s.changed for s in steps)
        elements = sum(s.elements for s in steps)
        return {
            "transitions": n,
            "mean_changed_frac": ratio(changed, elements),
            "mean_patch_bytes": ratio(patch, n),
            "mean_xor_zstd3_bytes": ratio(xor, n),
            "view_bytes": self.view_bytes.get(fmt),
            "mean_patch_frac_of_view": ratio(patch, n * self.view_bytes.get(fmt, 0)),
            "patch_to_bound": ratio(8 * patch, bound),
            "patch_to_xor": ratio(patch, xor),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoints": self.checkpoints,
            "formats": self.formats,
            "scales": self.scales,
            "model": {
                "tensors": self.tensors,
                "params": self.params,
                "group_params": self.group_params,
                "skipped": self.skipped,
                "quantised": self.quantised,
            },
            "view_bytes": self.view_bytes,
            "pairs": [p.to_json() for p in self.pairs],
            "lag": {f: [pt.to_json() for pt in pts] for f, pts in self.lags.items()},
            "totals": {f: self.totals(f) for f in self.formats},
            "seconds": self.seconds,
        }
