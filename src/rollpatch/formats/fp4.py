"""4-bit float formats: NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) and MXFP4 (OCP MX).

Both store E2M1 codes two per byte in ``P.weight_packed`` U8 [N, K/2] (element 2i in the low
nibble), kind ``e2m1x2``.

NVFP4 (groups of 16 along K), as compressed-tensors computes it, in float32:
``global_scale = 2688 / amax`` (448·6; 1.0 when amax is 0 or the quotient overflows),
``block_scale = e4m3_rne(min(amax_block / 6 * global_scale, 448))`` (code 0 → 0.125),
``q = e2m1_rne(clip(w / (block_scale / global_scale), ±6))``.

MXFP4 (groups of 32 along K), OCP MX v1.0: ``e = clamp(floor(log2(amax_block)) - 2, -127, 127)``
(amax 0 → -127), stored as the E8M0 byte ``e + 127``; ``q = e2m1_rne(clip(w / 2**e, ±6))``.
"""

from __future__ import annotations

import numpy as np

from ..kinds import KINDS
from ..view import Tensor
from .base import Format, ScaleSource, require_finite
from .blocks import Blocking, block_amax, quantise_blocks
from .minifloat import E2M1, E4M3, encode

__all__ = ["Mxfp4", "Nvfp4", "e8m0_to_f32"]

_NV_GLOBAL = np.float32(448.0 * 6.0)
_E4M3_EIGHTH = np.uint8(0x20)  # 0.125: compressed-tensors' replacement for a 0 scale


def _encode_e2m1(scaled: np.ndarray) -> np.ndarray:
    np.clip(scaled, -6.0, 6.0, out=scaled)
    return encode(E2M1, scaled)


def e8m0_to_f32(codes: np.ndarray) -> np.ndarray:
    """2**(code - 127) as float32, exact (code 0 is the subnormal 2**-127; 255 is not valid)."""
    bits = codes.astype(np.uint32) << 23
    bits[codes == 0] = 0x00400000
    return bits.view(np.float32)


class Nvfp4(Format):
    """``nvfp4``: E2M1 codes, an E4M3 scale per 16 elements, a float32 global scale."""

    name = "nvfp4"
    _group = 16
    _scale_suffixes = ("_scale", "_global_scale")

    def _blockable(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[1] % self._group == 0

    def _global_scale(self, amax: np.ndarray, src: ScaleSource) -> np.float32:
        top = src.amax(np.asarray(amax.max() if amax.size else 0.0, dtype=np.float32))
        with np.errstate(divide="ignore", over="ignore"):
            g = _NV_GLOBAL / np.float32(top)
        return g if np.isfinite(g) else np.float32(1.0)

    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        n, k = master.shape
        blocking = Blocking(1, self._group)
        amax = block_amax(master, blocking)
        require_finite(name, self.name, amax)
        grid = (n, k // self._group)
        g_words = src.reuse(name + "_global_scale", "f32", (1,))
        g = g_words.view(np.float32)[0] if g_words is not None else self._global_scale(amax, src)
        s_codes = src.reuse(name + "_scale", "e4m3", grid)
        if s_codes is None:
            raw = np.minimum(src.amax(amax) / np.float32(6.0) * g, np.float32(448.0))
            s_codes = encode(E4M3, raw)
            s_codes[s_codes == 0] = _E4M3_EIGHTH
        divisor = E4M3.values[s_codes] / g
        with np.errstate(over="ignore"):
            packed = quantise_blocks(master, blocking, divisor, _encode_e2m1, packed=True)
        return {
            name + "_packed": Tensor(KINDS["e2m1x2"], (n, k // 2), packed.reshape(-1)),
            name + "_scale": Tensor(KINDS["e4m3"], grid, s_codes.reshape(-1)),
            name + "_global_scale": Tensor.from_array(np.array([g], dtype=np.float32)),
        }


class Mxfp4(Format):
    """``mxfp4``: E2M1 codes with an E8M0 shared exponent (U8) per 32 elements."""

    name = "mxfp4"
    _group = 32
    _scale_suffixes = ("_scale",)

    def _blockable(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[1] % self._group == 0

    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        n, k = master.shape
        blocking = Blocking(1, self._group)
        amax = block_amax(master, blocking)
        require_finite(name, self.name, amax)
        grid = (n, k // self._group)
        codes = src.reuse(name + "_scale", "e8m0_u8", grid)
        if codes is None:
            # floor(log2(amax)) is the float32 exponent field - 127 (subnormals and 0 clamp)
            field = (src.amax(amax).view(np.uint32) >> 23).astype(np.int32)
            codes = (np.clip(field - 129, -127, 127) + 127).astype(np.uint8)
        with np.errstate(over="ignore"):
            packed = quantise_blocks(
                master, blocking, e8m0_to_f32(codes), _encode_e2m1, packed=True
            )
        return {
            name + "_packed": Tensor(KINDS["e2m1x2"], (n, k // 2), packed.reshape(-1)),
            name + "_scale": Tensor(KINDS["e8m0_u8"], grid, codes.reshape(-1)),
        }
