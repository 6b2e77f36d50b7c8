"""The :class:`Format` interface and what every format shares: master checks, plain casts,
scale sources (the three scale modes) and frozen-scale validation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import ConfigError, FormatError
from ..kinds import KINDS
from ..view import Tensor
from .floats import f32_to_bf16_bits, f32_to_f16_bits, round_bf16_saturating, to_float32
from .policy import QuantPolicy

__all__ = [
    "SCALE_FLOOR",
    "SCALE_MODES",
    "Format",
    "ScaleSource",
    "check_master",
    "plain_tensor",
    "require_finite",
]

#: Scale modes: ``bf16`` (scales from the BF16 rounding of the master: stable across RL
#: steps), ``fp32`` (from the FP32 master: churns every step), ``frozen`` (reuse previous).
SCALE_MODES = ("bf16", "fp32", "frozen")

#: Smallest float scale a format computes (float32 epsilon, compressed-tensors' clamp): keeps
#: the scale of an all-zero block positive and finite.
SCALE_FLOOR = np.float32(2.0**-23)

_MASTER_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_POLICY = QuantPolicy()


def check_master(name: str, master: np.ndarray) -> np.ndarray:
    """The master as a C-contiguous, native-endian float32/bfloat16/float16 array."""
    if not isinstance(master, np.ndarray) or master.dtype.name not in _MASTER_DTYPES:
        raise FormatError(
            "master tensors must be float32, bfloat16 or float16 numpy arrays",
            tensor=name,
            dtype=str(getattr(master, "dtype", type(master))),
            hint="convert with numpy/ml_dtypes first (float64 would round twice)",
        )
    if not master.dtype.isnative:
        master = master.astype(master.dtype.newbyteorder("="))
    return master if master.flags.c_contiguous else np.ascontiguousarray(master)


def plain_tensor(master: np.ndarray, kind: str) -> Tensor:
    """``master`` cast to BF16 (``kind='bf16'``) or FP16 (``'f16'``), as torch casts it."""
    native = "bfloat16" if kind == "bf16" else "float16"
    if master.dtype.name == native:
        words = master.view(np.uint16).reshape(-1).copy()  # a no-op cast keeps every bit
    elif kind == "bf16":
        words = f32_to_bf16_bits(to_float32(master))
    else:
        words = f32_to_f16_bits(to_float32(master))
    return Tensor(KINDS[kind], master.shape, words)


def require_finite(name: str, fmt: str, amax: np.ndarray) -> None:
    """Reject NaN/inf (found through the block maxima, which propagate them)."""
    if amax.size and not np.isfinite(amax).all():
        raise FormatError(
            "the master has NaN or infinite values, which this format cannot represent",
            tensor=name,
            format=fmt,
            hint="fix the master, or serve the tensor as BF16 with "
            f"QuantPolicy(exclude=({name!r},))",
        )


@dataclass
class ScaleSource:
    """Where one tensor's scales come from: computed (``bf16``/``fp32``) or reused (frozen)."""

    mode: str
    frozen: Mapping[str, Tensor] = field(default_factory=dict)

    def amax(self, amax: np.ndarray) -> np.ndarray:
        """The amax a computed scale is derived from (BF16-rounded unless mode is fp32)."""
        if self.mode == "fp32":
            return np.asarray(amax, dtype=np.float32)
        return round_bf16_saturating(np.asarray(amax, dtype=np.float32))

    def reuse(self, served: str, kind: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The stored words of frozen scale ``served`` (shaped), or None when none was given."""
        old = self.frozen.get(served)
        if old is None:
            return None
        if old.kind.name != kind or old.shape != shape:
            raise FormatError(
                "frozen scale does not match this tensor's layout",
                tensor=served,
                kind=old.kind.name,
                shape=old.shape,
                expected=(kind, shape),
                hint="the previous view must come from the same format and "
                "master shapes; use scales='bf16' to recompute",
            )
        words = old.data.reshape(shape)
        if kind == "e4m3":
            bad = (words == 0) | (words >= 0x7F)  # zero, NaN or negative
        elif kind == "e8m0_u8":
            bad = words == 0xFF  # E8M0 NaN
        else:
            values = old.to_array().astype(np.float32)
            bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            raise FormatError(
                "frozen scale holds zero, negative or non-finite values",
                tensor=served,
                hint="recompute scales with scales='bf16'",
            )
        return words.copy()


class Format(ABC):
    """A served format: a pure, deterministic function master tensor → served tensors.

    One stateless instance per CLI name (see :func:`rollpatch.formats.get_format`).
    """

    #: The stable CLI name.
    name: ClassVar[str]
    #: Kind of tensors the format does not quantise.
    _plain_kind: ClassVar[str] = "bf16"
    #: Suffixes of the scale tensors, appended to the master name.
    _scale_suffixes: ClassVar[tuple[str, ...]] = ()

    def cast_tensor(
        self,
        name: str,
        master: np.ndarray,
        *,
        frozen: Mapping[str, Tensor] | None = None,
        scales: str = "bf16",
        policy: QuantPolicy | None = None,
    ) -> dict[str, Tensor]:
        """Served tensors (by served name) of one master tensor.

        ``frozen``: previous served tensors of this weight; the scale tensors found there are
        reused (values beyond the range they allow saturate), missing ones are computed.
        ``scales``: ``bf16`` / ``fp32`` / ``frozen`` (computes missing scales as ``bf16``).
        ``policy``: which tensors are quantised (default :class:`QuantPolicy`); tensors not
        quantised are cast to BF16 (FP16 for ``fp16``). NaN/inf in a quantised tensor raise
        :class:`~rollpatch.errors.FormatError`.
        """
        if scales not in SCALE_MODES:
            raise ConfigError(
                f"unknown scale mode {scales!r}", hint=f"use one of {', '.join(SCALE_MODES)}"
            )
        m = check_master(name, master)
        if self.quantises(name, m.shape, policy):
            return self._quantise(name, m, ScaleSource(scales, frozen or {}))
        return {name: plain_tensor(m, self._plain_kind)}

    @property
    def plain_kind(self) -> str:
        """Kind of the tensors this format serves unquantised (``bf16``, or ``f16``)."""
        return self._plain_kind

    @property
    def scale_suffixes(self) -> tuple[str, ...]:
        """Suffixes (appended to the master name) of the scale tensors a quantised weight has."""
        return self._scale_suffixes

    def quantises(
        self, name: str, shape: tuple[int, ...], policy: QuantPolicy | None = None
    ) -> bool:
        """True if master ``name`` of ``shape`` is quantised (else served as ``plain_kind``,
        under its own name)."""
        chosen = policy if policy is not None else _DEFAULT_POLICY
        return self._blockable(tuple(shape)) and chosen.quantise(name, tuple(shape))

    @abstractmethod
    def _blockable(self, shape: tuple[int, ...]) -> bool:
        """True if the format can quantise a tensor of this shape."""

    @abstractmethod
    def _quantise(self, name: str, master: np.ndarray, src: ScaleSource) -> dict[str, Tensor]:
        """Quantise a blockable master (validated, contiguous)."""

    def __repr__(self) -> str:
        return f"<Format {self.name}>"
