"""The torch half of SGLang's double-buffered commit (in SGLang's process).

:class:`TorchBuffers` is the :class:`~.staged.Buffers` the loader lends
:class:`~.staged.HeldWeights`: a copy of a parameter's storage to write the staged words into
while SGLang serves, and, under the pause, the exchange of a parameter's storage for that
copy (``param.data = copy``: the ``Parameter`` object SGLang's modules hold stays the same, so
the next forward pass reads the new storage; O(1) per parameter). On the CPU without Intel
AMX (the only layouts :mod:`.describe` accepts) no derived copy of the weights exists, so
nothing else has to be rebuilt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import EngineError
from .describe import param_words

__all__ = ["TorchBuffers"]


class TorchBuffers:
    """:class:`~.staged.Buffers` over ``params`` (runtime name → torch ``Parameter``)."""

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
