"""Decoding a patch at TP > 1, split between the ranks: each touched tensor by one rank.

The decoder reads every base word of a tensor it decodes (its contexts), and at TP > 1 a
rank holds only its block, so a rank that decodes a tensor needs the whole tensor first.
Were every rank to decode every tensor, each would gather every touched tensor (about the
model, at RL change rates) and spend the whole decode's CPU time: TP times the work and
(TP - 1) times the model over the group, per commit. :func:`decode_split` gives each tensor
one owner instead:

1. the owners: the ``delta`` entries of the patch's header, largest estimated cost first
   (elements + 16 × changes: the decoder's cost per change record is about 16 words' worth,
   docs/engines.md *What a catch-up costs*), each to the least loaded rank. Every rank
   computes the same plan from the header alone;
2. in rounds (each rank's *k*-th tensor in round *k*): every tensor of the round gathered to
   its owner (:meth:`.weights.RuntimeWeights.gather_to`; the others send their block), the
   owners decode theirs at the same time and keep the result (each rank holds at most one
   gathered tensor at a time);
3. each owner shares all its results at once (:meth:`.weights.RuntimeWeights.share`, one
   broadcast of a size every rank knows from the header): per tensor the positions, old
   and new words, O(changed), with the rp.sum128 change of the writes, measured over the
   words it decoded against in one native pass that also checks their old words
   (:func:`.sumchange.dry_change`); or the error it met, which every rank then raises at
   the same point (an owner that failed still joins every collective: none is left
   waiting).

So each rank decodes about 1/TP of the
patch; what crosses between ranks is the model once (to the owners) plus the change. Every
rank ends with the same decoded patch as a decode of its own would give, and stages it as
before (its own writes), the target digests proven from the owners' changes
(``stage_patch(vouched=)``) without gathering the tensors again: the proof used to read
every touched tensor through a second all-gather. ``full`` and ``drop`` entries,
and deltas over a tensor the chain itself made, need no gather: every rank decodes them.
Results travel between the ranks of one engine only, in the layout :func:`pack` writes.
"""

from __future__ import annotations

import functools
import json
import struct
import time
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np

from ... import errors
from ...errors import BaseMismatchError, EngineError, PatchDecodeError, RollpatchError
from ...kinds import KINDS
from ...patch import Patch, TensorPatch
from ...patch.header import inspect
from ...patch.model import DeltaOp, FullOp
from ...patch.overlay import Overlay
from ...patch.unwire import decode_entry
from ...view import Tensor, View
from ..sumchange import SumState, dry_change
from .weights import RuntimeWeights

__all__ = ["decode_split", "owners", "pack", "pack_error", "result_size", "unpack"]

#: A change record's decode cost in words' worth (fit: 27.8 ns per record, 1.68 per word).
CHANGE_COST = 16
#: Bytes an owner may use to share an error (result_size).
ERROR_ROOM = 2048
#: status (0 decoded, 1 error), position width, whether the rp.sum128 change is measured,
#: changes, the change (two lanes)
_HEAD = struct.Struct("<BBB5xQQQ")
_ERRORS: dict[str, type[RollpatchError]] = {
    c.__name__: c
    for c in (
        errors.PatchError,
        errors.PatchDecodeError,
        errors.CodecError,
        errors.BaseMismatchError,
        errors.TargetMismatchError,
        errors.ManifestError,
        errors.LimitError,
        errors.ViewError,
        errors.EngineError,
    )
}


def owners(entries: list[dict[str, Any]], tp: int) -> list[list[int]]:
    """Each rank's entries (indices into ``entries``), in the order it decodes them: the
    costliest first, each to the least loaded rank (ties: the lower rank)."""
    cost = [int(np.prod(e["shape"], dtype=np.int64)) + CHANGE_COST * e["changed"] for e in entries]
    load, plan = [0] * tp, [[] for _ in range(tp)]  # type: list[int], list[list[int]]
    for i in sorted(range(len(entries)), key=lambda i: (-cost[i], i)):
        r = min(range(tp), key=lambda r: (load[r], r))
        plan[r].append(i)
        load[r] += cost[i]
    return plan


def _width(n_elements: int) -> int:
    """Bytes per shared position: 4 where every position of the tensor fits."""
    return 8 if n_elements > 1 << 32 else 4


def _elements(e: dict[str, Any]) -> int:
    return int(np.prod(e["shape"], dtype=np.int64)) * (2 if KINDS[e["kind"]].packed else 1)


def result_size(e: dict[str, Any]) -> int:
    """The bytes an owner shares for header entry ``e``, known to every rank beforehand (one
    broadcast): its ``changed`` positions, old and new words, or room for an error."""
    ok = _HEAD.size + e["changed"] * (
        _width(_elements(e)) + 2 * KINDS[e["kind"]].elem_dtype.itemsize
    )
    return max(ok, _HEAD.size + ERROR_ROOM)


def pack(tp: TensorPatch, change: SumState | None) -> bytes:
    """A decoded delta and the rp.sum128 change of its writes (None: not measured) as the
    bytes its owner shares: head, positions (4 bytes each where the tensor's fit), old
    words, new words."""
    pos, old, new = tp.changes()
    p = pos.astype(np.int64 if _width(tp.n_elements) == 8 else np.uint32, copy=False)
    d0, d1 = change if change is not None else (0, 0)
    head = _HEAD.pack(0, p.itemsize, change is not None, pos.size, d0, d1)
    return b"".join((head, p.tobytes(), old.tobytes(), new.tobytes()))


def pack_error(err: BaseException, rank: int) -> bytes:
    """An owner's failure as the bytes it shares instead of a result (at most
    ``ERROR_ROOM`` bytes of JSON after the head: class, message, hint, context)."""
    body: dict[str, Any]
    if isinstance(err, RollpatchError):
        body = {"type": type(err).__name__, "message": err.message, "hint": err.hint}
        body["context"] = {**err.context, "rank": rank}
    else:
        body = {"type": "EngineError", "message": f"decoding failed: {type(err).__name__}: {err}"}
        body["context"] = {"rank": rank}
    text = json.dumps(body, default=str).encode()
    if len(text) > ERROR_ROOM:  # the message cut, the context reduced to the rank
        body = {**body, "message": str(body["message"])[:500], "hint": None}
        body["context"] = {"rank": rank}
        text = json.dumps(body, default=str).encode()[:ERROR_ROOM]
    return _HEAD.pack(1, 0, 0, len(text), 0, 0) + text


def unpack(e: dict[str, Any], data: memoryview | bytes) -> tuple[TensorPatch, SumState | None]:
    """The delta of header entry ``e`` and its rp.sum128 change (None: not measured) from its
    owner's bytes (any padding after them ignored); the owner's error raised."""
    name, kind, shape = e["name"], KINDS[e["kind"]], tuple(e["shape"])
    if len(data) < _HEAD.size:
        raise EngineError("a rank shared a truncated result", tensor=name)
    status, width, has, k, d0, d1 = _HEAD.unpack_from(data)
    if status == 1 and k <= len(data) - _HEAD.size:
        raise _error(bytes(data[_HEAD.size : _HEAD.size + k]), name)
    size = kind.elem_dtype.itemsize
    if (
        status != 0
        or width != _width(_elements(e))
        or has > 1
        or k != e["changed"]
        or len(data) < _HEAD.size + k * (width + 2 * size)
    ):
        raise EngineError("a rank shared a malformed result", tensor=name)
    at = _HEAD.size
    pos = np.frombuffer(data, np.uint32 if width == 4 else np.int64, k, at).astype(np.int64)
    at += k * width
    old = np.frombuffer(data, kind.elem_dtype, k, at).copy()
    new = np.frombuffer(data, kind.elem_dtype, k, at + k * size).copy()
    tp = TensorPatch(name, kind, shape, e["base"], e["target"], DeltaOp(pos, old, new))
    return tp, ((d0, d1) if has else None)


def _error(body: bytes, name: str) -> RollpatchError:
    try:
        d = json.loads(body)
        cls = _ERRORS.get(d["type"], EngineError)
        ctx = {str(k): v for k, v in dict(d.get("context") or {}).items()}
        ctx.setdefault("tensor", name)
        return cls(str(d["message"]), hint=d.get("hint"), **ctx)
    except (ValueError, KeyError, TypeError):
        return EngineError("a rank failed to decode a tensor", tensor=name)


def decode_split(
    w: RuntimeWeights, blob: bytes | memoryview, prior: Patch | None, limit: int
) -> tuple[Patch, dict[str, SumState]]:
    """``blob`` decoded against ``w``'s words with ``prior`` (the chain's steps before it, or
    None) applied, each gathered tensor decoded by one rank (the module docstring). Also
    returns, per tensor decoded by an owner, the rp.sum128 change of its writes, measured by
    the owner over the words it decoded against (their old words checked there: the staging
    need not read them again, ``stage_patch(vouched=)``). A collective: every rank of ``w``'s
    group calls it with the same arguments."""
    header = inspect(blob)
    mv = memoryview(blob)
    source: Any = w if prior is None else Overlay(w, prior)
    out: dict[str, TensorPatch] = {}
    vouched: dict[str, SumState] = {}

    def payload(e: dict[str, Any]) -> memoryview:
        start = header.payload_start + e["offset"]
        p = mv[start : start + e["length"]]
        if blake3.blake3(p).hexdigest() != e["b3"]:
            raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
        return p

    split: list[dict[str, Any]] = []
    for e in header.tensors:
        made = prior is not None and isinstance(
            getattr(prior.tensors.get(e["name"]), "change", None), FullOp
        )
        if e["op"] != "delta" or made:  # no base words to gather: every rank decodes it
            out[e["name"]] = decode_entry(e, payload(e), source, limit)
            continue
        _check_layout(w, e, source)  # on every rank alike, before any collective
        split.append(e)

    sums = header.digest == "rp.sum128.v1"

    def start(k: int) -> Callable[[], Callable[[], bytes] | None]:
        """Round ``k``'s gathers, started on every rank; finishing them gives this rank's
        decode of its tensor of the round (None: it owns none)."""
        done = [
            (split[items[k]], r, w.gather_to(split[items[k]]["name"], r))
            for r, items in enumerate(plan)
            if k < len(items)
        ]

        def finish() -> Callable[[], bytes] | None:
            run: Callable[[], bytes] | None = None
            for e, r, fin in done:
                try:
                    t = fin()
                except RollpatchError as err:  # the owner's assembly (e.g. replicas disagree)
                    if r != w.rank:
                        raise
                    run = functools.partial(bytes, pack_error(err, w.rank))
                    continue
                if t is not None:
                    run = functools.partial(
                        _decode_owned, e, t, payload, prior, limit, w.rank, sums
                    )
            return run

        return finish

    plan = owners(split, w.tp)
    rounds = max(map(len, plan), default=0)
    ms = w.split_ms
    results: list[bytes] = []  # this rank's, in its plan's order
    pending = start(0) if rounds else None
    for k in range(rounds):
        t0 = time.perf_counter()
        assert pending is not None
        run = pending()
        t1 = time.perf_counter()
        if run is not None:  # the owners decode at the same time
            results.append(run())
        t2 = time.perf_counter()
        # the next round after this one's decode: started before it, its transfers competed
        # with the decodes for the ranks' cores and gained nothing on this host (docs/vllm.md)
        pending = start(k + 1) if k + 1 < rounds else None
        ms["gather_ms"] = ms.get("gather_ms", 0.0) + (t1 - t0 + time.perf_counter() - t2) * 1e3
        ms["own_decode_ms"] = ms.get("own_decode_ms", 0.0) + (t2 - t1) * 1e3
    t2 = time.perf_counter()
    for r, items in enumerate(plan):  # each owner's results at once: one broadcast
        sizes = [result_size(split[i]) for i in items]
        data = None
        if r == w.rank:
            data = b"".join(x.ljust(n, b"\0") for x, n in zip(results, sizes, strict=True))
        shared = w.share(data, r, sum(sizes)) if items else memoryview(b"")
        at = 0
        for i, n in zip(items, sizes, strict=True):
            e = split[i]
            tp, change = unpack(e, shared[at : at + n])  # an owner's error raised here
            at += n
            out[e["name"]] = tp
            if change is not None:
                vouched[e["name"]] = change
        del shared, data
    ms["share_ms"] = ms.get("share_ms", 0.0) + (time.perf_counter() - t2) * 1e3
    tensors = {e["name"]: out[e["name"]] for e in header.tensors}
    return Patch(header.base, header.target, tensors, header.meta, header.digest), vouched


def _decode_owned(
    e: dict[str, Any],
    t: Tensor,
    payload: Callable[[dict[str, Any]], memoryview],
    prior: Patch | None,
    limit: int,
    rank: int,
    sums: bool,
) -> bytes:
    """The owner's decode of entry ``e`` over its gathered tensor ``t`` (with ``prior``'s
    change of it applied) and, for rp.sum128 digests, the change of its writes over those
    words (the old words checked in the same native pass: :func:`.sumchange.dry_change`), as
    the bytes it shares; or any error it met (never raised here: the others wait for it)."""
    try:
        name = e["name"]
        if prior is not None and name in prior.tensors:
            t = Overlay(View({name: t}), prior)[name]
        tp = decode_entry(e, payload(e), View({name: t}), limit)
        pos, old, new = tp.changes()
        if pos.size != e["changed"]:  # the size every rank expects (result_size)
            raise PatchDecodeError("decoded changes differ from the header", tensor=name)
        change = dry_change(t.kind, t.data, pos, old, new, name) if sums else None
        return pack(tp, change)
    except Exception as err:  # noqa: BLE001 - shared with every rank, which raises it
        return pack_error(err, rank)


def _check_layout(w: RuntimeWeights, e: dict[str, Any], source: Any) -> None:
    name = e["name"]
    if name not in source:
        raise BaseMismatchError("the base lacks a tensor the patch changes", tensor=name)
    kind, shape = w.kind_of(name), w.placement(name).shape
    if kind.name != e["kind"] or tuple(shape) != tuple(e["shape"]):
        raise BaseMismatchError(
            "base tensor layout differs from the patch", tensor=name, kind=kind.name, shape=shape
        )
