"""Decode and apply an encoded patch in one pass: ``apply_encoded(view, blob)``.

The same checks and result as ``apply(view, decode(blob, view))``, bit for bit and error for
error class, but each rp.ctxgolomb.v2 chunk is written into the view right after the native
decoder read it from there, while its words are still in cache, and no second pass checks
the old elements (the decoder took them from the very words it overwrites). Unless
``incremental``, the re-hash of each touched tensor happens in that same pass (every word
summed as read, plus the change written: docs/patch-format.md §9). All tensors' v2 deltas
are decoded and written in one native call, on the core's own threads, before the checks.
Every other op and codec goes through :func:`decode` and :func:`apply`'s writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from .. import native
from ..errors import BaseMismatchError, PatchDecodeError, RollpatchError
from ..kinds import KINDS
from ..view import DigestAlgo, Tensor, View, sum_add
from . import spare
from .codec_v2 import CHUNK, CtxGolombV2, job_step
from .model import DeltaOp, TensorPatch
from .ops import InPlaceDelta, check_targets, scatter, write_verified
from .unwire import decode_entry
from .wire import MIN_FULL_BOUND, inspect

__all__ = ["apply_encoded"]

_V2 = CtxGolombV2()


@dataclass
class _FusedDelta:
    """One rp.ctxgolomb.v2 delta, to be decoded straight into its tensor by
    :func:`_write_concurrently` (which sets ``result`` and, hashed, ``state_after``)."""

    name: str
    base_digest: str | None
    target_digest: str | None
    payload: memoryview
    changed: int
    hashed: bool = False
    state_after: tuple[int, int] | None = None

    change: tuple[int, int] | None = None  # the rp.sum128 change written; None: not written
    consumed: bool = False
    out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # _share_outputs


@dataclass
class _Written:
    """A fused delta already written by :func:`_write_concurrently` (ops.InPlaceDelta):
    ``write`` hands its result to ``write_verified``, which then owns its undo."""

    item: _FusedDelta
    name: str
    base_digest: str | None
    target_digest: str | None
    hashed: bool
    state_after: tuple[int, int] | None

    @classmethod
    def of(cls, x: _FusedDelta) -> _Written:
        return cls(x, x.name, x.base_digest, x.target_digest, x.hashed, x.state_after)

    def write(self, t: Tensor) -> tuple[TensorPatch, tuple[int, int] | None]:
        x = self.item
        assert x.out is not None and x.change is not None
        x.consumed = True
        tp = TensorPatch(x.name, t.kind, t.shape, x.base_digest, x.target_digest, DeltaOp(*x.out))
        return tp, x.change


def _write_concurrently(view: View, fused: list[_FusedDelta], hashed: bool) -> None:
    """Decode and write every fused delta in one native call (``core.decode_apply_view``):
    each tensor's chunk table and chunk counts checked against its header count, then every
    (tensor, range of ``job_step`` chunks) one job, largest first, on the core's own
    ``native.threads()`` threads (the GIL released once; no Python per job or per chunk, and
    each table parsed once). All or nothing: on any failure nothing stays written and the
    first failure in header order is raised, with its tensor named."""
    core = native.require()
    nt = native.threads()
    tensors: list[tuple[Any, ...]] = []
    for x in fused:
        t = view[x.name]
        n = t.n_elements
        if x.out is None:  # header counts are bounded by the tensor's size (inspect)
            dt = t.kind.elem_dtype
            x.out = (
                np.empty(x.changed, np.int64),
                np.empty(x.changed, dt),
                np.empty(x.changed, dt),
            )
        kt = native.kind_tuple(t.kind, n)
        step = job_step(-(-n // CHUNK), nt)
        tensors.append((kt, t.data, x.payload, x.changed, step, *x.out))
    failed = np.full(1, -1, dtype=np.int64)
    try:
        results = core.decode_apply_view(tensors, nt, hashed, failed)
    except RollpatchError as err:
        if failed[0] >= 0:
            err.context.setdefault("tensor", fused[int(failed[0])].name)
            err.context.setdefault("codec", _V2.codec_id)
        raise
    for x, (d0, d1, s0, s1) in zip(fused, results, strict=True):
        x.change = (d0, d1)
        if x.hashed:
            x.state_after = sum_add((s0, s1), (d0, d1))


def _share_outputs(view: View, fused: list[_FusedDelta]) -> spare.Arrays:
    """Give the fused deltas slices of one position array and one old and one new array per
    element type, instead of three new arrays each, taken from :mod:`.spare` (the arrays of
    the last verified apply, when they fit: no fresh pages); returns the arrays, for
    ``spare.give`` once the patch is verified.

    Why: every tensor's outputs are held until the patch is verified (the undo), then all
    are freed together and glibc hands their pages back, so per-tensor arrays (0.1-1 MB
    each, ~110 tensors at 100M) are fresh pages on every apply: bf16 lr 1e-5 took ~16k minor
    faults per apply in them. One large array per kind is a few huge pages (numpy advises
    huge pages for arrays of 4 MiB and more), and a kept one none. A count beyond its
    tensor's size is left out, for the decoder's own check (the same error as before, and
    nothing allocated for it first).
    """
    ok = [x for x in fused if type(x.changed) is int and 0 <= x.changed <= view[x.name].n_elements]
    if not ok:
        return {}
    kinds: dict[np.dtype[Any], list[_FusedDelta]] = {}
    for x in ok:
        kinds.setdefault(np.dtype(view[x.name].kind.elem_dtype), []).append(x)
    sizes: dict[Any, tuple[np.dtype[Any], int]] = {
        "pos": (np.dtype(np.int64), sum(x.changed for x in ok))
    }
    for dt, xs in kinds.items():
        n = sum(x.changed for x in xs)
        sizes[(dt, 0)] = sizes[(dt, 1)] = (dt, n)
    arrays = spare.take(sizes)
    pos = arrays["pos"]
    p = 0
    for dt, xs in kinds.items():
        old, new = arrays[(dt, 0)], arrays[(dt, 1)]
        e = 0
        for x in xs:
            k = x.changed
            x.out = (pos[p : p + k], old[e : e + k], new[e : e + k])
            p += k
            e += k
    return arrays


def _undo_unconsumed(view: View, fused: list[_FusedDelta]) -> None:
    """Put back the tensors written ahead whose undo ``write_verified`` does not own."""
    for item in fused:
        if item.change is not None and not item.consumed:
            assert item.out is not None
            pos, old, _ = item.out
            scatter(view[item.name], pos, old)
            item.change = None


def _verify_written(view: View, fused: list[_FusedDelta], target: str, algo: DigestAlgo) -> None:
    """What ``write_verified`` does after its writes, for a patch of v2 deltas only, all
    written by :func:`_write_concurrently`: each tensor's new rp.sum128 state (hashed in the
    pass, or with ``incremental`` the base's plus the change), then every target digest and
    the root (``check_targets``); on any error every tensor is put back, with its base's
    state and digest. Why not ``write_verified`` itself: its per-item undo records and
    TensorPatch objects cost ~5 us a tensor of serial Python, for what is here one state
    update and one digest per tensor."""
    before: list[tuple[int, int] | None] = []
    try:
        for x in fused:
            st = view.cached_sum_state(x.name)  # apply_encoded hashed every base it checked
            before.append(st)
            if x.hashed and x.state_after is not None:
                view.update_sum_state(x.name, x.state_after)
            else:
                assert st is not None and x.change is not None
                view.update_sum_state(x.name, sum_add(st, x.change))
        check_targets(view, ((x.name, x.target_digest) for x in fused), target, algo)
    except BaseException:
        _undo_unconsumed(view, fused)
        for x, st in zip(fused, before):  # the tensors whose state was updated
            if st is None:
                view.invalidate(x.name)
            else:
                view.update_sum_state(x.name, st)
            if x.base_digest is not None:  # the digest _check_entry found
                view.set_digest(x.name, x.base_digest, algo)
        raise


def apply_encoded(
    view: View,
    blob: bytes | memoryview,
    *,
    incremental: bool = False,
    max_full_bytes: int | None = None,
) -> View:
    """Decode ``blob`` against ``view`` and apply it in place; returns the view.

    ``incremental`` as in :func:`rollpatch.patch.apply`. ``max_full_bytes`` as in
    :func:`rollpatch.patch.decode`. All or nothing: on any error the view keeps its words.
    """
    header = inspect(blob)
    algo = header.digest
    if view.digest(algo) != header.base:
        raise BaseMismatchError(
            "the view is not this patch's base",
            expected=header.base[:16],
            actual=view.digest(algo)[:16],
        )
    limit = max(MIN_FULL_BOUND, view.nbytes) if max_full_bytes is None else max_full_bytes
    mv = memoryview(blob)
    # the in-pass re-hash gives rp.sum128 states, and an incremental apply keeps the sums
    hashed = _V2.can_hash() and not incremental and algo == "rp.sum128.v1"
    items: list[TensorPatch | _FusedDelta] = []
    for e in header.tensors:
        _check_entry(view, e, algo)
        start = header.payload_start + e["offset"]
        payload = mv[start : start + e["length"]]
        if blake3.blake3(payload).hexdigest() != e["b3"]:
            raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
        if e["op"] == "delta" and e["codec"] == _V2.codec_id and native.core is not None:
            items.append(
                _FusedDelta(e["name"], e["base"], e["target"], payload, e["changed"], hashed)
            )
        else:
            items.append(decode_entry(e, payload, view, limit))
    fused = [x for x in items if isinstance(x, _FusedDelta)]
    outputs = _share_outputs(view, fused)
    if incremental:
        for x in fused:
            view.sum_state(x.name)  # the base's state, before the words change
    if fused:
        _write_concurrently(view, fused, hashed)
    if len(fused) == len(items) and (hashed or incremental):
        _verify_written(view, fused, header.target, algo)
        spare.give(outputs)
        return view
    written: list[TensorPatch | InPlaceDelta] = [
        _Written.of(x) if isinstance(x, _FusedDelta) else x for x in items
    ]
    try:
        write_verified(view, written, header.target, algo, incremental=incremental)
    except BaseException:
        _undo_unconsumed(view, fused)
        raise
    spare.give(outputs)  # nothing holds them now: write_verified's records are gone
    return view


def _check_entry(view: View, e: dict[str, Any], algo: Any) -> None:
    """What ``apply`` checks before writing, from the header alone."""
    name, op = e["name"], e["op"]
    if op in ("delta", "drop") and name not in view:
        raise BaseMismatchError("the view lacks a tensor the patch changes", tensor=name)
    if op == "delta":
        t, kind = view[name], KINDS[e["kind"]]
        if (t.kind is not kind and t.kind != kind) or t.shape != tuple(e["shape"]):
            raise BaseMismatchError(
                "base tensor layout differs from the patch",
                tensor=name,
                kind=t.kind.name,
                shape=t.shape,
            )
    if op == "full" and e["base"] is None and name in view:
        raise BaseMismatchError("the patch adds a tensor the view already has", tensor=name)
    if name in view and e["base"] is not None and view.tensor_digest(name, algo) != e["base"]:
        raise BaseMismatchError(
            "tensor is not the patch's base",
            tensor=name,
            hint="the engine is on another version; plan a new path",
        )
