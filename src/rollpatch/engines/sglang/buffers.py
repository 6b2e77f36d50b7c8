"""SGLang's double-buffered commit: the glue's seam, its torch half, and the steps over it.

:class:`Buffers` is what :class:`~.staged.HeldWeights` needs of the engine glue;
:func:`second_buffers` and :func:`exchange` are the double-buffered steps of its stage and
commit (numpy only).

:class:`TorchBuffers` is the :class:`Buffers` the loader lends
:class:`~.staged.HeldWeights`: fresh storage of a parameter's layout, which staging fills with
the live words and the staged writes in one pass while SGLang serves
(:func:`rollpatch.engines.writing.copy_with_writes`: block by block, the block copied, its old
words checked, the new ones written and read back while in L1), and, under the pause, the
exchange of a parameter's storage for that copy (``param.data = copy``: the ``Parameter``
object SGLang's modules hold stays the same, so the next forward pass reads the new storage;
O(1) per parameter). On the CPU without Intel AMX (the only layouts :mod:`.describe` accepts)
no derived copy of the weights exists, so nothing else has to be rebuilt.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ...errors import EngineError
from ..writing import ParamWrites, copy_with_writes
from .describe import param_words

__all__ = ["Buffers", "TorchBuffers", "exchange", "second_buffers"]


class Buffers(Protocol):
    """The engine glue's half of the double-buffered commit (torch, in SGLang's process)."""

    def empty(self, param: str) -> tuple[Any, np.ndarray]:
        """Fresh storage of ``param``'s layout (contents unset) and its words (as
        :attr:`HeldWeights.params` holds them: 2-D, C-contiguous, sharing its memory)."""
        ...

    def exchange(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """Put each buffer in place of its parameter's storage (O(1) each, all or nothing);
        returns the storage replaced (exchanging it back undoes the call)."""
        ...

    def words(self, param: str) -> np.ndarray:
        """The parameter's words as it now stands (after an exchange)."""
        ...


def second_buffers(
    buffers: Buffers, params: dict[str, np.ndarray], writes: dict[str, ParamWrites]
) -> dict[str, Any]:
    """Per parameter of ``writes``, a second buffer holding its live words with the writes in
    (old words checked, new ones read back), made in one pass by
    :func:`~rollpatch.engines.writing.copy_with_writes`; the live words are only read.
    Returns the glue's storage of each (the buffers a commit exchanges in)."""
    handles: dict[str, Any] = {}
    for p in sorted(writes):
        handle, words = buffers.empty(p)
        if words.shape != params[p].shape or not words.flags.c_contiguous:
            raise EngineError("a parameter's second buffer has another layout", param=p)
        w = writes[p]
        copy_with_writes(params[p].reshape(-1), words.reshape(-1), w.prepared, w.old, w.new, p)
        handles[p] = handle
    return handles


def exchange(
    buffers: Buffers, params: dict[str, np.ndarray], handles: dict[str, Any]
) -> dict[str, Any]:
    """Under the pause: ``handles`` in place of the parameters' storage, ``params``'s words
    re-aliased; undone on any failure. Returns the storage replaced."""
    held = buffers.exchange(handles)
    try:
        for p in handles:
            params[p] = buffers.words(p)
    except BaseException:
        buffers.exchange(held)
        for p in held:
            params[p] = buffers.words(p)
        raise
    return held


class TorchBuffers:
    """:class:`Buffers` over ``params`` (runtime name → torch ``Parameter``)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def empty(self, param: str) -> tuple[Any, np.ndarray]:
        """Storage from numpy, which asks the kernel for huge pages for arrays of 4 MiB and
        more (``torch.empty_like``'s 4 KiB pages took longer to fault in than the one-pass
        copy took to fill them: 882 MiB of parameters in 280 ms against 150), as a torch
        tensor of the parameter's dtype and shape sharing it."""
        import torch

        p = self.params[param]
        raw = np.empty(tuple(p.shape), np.dtype(f"i{p.element_size()}"))  # torch has int16
        fresh = torch.from_numpy(raw).view(p.dtype)
        if not fresh.is_contiguous() or tuple(fresh.stride()) != tuple(p.stride()):
            raise EngineError("a parameter's second buffer has other strides", param=param)
        return fresh, param_words(fresh)

    def exchange(self, buffers: dict[str, Any]) -> dict[str, Any]:
        held: dict[str, Any] = {}
        try:
            for name, t in buffers.items():
                p = self.params[name]
                if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                    raise EngineError("a buffer does not match its parameter", param=name)
                held[name] = p.data
                p.data = t
        except BaseException:
            for name, t in held.items():
                self.params[name].data = t
            raise
        return held

    def words(self, param: str) -> np.ndarray:
        return param_words(self.params[param])
