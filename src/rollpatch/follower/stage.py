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

Replaying one step (keyframe shards merged, shard patches decoded and bound to the manifests'
root digests) is :mod:`rollpatch.replay`, shared with the publisher's reconstruct. The
engine's apply then verifies the whole base before writing and the whole target after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor

from ..board import Board
from ..engines import EngineAdapter
from ..engines.fit import FitCheck, ModelTensors
from ..engines.staged import EncodedStep, StagedUpdate
from ..errors import NoPathError, ObjectIntegrityError, RollpatchError
from ..io.safetensors import read_entries_ranges
from ..manifest import Manifest
from ..patch import Patch, apply, compose
from ..patch.overlay import Overlay
from ..planning import Plan
from ..replay import decode_object, decode_step, encoded_step, keyframe_view
from ..types import ObjectRef
from ..view import View, WordSource

__all__ = [
    "EarlyDecode",
    "Stage",
    "anchor_evidence",
    "check_size",
    "decode_step",
    "encoded_step",
    "keyframe_view",
    "refused_hop",
    "stage_plan",
]


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

    def keyframe(
        self,
        m: Manifest,
        source: MutableMapping[str, bytes] | Callable[..., View],
        check: FitCheck | None = None,
    ) -> None:
        """Boot from the keyframe of ``m`` (``source``, ``check``: see :func:`keyframe_view`);
        earlier staged steps are discarded."""
        self.view = keyframe_view(m, source, check)
        self.patch = None

    def step(
        self,
        m: Manifest,
        base: Manifest,
        blobs: MutableMapping[str, bytes],
        early: Mapping[str, Patch] | None = None,
    ) -> None:
        """Stage the patch step ``base.version`` → ``m.version`` (``early``: its objects
        already decoded against the engine's words, by key)."""
        if self.view is not None:
            apply(self.view, decode_step(m, base, blobs, self.view))  # verified, in place
            return
        if self._words is None:
            raise NoPathError(
                "a patch step needs a loaded engine",
                run=m.run,
                version=m.version,
                hint="plan from a keyframe (have=None)",
            )
        if self.patch is None:
            self.patch = decode_step(m, base, blobs, self._words, early)
            return
        overlay = Overlay(self._words, self.patch)
        step = decode_step(m, base, blobs, overlay)
        self.copied_bytes += overlay.copied_bytes
        self.patch = compose(self.patch, step)


def stage_plan(
    engine: EngineAdapter,
    plan: Plan,
    manifests: Mapping[int, Manifest],
    blobs: MutableMapping[str, bytes],
    have: int | None,
    want: int,
    fetch_view: Callable[..., View],
    early: Mapping[str, Patch] | None = None,
    model: ModelTensors | None = None,
) -> Callable[[], None]:
    """Stage every step of ``plan`` (fetched ``blobs``; keyframe shards read through
    ``fetch_view`` and checked against ``model``, the engine's tensors as the caller read
    them before fetching, else read here) and return the write that commits ``want`` into
    ``engine``.

    A chain of patches over a loaded engine is handed to the engine encoded first
    (``stage_encoded``: an engine that decodes in its own workers takes it); otherwise it is
    decoded here (:class:`Stage`) and staged as one patch, or booted as a view. The write
    holds no reference to ``blobs``, so the caller can free them before committing.

    A plan that starts at a rewind source (:attr:`Plan.rewinds`) can only be staged by the
    engine (``stage_encoded`` rebuilds that version's words): when it does not take it, a
    :class:`NoPathError` says so (the caller plans again without rewind sources); nothing
    is written either way.
    """
    staged: StagedUpdate | None = None
    encodable = have is not None and all(
        s.base is not None and not manifests[s.to].sliced for s in plan.steps
    )
    if plan.rewinds and not encodable:
        raise NoPathError("a rewind plan needs an engine that decodes it", run=plan.run)
    # sliced versions (manifest schema 2) are decoded here, against cuts of the engine's words
    if encodable:
        staged = engine.stage_encoded(
            [
                EncodedStep(
                    tuple(encoded_step(manifests[s.to], manifests[s.base], blobs)),
                    manifests[s.base].target,
                    manifests[s.to].target,
                )
                for s in plan.steps
                if s.base is not None
            ],
            want,
        )
    stage = Stage(None)
    if staged is None and plan.rewinds:
        raise NoPathError("the engine did not stage the rewind plan", run=plan.run)
    if staged is None:
        stage = Stage(engine.words() if have is not None else None)
        for step in plan.steps:
            if step.base is None:  # the engine's tensors checked from the keyframe's headers
                held = model if model is not None else engine.model_tensors()
                m = manifests[step.to]
                fit = None
                if held is not None:
                    fit = FitCheck(
                        held, engine=engine.name, run=plan.run, version=step.to, fmt=m.format
                    )
                stage.keyframe(m, fetch_view, fit)
            else:
                stage.step(manifests[step.to], manifests[step.base], blobs, early)
        if stage.patch is not None:
            staged = engine.stage(stage.patch, want)

    def write() -> None:
        if staged is not None:
            engine.commit_staged(staged, want)
        elif stage.view is not None:
            engine.load(stage.view, want)
        else:
            assert stage.patch is not None
            engine.apply(stage.patch, want)  # verifies base and target; all or nothing

    return write


def check_keyframe_fit(
    board: Board, engine: EngineAdapter, m: Manifest, model: ModelTensors | None
) -> None:
    """Before a keyframe boot fetches anything else (the patches after the keyframe): the
    keyframe's tensors against the engine's ``model``, from the sliced entries of the signed
    manifest and each shard's header (two ranged reads a shard).
    :class:`IncompatibleModelError` names the first difference; the keyframe read checks the
    same again (and the name sets) as it streams."""
    if model is None:
        return
    fit = FitCheck(model, engine=engine.name, run=m.run, version=m.version, fmt=m.format)
    for w in m.sliced:
        fit.tensor(w.name, w.dtype, tuple(w.shape))
    for k in sorted(m.keyframes, key=lambda k: k.shard):
        sliced = m.slices_of(k.shard)
        read = functools.partial(board.store.get_range, k.ref.key)
        try:
            entries = read_entries_ranges(read, k.ref.size)
        except RollpatchError:  # unreadable here: the verified read says what it is
            return
        for name, dtype, shape in entries:
            if name not in sliced:
                fit.tensor(name, dtype, shape)


def check_size(plan: Plan, limit: int | None) -> None:
    """Refuse a plan that would fetch more than ``limit`` bytes (``max_stage_bytes``)."""
    if limit is not None and plan.bytes > limit:
        raise NoPathError(
            "plan is larger than max_stage_bytes",
            run=plan.run,
            have=plan.have,
            want=plan.want,
            plan_bytes=plan.bytes,
            max_stage_bytes=limit,
        )


def anchor_evidence(m: Manifest) -> int | None:
    """The oldest base of ``m``'s patches not from its parent (a fold's anchor, or a skip
    patch's base, whichever is older), None if none: no later fold starts below it, so an
    engine's rewind records of older versions may go (:meth:`EngineAdapter.note_anchor`)."""
    bases = [p.base for p in m.patches if p.base != m.parent]
    return min(bases) if bases else None


def refused_hop(
    e: BaseException,
    engine: EngineAdapter,
    plan: Plan,
    manifests: Mapping[int, Manifest],
    have: int | None,
) -> ObjectIntegrityError | None:
    """What to raise when staging ``plan`` failed with ``e`` (a base or target mismatch, a
    patch binding other digests): for a one-hop plan over a skip or folded patch (not from
    the target's parent) while the engine still holds ``have`` verified, the object is what
    is wrong (a signed patch whose contents do not match its manifest), not the engine's
    bits: an :class:`ObjectIntegrityError` naming it, so the sync plans around it (the
    chain of steps) instead of rebooting from a keyframe, whose cheapest plan would take
    the same object again. None otherwise (the caller re-raises ``e``)."""
    if isinstance(e, ObjectIntegrityError) or have is None or len(plan.steps) != 1:
        return None
    hop = plan.steps[0]
    if hop.base != have or manifests[hop.to].parent == have or not hop.objects:
        return None
    if engine.version != have or engine.digest != manifests[have].target:
        return None
    return ObjectIntegrityError(
        "a skip or folded patch does not match its manifest; planning around it",
        key=hop.objects[0].key,
        run=plan.run,
        base=have,
        version=hop.to,
        cause=f"{type(e).__name__}: {e}",
    )


class EarlyDecode:
    """Decodes the shard objects of a one-step plan as they arrive, on one background thread,
    while the others are still being fetched (decode overlaps the fetch instead of following
    it). Only an optimisation: :func:`decode_step` still checks the base and binds the
    result, and an object whose early decode failed is decoded again there (and raises)."""

    def __init__(self, m: Manifest, base: int, words: WordSource) -> None:
        self._m, self._words = m, words
        self._objects = {po.ref.key: po for po in m.patches_from(base)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollpatch-decode")
        self._futures: dict[str, Future[Patch]] = {}

    @classmethod
    def for_plan(
        cls, engine: EngineAdapter, plan: Plan, manifests: Mapping[int, Manifest], have: int | None
    ) -> EarlyDecode | None:
        """One for a one-step patch plan of several shard objects that this process decodes
        (not an engine that decodes unsliced steps itself); else None."""
        if have is None or len(plan.steps) != 1 or plan.steps[0].base != have:
            return None  # (a rewind plan is decoded by the engine, against rebuilt words)
        m, base = manifests[plan.steps[0].to], plan.steps[0].base
        if len(m.patches_from(base)) < 2:
            return None
        if not m.sliced and type(engine).stage_encoded is not EngineAdapter.stage_encoded:
            return None
        return cls(m, base, engine.words())

    def arrived(self, ref: ObjectRef, blob: bytes) -> None:
        po = self._objects.get(ref.key)
        if po is not None:
            self._futures[ref.key] = self._pool.submit(
                decode_object, self._m, po, blob, self._words
            )

    def results(self) -> dict[str, Patch]:
        """The objects decoded so far (waits for the ones in progress)."""
        out: dict[str, Patch] = {}
        for key, f in list(self._futures.items()):
            try:
                out[key] = f.result()
            except Exception:  # noqa: BLE001, S112 (decoded again by decode_step, which raises)
                continue
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
