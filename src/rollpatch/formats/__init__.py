"""Served formats: pure, deterministic, bit-exact functions master tensors → served view.

A :class:`Format` turns one master tensor (float32, bfloat16 or float16 numpy array, under its
checkpoint name) into the exact words an engine holds, named and laid out as real checkpoints
name them. :func:`cast_view` does it for a whole model. See ``docs/formats.md``.

CLI names (stable forever): ``bf16``, ``fp16``, ``fp8-e4m3``, ``fp8-e4m3-channel``,
``fp8-e4m3-block128``, ``fp8-e5m2``, ``nvfp4``, ``mxfp4``, ``int4-g128``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import ConfigError, FormatError
from ..view import Tensor, View
from .base import SCALE_MODES, Format
from .fp4 import Mxfp4, Nvfp4
from .fp8 import Fp8Block128, Fp8Channel, Fp8E5M2, Fp8Tensor
from .int4 import Int4G128
from .plain import Bf16, Fp16
from .policy import QuantPolicy

__all__ = ["FORMAT_NAMES", "Format", "QuantPolicy", "cast_view", "get_format"]

_FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Bf16(),
        Fp16(),
        Fp8Tensor(),
        Fp8Channel(),
        Fp8Block128(),
        Fp8E5M2(),
        Nvfp4(),
        Mxfp4(),
        Int4G128(),
    )
}

#: Every format's CLI name.
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)

_META_FORMAT = "rollpatch.format"
_META_SCALES = "rollpatch.scales"


def get_format(name: str) -> Format:
    """The format registered under CLI name ``name``; ConfigError listing valid names if none."""
    fmt = _FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(
            f"unknown format {name!r}", hint=f"valid formats: {', '.join(FORMAT_NAMES)}"
        )
    return fmt


def cast_view(
    masters: Mapping[str, np.ndarray],
    fmt: str | Format,
    *,
    policy: QuantPolicy | None = None,
    scales: str = "bf16",
    previous: View | None = None,
) -> View:
    """The served view of ``masters`` under format ``fmt``.

    ``policy`` picks the tensors a quantised format quantises (default :class:`QuantPolicy`);
    the rest are cast to BF16 (FP16 under ``fp16``).

    ``scales``: ``bf16`` computes scales from the BF16 rounding of the master, so they move
    only when a block's largest value crosses a BF16 rounding boundary; ``fp32`` computes them
    from the FP32 master (they move every step and rewrite whole blocks: dense churn);
    ``frozen`` reuses the scale tensors of ``previous`` (a view of the same format), computing
    (as ``bf16``) only those it lacks. ``previous`` is only read in ``frozen`` mode.

    The view's metadata records ``rollpatch.format`` and ``rollpatch.scales``.
    """
    f = fmt if isinstance(fmt, Format) else get_format(fmt)
    if scales not in SCALE_MODES:
        raise ConfigError(
            f"unknown scale mode {scales!r}", hint=f"use one of {', '.join(SCALE_MODES)}"
        )
    prev = previous if scales == "frozen" else None
    if prev is not None:
        prev_fmt = prev.metadata.get(_META_FORMAT, f.name)
        if prev_fmt != f.name:
            raise ConfigError(
                "frozen scales need a previous view of the same format",
                format=f.name,
                previous_format=prev_fmt,
                hint="use scales='bf16' when changing formats",
            )
    out: dict[str, Tensor] = {}
    for name, master in masters.items():
        frozen = None
        if prev is not None:
            frozen = {name + s: prev[name + s] for s in f._scale_suffixes if name + s in prev}
        for served, tensor in f.cast_tensor(
            name, master, frozen=frozen, scales=scales, policy=policy
        ).items():
            if served in out:
                raise FormatError(
                    "two master tensors produce the same served name",
                    tensor=served,
                    format=f.name,
                    hint="rename the master, or exclude one from quantisation",
                )
            out[served] = tensor
    return View(out, {_META_FORMAT: f.name, _META_SCALES: scales})
