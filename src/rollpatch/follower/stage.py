"""Staging: fetched objects → one verified commit (a composed patch, or a booted view).

Two shapes of plan, two ways to stage:

- **patch chain over the engine's words** — step 1 is decoded against ``engine.words()``,
  step *k* against an :class:`~rollpatch.patch.overlay.Overlay` of the engine's words and the
  steps composed so far; the steps are composed into one patch, committed with one
  ``engine.apply`` (one pause). Staging holds patches, never a second model.
- **keyframe (+ chain)** — the keyframe shards are merged into a view, checked against the
  manifest's target, then each later step is applied to it in place (verified); the result is
  handed to ``engine.load``.

An engine that decodes patches itself (:meth:`EngineAdapter.commit_encoded`, e.g. vLLM in its
workers) is handed a single-step plan's objects as they are (:func:`encoded_step`): nothing is
decoded here, and no words cross to this process.

Sharded versions carry one patch object per shard (same base, disjoint tensors, patch-level
digests of the shard's sub-view): each is decoded without a root check, the tensor sets must
be disjoint, and the union is bound to the manifest's whole-view digests. The engine's apply
then verifies the whole base before writing and the whole target after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

from ..errors import BaseMismatchError, ManifestError, NoPathError, VerificationError
from ..io import view_from_bytes
from ..manifest import Manifest, PatchObject
from ..patch import Patch, apply, compose, decode, inspect
from ..patch.model import TensorPatch
from ..patch.overlay import Overlay
from ..types import ObjectRef
from ..view import Tensor, View, WordSource

__all__ = ["Stage", "decode_step", "encoded_step", "keyframe_view"]


def keyframe_view(m: Manifest, source: MutableMapping[str, bytes] | Callable[[ObjectRef], View]
                  ) -> View:
    """Merge the keyframe shards of ``m`` into one view whose root digest is ``m.target``.

    ``source``: fetched blobs (each released once parsed), or a function that reads one shard
    as a verified view (``Board.fetch_view``: tensor by tensor, the view plus one chunk).
    """
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for k in sorted(m.keyframes, key=lambda k: k.shard):
        part = (source(k.ref) if callable(source)
                else view_from_bytes(source.pop(k.ref.key)))
        meta.update(part.metadata)
        overlap = tensors.keys() & part.keys()
        if overlap:
            raise ManifestError("keyframe shards overlap", run=m.run, version=m.version,
                                tensor=min(overlap))
        tensors.update(part.items())
    view = View(tensors, meta)
    if view.digest() != m.target:
        raise VerificationError("keyframe does not match its manifest's target digest",
                                run=m.run, version=m.version, expected=m.target[:16],
                                actual=view.digest()[:16])
    return view


def _step_objects(m: Manifest, base: Manifest) -> list[PatchObject]:
    """The patch objects ``base.version`` → ``m.version`` (one per shard), checked against the
    base manifest."""
    objs = m.patches_from(base.version)
    if not objs:
        raise ManifestError("manifest has no patch from the planned base", run=m.run,
                            version=m.version, base=base.version)
    for po in objs:
        if po.base_digest != base.target:
            raise ManifestError("patch entry's base digest is not its base version's target",
                                run=m.run, version=m.version, base=base.version)
    return objs


def _check_binding(m: Manifest, base: Manifest, n_objects: int, key: str,
                   digests: tuple[str, str]) -> None:
    """An unsharded step's patch binds exactly its manifests' root digests."""
    if n_objects == 1 and digests != (base.target, m.target):
        raise ManifestError("patch object binds other digests than its manifest",
                            run=m.run, version=m.version, key=key)


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


def decode_step(m: Manifest, base: Manifest, blobs: MutableMapping[str, bytes],
                source: WordSource) -> Patch:
    """Decode the patch objects ``base.version`` → ``m.version`` (all shards) against ``source``.

    Returns one patch bound to the whole views: ``base.target`` → ``m.target``.
    """
    objs = _step_objects(m, base)
    if isinstance(source, View) and source.digest() != base.target:
        raise BaseMismatchError("the staging base is not the patch's base", run=m.run,
                                version=m.version, base=base.version,
                                expected=base.target[:16], actual=source.digest()[:16])
    tensors: dict[str, TensorPatch] = {}
    meta: dict[str, str] = {}
    for po in objs:
        part = decode(blobs.pop(po.ref.key), source, check_base=False)
        _check_binding(m, base, len(objs), po.ref.key, (part.base, part.target))
        overlap = tensors.keys() & part.tensors.keys()
        if overlap:
            raise ManifestError("patch shards overlap", run=m.run, version=m.version,
                                shard=po.shard, tensor=min(overlap))
        tensors.update(part.tensors)
        meta.update(part.meta)
    return Patch(base.target, m.target, tensors, meta)


class Stage:
    """Accumulates the steps of one plan into a single commit.

    After the steps, exactly one of ``view`` (keyframe path: load it) and ``patch`` (chain
    over the engine's words: apply it) is set. ``copied_bytes`` counts the tensor copies the
    overlays lent while decoding (the staging memory beyond the patches themselves).
    """

    def __init__(self, words: WordSource | None) -> None:
        self._words = words
        self.view: View | None = None
        self.patch: Patch | None = None
        self.copied_bytes = 0

    def keyframe(self, m: Manifest,
                 source: MutableMapping[str, bytes] | Callable[[ObjectRef], View]) -> None:
        """Boot from the keyframe of ``m`` (``source``: see :func:`keyframe_view`); earlier
        staged steps are discarded."""
        self.view = keyframe_view(m, source)
        self.patch = None

    def step(self, m: Manifest, base: Manifest, blobs: MutableMapping[str, bytes]) -> None:
        """Stage the patch step ``base.version`` → ``m.version``."""
        if self.view is not None:
            apply(self.view, decode_step(m, base, blobs, self.view))  # verified, in place
            return
        if self._words is None:
            raise NoPathError("a patch step needs a loaded engine", run=m.run,
                              version=m.version, hint="plan from a keyframe (have=None)")
        if self.patch is None:
            self.patch = decode_step(m, base, blobs, self._words)
            return
        overlay = Overlay(self._words, self.patch)
        step = decode_step(m, base, blobs, overlay)
        self.copied_bytes += overlay.copied_bytes
        self.patch = compose(self.patch, step)
