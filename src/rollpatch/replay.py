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

Sliced tensors (``Manifest.sliced``, schema 2) are element ranges of one tensor held by
different shards: each shard's patch is decoded against the same range of the words held
here (a zero-copy cut, never a re-assembled copy), the slices' changes are offset into the
whole tensor and joined, and the joined change is bound to the whole tensor's digests from
the manifests; the engine's apply verifies them as for any patch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, MutableMapping
from typing import Protocol

import numpy as np

from .errors import BaseMismatchError, ManifestError, VerificationError
from .io import view_from_bytes
from .manifest import Manifest, PatchObject, SlicedTensor, SliceEntry
from .patch import Patch, decode, inspect
from .patch.model import DeltaOp, TensorPatch
from .view import Tensor, View, WordSource, tensor_digest

__all__ = ["KeyframeCheck", "decode_object", "decode_step", "encoded_step", "keyframe_view"]


class KeyframeCheck(Protocol):
    """Checks a keyframe against what will load it (an engine's tensors:
    :class:`rollpatch.engines.fit.FitCheck`), raising to refuse it."""

    def tensor(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        """One tensor, from a shard's header (before its bytes are read) or a sliced
        tensor's manifest entry."""

    def names(self, names: Collection[str]) -> None:
        """The keyframe's whole name set, once every shard is read."""


def keyframe_view(
    m: Manifest,
    source: MutableMapping[str, bytes] | Callable[..., View],
    check: KeyframeCheck | None = None,
) -> View:
    """Merge the keyframe shards of ``m`` into one view whose root digest is ``m.target``.

    ``source``: fetched blobs (each released once parsed), or a function that reads one shard
    as a verified view (``Board.fetch_view``: tensor by tensor, the view plus one chunk; it
    takes ``into=`` and reads each slice of a sliced tensor straight into its whole tensor).
    ``check``: the engine's tensors, checked against each shard's header before its tensors
    are read (and against the sliced tensors' manifest entries first), and the name sets
    once every shard is read (:class:`IncompatibleModelError`).
    """
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    wholes = {t.name: t for t in m.sliced}
    raw: dict[str, np.ndarray] = {}  # the sliced tensors' bytes, read into in place
    if check is not None:
        for w in m.sliced:
            check.tensor(w.name, w.dtype, tuple(w.shape))
    for k in sorted(m.keyframes, key=lambda k: k.shard):
        slices = m.slices_of(k.shard)
        if not callable(source):
            part = view_from_bytes(source.pop(k.ref.key))
            for name, t in part.items():
                if check is not None and name not in slices:
                    check.tensor(name, t.dtype, tuple(t.shape))
        else:
            into = _checked(_into(wholes, slices, raw) if m.sliced else None, slices, check)
            part = source(k.ref) if into is None else source(k.ref, into=into)
        meta.update(part.metadata)
        for name, entry in slices.items():  # in the whole tensor (read there, or copied)
            _place(m, tensors, wholes[name], entry, part.get(name), raw.get(name))
            del part[name]
        overlap = (tensors.keys() | wholes.keys()) & part.keys()
        if overlap:
            raise ManifestError(
                "keyframe shards overlap", run=m.run, version=m.version, tensor=min(overlap)
            )
        tensors.update(part.items())
    if check is not None:
        check.names(tensors)
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


def _checked(
    inner: Callable[[str, str, tuple[int, ...], int], np.ndarray | None] | None,
    slices: Mapping[str, SliceEntry],
    check: KeyframeCheck | None,
) -> Callable[[str, str, tuple[int, ...], int], np.ndarray | None] | None:
    """``inner`` (where slices are read to), with each other tensor of the shard's header
    checked against the engine's first (None: nothing to check, nothing to place)."""
    if check is None:
        return inner

    def into(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> np.ndarray | None:
        if name not in slices:  # a slice's shape is its own: its whole tensor is checked
            check.tensor(name, dtype, tuple(shape))
        return None if inner is None else inner(name, dtype, shape, nbytes)

    return into


def _into(
    wholes: Mapping[str, SlicedTensor],
    slices: Mapping[str, SliceEntry],
    raw: dict[str, np.ndarray],
) -> Callable[[str, str, tuple[int, ...], int], np.ndarray | None]:
    """Where a keyframe shard's slices are read to: their places in the whole tensors'
    bytes (allocated at the first slice); anything else is allocated by the reader."""

    def into(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> np.ndarray | None:
        e, w = slices.get(name), wholes.get(name)
        if e is None or w is None or dtype != w.dtype or shape != e.shape or e.length == 0:
            return None  # not this shard's slice as listed: _place refuses it
        size = nbytes // e.length
        buf = raw.get(name)
        if buf is None:
            buf = raw[name] = np.empty(SliceEntry(0, 0, w.shape).length * size, np.uint8)
        lo = e.offset * size
        return buf[lo : lo + nbytes] if lo + nbytes <= buf.size else None

    return into


def _place(
    m: Manifest,
    tensors: dict[str, Tensor],
    whole: SlicedTensor,
    entry: SliceEntry,
    part: Tensor | None,
    raw: np.ndarray | None = None,
) -> None:
    """Put one keyframe shard's slice in its whole tensor (allocated at the first; a slice
    read straight into its place by :func:`_into` is not copied)."""
    if part is None or part.shape != entry.shape or part.dtype != whole.dtype or part.kind.packed:
        raise ManifestError(
            "keyframe shard lacks its slice, or holds another layout",
            run=m.run,
            version=m.version,
            tensor=whole.name,
            shard=entry.shard,
        )
    t = tensors.get(whole.name)
    if t is None:
        words = (
            raw.view(part.kind.word_dtype)
            if raw is not None
            else np.empty(SliceEntry(0, 0, whole.shape).length, part.kind.word_dtype)
        )
        t = tensors[whole.name] = Tensor(part.kind, whole.shape, words)
    dest = t.data[entry.offset : entry.offset + entry.length]
    if not np.shares_memory(dest, part.data):
        dest[:] = part.data


class _SliceSource:
    """A word source whose sliced tensors are zero-copy cuts of ``source``'s."""

    def __init__(self, source: WordSource, slices: Mapping[str, SliceEntry]) -> None:
        self._source, self._slices = source, slices

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __getitem__(self, name: str) -> Tensor:
        t = self._source[name]
        e = self._slices.get(name)
        if e is None:
            return t
        if e.offset + e.length > t.data.size or t.kind.packed:
            raise BaseMismatchError("the base tensor cannot hold this slice", tensor=name)
        return Tensor(t.kind, e.shape, t.data[e.offset : e.offset + e.length])


def _check_layouts(m: Manifest, base: Manifest) -> None:
    """A step's slices must cut the base the way the base's own shards did."""
    if base.sliced and {t.name: t.layout() for t in m.sliced} != {
        t.name: t.layout() for t in base.sliced
    }:
        raise ManifestError(
            "the version's slices differ from its base's", run=m.run, version=m.version
        )


def _join(
    m: Manifest,
    base: Manifest,
    whole: SlicedTensor,
    pieces: list[tuple[int, TensorPatch]],
    source: WordSource,
) -> TensorPatch:
    """The slices' changes of one tensor, offset into it and joined (in offset order)."""
    pieces.sort(key=lambda p: p[0])
    ch = [tp.change for _, tp in pieces if isinstance(tp.change, DeltaOp)]
    if len(ch) != len(pieces):
        raise ManifestError(
            "a slice patch must change elements, not replace the tensor",
            run=m.run,
            version=m.version,
            tensor=whole.name,
        )
    positions = np.concatenate(
        [c.positions.astype(np.int64) + off for (off, _), c in zip(pieces, ch)]
    )
    old = np.concatenate([c.old for c in ch])
    new = np.concatenate([c.new for c in ch])
    prior = {t.name: t.digest for t in base.sliced}.get(whole.name)
    if prior is None:  # the base was published whole: its digest is the words held here
        prior = (
            source.tensor_digest(whole.name)
            if isinstance(source, View)
            else tensor_digest(whole.dtype, whole.shape, source[whole.name].data)
        )
    kind = pieces[0][1].kind
    return TensorPatch(
        whole.name, kind, whole.shape, prior, whole.digest, DeltaOp(positions, old, new)
    )


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
    if m.sliced or base.sliced:
        raise ManifestError(
            "a sliced version is decoded by the follower, not handed over encoded",
            run=m.run,
            version=m.version,
        )
    out = []
    for po in objs:
        blob = blobs[po.ref.key]
        header = inspect(blob)
        _check_binding(m, base, len(objs), po.ref.key, (header.base, header.target))
        out.append(blob)
    return out


def decode_object(m: Manifest, po: PatchObject, blob: bytes, source: WordSource) -> Patch:
    """One shard's patch object of ``m`` decoded against ``source`` (its sliced tensors
    against zero-copy cuts of the words), bound to nothing yet: :func:`decode_step` checks
    the base and joins the shards. Callers may run it as each object arrives."""
    slices = m.slices_of(po.shard)
    return decode(blob, _SliceSource(source, slices) if slices else source, check_base=False)


def decode_step(
    m: Manifest,
    base: Manifest,
    blobs: MutableMapping[str, bytes],
    source: WordSource,
    decoded: Mapping[str, Patch] | None = None,
) -> Patch:
    """Decode the patch objects ``base.version`` → ``m.version`` (all shards) against ``source``.

    Returns one patch bound to the whole views: ``base.target`` → ``m.target``. ``decoded``:
    objects (by key) already decoded against ``source`` with :func:`decode_object`, e.g. while
    the others were still fetched; their blobs are only dropped.
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
    _check_layouts(m, base)
    sliced = {t.name for t in m.sliced}
    tensors: dict[str, TensorPatch] = {}
    pieces: dict[str, list[tuple[int, TensorPatch]]] = {}
    meta: dict[str, str] = {}
    for po in objs:
        slices = m.slices_of(po.shard)
        blob = blobs.pop(po.ref.key)
        part = (decoded or {}).get(po.ref.key) or decode_object(m, po, blob, source)
        del blob
        _check_binding(m, base, len(objs), po.ref.key, (part.base, part.target))
        whole = {k: tp for k, tp in part.tensors.items() if k not in slices}
        for name in part.tensors.keys() - whole.keys():
            pieces.setdefault(name, []).append((slices[name].offset, part.tensors[name]))
        overlap = (tensors.keys() | sliced) & whole.keys()
        if overlap:
            raise ManifestError(
                "patch shards overlap",
                run=m.run,
                version=m.version,
                shard=po.shard,
                tensor=min(overlap),
            )
        tensors.update(whole)
        meta.update(part.meta)
    for st in m.sliced:
        if st.name in pieces:
            tensors[st.name] = _join(m, base, st, pieces[st.name], source)
    return Patch(base.target, m.target, tensors, meta)
