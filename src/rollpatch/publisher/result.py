"""What one rank's build of a version yields (:class:`ShardResult`, the message rank 0 reads
for the manifest) and the skip accumulators it carries between versions: the data that
:mod:`.pipeline` (host) and :mod:`.devpipe` (device) produce and :mod:`.writer` consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..patch import Patch
from ..types import ObjectRef

__all__ = ["FOLD", "Accumulators", "ServedView", "ShardResult"]


class ServedView(Protocol):
    """What a version's message needs of its view: a host :class:`View`, or the device path's
    ``DeviceView``."""

    @property
    def nbytes(self) -> int: ...
    def tensor_digests(self) -> dict[str, str]: ...


#: Stride → (base version, patch composed from the base to the current version, or None);
#: the key :data:`FOLD` holds the folded patch's (anchor, composed).
Accumulators = dict[int, tuple[int, "Patch | None"]]
#: The accumulators' key of the fold (skip strides are >= 2).
FOLD = 0


@dataclass
class ShardResult:
    """What ``build`` made for one version; ``message()`` is what the rank tells rank 0."""

    version: int
    view: ServedView
    patches: list[tuple[int, ObjectRef]] = field(default_factory=list)
    #: Base version → the (base, target) root digests its patch object binds.
    binds: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: The step patch's tensors dropped, and shipped whole (added, reshaped or retyped).
    dropped: int = 0
    whole: int = 0
    #: A sharded rank's first version after resuming on the whole view: that view's names
    #: (rank 0 refuses the version when one is in no rank's shard: it would vanish unpatched).
    resumed: list[str] | None = None
    keyframe: ObjectRef | None = None
    accumulators: Accumulators = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    patch_bytes: int = 0
    changed: int = 0
    host_bytes: int = 0
    #: Sliced tensor name → :func:`slice_part` (what rank 0 needs for the whole digest).
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``(step patch,)`` when no skip patch is due at this version: the accumulators then
    #: advance in :meth:`ShardPipeline.commit`, after LATEST names the version (latency).
    deferred: tuple[Patch | None] | None = None

    def message(self) -> dict[str, Any]:
        def ref(r: ObjectRef) -> dict[str, Any]:
            return {"key": r.key, "size": r.size, "b3": r.b3}

        return {
            "ok": True,
            "version": self.version,
            "nbytes": self.view.nbytes,
            "digests": {
                k: d for k, d in self.view.tensor_digests().items() if k not in self.slices
            },
            "slices": self.slices,
            "patches": [
                dict(ref(r), base=b, binds=list(self.binds.get(b, ()))) for b, r in self.patches
            ],
            "keyframe": None if self.keyframe is None else ref(self.keyframe),
            **({} if self.resumed is None else {"resumed": self.resumed}),
        }
