"""Small floats (E4M3, E5M2, E2M1): round-to-nearest-even encoding on float32 bits.

:func:`encode` takes float32 values already clipped to the format's finite range (callers
saturate first, as quantisers do) and returns sign-magnitude codes. The rounding is done by
one float32 addition: adding ``2**(E + 23 - m)`` (``E`` = the value's exponent, floored at
the smallest normal exponent) leaves exactly ``m`` fraction bits, so IEEE addition performs
the round-to-nearest-even, subnormals included; the code is read back from the sum's bits.
Results match torch's ``float8_e4m3fn``/``float8_e5m2`` casts and ml_dtypes'
``float4_e2m1fn`` cast on that range (tests cross-check), and run at memory speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["E2M1", "E4M3", "E5M2", "Minifloat", "encode"]


@dataclass(frozen=True)
class Minifloat:
    """A sign-magnitude small float: exponent bits, mantissa bits, bias, largest finite value."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_value: float

    @property
    def sign_shift(self) -> int:
        return self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @cached_property
    def values(self) -> np.ndarray:
        """float32 value of every code (NaN codes of E4M3/E5M2 decode as NaN/inf)."""
        codes = np.arange(1 << (self.sign_shift + 1), dtype=np.int64)
        mag = codes & ((1 << self.sign_shift) - 1)
        exp = mag >> self.mbits
        frac = (mag & ((1 << self.mbits) - 1)).astype(np.float64)
        scale = 2.0 ** (np.maximum(exp, 1) - self.bias - self.mbits)
        val = np.where(exp == 0, frac, frac + (1 << self.mbits)) * scale
        if self.name == "e4m3":
            val = np.where(mag == 0x7F, np.nan, val)
        elif self.name == "e5m2":
            val = np.where(exp == 0x1F, np.where(frac == 0, np.inf, np.nan), val)
        val = np.where(codes >> self.sign_shift, -val, val)
        return val.astype(np.float32)


E4M3 = Minifloat("e4m3", 4, 3, 7, 448.0)
E5M2 = Minifloat("e5m2", 5, 2, 15, 57344.0)
E2M1 = Minifloat("e2m1", 2, 1, 1, 6.0)


def encode(spec: Minifloat, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Codes (uint8, same shape) of float32 ``y``, which must be finite with |y| <= max.

    Round to nearest, ties to even; the sign bit is kept, so -0.0 and negative values that
    round to zero encode as negative zero (as torch and ml_dtypes do).
    """
    u = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    if out is None:
        out = np.empty(u.shape, dtype=np.uint8)
    mag = u & np.uint32(0x7FFFFFFF)
    exp = mag & np.uint32(0x7F800000)
    np.maximum(exp, np.uint32((spec.emin + 127) << 23), out=exp)
    shift = 23 - spec.mbits
    exp += np.uint32(shift << 23)  # bits of 2**(E + 23 - m): its ulp is the target ulp
    total = mag.view(np.float32) + exp.view(np.float32)
    k = total.view(np.uint32)
    k -= exp  # fraction steps of 2**(E - m): round(|y| / ulp)
    exp >>= shift
    k += exp
    k -= np.uint32((spec.emin + 127 + shift) << spec.mbits)
    u = u >> np.uint32(31 - spec.sign_shift)
    u &= np.uint32(1 << spec.sign_shift)
    k |= u
    out[...] = k
    return out
