"""rollpatch: lossless patches over engine-visible weights.

Keeps rollout engines anywhere serving exactly the policy version an RL trainer published.
See ``docs/`` and DESIGN for the architecture: formats → views → patches → board → follower →
engine adapters → sidecar.
"""

from .errors import RollpatchError
from .kinds import KINDS, Kind
from .view import Tensor, View

__version__ = "0.1.0"

__all__ = ["KINDS", "Kind", "RollpatchError", "Tensor", "View", "__version__"]
