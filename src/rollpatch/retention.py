"""Retention: garbage-collect old versions and orphaned objects without breaking any plan.

Rule: keep LATEST, the last ``keep_last`` versions, pinned versions and everything after the
oldest of them, and the newest keyframe at or below that line (plus everything after it), so
every retained version — and a new replica booting from a keyframe — still plans to LATEST.
Deletion order is marker → manifest → objects, so no surviving manifest ever names a deleted
object. Objects no manifest names (a publisher crashed between upload and manifest) are
deleted once older than ``orphan_grace_s``, which protects an in-flight publish.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .board import Board, version_key
from .errors import ConfigError, ManifestError

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


def collect(board: Board, run: str, *, keep_last: int = 32, pinned: Iterable[int] = (),
            orphan_grace_s: float = 3600.0, dry_run: bool = False,
            now: float | None = None) -> GcReport:
    """Delete what no retained version needs. See the module docstring for the rule."""
    if keep_last < 0 or orphan_grace_s < 0:
        raise ConfigError("keep_last and orphan_grace_s must be non-negative")
    now = time.time() if now is None else now
    latest = board.latest(run)
    versions = board.versions(run)
    report = GcReport(run, None)
    if latest is not None:
        line = min([latest.version - keep_last, *pinned, latest.version])
        kfs = [k for k in board.keyframes(run) if k <= min(line, latest.version)]
        cutoff = min(line, kfs[-1]) if kfs else min(versions, default=0)
        report.cutoff = cutoff
        keep = [v for v in versions if v >= cutoff]
        referenced = _referenced(board, run, keep)
        for v in versions:
            if v >= cutoff:
                continue
            try:
                doomed = board.manifest(run, v).objects()
            except ManifestError:
                doomed = []
            report.versions_deleted.append(v)
            if not dry_run:
                board.store.delete(f"runs/{run}/keyframes/{v:012d}")
                board.store.delete(version_key(run, v))
            for ref in doomed:
                if ref.key not in referenced and ref.key not in report.objects_deleted:
                    report.objects_deleted.append(ref.key)
                    report.bytes_freed += ref.size
                    if not dry_run:
                        board.store.delete(ref.key)
        named = referenced | set(report.objects_deleted)
    else:
        named = _referenced(board, run, versions)
    for key in board.store.list(f"runs/{run}/objects/"):
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
