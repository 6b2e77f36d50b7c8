"""FP8 formats: E4M3 per-tensor / per-channel / 128×128 blocks, and E5M2 per-tensor.

For a master ``P.weight`` [N, K]: ``P.weight`` holds the FP8 codes [N, K] and a float32 scale
tensor holds one scale per block (dequantised ``w = q * scale``):

=====================  =====================  =================================
format                 scale tensor           scale shape
=====================  =====================  =================================
``fp8-e4m3``           ``P.weight_scale``     ``[]`` (scalar)
``fp8-e4m3-channel``   ``P.weight_scale``     ``[N, 1]``
``fp8-e4m3-block128``  ``P.weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``
``fp8-e5m2``           ``P.weight_scale``     ``[]`` (scalar)
=====================  =====================  =================================

``scale = max(amax / FP8_MAX, 2**-23)``; ``q = rne(clip(w / scale, ±FP8_MAX))``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..kinds import KINDS
from ..view import Tensor
from .base import SCALE_FLOOR, Format, ScaleSource, require_finite
from .blocks import Blocking, block_amax, quantise_blocks
from .minifloat import E4M3, E5M2, Minifloat, encode

__all__ = ["Fp8Block128", "Fp8Channel", "Fp8E5M2", "Fp8Tensor"]


class _Fp8(Format):
    _spec: ClassVar[Minifloat]
    _blocking: ClassVar[Blocking]
    _scale_suffixes = ("_scale",)

    def _blockable(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2

    def _scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        return self._blocking.grid(shape)

    def _encode(self, scaled: np.ndarray) -> np.ndarray:
        limit = self._spec.max_value
        np.clip(scaled, -limit, limit, out=scaled)
        return encode(self._spec, scaled)

    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        shape = master.shape
        amax = block_amax(master, self._blocking)
        require_finite(name, self.name, amax)
        served = name + self._scale_suffixes[0]
        scale_shape = self._scale_shape(shape)
        words = src.reuse(served, "f32", scale_shape)
        if words is not None:
            scale = words.view(np.float32).reshape(amax.shape)
        else:
            scale = np.maximum(src.amax(amax) / np.float32(self._spec.max_value), SCALE_FLOOR)
        with np.errstate(over="ignore"):
            codes = quantise_blocks(master, self._blocking, scale, self._encode, packed=False)
        return {
            name: Tensor(KINDS[self._spec.name], shape, codes.reshape(-1)),
            served: Tensor.from_array(np.ascontiguousarray(scale, np.float32).reshape(scale_shape)),
        }


class Fp8Tensor(_Fp8):
    """``fp8-e4m3``: E4M3 codes with one float32 scale per tensor (shape ``[]``)."""

    name = "fp8-e4m3"
    _spec = E4M3
    _blocking = Blocking(0, 0)

    def _scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        return ()


class Fp8Channel(_Fp8):
    """``fp8-e4m3-channel``: E4M3 codes with one float32 scale per output row ([N, 1])."""

    name = "fp8-e4m3-channel"
    _spec = E4M3
    _blocking = Blocking(1, 0)


class Fp8Block128(_Fp8):
    """``fp8-e4m3-block128``: E4M3 codes with a float32 ``weight_scale_inv`` per 128×128 block
    (DeepSeek-V3 layout; edge blocks are partial; dequantised ``w = q * scale_inv``)."""

    name = "fp8-e4m3-block128"
    _spec = E4M3
    _blocking = Blocking(128, 128)
    _scale_suffixes = ("_scale_inv",)


class Fp8E5M2(_Fp8):
    """``fp8-e5m2``: E5M2 codes with one float32 scale per tensor (shape ``[]``)."""

    name = "fp8-e5m2"
    _spec = E5M2
    _blocking = Blocking(0, 0)

    def _scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        return ()
