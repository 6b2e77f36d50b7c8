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
from ..view import Tensor, View, sum_add
from .codec_v2 import CHUNK, CtxGolombV2, job_ranges
from .model import DeltaOp, TensorPatch
from .ops import InPlaceDelta, scatter, write_verified
from .wire import MIN_FULL_BOUND, decode_entry, inspect

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


def _write_concurrently(view: View, fused: list[_FusedDelta], hashed: bool) -> None:
    """Decode and write every fused delta in one native call: each (tensor, range of chunks)
    is a job, largest first, on the core's own ``native.threads()`` threads
    (``core.decode_apply_jobs``: the GIL released once, no Python per job or per tensor on
    the workers). All or nothing: on any failure nothing stays written and the first failure
    in header order is raised, with its tensor named."""
    core = native.require()
    nt = native.threads()
    tensors: list[tuple[Any, ...]] = []
    jobs: list[tuple[int, int, int, int]] = []  # (elements, tensor, first chunk, last chunk)
    prep: BaseException | None = None
    for i, x in enumerate(fused):
        t = view[x.name]
        try:
            _, kt, counts, offs, pos, old, new = _V2._outputs(x.payload, t, x.changed, x.out)
        except RollpatchError as err:  # raised after the tensors before it are decoded
            err.context.setdefault("tensor", x.name)
            prep = err
            break
        x.out = (pos, old, new)
        tensors.append((kt, t.data, x.payload, counts, offs, pos, old, new))
        n = t.n_elements
        for c0, c1 in job_ranges(len(counts), nt):
            jobs.append((min(c1 * CHUNK, n) - c0 * CHUNK, i, c0, c1))
    jobs.sort(reverse=True)
    failed = np.full(1, -1, dtype=np.int64)
    try:
        results = (
            core.decode_apply_jobs(tensors, [j[1:] for j in jobs], nt, hashed, failed)
            if jobs
            else []
        )
    except RollpatchError as err:
        if failed[0] >= 0:
            err.context.setdefault("tensor", fused[jobs[int(failed[0])][1]].name)
        raise
    sums: list[list[tuple[int, int]]] = [[(0, 0), (0, 0)] for _ in tensors]
    for job, res in zip(jobs, results, strict=True):
        acc = sums[job[1]]
        acc[0] = sum_add(acc[0], (res[0], res[1]))
        acc[1] = sum_add(acc[1], (res[2], res[3]))
    for x, (change, state) in zip(fused, sums):  # tensors past a failed one are not in sums
        assert x.out is not None
        pos, old, new = x.out
        t = view[x.name]
        tp = TensorPatch(
            x.name, t.kind, t.shape, x.base_digest, x.target_digest, DeltaOp(pos, old, new)
        )
        x.result = (tp, change)
        if x.hashed:
            x.state_after = sum_add(state, change)
    if prep is not None:
        _undo_unconsumed(view, fused)
        raise prep


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
    _share_outputs(view, fused)
    if incremental:
        for x in fused:
            view.sum_state(x.name)  # the base's state, before the words change
    if fused:
        _write_concurrently(view, fused, hashed)
    written: list[TensorPatch | InPlaceDelta] = [
        _Written.of(x) if isinstance(x, _FusedDelta) else x for x in items
    ]
    try:
        write_verified(view, written, header.target, algo, incremental=incremental)
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
