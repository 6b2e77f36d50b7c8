"""Reference points for a patch's size: the i.i.d. entropy bound and the XOR+zstd-3 baseline.

Shared by ``rollpatch analyze`` and ``bench/codec.py`` so both report the same numbers.

- **i.i.d. bound**: ``n·H(k/n) + k·H(d)`` bits for ``n`` elements of which ``k`` changed, ``d``
  the integer delta new − old of each changed element in its word space (4-bit codes as
  nibbles), ``H`` the empirical entropy. It is what a coder that treats positions as i.i.d.
  coin flips and deltas as i.i.d. symbols needs at best; rollpatch's context model can beat it
  because the chance of a change depends on the old value's exponent.
- **XOR+zstd-3**: per tensor, the stored bytes of old XOR new, compressed by zstd level 3
  (rollpatch's dense fallback's level). Stitch's encoder and slime's disk deltas use level 1,
  whose frames are a few percent larger: ``bench/codec.py`` reports both.
"""

from __future__ import annotations

import math

import numpy as np
import zstandard

from ..errors import PatchError
from ..patch import DeltaOp, Patch, TensorPatch
from ..view import View

__all__ = [
    "BoundAccumulator",
    "binary_bits",
    "entropy_bits",
    "histogram",
    "iid_bound_bits",
    "xor_zstd",
]

#: zstd level of the XOR baseline.
XOR_ZSTD_LEVEL = 3


def entropy_bits(counts: np.ndarray) -> float:
    """Total empirical entropy, in bits, of symbols with these occurrence counts."""
    counts = counts[counts > 0].astype(np.float64)
    total = counts.sum()
    return float(-(counts * np.log2(counts / total)).sum()) if total else 0.0


def binary_bits(n: int, k: int) -> float:
    """``n·H(k/n)`` bits: which ``k`` of ``n`` positions changed, as i.i.d. coin flips."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def histogram(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, counts) of an integer array; a bincount when the range is small (no sort)."""
    lo, hi = int(d.min()), int(d.max())
    if hi - lo > 1 << 18:
        return np.unique(d, return_counts=True)
    c = np.bincount(d - lo, minlength=hi - lo + 1)
    u = np.flatnonzero(c)
    return u + lo, c[u]


class BoundAccumulator:
    """The i.i.d. bound summed tensor by tensor (so a caller never holds a whole patch)."""

    def __init__(self) -> None:
        self.n = self.k = 0
        self.per = 0.0
        self._vals: list[np.ndarray] = []
        self._cnts: list[np.ndarray] = []

    def add(self, name: str, n_elements: int, tp: TensorPatch | None) -> None:
        """One tensor of ``n_elements`` and its same-layout diff (None: unchanged)."""
        self.n += n_elements
        if tp is None:
            return
        if not isinstance(ch := tp.change, DeltaOp):
            raise PatchError(
                "the i.i.d. bound needs a same-layout diff (delta ops only)", tensor=name, op=tp.op
            )
        d = ch.new.astype(np.int64) - ch.old.astype(np.int64)
        u, c = histogram(d)
        self.k += d.size
        self.per += binary_bits(n_elements, d.size) + entropy_bits(c)
        self._vals.append(u)
        self._cnts.append(c)

    def whole_bits(self) -> float:
        """The bound over all tensors added (one density, one delta histogram)."""
        whole = binary_bits(self.n, self.k)
        if self._vals:
            _, inv = np.unique(np.concatenate(self._vals), return_inverse=True)
            whole += entropy_bits(np.bincount(inv, weights=np.concatenate(self._cnts)))
        return whole


def iid_bound_bits(patch: Patch, view: View) -> tuple[int, int, float, float]:
    """(elements, changed, whole-view bound bits, per-tensor-sum bound bits).

    ``patch`` must be a same-layout diff of ``view`` (delta ops only): the bound is defined
    over a fixed set of positions.
    """
    acc = BoundAccumulator()
    for name, t in view.items():
        acc.add(name, t.n_elements, patch.tensors.get(name))
    return acc.n, acc.k, acc.whole_bits(), acc.per


def xor_zstd(old: np.ndarray, new: np.ndarray, level: int = XOR_ZSTD_LEVEL) -> bytes:
    """The XOR baseline frame of one tensor: zstd(level) of the stored words old XOR new."""
    return zstandard.ZstdCompressor(level=level).compress(np.bitwise_xor(old, new))
