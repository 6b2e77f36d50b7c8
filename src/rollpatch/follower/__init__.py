"""The rollout-side follower: watch a run's LATEST, plan, fetch, verify, stage, commit.

>>> from rollpatch.follower import Follower, FollowerConfig   # doctest: +SKIP
>>> f = Follower("s3://bucket/board", "run-7", engine, FollowerConfig(poll_s=1.0))
>>> f.sync()            # catch up to LATEST now; returns the engine's verified version
>>> f.start()           # or keep following in the background; f.status(), f.wait_for(n, 30)

See docs/follower.md for the state machine, the guarantees and the memory bound.
"""

from .audit import Auditor
from .commit import CommitGate, CommitMode, CommitRecord
from .config import FollowerConfig, FollowerState, FollowerStatus
from .core import CommitCallback, Follower

__all__ = [
    "Auditor",
    "CommitCallback",
    "CommitGate",
    "CommitMode",
    "CommitRecord",
    "Follower",
    "FollowerConfig",
    "FollowerState",
    "FollowerStatus",
]
