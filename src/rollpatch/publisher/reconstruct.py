"""Rebuild a version's served view from the board: keyframe + patch chain, verified.

The publisher uses this to resume a run; followers may use it to boot. Every object is checked
against its manifest entry (size and BLAKE3, by :meth:`Board.fetch`), every patch against its
base and target digests, and the result against the manifest's target digest. An object found
corrupt is planned around (:func:`rollpatch.avoid.plan_around`), as a follower does.
"""

from __future__ import annotations

import logging

from ..avoid import BadObjects, plan_around
from ..board import Board, PlanStep
from ..errors import ManifestError, VersionNotFoundError
from ..manifest import Manifest
from ..patch import Patch, apply
from ..replay import decode_step, keyframe_view
from ..trust import Trust
from ..view import View

__all__ = ["apply_step", "load_keyframe", "merge_shard_patches", "reconstruct"]

log = logging.getLogger("rollpatch.publisher")

#: Plans a rebuild may try, each around one more corrupt object (then the corruption is the
#: error): bounded, as a resume fetches whole keyframes.
MAX_PLANS = 8


def reconstruct(
    board: Board | str, run: str, version: int | None = None, *, trust: Trust | None = None
) -> View:
    """The served view of ``run`` at ``version`` (None: LATEST), rebuilt and verified.

    Follows :meth:`Board.plan` from nothing (fewest bytes: a keyframe, then patches), around
    every object found corrupt (at most :data:`MAX_PLANS` plans). With ``trust`` (or a board
    that has one), every manifest used, and LATEST, must be signed under that trust root.

    Raises :class:`VersionNotFoundError` (no such version or no LATEST), :class:`NoPathError`,
    :class:`ObjectIntegrityError` (a corrupt object, and no way around it),
    :class:`ManifestError` (shards overlap), or a :class:`VerificationError` when bits do not
    match their digests.
    """
    b = board if isinstance(board, Board) else Board(board)
    if trust is not None:
        b = Board(b.store, trust=trust)
    if version is None:
        pointer = b.latest(run)
        if pointer is None:
            raise VersionNotFoundError("the run has no published version", run=run)
        version = pointer.version
    want = version

    def rebuild(avoid: frozenset[str]) -> View:
        view: View | None = None
        for step in b.plan(run, None, want, avoid=avoid).steps:
            view = apply_step(b, run, step, view)
        if view is None:  # plan(None, v) always has at least the keyframe step
            raise VersionNotFoundError("empty plan", run=run, version=want)
        return view

    return plan_around(BadObjects(), run, rebuild, log=log, tries=MAX_PLANS)


def apply_step(board: Board, run: str, step: PlanStep, view: View | None) -> View:
    """Take one plan step: load the keyframe of ``step.to``, or patch ``view`` in place
    (manifests verified under ``board.trust``, if it has one)."""
    m = board.manifest(run, step.to)
    if step.is_keyframe:
        return load_keyframe(board, m)
    if view is None or step.base is None:
        raise ManifestError("a patch step needs the base view", run=run, version=step.to)
    return apply(view, merge_shard_patches(board, m, step.base, view))


def load_keyframe(board: Board, m: Manifest) -> View:
    """The view in ``m``'s keyframe objects (one per shard, merged), checked against its target."""
    if not m.keyframes:
        raise ManifestError("version has no keyframe", run=m.run, version=m.version)
    return keyframe_view(m, board.fetch_view)  # streamed: the view plus one chunk


def merge_shard_patches(board: Board, m: Manifest, base: int, view: View) -> Patch:
    """One patch from version ``base`` (whose view is ``view``) to ``m``: the shards' patch
    objects decoded against ``view`` and merged, bound to the manifests' root digests."""
    objects = m.patches_from(base)
    if not objects:
        raise VersionNotFoundError(
            "no patch from that base", run=m.run, version=m.version, base=base
        )
    blobs = {o.ref.key: board.fetch(o.ref) for o in objects}
    return decode_step(m, board.manifest(m.run, base), blobs, view)
