"""Element kinds: what the fixed-width words of a served tensor mean.

A view tensor is stored as the exact bytes an engine holds (a safetensors dtype plus shape).
Its *kind* tells the patch codec how to read those bytes as elements:

- ``bits``: element width (4 for packed two-per-byte codes, else the dtype width);
- ``order``: how words map to an ordered integer key, so that "one step up in value" is +1
  (``signmag`` for IEEE-style floats and E2M1, ``twos`` for signed ints, ``unsigned``);
- ``ctx_shift``/``ctx_bits``: which bits of the old word form the coding context (the
  exponent for floats: the chance that a served value changes depends on its rounding gap).

Kinds are pure data; this module imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ViewError

__all__ = [
    "DTYPE_BYTES",
    "KINDS",
    "MIN_CONTEXT_ELEMENTS",
    "Kind",
    "get_kind",
    "kind_for_dtype",
    "single_context",
]

#: Storage bytes per safetensors dtype code (F4 and the F6 codes are sub-byte and not used as
#: storage dtypes by rollpatch: packed 4-bit tensors are stored as U8, as engines do).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: Tensors smaller than this use a single coding context (docs/patch-format.md §4): context
#: headers would cost more than they save.
MIN_CONTEXT_ELEMENTS = 65536

_WORD_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


@dataclass(frozen=True)
class Kind:
    """How the codec reads one tensor's words. See the module docstring."""

    name: str
    dtype: str
    bits: int
    order: str
    ctx_shift: int = 0
    ctx_bits: int = 0

    @property
    def packed(self) -> bool:
        """True when two 4-bit elements share one stored byte (low nibble first)."""
        return self.bits == 4

    @property
    def word_dtype(self) -> np.dtype:
        """The unsigned numpy dtype of one stored word."""
        return _WORD_DTYPES[DTYPE_BYTES[self.dtype]]

    @property
    def elem_dtype(self) -> np.dtype:
        """The unsigned numpy dtype that holds one element (uint8 for nibbles)."""
        return np.dtype("<u1") if self.packed else self.word_dtype

    @property
    def sign_bit(self) -> int:
        """Mask of the sign bit of one element (0 for unsigned kinds)."""
        return 0 if self.order == "unsigned" else 1 << (self.bits - 1)

    def elements(self, nbytes: int) -> int:
        """Number of elements held in ``nbytes`` stored bytes."""
        return nbytes * 2 if self.packed else nbytes // DTYPE_BYTES[self.dtype]


def _k(
    name: str,
    dtype: str,
    order: str,
    ctx_shift: int = 0,
    ctx_bits: int = 0,
    bits: int | None = None,
) -> Kind:
    return Kind(
        name,
        dtype,
        bits if bits is not None else DTYPE_BYTES[dtype] * 8,
        order,
        ctx_shift,
        ctx_bits,
    )


#: Every kind rollpatch knows, by stable name (names are written into patches and views).
KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        _k("bf16", "BF16", "signmag", 7, 8),
        _k("f16", "F16", "signmag", 10, 5),
        _k("f32", "F32", "signmag", 23, 8),
        _k("f64", "F64", "signmag", 55, 8),
        _k("e4m3", "F8_E4M3", "signmag", 3, 4),
        _k("e5m2", "F8_E5M2", "signmag", 2, 5),
        _k("e8m0", "F8_E8M0", "unsigned"),
        _k("e4m3_u8", "U8", "signmag", 3, 4),  # E4M3 bits stored under a U8 dtype
        _k("e8m0_u8", "U8", "unsigned"),  # E8M0 exponents stored as U8 (MXFP4 scales)
        _k("e2m1x2", "U8", "signmag", 0, 3, bits=4),  # two E2M1 codes per byte, low nibble first
        _k("int4x2", "U8", "twos", 0, 3, bits=4),  # two int4 codes per byte, low nibble first
        _k("u8", "U8", "unsigned"),
        _k("i8", "I8", "twos"),
        _k("bool", "BOOL", "unsigned"),
        _k("u16", "U16", "unsigned"),
        _k("i16", "I16", "twos"),
        _k("u32", "U32", "unsigned"),
        _k("i32", "I32", "twos"),
        _k("u64", "U64", "unsigned"),
        _k("i64", "I64", "twos"),
    ]
}

_DEFAULT_FOR_DTYPE = {
    "BF16": "bf16",
    "F16": "f16",
    "F32": "f32",
    "F64": "f64",
    "F8_E4M3": "e4m3",
    "F8_E5M2": "e5m2",
    "F8_E8M0": "e8m0",
    "U8": "u8",
    "I8": "i8",
    "BOOL": "bool",
    "U16": "u16",
    "I16": "i16",
    "U32": "u32",
    "I32": "i32",
    "U64": "u64",
    "I64": "i64",
}


def kind_for_dtype(dtype: str) -> Kind:
    """The default kind of a safetensors dtype (used when a file names no kind)."""
    name = _DEFAULT_FOR_DTYPE.get(dtype)
    if name is None:
        raise ViewError(
            f"unsupported safetensors dtype {dtype!r}",
            hint="rollpatch stores 4-bit tensors packed as U8",
        )
    return KINDS[name]


def single_context(kind: Kind, n_elements: int) -> bool:
    """Whether a tensor of this kind and size codes every element in one context."""
    return kind.ctx_bits == 0 or n_elements < MIN_CONTEXT_ELEMENTS


def get_kind(name: str) -> Kind:
    """Look a kind up by name, with a clear error for unknown names."""
    try:
        return KINDS[name]
    except KeyError:
        raise ViewError(
            f"unknown element kind {name!r}", hint=f"known kinds: {', '.join(sorted(KINDS))}"
        ) from None
