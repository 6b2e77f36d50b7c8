"""Master checkpoints: safetensors or torch state-dict files → name → numpy array.

Safetensors floats come back as numpy float32/float16/bfloat16 (ml_dtypes) arrays without
torch. Torch files (``.pt``/``.pth``/``.bin``) need the ``torch`` extra and are read with
``torch.load(weights_only=True)``, torch's restricted unpickler that refuses arbitrary code —
rollpatch itself never unpickles anything.
"""

from __future__ import annotations

import os
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
        import ml_dtypes
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.contiguous().numpy()
    raise ConfigError(
        f"cannot read a tensor of type {type(value).__name__}",
        hint="pass numpy arrays or torch tensors",
    )


def load_masters(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Load a master checkpoint (safetensors, or a torch state dict with the torch extra)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"checkpoint not found: {p}")
    if p.suffix in _TORCH_SUFFIXES:
        return _load_torch(p)
    view = load_view(p, mmap=True)
    return {name: t.to_array() for name, t in view.items()}


def _load_torch(p: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConfigError(
            "reading torch files needs torch", hint="pip install 'rollpatch[torch]'"
        ) from None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for malformed files
        raise ViewError(f"cannot read torch checkpoint {p}: {e}") from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ViewError("torch checkpoint is not a state dict", path=str(p))
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ViewError("state dict entries must map names to tensors", path=str(p))
        out[name] = to_numpy(value)
    return out
