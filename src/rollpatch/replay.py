"""Version replay: keyframe shards and patch objects → a verified view or patch.

The board-level half of reading a version, shared by both sides of the board: the
publisher's :func:`~rollpatch.publisher.reconstruct` (resume a run) and the follower's
staging (:mod:`rollpatch.follower.stage`). Nothing here fetches or serves; callers hand in
the manifests and the fetched (already size- and BLAKE3-checked) objects.

- :func:`keyframe_view` merges a version's keyframe shards and checks the manifest's target.
- :func:`decode_step` decodes the patch objects of one step ``base → m`` (one per shard,
  disjoint tensors) against the base words and binds the union to the manifests' root
  digests; :func:`encoded_step` checks the same step's objects without decoding them, for an
  engine that decodes patches itself.

Sharded versions carry one patch object per shard (same base, disjoint tensors, patch-level
digests of the shard's sub-view): each is decoded without a root check, the tensor sets must
be disjoint, and the union is bound to the manifest's whole-view digests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

from .errors import BaseMismatchError, ManifestError, VerificationError
from .io import view_from_bytes
from .manifest import Manifest, PatchObject
from .patch import Patch, decode, inspect
from .patch.model import TensorPatch
from .types import ObjectRef
from .view import Tensor, View, WordSource

__all__ = ["decode_step", "encoded_step", "keyframe_view"]


def keyframe_view(
    m: Manifest, source: MutableMapping[str, bytes] | Callable[[ObjectRef], View]
) -> View:
    """Merge the keyframe shards of ``m`` into one view whose root digest is ``m.target``.

    ``source``: fetched blobs (each released once parsed), or a function that reads one shard
    as a verified view (``Board.fetch_view``: tensor by tensor, the view plus one chunk).
    """
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for k in sorted(m.keyframes, key=lambda k: k.shard):
        part = source(k.ref) if callable(source) else view_from_bytes(source.pop(k.ref.key))
        meta.update(part.metadata)
        overlap = tensors.keys() & part.keys()
        if overlap:
            raise ManifestError(
                "keyframe shards overlap", run=m.run, version=m.version, tensor=min(overlap)
            )
        tensors.update(part.items())
    view = View(tensors, meta)
    if view.digest() != m.target:
        raise VerificationError(
            "keyframe does not match its manifest's target digest",
            run=m.run,
            version=m.version,
            expected=m.target[:16],
            actual=view.digest()[:16],
        )
    return view


def _step_objects(m: Manifest, base: Manifest) -> list[PatchObject]:
    """The patch objects ``base.version`` → ``m.version`` (one per shard), checked against the
    base manifest."""
    objs = m.patches_from(base.version)
    if not objs:
        raise ManifestError(
            "manifest has no patch from the planned base",
            run=m.run,
            version=m.version,
            base=base.version,
        )
    for po in objs:
        if po.base_digest != base.target:
            raise ManifestError(
                "patch entry's base digest is not its base version's target",
                run=m.run,
                version=m.version,
                base=base.version,
            )
    return objs


def _check_binding(
    m: Manifest, base: Manifest, n_objects: int, key: str, digests: tuple[str, str]
) -> None:
    """An unsharded step's patch binds exactly its manifests' root digests."""
    if n_objects == 1 and digests != (base.target, m.target):
        raise ManifestError(
            "patch object binds other digests than its manifest",
            run=m.run,
            version=m.version,
            key=key,
        )


def encoded_step(m: Manifest, base: Manifest, blobs: Mapping[str, bytes]) -> list[bytes]:
    """The wire-format objects of the step ``base.version`` → ``m.version``, in shard order,
    for an engine that decodes them itself (:meth:`EngineAdapter.commit_encoded`).

    Checks what can be checked without the base words (the containers and headers, and, for
    an unsharded step, the root digests the patch binds); ``blobs`` is left untouched, so the
    caller can still decode them if the engine declines.
    """
    objs = _step_objects(m, base)
    out = []
    for po in objs:
        blob = blobs[po.ref.key]
        header = inspect(blob)
        _check_binding(m, base, len(objs), po.ref.key, (header.base, header.target))
        out.append(blob)
    return out


def decode_step(
    m: Manifest, base: Manifest, blobs: MutableMapping[str, bytes], source: WordSource
) -> Patch:
    """Decode the patch objects ``base.version`` → ``m.version`` (all shards) against ``source``.

    Returns one patch bound to the whole views: ``base.target`` → ``m.target``.
    """
    objs = _step_objects(m, base)
    if isinstance(source, View) and source.digest() != base.target:
        raise BaseMismatchError(
            "the staging base is not the patch's base",
            run=m.run,
            version=m.version,
            base=base.version,
            expected=base.target[:16],
            actual=source.digest()[:16],
        )
    tensors: dict[str, TensorPatch] = {}
    meta: dict[str, str] = {}
    for po in objs:
        part = decode(blobs.pop(po.ref.key), source, check_base=False)
        _check_binding(m, base, len(objs), po.ref.key, (part.base, part.target))
        overlap = tensors.keys() & part.tensors.keys()
        if overlap:
            raise ManifestError(
                "patch shards overlap",
                run=m.run,
                version=m.version,
                shard=po.shard,
                tensor=min(overlap),
            )
        tensors.update(part.tensors)
        meta.update(part.meta)
    return Patch(base.target, m.target, tensors, meta)
