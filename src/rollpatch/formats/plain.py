"""Unquantised formats: ``bf16`` and ``fp16`` (every tensor cast, same name, same shape)."""

from __future__ import annotations

import numpy as np

from ..view import Tensor
from .base import Format, ScaleSource

__all__ = ["Bf16", "Fp16"]


class _Plain(Format):
    def _blockable(self, shape: tuple[int, ...]) -> bool:
        return False

    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        raise AssertionError("plain formats never quantise")  # unreachable: not blockable


class Bf16(_Plain):
    """``bf16``: round-to-nearest-even BF16, as ``torch.Tensor.to(torch.bfloat16)``."""

    name = "bf16"
    _plain_kind = "bf16"


class Fp16(_Plain):
    """``fp16``: round-to-nearest-even FP16, as ``torch.Tensor.to(torch.float16)``."""

    name = "fp16"
    _plain_kind = "f16"
