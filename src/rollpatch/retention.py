"""Retention: garbage-collect old versions and orphaned objects without breaking any plan.

Rule: keep LATEST, the last ``keep_last`` versions, pinned versions and everything after the
oldest of them, and the newest keyframe at or below that line (plus everything after it), so
every retained version — and a new replica booting from a keyframe — still plans to LATEST.
Deletion order is marker → manifest → objects, so no surviving manifest ever names a deleted
object. Objects no manifest names (a publisher crashed between upload and manifest) are
deleted once older than ``orphan_grace_s``, which protects an in-flight publish.

A version below the cutoff whose manifest cannot be read (corrupt, forged, unparseable) is
still deleted, but the objects it may name are left to the orphan rule, and the version is
reported in :attr:`GcReport.unreadable` with the reason: nothing is skipped silently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .board import Board
from .errors import ConfigError, ManifestError
from .layout import keyframe_marker_key, objects_prefix, version_key

__all__ = ["GcReport", "collect"]


@dataclass
class GcReport:
    """What :func:`collect` deleted (or would delete, with ``dry_run``)."""

    run: str
    cutoff: int | None
    versions_deleted: list[int] = field(default_factory=list)
    objects_deleted: list[str] = field(default_factory=list)
    orphans_deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    #: The cutoff's keyframe when the kept versions' own line lay above it (they are rebuilt
    #: from it); None when the line itself is the cutoff.
    keyframe_floor: int | None = None
    #: Versions below the cutoff whose manifest could not be read: ``(version, reason)``.
    #: Their objects were not deleted with them; unreferenced, they go as orphans later.
    unreadable: list[tuple[int, str]] = field(default_factory=list)


def collect(
    board: Board,
    run: str,
    *,
    keep_last: int = 32,
    pinned: Iterable[int] = (),
    orphan_grace_s: float = 3600.0,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Delete what no retained version needs. See the module docstring for the rule."""
    if keep_last < 0 or not orphan_grace_s >= 0 or math.isinf(orphan_grace_s):
        raise ConfigError(
            "keep_last (--keep-last) and orphan_grace_s (--orphan-grace) must be finite and "
            "non-negative",
            keep_last=keep_last,
            orphan_grace_s=orphan_grace_s,
        )
    now = time.time() if now is None else now
    latest = board.latest(run)
    versions = board.versions(run)
    report = GcReport(run, None)
    if latest is not None:
        line = min([latest.version - keep_last, *pinned, latest.version])
        kfs = [k for k in board.keyframes(run) if k <= min(line, latest.version)]
        cutoff = min(line, kfs[-1]) if kfs else min(versions, default=0)
        report.cutoff = cutoff
        report.keyframe_floor = cutoff if cutoff < line else None
        keep = [v for v in versions if v >= cutoff]
        referenced = _referenced(board, run, keep)
        deleted: set[str] = set()
        for v in versions:
            if v >= cutoff:
                continue
            try:
                doomed = board.manifest(run, v).objects()
            except ManifestError as e:
                report.unreadable.append((v, str(e)))
                doomed = []
            report.versions_deleted.append(v)
            if not dry_run:
                board.store.delete(keyframe_marker_key(run, v))
                board.store.delete(version_key(run, v))
            for ref in doomed:
                if ref.key not in referenced and ref.key not in deleted:
                    deleted.add(ref.key)
                    report.objects_deleted.append(ref.key)
                    report.bytes_freed += ref.size
                    if not dry_run:
                        board.store.delete(ref.key)
        named = referenced | deleted
    else:
        named = _referenced(board, run, versions)
    for key in board.store.list(objects_prefix(run)):
        if key in named:
            continue
        info = board.store.head(key)
        if info is None or info.modified is None or now - info.modified < orphan_grace_s:
            continue
        report.orphans_deleted.append(key)
        report.bytes_freed += info.size
        if not dry_run:
            board.store.delete(key)
    return report


def _referenced(board: Board, run: str, versions: Iterable[int]) -> set[str]:
    out: set[str] = set()
    for v in versions:
        out.update(ref.key for ref in board.manifest(run, v).objects())
    return out
