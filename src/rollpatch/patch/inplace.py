"""Decode and apply an encoded patch in one pass: ``apply_encoded(view, blob)``.

The same checks and result as ``apply(view, decode(blob, view))``, bit for bit and error for
error class, but each rp.ctxgolomb.v2 chunk is written into the view right after the native
decoder read it from there, while its words are still in cache, and no second pass checks
the old elements (the decoder took them from the very words it overwrites). Unless
``incremental``, the re-hash of each touched tensor happens in that same pass (every word
summed as read, plus the change written: docs/patch-format.md §9). On several threads all
tensors' v2 deltas are decoded and written at once. Every other op and codec goes through
:func:`decode` and :func:`apply`'s writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from .. import native
from ..errors import BaseMismatchError, PatchDecodeError, RollpatchError
from ..kinds import KINDS
from ..view import Tensor, View
from .codec_v2 import CtxGolombV2
from .model import DeltaOp, TensorPatch
from .ops import InPlaceDelta, scatter, write_verified
from .wire import MIN_FULL_BOUND, decode_entry, inspect

__all__ = ["apply_encoded"]

_V2 = CtxGolombV2()


@dataclass
class _FusedDelta:
    """One rp.ctxgolomb.v2 delta, decoded straight into its tensor (ops.InPlaceDelta)."""

    name: str
    base_digest: str | None
    target_digest: str | None
    payload: memoryview
    changed: int
    hashed: bool = False
    state_after: tuple[int, int] | None = None

    def write(self, t: Tensor) -> tuple[TensorPatch, tuple[int, int] | None]:
        try:
            if self.hashed:
                pos, old, new, change, self.state_after = _V2.decode_into_hashed(
                    self.payload, t, self.changed, self.out
                )
            else:
                pos, old, new, change = _V2.decode_into(self.payload, t, self.changed, self.out)
        except RollpatchError as err:
            err.context.setdefault("tensor", self.name)
            raise
        tp = TensorPatch(
            self.name, t.kind, t.shape, self.base_digest, self.target_digest, DeltaOp(pos, old, new)
        )
        self.result = (tp, change)
        return tp, change

    result: tuple[TensorPatch, tuple[int, int] | None] | None = None
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
        assert self.item.result is not None
        self.item.consumed = True
        return self.item.result


def _write_concurrently(view: View, fused: list[_FusedDelta]) -> None:
    """Decode and write several tensors' deltas at once on ``native.threads()`` threads (the
    core drops the GIL; each tensor's chunk ranges run inline on its thread). All or
    nothing: on any failure every tensor written here is put back and the first failure, in
    header order, is raised."""

    def one(item: _FusedDelta) -> BaseException | None:
        try:
            item.write(view[item.name])
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the undo
            return e
        return None

    errors = native.parallel_map(one, fused)
    failed = [e for e in errors if e is not None]
    if failed:
        _undo_unconsumed(view, fused)
        raise failed[0]


def _share_outputs(view: View, fused: list[_FusedDelta]) -> None:
    """Give the fused deltas slices of one position array and one old and one new array per
    element type, instead of three new arrays each.

    Why: every tensor's outputs are held until the patch is verified (the undo), then all
    are freed together and glibc hands their pages back, so per-tensor arrays (0.1-1 MB
    each, ~110 tensors at 100M) are fresh pages on every apply: bf16 lr 1e-5 took ~16k minor
    faults per apply in them. One large array per kind is a few huge pages (numpy advises
    huge pages for arrays of 4 MiB and more). The memory held is the same: the sum of the
    tensors' counts. A count beyond its tensor's size is left out, for the decoder's own
    check (the same error as before, and nothing allocated for it first).
    """
    ok = [x for x in fused if type(x.changed) is int and 0 <= x.changed <= view[x.name].n_elements]
    if len(ok) < 2:
        return
    pos = np.empty(sum(x.changed for x in ok), dtype=np.int64)
    kinds: dict[np.dtype[Any], list[_FusedDelta]] = {}
    for x in ok:
        kinds.setdefault(np.dtype(view[x.name].kind.elem_dtype), []).append(x)
    p = 0
    for dt, xs in kinds.items():
        n = sum(x.changed for x in xs)
        old, new = np.empty(n, dtype=dt), np.empty(n, dtype=dt)
        e = 0
        for x in xs:
            k = x.changed
            x.out = (pos[p : p + k], old[e : e + k], new[e : e + k])
            p += k
            e += k


def _undo_unconsumed(view: View, fused: list[_FusedDelta]) -> None:
    """Put back the tensors written ahead whose undo ``write_verified`` does not own."""
    for item in fused:
        if item.result is not None and not item.consumed:
            ch = item.result[0].change
            assert isinstance(ch, DeltaOp)
            scatter(view[item.name], ch.positions, ch.old)
            item.result = None


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
    items: list[TensorPatch | InPlaceDelta] = []
    for e in header.tensors:
        _check_entry(view, e, algo)
        start = header.payload_start + e["offset"]
        payload = mv[start : start + e["length"]]
        if blake3.blake3(payload).hexdigest() != e["b3"]:
            raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
        if e["op"] == "delta" and e["codec"] == _V2.codec_id and native.core is not None:
            items.append(
                _FusedDelta(
                    e["name"], e["base"], e["target"], payload, e["changed"], _V2.can_hash()
                )
            )
        else:
            items.append(decode_entry(e, payload, view, limit))
    fused = [x for x in items if isinstance(x, _FusedDelta)]
    _share_outputs(view, fused)
    if native.threads() > 1 and len(fused) > 1:
        for x in fused:
            x.hashed = x.hashed and not incremental
            if incremental:
                view.sum_state(x.name)  # the base's state, before the words change
        _write_concurrently(view, fused)
        items = [_Written.of(x) if isinstance(x, _FusedDelta) else x for x in items]
    try:
        write_verified(view, items, header.target, algo, incremental=incremental)
    except BaseException:
        _undo_unconsumed(view, fused)
        raise
    return view


def _check_entry(view: View, e: dict[str, Any], algo: Any) -> None:
    """What ``apply`` checks before writing, from the header alone."""
    name, op = e["name"], e["op"]
    if op in ("delta", "drop") and name not in view:
        raise BaseMismatchError("the view lacks a tensor the patch changes", tensor=name)
    if op == "delta":
        t = view[name]
        if t.kind != KINDS[e["kind"]] or t.shape != tuple(e["shape"]):
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
