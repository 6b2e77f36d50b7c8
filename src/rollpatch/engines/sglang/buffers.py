"""SGLang's double-buffered commit: the glue's seam, its torch half, and the steps over it.

:class:`Buffers` is what :class:`~.staged.HeldWeights` needs of the engine glue;
:func:`clone`, :func:`write_copy`, :func:`check_copies` and :func:`exchange` are the
double-buffered steps of its stage and commit (numpy only).

:class:`TorchBuffers` is the :class:`Buffers` the loader lends
:class:`~.staged.HeldWeights`: a copy of a parameter's storage to write the staged words into
while SGLang serves, and, under the pause, the exchange of a parameter's storage for that
copy (``param.data = copy``: the ``Parameter`` object SGLang's modules hold stays the same, so
the next forward pass reads the new storage; O(1) per parameter). On the CPU without Intel
AMX (the only layouts :mod:`.describe` accepts) no derived copy of the weights exists, so
nothing else has to be rebuilt.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ...errors import EngineError, TargetMismatchError
from ...patch import DeltaOp
from ..vllm.layout import Placement, locate
from ..writing import SLICE, check_and_write, numpy_access
from .describe import param_words
from .update import Staged

__all__ = ["Buffers", "TorchBuffers", "check_copies", "clone", "exchange", "write_copy"]


class Buffers(Protocol):
    """The engine glue's half of the double-buffered commit (torch, in SGLang's process)."""

    def clone(self, param: str) -> tuple[Any, np.ndarray]:
        """A copy of ``param``'s storage and its words (as :attr:`HeldWeights.params` holds
        them: 2-D, C-contiguous, sharing the copy's memory)."""
        ...

    def exchange(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """Put each buffer in place of its parameter's storage (O(1) each, all or nothing);
        returns the storage replaced (exchanging it back undoes the call)."""
        ...

    def words(self, param: str) -> np.ndarray:
        """The parameter's words as it now stands (after an exchange)."""
        ...


def clone(
    buffers: Buffers, params: dict[str, np.ndarray], names: set[str]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A second buffer of each of ``names`` (the glue's storage, and its words)."""
    handles: dict[str, Any] = {}
    words: dict[str, np.ndarray] = {}
    for p in sorted(names):
        handles[p], words[p] = buffers.clone(p)
        if words[p].shape != params[p].shape or not words[p].flags.c_contiguous:
            raise EngineError("a parameter's copy has another layout", param=p)
    return handles, words


def write_copy(words: dict[str, np.ndarray], pl: Placement, ch: DeltaOp) -> None:
    """A tensor's changes written into its parameter's copy (the old words checked)."""
    held, offsets = locate(pl, ch.positions)
    check_and_write(words[pl.param].reshape(-1), offsets, ch.old[held], ch.new[held], pl.param)


def check_copies(staged: Staged, words: dict[str, np.ndarray]) -> None:
    """Every staged word read back from the copies, a slice at a time."""
    acc = numpy_access(words)
    assert acc.read_at is not None
    for p, w in staged.writes.items():
        for i in range(0, w.offsets.size, SLICE):
            s = slice(i, i + SLICE)
            if not np.array_equal(acc.read_at(p, w.offsets[s]), w.new[s]):
                raise TargetMismatchError("read-back of a copy's words differs", param=p)


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

    def clone(self, param: str) -> tuple[Any, np.ndarray]:
        p = self.params[param]
        copy = p.detach().clone()
        if not copy.is_contiguous() or tuple(copy.stride()) != tuple(p.stride()):
            raise EngineError("a parameter's copy has other strides", param=param)
        return copy, param_words(copy)

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
