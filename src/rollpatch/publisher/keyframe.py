"""Resuming one shard: the part of a version's view that one publisher rank holds, rebuilt
from that shard's keyframe object and patch objects only, so no rank rebuilds the whole view.

Shard ``i`` of every manifest on the plan's path is what rank ``i`` published: its keyframe
shard is a safetensors view of its tensors (read streamed, BLAKE3-checked), and its patch
objects bind that shard's own base and target digests, so each is applied to the partial view
with full verification (``apply_encoded``: base digest before, target digest after).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ..board import Board
from ..errors import ObjectIntegrityError, PatchError
from ..formats import get_format
from ..patch import apply_encoded
from ..trust import Trust
from ..view import View

__all__ = ["reconstruct_shard", "shard_matches"]

log = logging.getLogger("rollpatch.publisher")


def reconstruct_shard(
    board: Board, run: str, version: int, shard: int, shards: int, *, trust: Trust | None = None
) -> View | None:
    """Shard ``shard`` of ``version``'s view, or None when the board does not allow it (a
    manifest on the path was published by another number of ranks, or lacks this shard's
    keyframe or patch, or an object on the path is corrupt, or shard ``shard`` held other
    tensors on part of the path: a patch then does not bind the view built so far,
    ``BaseMismatchError``, as the same world size with another assignment of tensors to
    ranks across sessions gives): the caller then falls back to
    the whole view (``reconstruct``, which plans around corrupt objects)."""
    try:
        return _shard_view(board, run, version, shard, shards, trust)
    except ObjectIntegrityError:
        return None
    except PatchError as e:  # shard i held other tensors on part of the path
        log.info(
            "%s@%d: shard %d cannot be rebuilt from its own objects (the ranks' tensors "
            "changed between sessions on the way to it: %s); rebuilding the whole view",
            run,
            version,
            shard,
            type(e).__name__,
        )
        return None


def _shard_view(
    board: Board, run: str, version: int, shard: int, shards: int, trust: Trust | None
) -> View | None:
    b = board if trust is None else Board(board.store, trust=trust)
    view: View | None = None
    for step in b.plan(run, None, version).steps:
        m = b.manifest(run, step.to)
        if m.shards != shards:
            return None
        if step.is_keyframe:
            kfs = [k for k in m.keyframes if k.shard == shard]
            if len(kfs) != 1:
                return None
            view = b.fetch_view(kfs[0].ref)
            continue
        objs = (
            [p for p in m.patches_from(step.base) if p.shard == shard]
            if step.base is not None
            else []
        )
        if view is None or len(objs) != 1:
            return None
        apply_encoded(view, b.fetch(objs[0].ref))
    return view


def shard_matches(part: View, masters: Collection[str], fmt: str) -> bool:
    """Whether ``part`` holds exactly the served names of ``masters`` (each master, or a
    master plus one of the format's scale suffixes), so it can be the shard's base."""
    names = set(masters)
    suffixes = get_format(fmt).scale_suffixes
    if not names <= set(part):
        return False
    return all(
        p in names or any(p.endswith(s) and p[: -len(s)] in names for s in suffixes) for p in part
    )
