"""Master checkpoints: safetensors or torch state-dict files, or a folder of them (a Hugging
Face model directory) → name → numpy array.

Safetensors floats come back as numpy float32/float16/bfloat16 (ml_dtypes) arrays without
torch. Torch files (``.pt``/``.pth``/``.bin``) need the ``torch`` extra and are read with
``torch.load(weights_only=True)``, torch's restricted unpickler that refuses arbitrary code —
rollpatch itself never unpickles anything.

A folder's files (:func:`checkpoint_files`): those its index names
(``model.safetensors.index.json``, else ``pytorch_model.bin.index.json``; every tensor must
be in the shard the index maps it to, every shard's tensors in the index, and no shard of the
index's series left unnamed), else ``model.safetensors`` or ``pytorch_model.bin`` alone, else
every ``*.safetensors`` file, else its torch files; never a PEFT adapter's
(``adapter_model*``) or a trainer's own state (``optimizer*``, ``scheduler*``, ``scaler*``,
``rng_state*``, ``training_args*``, ``trainer_state*``). A tensor in two shards is refused.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, ViewError
from .names import check_names
from .safetensors import load_view

__all__ = ["checkpoint_files", "load_masters", "to_numpy"]

_TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt"}
#: A folder's index files, in the order they are looked for.
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Torch files of a trainer's checkpoint folder that are not the model's weights.
_TRAINER_STATE = (
    "optimizer",
    "scheduler",
    "scaler",
    "rng_state",
    "training_args",
    "trainer_state",
)
#: Files beside a model's weights that are a PEFT adapter's, not the model's.
_ADAPTER = ("adapter_model",)
#: A shard of a series: prefix, number, count, extension.
_SHARD = re.compile(r"(.+)-(\d+)-of-(\d+)\.(safetensors|bin)")
#: Bytes an index file may have (a 1T-parameter model's index is a few MB).
MAX_INDEX_BYTES = 64 * 2**20


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
    """Load a master checkpoint: a safetensors file, a torch state dict (the torch extra), or
    a folder of either (see the module). Every name obeys :func:`~.names.check_names`."""
    out = _load_masters(Path(path))
    try:
        check_names(out)
    except ViewError as e:  # which checkpoint it was: a user passes several
        raise ViewError(e.message, hint=e.hint, path=str(path), **e.context) from None
    return out


def _load_masters(p: Path) -> dict[str, np.ndarray]:
    if p.is_dir():
        files, index = checkpoint_files(p)
        out: dict[str, np.ndarray] = {}
        for f in files:
            for name, a in _load_file(f).items():
                if name in out:
                    raise ViewError("a tensor is in two shards", tensor=name, path=str(f))
                if index is not None and index.get(name) != f.name:
                    raise ViewError(
                        "the folder's index does not map this tensor to the shard holding it",
                        tensor=name,
                        path=str(f),
                        index=index.get(name),
                    )
                out[name] = a
        missing = sorted(set(index or ()) - set(out))
        if missing:
            raise ViewError(
                f"the folder's index names {len(missing)} tensor{'s' * (len(missing) != 1)} "
                "its shards do not hold",
                tensor=missing[0],
                path=str(p),
            )
        return out
    if not p.is_file():
        raise ConfigError(f"checkpoint not found: {p}")
    return _load_file(p)


def _load_file(p: Path) -> dict[str, np.ndarray]:
    if p.suffix in _TORCH_SUFFIXES:
        return _load_torch(p)
    view = load_view(p, mmap=True)
    return {name: t.to_array() for name, t in view.items()}


def checkpoint_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """A checkpoint folder's weight files, sorted, and its index's tensor → file map (None
    without an index); see the module. :class:`ConfigError` when it holds none."""
    for name in INDEX_FILES:
        if (folder / name).is_file():
            index = _read_index(folder / name)
            named = sorted(set(index.values()))
            _no_unnamed_shards(folder, named)
            return [folder / f for f in named], index
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():  # beside it a PEFT adapter, a trainer's state: not read
            return [folder / single], None
    files = sorted(
        f for f in folder.glob("*.safetensors") if f.is_file() and not f.name.startswith(_ADAPTER)
    )
    if not files:
        files = sorted(
            f
            for f in folder.iterdir()
            if f.suffix in _TORCH_SUFFIXES
            and f.is_file()
            and not f.name.startswith((*_TRAINER_STATE, *_ADAPTER))
        )
    if not files:
        subs = sorted(d.name for d in folder.glob("checkpoint-*") if d.is_dir())
        raise ConfigError(
            f"checkpoint folder {folder} holds no weights",
            hint=(
                f"a trainer's output folder: name one of its checkpoints ({', '.join(subs[-3:])})"
                if subs
                else "a Hugging Face model folder: model.safetensors, or shards with "
                "model.safetensors.index.json (or pytorch_model*.bin), or a checkpoint file "
                "(a PEFT adapter folder: merge the adapter into the model first)"
            ),
        )
    return files, None


def _no_unnamed_shards(folder: Path, named: list[str]) -> None:
    """Refuse a folder holding a shard of the index's series (``model-00002-of-00003``) that
    the index does not name: a tensor left out of the index would be dropped unseen."""
    series = {m.group(1, 3, 4) for f in named if (m := _SHARD.fullmatch(f))}
    for f in sorted(p.name for p in folder.iterdir()):
        m = _SHARD.fullmatch(f)
        if m is not None and m.group(1, 3, 4) in series and f not in named:
            raise ViewError(
                "the folder holds a shard its index does not name (a tensor left out of "
                "the index?)",
                path=str(folder / f),
                hint="regenerate the index (save_pretrained), or remove the stray shard",
            )


def _read_index(path: Path) -> dict[str, str]:
    """An index's ``weight_map``, checked: names of files beside it, each present."""
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise ViewError("checkpoint index too large", path=str(path), bytes=size)
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise ViewError(f"checkpoint index is not JSON: {e}", path=str(path)) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ViewError("checkpoint index has no weight_map", path=str(path))
    for tensor, file in wm.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ViewError(
                "checkpoint index maps a tensor to something other than a file beside it",
                path=str(path),
                tensor=str(tensor)[:80],
                file=str(file)[:80],
            )
        if not (path.parent / file).is_file():
            raise ViewError("a shard the index names is missing", path=str(path), file=file)
    return wm


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
