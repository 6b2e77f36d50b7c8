"""One rank's share of publishing a version, and the manifest that rank 0 writes from all shares.

:class:`ShardPipeline` keeps the rank's previous view and, per skip stride, the patch composed
since the last multiple of the stride, and with ``fold_every`` the view of the last anchor:
every version also gets a folded patch from it (one fused encode of the anchor's view against
the new one; the device path composes it in an accumulator instead, its views being on the
device). ``build`` casts, diffs, encodes and uploads the shard's objects without changing that
state; ``commit`` installs the new view once the manifest is durable, so a failed version
leaves the pipeline where it was.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .. import native
from ..board import Board
from ..errors import PatchError
from ..formats import cast_view
from ..patch import Patch, compose, diff, encode, encode_views, encode_views_patch, inspect
from ..view import View
from .cast import has_step, step_patch
from .config import PublisherConfig
from .guards import check_finite, check_same_model
from .result import FOLD, Accumulators, ShardResult
from .sharded_slices import SliceSpec, check_sliceable, cut, slice_part
from .skipbase import RewoundBase, rebuild_ahead, rewind, same_layout

__all__ = ["ShardPipeline"]


class ShardPipeline:
    """One rank's publishing state: its previous view, version and skip accumulators."""

    #: How the folded patch is made: False (host) encodes it from the anchor's view, held
    #: from anchor to anchor; True (the device path) composes it in an accumulator.
    FOLD_BY_ACCUMULATOR = False

    def __init__(self, board: Board, run: str, config: PublisherConfig, shard: int) -> None:
        self.board, self.run, self.config, self.shard = board, run, config, shard
        self.prev: Any = None  # View (host path), or DeviceView (device path)
        self.prev_version: int | None = None
        self._whole_prev = False  # prev is the whole resumed view, not yet cut to this shard
        self._acc: Accumulators = {}
        #: (version, step patch) that :meth:`commit` left for :meth:`settle` to compose into
        #: the accumulators (``settle_later``); the next :meth:`build` settles first.
        self._later: tuple[int, Patch | None] | None = None
        self.settle_later = False
        #: The host path's fold: (anchor version, its view, whether it is the whole resumed
        #: view, not yet cut to this shard).
        self._anchor: tuple[int, Any, bool] | None = None
        #: The base view of the next version's skip patch, rebuilt by :meth:`settle` (host
        #: path, ``settle_later``): the build codes the skip patch from it (skipbase.py).
        self._rewound: RewoundBase | None = None
        #: Where this rank's sliced tensors lie (fixed for a run; the writer sets it).
        self.slices: Mapping[str, SliceSpec] = {}

    def resume(self, version: int, whole_view: View, *, sharded: bool) -> None:
        """Continue after ``version``, whose whole (all shards) view is ``whole_view``;
        ``sharded``: this rank publishes a shard of it, so the view is cut to the shard's names
        (an unsharded publisher's base is all of it: a tensor the trainer no longer has is a
        drop, as within one publisher's life, not a name left out of the base)."""
        self.prev, self.prev_version, self._whole_prev = whole_view, version, sharded
        self._acc = {s: (version, None) for s in self.config.skip_strides if version % s == 0}
        self._later = None
        self._anchor = None
        self._rewound = None
        if self.config.is_anchor(version):
            if self.FOLD_BY_ACCUMULATOR:
                self._acc[FOLD] = (version, None)
            else:
                self._anchor = (version, whole_view, sharded)

    def build(self, version: int, masters: Mapping[str, Any], *, keyframe: bool) -> ShardResult:
        """Cast, diff, encode and upload this shard's objects for ``version``; the masters
        named in ``self.slices`` are element ranges of larger tensors (their digest parts
        are computed here and counted in ``cast_s``)."""
        self.settle()
        cfg = self.config
        t = time.perf_counter()
        view = (
            masters  # cast when snapshotted (PublisherConfig.snapshot="served")
            if isinstance(masters, View)
            else cast_view(
                masters, cfg.format, policy=cfg.policy, scales=cfg.scales, previous=self.prev
            )
        )
        if cfg.nonfinite == "refuse":
            check_finite(view, run=self.run, version=version)
        if cfg.model_changes == "refuse":
            base = self._base_view(view)
            check_same_model(base, view, run=self.run, version=version, whole=self._whole_prev)
        res = ShardResult(version, view)
        res.resumed = self.resumed_names()
        if self.slices:
            check_sliceable(view, self.slices, cfg.format)
            res.slices = {k: slice_part(view[k], s) for k, s in self.slices.items()}
        res.timings["cast_s"] = _lap(t)
        t = time.perf_counter()
        prev = self._base_view(view)
        blobs: list[tuple[int | None, str, bytes]] = []
        step: Patch | None = None
        if (
            prev is not None
            and self.prev_version is not None
            and not cfg.skip_strides
            and native.core is not None
        ):
            # no skip patch to compose: one fused pass, no decoded patch held
            res.timings["diff_s"] = _lap(t)
            t = time.perf_counter()
            blob = encode_views(prev, view, meta=self._meta(self.prev_version, version))
            blobs.append((self.prev_version, "rpatch", blob))
            res.patch_bytes, res.changed = len(blob), inspect(blob).n_changed
        elif prev is not None and self.prev_version is not None and native.core is not None:
            # the step patch kept for the skip accumulators comes out of the same fused pass
            # that encodes it (no second compare): byte for byte encode(diff(prev, view), prev)
            res.timings["diff_s"] = _lap(t)
            t = time.perf_counter()
            meta = self._meta(self.prev_version, version)
            if has_step(view, prev):  # the snapshot's cast listed the step's changes
                blob = encode_views(prev, view, meta=meta)
                step = step_patch(prev, view, inspect(blob), meta)
            else:
                blob, step = encode_views_patch(prev, view, meta=meta)
            blobs.append((self.prev_version, "rpatch", blob))
            res.patch_bytes, res.changed = len(blob), step.n_changed
        else:
            step = None if prev is None else diff(prev, view)
            res.timings["diff_s"] = _lap(t)
            t = time.perf_counter()
            if step is not None and prev is not None and self.prev_version is not None:
                meta = self._meta(self.prev_version, version)
                blob = encode(self._with_meta(step, self.prev_version, version), prev)
                blobs.append((self.prev_version, "rpatch", blob))
                res.patch_bytes, res.changed = len(blob), step.n_changed
        skips: list[tuple[int, Patch | None]] = []
        rebuilt = self._rebuilt_base(view)
        if self._skip_due(version):
            res.accumulators, skips = self._advance_accumulators(
                version, step, rebuilt=None if rebuilt is None else rebuilt.base
            )
        else:  # composing into the accumulators waits until the version is published
            res.deferred = (step,)
        fold = self._fold_blob(view, version)
        if fold is not None:
            blobs.append((fold[0], "rpatch", fold[1]))
        for skip_base, composed in skips:
            if fold is not None and skip_base == fold[0]:
                continue  # the folded patch is this skip patch, byte for byte
            if composed is None:  # the base's view was rebuilt ahead, not composed
                assert rebuilt is not None and rebuilt.base == skip_base
                meta = self._meta(skip_base, version)
                blobs.append((skip_base, "rpatch", encode_views(rebuilt.view, view, meta=meta)))
                continue
            skip_blob = self._skip_blob(composed, view, skip_base, version)
            if skip_blob is not None:
                blobs.append((skip_base, "rpatch", skip_blob))
        res.timings["encode_s"] = _lap(t)
        self._upload(res, blobs)
        if keyframe:  # streamed tensor by tensor: never serialized whole in memory
            t = time.perf_counter()
            res.keyframe = self.board.put_view_object(self.run, view)
            res.bytes += res.keyframe.size
            res.timings["upload_s"] += _lap(t)
        return res

    def _upload(self, res: ShardResult, blobs: list[tuple[int | None, str, bytes]]) -> None:
        """Put the version's objects (patches by base; base None: the keyframe)."""
        t = time.perf_counter()
        for base, suffix, data in blobs:
            if base is not None:  # the digests it binds, for rank 0's check of the manifest
                head = inspect(data)
                res.binds[base] = (head.base, head.target)
                if base == self.prev_version:  # the step patch: what it does not patch
                    ops = [e["op"] for e in head.tensors]
                    res.dropped, res.whole = ops.count("drop"), ops.count("full")
            ref = self.board.put_object(self.run, data, suffix)
            res.bytes += len(data)
            if base is None:
                res.keyframe = ref
            else:
                res.patches.append((base, ref))
        res.timings["upload_s"] = _lap(t)

    def commit(self, res: ShardResult) -> None:
        """The version is durable: its view becomes the base of the next one (and its step
        patch is composed into the skip accumulators, if ``build`` left that for now: here,
        or with ``settle_later`` by :meth:`settle`, once readers are done with the version)."""
        if res.deferred is not None:
            self._later, res.deferred = (res.version, res.deferred[0]), None
        else:
            self._acc = res.accumulators
        self.prev, self.prev_version, self._whole_prev = res.view, res.version, False
        self._rewound = None  # rebuilt from the view before: the next settle rebuilds
        if not self.settle_later:
            self.settle()
        cfg = self.config
        if self.FOLD_BY_ACCUMULATOR:
            pass  # the fold is the accumulators'
        elif cfg.is_anchor(res.version):
            self._anchor = (res.version, res.view, False)
        elif self._anchor is not None and self._anchor[0] != cfg.anchor_below(res.version + 1):
            self._anchor = None  # an anchor was dropped: no fold until the next one

    @property
    def unsettled(self) -> bool:
        """Whether :meth:`commit` left a step patch for :meth:`settle`."""
        return self._later is not None

    def settle(self) -> None:
        """Compose the step patch :meth:`commit` left into the skip accumulators (the same
        accumulators as composing it there: only the skip patches depend on the previous
        version, and a deferred step has none; the host path's fold is encoded from the
        anchor's view, not composed)."""
        if self._later is not None:
            version, step = self._later
            self._acc, _ = self._advance_accumulators(version, step)
            try:
                self._rebuild_base()
            finally:  # unsettled until the rebuilt base is in place (composed once either way)
                self._later = None

    # -- helpers -----------------------------------------------------------------------------

    def _fold_blob(self, view: View, version: int) -> tuple[int, bytes] | None:
        """The folded patch (anchor, bytes) ``version`` gets: one fused pass over the
        anchor's view and ``view`` (``encode(diff(anchor, view), anchor)``, byte for byte),
        when the anchor below ``version`` is the held one and not the parent, and the two
        views hold the same tensors (as skip patches: the device path's accumulator cannot
        rewind an added or reshaped tensor, and both paths publish the same bytes)."""
        if self._anchor is None or self.prev_version is None:
            return None
        a, held, whole = self._anchor
        if a != self.config.anchor_below(version) or a == self.prev_version:
            return None
        base = held
        if whole:  # cut once: its digests are then cached for the rest of the window
            base = self._cut(held, view)
            self._anchor = (a, base, False)
        if not same_layout(base, view):
            return None  # a tensor was added, dropped or reshaped: step patches only
        meta = self._meta(a, version)
        if native.core is not None:
            return a, encode_views(base, view, meta=meta)
        return a, encode(self._with_meta(diff(base, view), a, version), base)

    def resumed_names(self) -> list[str] | None:
        """The names of the whole view a sharded rank resumed on, until its first version
        after the resume is committed (None otherwise)."""
        return sorted(self.prev) if self._whole_prev and self.prev is not None else None

    def _base_view(self, view: View) -> View | None:
        """The previous view of this shard (a resumed whole view cut to this shard's names,
        and its sliced tensors to this shard's ranges, zero-copy)."""
        if self.prev is None or not self._whole_prev:
            return self.prev
        return self._cut(self.prev, view)

    def _cut(self, prev: View, view: View) -> View:
        """A whole (all shards) view cut to the names and slices of this shard's ``view``."""
        return View(
            {
                k: cut(prev[k], self.slices[k]) if self._is_whole(prev, k) else prev[k]
                for k in view
                if k in prev
            },
            prev.metadata,
        )

    def _is_whole(self, prev: View, name: str) -> bool:
        """``prev[name]`` is the whole tensor of a slice this rank holds (a whole resume)."""
        spec = self.slices.get(name)
        return spec is not None and prev[name].shape == spec.shape != spec.local_shape

    def _meta(self, base: int, version: int) -> dict[str, str]:
        return {"run": self.run, "from": str(base), "to": str(version), "shard": str(self.shard)}

    def _with_meta(self, p: Patch, base: int, version: int) -> Patch:
        return Patch(p.base, p.target, p.tensors, self._meta(base, version))

    def _skip_due(self, version: int) -> bool:
        """Whether ``version`` gets a skip patch (:meth:`_advance_accumulators`'s rule; the
        host path's fold is :meth:`_fold_blob`'s)."""
        for s in self.config.skip_strides:
            entry = self._acc.get(s)
            if entry is not None and version - s == entry[0] and entry[0] != self.prev_version:
                return True
        return False

    def _advance_accumulators(
        self, version: int, step: Patch | None, *, rebuilt: int | None = None
    ) -> tuple[Accumulators, list[tuple[int, Patch | None]]]:
        """The accumulators after ``version`` and the skip and folded patches (base,
        composed) it gets (one per base: a fold landing on a skip stride's base is that skip
        patch). A step that does not chain onto an accumulator (a dropped or failed version
        left it behind) ends that accumulator until its next base: a patch is never composed
        over a gap. With :attr:`FOLD_BY_ACCUMULATOR`, also the fold's accumulator, whose base
        is always the anchor below
        ``version``: one the publisher skipped (a dropped version) ends it until the next.
        ``rebuilt``: a skip base whose view :meth:`_rebuilt_base` holds (rebuilt from the
        previous view, which ``step`` starts at): its skip patch is listed with None, not
        composed (its accumulator ends at ``version`` anyway)."""
        new: Accumulators = {}
        skips: dict[int, Patch | None] = {}
        cfg = self.config
        below = cfg.anchor_below(version) if cfg.fold_every else -1
        fold = self.FOLD_BY_ACCUMULATOR and cfg.fold_every
        for s in (*cfg.skip_strides, *((FOLD,) if fold else ())):
            entry = self._acc.get(s)
            if entry is not None and step is not None:
                base, acc = entry
                due = version - s == base if s != FOLD else base == below
                ahead = s != FOLD and due and base == rebuilt != self.prev_version
                composed = None if ahead else _chained(acc, step)  # ahead: not kept (due)
                if ahead:
                    skips.setdefault(base, None)
                elif composed is not None and due and base != self.prev_version:
                    skips.setdefault(base, composed)
                if composed is not None and (version < base + s if s != FOLD else due):
                    new[s] = (base, composed)
            if (version % s == 0) if s != FOLD else cfg.is_anchor(version):
                new[s] = (version, None)
        return new, sorted(skips.items(), key=lambda kv: kv[0])

    def _rebuild_base(self) -> None:
        """After settling: rebuild the base view of the next version's skip patch, when only
        the worker's idle time pays for it (``settle_later``; host path, no slices, the
        native encoder: :func:`~rollpatch.publisher.skipbase.rebuild_ahead`)."""
        self._rewound = None
        prev, pv = self.prev, self.prev_version
        if (
            self.settle_later
            and native.core is not None
            and isinstance(prev, View)
            and pv is not None
            and not self._whole_prev
            and not self.slices
        ):
            anchor = None if self._anchor is None else self._anchor[0]  # a fold covers it
            due = [(s, *e) for s, e in self._acc.items() if s != FOLD and e[0] != anchor]
            self._rewound = rebuild_ahead(prev, pv, due)

    def _rebuilt_base(self, view: Any) -> RewoundBase | None:
        """:attr:`_rewound` when it was rebuilt from the current previous view and ``view``
        (the version being built) has its layout; else None (the build composes)."""
        r = self._rewound
        if r is not None and r.fits(self.prev, self.prev_version, view):
            return r
        return None

    def _skip_blob(self, composed: Patch, view: View, base: int, version: int) -> bytes | None:
        """The encoded skip (or folded) patch, against the view of ``base`` rewound from
        ``view`` (:func:`~rollpatch.publisher.skipbase.rewind`), then one fused native pass
        over the rewound and the current view (``encode_views``: byte for byte
        ``encode(composed, rewound)``, 2-3x faster at 100M); without the native core,
        ``encode``."""
        old = rewind(view, composed, version=version, base=base)
        if old is None:  # a tensor was added, dropped or reshaped: step patches only
            return None
        if native.core is None or composed.digest != "rp.sum128.v1":  # encode_views: sum128
            return encode(self._with_meta(composed, base, version), old)
        return encode_views(old, view, meta=self._meta(base, version))


def _chained(acc: Patch | None, step: Patch) -> Patch | None:
    """``step`` composed after ``acc`` (None: they do not chain)."""
    try:
        return step if acc is None else compose(acc, step)
    except PatchError:
        return None


def _lap(t: float) -> float:
    return time.perf_counter() - t
