"""A word source that reads as ``base`` with a decoded patch applied, one tensor at a time.

The follower decodes step *k* of a multi-step plan against "the engine's words after steps
1..k-1" without building that view: :class:`Overlay` lends, per tensor on access, a fresh copy
of that one tensor with the patch applied. Tensors the patch does not touch come straight
from ``base`` (no copy), so staging a chain costs the patches plus the few tensors the
decoder holds at once — never a second copy of the model.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import BaseMismatchError
from ..view import Tensor, WordSource
from .model import DeltaOp, DropOp, FullOp, Patch
from .ops import gather, scatter

__all__ = ["Overlay"]


class Overlay:
    """``base`` as ``patch`` would leave it, lent tensor by tensor (a :class:`WordSource`).

    - untouched tensor: ``base[name]`` itself (no copy);
    - ``delta``: a copy of ``base[name]`` with the new elements scattered in, made on every
      access and not kept (the caller drops it after decoding);
    - ``full``: the patch's own new tensor (no copy);
    - ``drop``: absent.

    Lent tensors are for reading. A delta whose old elements are not in ``base`` raises
    :class:`BaseMismatchError` (the base is not the patch's base). ``copied_bytes`` and
    ``copied_tensors`` count the copies made, so callers and tests can bound staging memory.
    """

    def __init__(self, base: WordSource, patch: Patch) -> None:
        self.base = base
        self.patch = patch
        self.copied_bytes = 0
        self.copied_tensors = 0
        self._lock = threading.Lock()  # decoders read tensors from a thread pool

    def __contains__(self, name: object) -> bool:
        tp = self.patch.tensors.get(name) if isinstance(name, str) else None
        if tp is None:
            return name in self.base
        return not isinstance(tp.change, DropOp)

    def __getitem__(self, name: str) -> Tensor:
        tp = self.patch.tensors.get(name)
        if tp is None:
            return self.base[name]
        match tp.change:
            case DropOp():
                raise KeyError(name)
            case FullOp(tensor):
                return tensor
            case DeltaOp() as ch:
                pass
        src = self.base[name]
        if src.kind != tp.kind or src.shape != tp.shape:
            raise BaseMismatchError(
                "overlay base tensor layout differs from the patch",
                tensor=name,
                kind=src.kind.name,
                shape=src.shape,
            )
        if not np.array_equal(gather(src, ch.positions), ch.old):
            raise BaseMismatchError(
                "overlay base differs from the patch's old elements",
                tensor=name,
                hint="the engine is not on the plan's base",
            )
        out = src.copy()
        scatter(out, ch.positions, ch.new)
        with self._lock:
            self.copied_bytes += out.nbytes
            self.copied_tensors += 1
        return out
