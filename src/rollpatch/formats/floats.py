"""BF16 and FP16 rounding of float32 values, bit-exact with torch's CPU casts.

Both round to nearest, ties to even, keep ±0, subnormals and infinities, and overflow to
±inf exactly as IEEE 754 says. NaN is where casts disagree, so the rule is pinned here:

- BF16: every NaN becomes ``0xFFFF``. That is what ``torch.Tensor.to(torch.bfloat16)``
  produces on x86 CPUs with AVX2 or AVX-512 (its vectorised kernel blends in 0xFFFF). Other
  casts differ: torch's scalar/``DEFAULT``-ISA path gives 0x7FC0, ml_dtypes gives
  ``sign | 0x7FC0``, CUDA is documented to give 0x7FFF. Only NaN-ness is portable.
- FP16: ``sign | 0x7E00 | (mantissa >> 13)`` (quieted, payload truncated), which is what
  torch's CPU cast (F16C ``vcvtps2ph`` and its scalar fallback) produces.

Work is done in chunks that fit in cache, with integer arithmetic on the float32 bits.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BF16_NAN",
    "CHUNK",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "f32_to_f16_bits",
    "round_bf16_saturating",
    "to_float32",
]

#: Elements per chunk: 1 MiB of float32 keeps temporaries in cache (about 3x faster).
CHUNK = 1 << 18

#: The BF16 word every NaN becomes (torch CPU, vectorised kernels).
BF16_NAN = 0xFFFF

_BF16_MAX_BITS = 0x7F7F


def _bf16_chunk(u: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    np.right_shift(u, 16, out=tmp)
    tmp &= 1
    tmp += 0x7FFF
    tmp += u
    tmp >>= 16
    out[...] = tmp


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """BF16 words (flat uint16) of a float32 array, round-to-nearest-even; NaN → 0xFFFF."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.size, dtype=np.uint16)
    tmp = np.empty(min(CHUNK, flat.size), dtype=np.uint32)
    for start in range(0, flat.size, CHUNK):
        chunk = flat[start : start + CHUNK]
        dst = out[start : start + chunk.size]
        _bf16_chunk(chunk.view(np.uint32), dst, tmp[: chunk.size])
        if np.isnan(chunk.max()):
            dst[np.isnan(chunk)] = BF16_NAN
    return out


def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    """FP16 words (flat uint16) of a float32 array, round-to-nearest-even, torch's NaN rule."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.size, dtype=np.uint16)
    with np.errstate(all="ignore"):
        for start in range(0, flat.size, CHUNK):
            chunk = flat[start : start + CHUNK]
            dst = out[start : start + chunk.size]
            dst[...] = chunk.astype(np.float16).view(np.uint16)
            if np.isnan(chunk.max()):
                nan = np.isnan(chunk)
                u = chunk.view(np.uint32)[nan]
                dst[nan] = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
    return out


def bf16_bits_to_f32(words: np.ndarray) -> np.ndarray:
    """Exact float32 values of BF16 words (any shape; NaN payloads kept)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def round_bf16_saturating(x: np.ndarray) -> np.ndarray:
    """Round non-negative, non-NaN float32 values to BF16 (as float32), saturating at BF16 max.

    Used for scale sources: RNE is monotone, so ``round(max|w|) == max|round(w)|`` and the
    BF16-derived amax of a block needs no cast of the block itself.
    """
    words = f32_to_bf16_bits(x).reshape(np.shape(x))
    np.minimum(words, _BF16_MAX_BITS, out=words)
    return bf16_bits_to_f32(words)


def to_float32(master: np.ndarray) -> np.ndarray:
    """Exact float32 values of a float32/bfloat16/float16 array (a view when already float32)."""
    if master.dtype == np.float32:
        return master
    if master.dtype.name == "bfloat16":
        return bf16_bits_to_f32(master.view(np.uint16))
    return master.astype(np.float32)
