"""A view over a torch model's own parameter memory (:func:`bind_view`).

Each tensor's words are a numpy view of the parameter's storage (same address, checked), so
applying a patch to the view changes the weights the model serves, with no copy and no reload.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ...errors import EngineError
from ...kinds import get_kind
from ...view import Tensor, View

__all__ = ["Storage", "bind_params", "bind_view", "rebind", "storage_for"]

#: torch dtype → (same-width integer dtype, unsigned numpy word dtype, rollpatch kind).
_WORDS: dict[torch.dtype, tuple[torch.dtype, type, str]] = {
    torch.bfloat16: (torch.int16, np.uint16, "bf16"),
    torch.float16: (torch.int16, np.uint16, "f16"),
    torch.float32: (torch.int32, np.uint32, "f32"),
}


def _words_of(t: torch.Tensor, name: str) -> Tensor:
    spec = _WORDS.get(t.dtype)
    if spec is None:
        raise EngineError(
            "unsupported parameter dtype for an in-place view",
            tensor=name,
            dtype=str(t.dtype),
            hint="load the model as bfloat16/float16/float32",
        )
    if t.device.type != "cpu" or not t.is_contiguous():
        raise EngineError("parameter is not contiguous CPU memory", tensor=name)
    int_dtype, word_dtype, kind = spec
    data: np.ndarray = t.detach().view(int_dtype).numpy().view(word_dtype).reshape(-1)
    if data.size and data.__array_interface__["data"][0] != t.data_ptr():
        raise EngineError("view words do not alias the parameter", tensor=name)
    return Tensor(get_kind(kind), tuple(t.shape), data)


def _persistent(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """Each persistent tensor of ``model`` once (a tied alias under its first name), with its
    split into the checkpoint's per-expert tensors (None: not a fused expert parameter)."""
    from .experts import split_experts

    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        ptr = t.data_ptr()
        if ptr in seen and t.numel():
            continue
        seen.add(ptr)
        yield name, t, split_experts(model, name, t)


def bind_view(model: torch.nn.Module) -> View:
    """A view whose tensors share memory with ``model``'s persistent state, by checkpoint name.

    Non-persistent buffers (rotary tables) are not in ``state_dict`` and are skipped; a tied
    alias keeps only its first (checkpoint) name so no word is reachable under two names.
    Fused MoE expert parameters (transformers stacks them per layer) are exposed as the
    checkpoint's per-expert tensors, each a view of its contiguous slice (:mod:`.experts`).
    """
    from .experts import checkpoint_name

    tensors: dict[str, Tensor] = {}
    for name, t, split in _persistent(model):
        if split is None:
            tensors[checkpoint_name(model, name)] = _words_of(t, name)
        else:
            tensors.update((n, _words_of(part, n)) for n, part in split)
    return View(tensors)


def bind_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that are whole tensors of :func:`bind_view`'s view, by the view's name
    (not fused MoE experts, whose checkpoint tensors are slices of one parameter)."""
    from .experts import checkpoint_name

    out: dict[str, torch.nn.Parameter] = {}
    for name, t, split in _persistent(model):
        if isinstance(t, torch.nn.Parameter) and split is None:
            out[checkpoint_name(model, name)] = t
    return out


class Storage:
    """New storage for one parameter, made ready before a pause (:func:`storage_for`):
    ``data``, the torch tensor the parameter will hold, and ``tensor``, the view tensor over
    the same memory. Putting it in place is then two assignments (:func:`rebind`)."""

    __slots__ = ("data", "tensor")

    def __init__(self, data: torch.Tensor, tensor: Tensor) -> None:
        self.data, self.tensor = data, tensor


def storage_for(param: torch.nn.Parameter, words: np.ndarray, name: str) -> Storage:
    """``words`` (a contiguous array of the parameter's word dtype and size) as the storage
    ``param`` would hold (no copy, nothing assigned): built while staging, so the pause
    does no conversion, check or allocation."""
    int_dtype = _WORDS[param.dtype][0]
    raw = torch.from_numpy(words.view(np.dtype(str(int_dtype).removeprefix("torch."))))
    data = raw.view(param.dtype).reshape(param.shape)
    return Storage(data, _words_of(data, name))


def rebind(param: torch.nn.Parameter, words: np.ndarray | Storage, name: str) -> Tensor:
    """Put ``words`` (a :class:`Storage`, or a contiguous array of the parameter's word dtype
    and size) in place of ``param``'s storage (O(1): no copy); returns the view tensor over
    the new storage."""
    new = words if isinstance(words, Storage) else storage_for(param, words, name)
    if new.data.dtype != param.dtype or new.data.shape != param.shape:
        raise EngineError("new storage's layout differs from the parameter's", tensor=name)
    param.data = new.data
    return new.tensor
