"""``int4-g128``: symmetric INT4 with one FP16 scale per 128 elements along K.

For ``P.weight`` [N, K] (K divisible by 128): ``P.weight_packed`` U8 [N, K/2], kind
``int4x2`` (two's-complement nibbles, element 2i in the low nibble) and ``P.weight_scale``
F16 [N, K/128]. ``scale = fp16_rne(clamp(amax / 7, 2**-23, 65504))``,
``q = clamp(rne(w / scale), -8, 7)``; dequantised ``w = q * scale``.
(compressed-tensors' ``pack-quantized`` differs: offset-binary nibbles ``q + 8``, eight per
int32 word, amax / 7.5. See docs/formats.md.)
"""

from __future__ import annotations

import numpy as np

from ..kinds import KINDS
from ..view import Tensor
from .base import SCALE_FLOOR, Format, ScaleSource, require_finite
from .blocks import Blocking, block_amax, quantise_blocks
from .floats import f32_to_f16_bits

__all__ = ["Int4G128"]

_F16_MAX = np.float32(65504.0)


def _encode_int4(scaled: np.ndarray) -> np.ndarray:
    np.rint(scaled, out=scaled)
    np.clip(scaled, -8.0, 7.0, out=scaled)
    return scaled.astype(np.int8).view(np.uint8) & np.uint8(0x0F)


class Int4G128(Format):
    """``int4-g128``: INT4 codes, an FP16 scale per 128-element group along K."""

    name = "int4-g128"
    _group = 128
    _scale_suffixes = ("_scale",)

    def _blockable(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[1] % self._group == 0

    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        n, k = master.shape
        blocking = Blocking(1, self._group)
        amax = block_amax(master, blocking)
        require_finite(name, self.name, amax)
        grid = (n, k // self._group)
        words = src.reuse(name + "_scale", "f16", grid)
        if words is None:
            raw = np.clip(src.amax(amax) / np.float32(7.0), SCALE_FLOOR, _F16_MAX)
            words = f32_to_f16_bits(raw).reshape(grid)
        divisor = words.view(np.float16).astype(np.float32)
        with np.errstate(over="ignore"):
            packed = quantise_blocks(master, blocking, divisor, _encode_int4, packed=True)
        return {
            name + "_packed": Tensor(KINDS["int4x2"], (n, k // 2), packed.reshape(-1)),
            name + "_scale": Tensor(KINDS["f16"], grid, words.reshape(-1)),
        }
