"""The SGLang engine's live words as a :class:`~rollpatch.view.WordSource`, read a tensor at a
time (in the sidecar's process; the follower decodes chains of patches against them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...io.safetensors import load_view
from ...view import Tensor
from . import tp as tp_ops

if TYPE_CHECKING:
    from .adapter import SglangEngine

__all__ = ["RemoteWords"]


class RemoteWords:
    """A :class:`WordSource` over the engine's tensors, exported one at a time (each access
    copies one tensor through a file). :meth:`SglangEngine.apply_encoded` needs none."""

    def __init__(self, engine: SglangEngine) -> None:
        self.engine = engine

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.engine.tensors()

    def __getitem__(self, name: str) -> Tensor:
        if name not in self:
            raise KeyError(name)
        channel = self.engine.channel
        if self.engine.tp > 1:  # every rank's block through a file (measured faster here
            # than one shared-memory buffer per tensor: docs/sglang.md, Measured)
            path = channel.scratch.name("words")
            return tp_ops.export(channel, name, self.engine.tensors()[name], path, shared=False)
        with channel.scratch.files("words") as (path,):
            self.engine._control("export", name=name, path=str(path))
            return load_view(path)[name]
