"""The trainer side: publish master weights as immutable versions on a board.

>>> import numpy as np
>>> from rollpatch.publisher import Publisher, PublisherConfig
>>> with Publisher("memory://doctest-pub", "run1", PublisherConfig(format="bf16")) as pub:
...     v = pub.publish({"w": np.ones((4, 4), np.float32)})
>>> v
0

Each version: master state dict → served view (format) → patch against the previous view →
objects → manifest → LATEST, in that order (docs/publisher.md). :func:`reconstruct` rebuilds
any version's view from the board.
"""

from .config import PublisherConfig, PublisherStats, VersionStats
from .core import Publisher
from .reconstruct import apply_step, load_keyframe, merge_shard_patches, reconstruct
from .sharded_slices import TensorSlice
from .snapshot import snapshot_state

__all__ = [
    "Publisher",
    "PublisherConfig",
    "PublisherStats",
    "TensorSlice",
    "VersionStats",
    "apply_step",
    "load_keyframe",
    "merge_shard_patches",
    "reconstruct",
    "snapshot_state",
]
