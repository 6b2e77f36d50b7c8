"""Master checkpoints: safetensors or torch state-dict files → name → numpy array.

Safetensors floats come back as numpy float32/float16/bfloat16 (ml_dtypes) arrays without
torch. Torch files (``.pt``/``.pth``/``.bin``) need the ``torch`` extra and are read with
``torch.load(weights_only=True)``, torch's restricted unpickler that refuses arbitrary code —
rollpatch itself never unpickles anything.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, ViewError
from .safetensors import load_view

__all__ = ["load_masters", "to_numpy"]

_TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt"}


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array for a numpy array or a torch tensor on any device (bf16 via ml_dtypes)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:  # ml_dtypes only then: its import took 0.5-2.7 s here
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.contiguous().numpy()
    raise ConfigError(
        f"cannot read a tensor of type {type(value).__name__}",
        hint="pass numpy arrays or torch tensors",
    )


def load_masters(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Load a master checkpoint (safetensors, or a torch state dict with the torch extra)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"checkpoint {p} is a directory, not a file")
    if not p.is_file():
        raise ConfigError(f"checkpoint not found: {p}")
    if p.suffix in _TORCH_SUFFIXES:
        return _load_torch(p)
    view = load_view(p, mmap=True)
    return {name: t.to_array() for name, t in view.items()}


def _torch_reason(e: BaseException) -> str:
    """What torch's error says was wrong with the file (its weights-only error leads with
    advice to unpickle the file whole, which rollpatch never does)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [ln for ln in lines[1:] if not ln.startswith(("Please file", "Check the doc"))]
    detail = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
    return f"not a torch.save file of tensors ({detail})"


def _torch_load(torch: Any, p: Path) -> Any:
    """``torch.load`` weights-only, mapped; unmapped for a file not in the zip format (an
    older ``torch.save``)."""
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - mapping needs the zip format: try it unmapped
        return torch.load(p, map_location="cpu", weights_only=True)


def _load_torch(p: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConfigError(
            "reading torch files needs torch", hint="pip install 'rollpatch[torch]'"
        ) from None
    try:
        with warnings.catch_warnings():  # torch's warnings about odd pickles: not one line
            warnings.simplefilter("ignore")
            obj = _torch_load(torch, p)
    except Exception as e:  # noqa: BLE001 - torch raises many types for malformed files
        raise ViewError(
            f"cannot read torch checkpoint {p}: {_torch_reason(e)}",
            hint="a torch.save state dict of tensors (.pt/.bin; read weights-only, never "
            "unpickled whole) or a .safetensors file",
        ) from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ViewError("torch checkpoint is not a state dict", path=str(p))
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            nested = sorted(str(k) for k, v in obj.items() if isinstance(v, Mapping))[:5]
            raise ViewError(
                "state dict entries must map names to tensors",
                path=str(p),
                entry=str(name)[:80],
                hint=(
                    f"it looks like a training checkpoint (entries {', '.join(nested)} hold "
                    "dicts): save the model's state dict alone, e.g. "
                    "torch.save(ckpt['model'], path)"
                )
                if nested
                else "save model.state_dict() (names to tensors)",
            )
        out[name] = to_numpy(value)
    return out
