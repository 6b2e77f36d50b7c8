"""The version-aware sidecar: an OpenAI-compatible HTTP front of one engine.

Requests carry a version constraint; responses carry the versions that produced them; the
sidecar catches its engine up through its follower, answers 409 when it cannot satisfy the
caller and 503 until ready. See docs/sidecar.md.
"""

from ..serving.body import BodyLimits
from .gate import COMMIT_MODES, Admission, CommitGate, GatedEngine
from .protocol import decide, parse_constraint
from .service import Sidecar, SidecarConfig

__all__ = [
    "COMMIT_MODES",
    "Admission",
    "BodyLimits",
    "CommitGate",
    "GatedEngine",
    "Sidecar",
    "SidecarConfig",
    "create_app",
    "decide",
    "parse_constraint",
]


def __getattr__(name: str) -> object:
    if name == "create_app":  # the web stack is an optional extra
        from .app import create_app

        return create_app
    raise AttributeError(name)
