"""How big master updates are compared with the served rounding gap.

For each element, ``r = |master_new − master_old| / ulp(old)`` where ``ulp(old)`` is the
spacing of the served grid (BF16, or FP16) at the served old value: ``2^(e − bias − m)`` for
exponent field ``e`` (``e = 1`` for subnormals and zero), ``m`` mantissa bits. The difference
is taken in float64, so it is exact. Non-finite old values or updates are counted apart.
An update from a served old value of exactly ±0 (zero-initialised biases, norms, LoRA B)
has the grid's smallest subnormal as its gap, so its r is astronomically large (1e-6 from 0
is r ~ 1e34 on BF16): true, and it changes the served value, but it says nothing about the
update's size. These are counted apart too (``from_zero``), in every share and quantile as
they are, but not in ``max``, the largest r of an update from a nonzero value.

Why it matters: a master that sits uniformly inside its rounding cell crosses a cell boundary
— and changes the served value — with probability ``min(r, 1)``. So ``mean(min(r, 1))`` is
what the rounding arithmetic alone predicts for the share of changed values, and ``r > 0.5``
is the share of updates large enough to move even a value sitting exactly on the grid.

Quantiles come from a log-spaced histogram (16 bins per binade, interpolated inside the bin),
so they are exact to about ±2%; counts, fractions, the mean and the maximum are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..formats.floats import f32_to_bf16_bits, f32_to_f16_bits, to_float32

__all__ = ["GRIDS", "QUANTILES", "GapStats"]

#: Served grids: (exponent shift, exponent mask, bias + mantissa bits).
GRIDS: dict[str, tuple[int, int, int]] = {"bf16": (7, 0xFF, 127 + 7), "fp16": (10, 0x1F, 15 + 10)}
#: Reported quantiles of r.
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)

_PER_BINADE = 128  # bins 2^(1/128) wide: a quantile within 0.55% (16 gave up to 4.4%)
_LO, _HI = -48, 24  # log2(r) range of the histogram; outside is clipped
_NBINS = (_HI - _LO) * _PER_BINADE
_CHUNK = 1 << 20


def _served_bits(grid: str, x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x) if grid == "bf16" else f32_to_f16_bits(x)


@dataclass
class GapStats:
    """Accumulates r over any number of tensors on one grid; :meth:`summary` reports it."""

    grid: str
    elements: int = 0
    zero: int = 0
    nonfinite: int = 0
    from_zero: int = 0
    over_half: int = 0
    over_one: int = 0
    p_change: float = 0.0
    max: float = 0.0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(_NBINS, dtype=np.int64))

    def add(self, old: np.ndarray, new: np.ndarray) -> None:
        """Add one tensor's update (float32/bfloat16/float16 arrays of one shape)."""
        o, n = to_float32(old).reshape(-1), to_float32(new).reshape(-1)
        shift, mask, offset = GRIDS[self.grid]
        for s in range(0, o.size, _CHUNK):
            oc, nc = o[s : s + _CHUNK], n[s : s + _CHUNK]
            e = (_served_bits(self.grid, oc) >> shift) & mask
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(nc.astype(np.float64) - oc.astype(np.float64))
            ok = (e != mask) & np.isfinite(d)
            if not ok.all():
                self.nonfinite += int(ok.size - np.count_nonzero(ok))
                d, e = d[ok], e[ok]
            r = np.ldexp(d, offset - np.maximum(e, 1).astype(np.int32))
            zero_old = (oc[ok] if not ok.all() else oc) == 0
            self._count(r, zero_old)

    def _count(self, r: np.ndarray, zero_old: np.ndarray) -> None:
        self.elements += r.size
        pos = r[r > 0]
        self.zero += r.size - pos.size
        if not pos.size:
            return
        self.over_half += int(np.count_nonzero(pos > 0.5))
        self.over_one += int(np.count_nonzero(pos > 1.0))
        self.p_change += float(np.minimum(pos, 1.0).sum())
        from0 = zero_old & (r > 0)
        self.from_zero += int(np.count_nonzero(from0))
        rest = r[~from0 & (r > 0)]
        if rest.size:
            self.max = max(self.max, float(rest.max()))
        b = np.floor((np.log2(pos) - _LO) * _PER_BINADE)
        self.counts += np.bincount(np.clip(b, 0, _NBINS - 1).astype(np.int64), minlength=_NBINS)

    def merge(self, other: GapStats) -> None:
        self.elements += other.elements
        self.zero += other.zero
        self.nonfinite += other.nonfinite
        self.from_zero += other.from_zero
        self.over_half += other.over_half
        self.over_one += other.over_one
        self.p_change += other.p_change
        self.max = max(self.max, other.max)
        self.counts += other.counts

    def quantile(self, q: float) -> float | None:
        """The q-quantile of r (0 inside the zero updates), from the histogram."""
        if not self.elements:
            return None
        rank = q * self.elements
        if rank <= self.zero:
            return 0.0
        cum = np.cumsum(self.counts)
        b = int(np.searchsorted(cum, rank - self.zero))
        below = int(cum[b - 1]) if b else 0
        frac = (rank - self.zero - below) / max(int(self.counts[b]), 1)
        q_r = 2.0 ** (_LO + (b + frac) / _PER_BINADE)
        return q_r if self.from_zero else min(self.max, q_r)

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (fractions in [0, 1]; None where no element was counted)."""
        n = self.elements

        def frac(x: float) -> float | None:
            return x / n if n else None

        return {
            "grid": self.grid,
            "elements": n,
            "zero_updates": self.zero,
            "nonfinite_skipped": self.nonfinite,
            "from_zero": self.from_zero,
            "quantiles": {f"p{100 * q:g}": self.quantile(q) for q in QUANTILES},
            "max": self.max,
            "frac_gt_half": frac(self.over_half),
            "frac_gt_one": frac(self.over_one),
            "expected_changed": frac(self.p_change),
        }
