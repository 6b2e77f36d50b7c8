"""A follower whose cached manifests no longer describe the board (audit I, session 42).

A follower caches the manifests it verified (``Board.manifest``). When the board's versions
change under that cache — the run deleted and published again under its name (data loss, a
reused name), or versions replaced after a key rotation took the old key away — the engine's
version still matched its cached manifest, every plan from it failed ("patch entry's base
digest is not its base version's target"), and the follower stayed in ERROR on bits that are
not the board's, for ever, reporting their version. :func:`cache_was_stale` drops the run's
cached manifests and says whether the held version's manifest changed; the follower then
checks its engine against the fresh one (and boots from a keyframe when they differ:
docs/follower.md, *Wrong engine bits heal from a keyframe*).
"""

from __future__ import annotations

import logging

from ..board import Board
from ..errors import ManifestError, TrustError, VersionNotFoundError

__all__ = ["cache_was_stale"]


def cache_was_stale(
    reader: Board, run: str, have: int | None, error: BaseException, log: logging.Logger
) -> bool:
    """After ``error`` planning or staging from ``have``: whether the cached manifest of
    ``have`` was not the board's (then the run's cache is dropped, and a WARNING says so)."""
    if have is None or not isinstance(error, ManifestError) or isinstance(error, TrustError):
        return False
    cached = reader.forget(run).get(have)
    try:
        fresh = reader.manifest(run, have)
    except (VersionNotFoundError, ManifestError):
        fresh = None
    if cached is None or (fresh is not None and fresh.target == cached.target):
        return False
    log.warning(
        "%s@%d: the board's manifest of this version is not the one this follower verified "
        "(%s): the run was published again under its name, or the version replaced after a "
        "key rotation; its manifests are read again",
        run,
        have,
        error,
    )
    return True
