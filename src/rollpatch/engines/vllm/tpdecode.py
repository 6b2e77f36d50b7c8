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
3. each owner shares all its results at once: per tensor the positions, old and new words,
   O(changed), with the rp.sum128 change of the writes, measured over the words it decoded
   against in one native pass that also checks their old words
   (:func:`.sumchange.dry_change`); or the error it met, which every rank then raises at
   the same point (an owner that failed still joins every collective: none is left
   waiting). Where the ranks can send to each other (gloo:
   :meth:`.weights.RuntimeWeights.deliver`) and no later step decodes against the result
   (one step, or a chain composed per tensor), each rank is sent the changes in *its own
   block* of the tensor only (:func:`.tpshare.restrict`: a slice of the sorted positions
   for a row block), with the change of the whole tensor's writes for the proof, point to
   point: the change crosses once, not once per rank, and no rank lays out changes it does
   not hold. Else one broadcast per owner (:meth:`.weights.RuntimeWeights.share`) gives
   every rank the whole change.

So each rank decodes about 1/TP of the
patch; what crosses between ranks is the model once (to the owners) plus the change. Every
rank ends with the decoded patch a decode of its own would give (in its blocks), and stages
it as before (its own writes), the target digests proven from the owners' changes
(``stage_patch(vouched=)``) without gathering the tensors again: the proof used to read
every touched tensor through a second all-gather. ``full`` and ``drop`` entries,
and deltas over a tensor the chain itself made, need no gather: every rank decodes them.
A chain of steps whose entries all take the in-place decoder (:func:`decode_chain_split`) is
planned per tensor instead: its owner gathers it once and decodes every step that touches
it into one copy (:func:`rollpatch.engines.catchup.decode_in_place` on that tensor), so the
chain costs one gather per touched tensor, not one per step. Results travel between the ranks
of one engine only, in the layout of :mod:`.tpshare`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np

from ...errors import BaseMismatchError, EngineError, PatchDecodeError, RollpatchError
from ...patch import Patch, TensorPatch
from ...patch.header import DIGESTS, inspect
from ...patch.model import FullOp
from ...patch.overlay import Overlay
from ...patch.unwire import decode_entry
from ...view import Tensor, View
from ..catchup import StepEntry, decode_in_place, step_entries
from ..sumchange import SumState, dry_change
from .layout import Placement
from .tpshare import bound, pack, pack_error, restrict, unpack, within
from .weights import RuntimeWeights

__all__ = ["decode_chain_split", "decode_split", "owners"]

#: A change record's decode cost in words' worth (fit: 27.8 ns per record, 1.68 per word).
CHANGE_COST = 16
_M64 = (1 << 64) - 1

#: The owner's work on one gathered tensor: its decoded delta and the rp.sum128 change of its
#: writes (None: not measured); what it raises is shared with every rank, which raises it.
Owned = Callable[[dict[str, Any], Tensor], tuple[TensorPatch, SumState | None]]
#: An owner's outcome for one tensor: its result, or its error as the bytes it shares.
Outcome = tuple[TensorPatch, SumState | None] | bytes


def owners(costs: list[int], tp: int) -> list[list[int]]:
    """Each rank's jobs (indices into ``costs``), in the order it does them: the costliest
    first, each to the least loaded rank (ties: the lower rank)."""
    load, plan = [0] * tp, [[] for _ in range(tp)]  # type: list[int], list[list[int]]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(tp), key=lambda r: (load[r], r))
        plan[r].append(i)
        load[r] += costs[i]
    return plan


def _cost(e: dict[str, Any], changed: int) -> int:
    return int(np.prod(e["shape"], dtype=np.int64)) + CHANGE_COST * changed


def _rounds(
    w: RuntimeWeights,
    jobs: list[dict[str, Any]],
    costs: list[int],
    owned: Owned,
    timings: dict[str, float] | None,
    blocks: bool,
) -> tuple[dict[str, TensorPatch], dict[str, SumState]]:
    """Every job's tensor gathered to its owner and done there (``owned``), round by round;
    then each owner's results shared: with ``blocks`` and where the ranks can send to each
    other (:attr:`.weights.RuntimeWeights.delivers`), each rank gets the changes in its own
    block only (:func:`_deliver`); else every rank gets every change (:func:`_broadcast`).
    Returns the decoded tensors (this rank's part of them with ``blocks``) and the measured
    changes (of the whole tensors); adds its phases' ms to ``timings`` (``gather_ms``,
    ``own_decode_ms``, ``share_ms``)."""
    plan = owners(costs, w.tp)
    rounds = max(map(len, plan), default=0)
    ms = timings if timings is not None else {}

    results: list[Outcome] = []  # this rank's, in its plan's order
    for k in range(rounds):
        t0 = time.perf_counter()
        # the round's transfers all started (sends, receives), then finished; started before
        # the previous round's decode instead, they competed with it for the ranks' cores
        # and gained nothing on this host (docs/vllm.md)
        started = [
            (jobs[items[k]], r, w.gather_to(jobs[items[k]]["name"], r, ms))
            for r, items in enumerate(plan)
            if k < len(items)
        ]
        run: Callable[[], Outcome] | None = None  # this rank's work of the round
        for job, r, fin in started:
            try:
                t = fin()
            except RollpatchError as err:  # the owner's assembly (e.g. replicas disagree)
                if r != w.rank:
                    raise
                run = functools.partial(bytes, pack_error(err, w.rank))
                continue
            if t is not None:
                run = functools.partial(_own, owned, job, t, w.rank)
        t1 = time.perf_counter()
        if run is not None:  # the owners work at the same time
            results.append(run())
        ms["gather_ms"] = ms.get("gather_ms", 0.0) + (t1 - t0) * 1e3
        ms["own_decode_ms"] = ms.get("own_decode_ms", 0.0) + (time.perf_counter() - t1) * 1e3
    t3 = time.perf_counter()
    share = _deliver if blocks and w.delivers else _broadcast
    out, changes = share(w, jobs, plan, results)
    ms["share_ms"] = ms.get("share_ms", 0.0) + (time.perf_counter() - t3) * 1e3
    return out, changes


def _own(owned: Owned, job: dict[str, Any], t: Tensor, rank: int) -> Outcome:
    try:
        return owned(job, t)
    except Exception as err:  # noqa: BLE001 - shared with every rank, which raises it
        return pack_error(err, rank)


def _packed(outcome: Outcome) -> bytes:
    return outcome if isinstance(outcome, bytes) else pack(*outcome)


def _broadcast(
    w: RuntimeWeights, jobs: list[dict[str, Any]], plan: list[list[int]], results: list[Outcome]
) -> tuple[dict[str, TensorPatch], dict[str, SumState]]:
    """Each owner's results on every rank, whole: per owner a table of lengths, then the
    bytes (two broadcasts); an owner's error raised on every rank at the same point."""
    out: dict[str, TensorPatch] = {}
    changes: dict[str, SumState] = {}
    packed = [_packed(x) for x in results]
    for r, items in enumerate(plan):  # each owner's results at once
        if not items:
            continue
        mine = r == w.rank
        table = np.array([len(x) for x in packed] if mine else [], np.int64)
        got = w.share(table.tobytes() if mine else None, r, 8 * len(items))
        sizes = np.frombuffer(got, np.int64, len(items)).tolist()
        for i, n in zip(items, sizes, strict=True):
            if not 0 <= n <= bound(jobs[i]):
                raise EngineError("a rank shared a malformed result", tensor=jobs[i]["name"])
        shared = w.share(b"".join(packed) if mine else None, r, sum(sizes))
        at = 0
        for i, n in zip(items, sizes, strict=True):
            tp, change = unpack(jobs[i], shared[at : at + n])  # an owner's error raised here
            at += n
            out[tp.name] = tp
            if change is not None:
                changes[tp.name] = change
        del shared
    return out, changes


def _deliver(
    w: RuntimeWeights, jobs: list[dict[str, Any]], plan: list[list[int]], results: list[Outcome]
) -> tuple[dict[str, TensorPatch], dict[str, SumState]]:
    """Each owner's results to each rank, the changes in that rank's block only (with the
    change of the whole tensor's writes, for the proof): point to point, a table of lengths
    then the bytes, so what crosses is the change once, not once per rank. Every rank then
    reads the owners' outcomes in one order (owner, then its plan), so an owner's error is
    raised on every rank at the same point, after every transfer. Ranks receive different
    bytes here, so a rank that refuses what it was sent tells the others (one byte to each)
    before it raises, and they raise too: no rank goes on to a collective the others left. A
    table of lengths out of bounds is refused the same way, before any bytes are sent."""
    me, tp = w.rank, w.tp
    tables: list[bytes] = []
    parts: list[bytes] = []
    for q in range(tp):
        packs = (
            [
                x if isinstance(x, bytes) else pack(restrict(x[0], _placed(w, jobs[i], q)), x[1])
                for i, x in zip(plan[me], results, strict=True)
            ]
            if q != me
            else []
        )
        tables.append(np.array([len(p) for p in packs], np.int64).tobytes())
        parts.append(b"".join(packs))
    got = w.deliver(tables, [0 if q == me else 8 * len(plan[q]) for q in range(tp)])
    sizes: list[list[int]] = [[] for _ in range(tp)]
    bad: EngineError | None = None
    for q in range(tp):
        if q != me:
            sizes[q] = np.frombuffer(got[q], np.int64, len(plan[q])).tolist()
            room = sum(bound(jobs[i]) for i in plan[q])
            if bad is None and not 0 <= sum(sizes[q]) <= room:  # not to be received at all
                bad = EngineError("a rank shared a malformed result table", rank=q)
    # every rank learns whether another refused its table before any bytes move: a rank that
    # raised here alone would leave its peers waiting on their sends
    _agree(w, bad, "a rank refused the result table it was sent")
    data = w.deliver(parts, [sum(n) for n in sizes])
    out: dict[str, TensorPatch] = {}
    changes: dict[str, SumState] = {}
    failure: RollpatchError | None = None
    try:
        for q in range(tp):
            at = 0
            for k, i in enumerate(plan[q]):
                job = jobs[i]
                if q == me:
                    x = results[k]
                    if isinstance(x, bytes):
                        unpack(job, x)  # this rank's own error, raised as the others raise it
                        raise EngineError("an owner's error did not raise", tensor=job["name"])
                    t, change = restrict(x[0], _placed(w, job, me)), x[1]
                else:
                    n = sizes[q][k]
                    if not 0 <= n <= bound(job):
                        raise EngineError("a rank shared a malformed result", tensor=job["name"])
                    t, change = unpack({**job, "changed": None}, data[q][at : at + n])
                    at += n
                    if not within(t, _placed(w, job, me)):
                        raise EngineError(
                            "a rank shared changes outside this rank's block", tensor=job["name"]
                        )
                out[t.name] = t
                if change is not None:
                    changes[t.name] = change
    except RollpatchError as err:
        failure = err
    _agree(w, failure, "a rank refused the results it was sent")
    return out, changes


def _agree(w: RuntimeWeights, failure: RollpatchError | None, refused: str) -> None:
    """Every rank tells every other one (one byte each) whether it failed; a rank that failed
    raises its ``failure``, the others raise ``refused`` naming the first that failed. So
    every rank raises, or none does, at the same point."""
    me, tp = w.rank, w.tp
    flag = b"\x01" if failure is not None else b"\x00"
    told = w.deliver(
        [b"" if q == me else flag for q in range(tp)], [int(q != me) for q in range(tp)]
    )
    if failure is not None:
        raise failure
    others = [q for q in range(tp) if q != me and bytes(told[q]) != b"\x00"]
    if others:
        raise EngineError(refused, rank=others[0])


def _placed(w: RuntimeWeights, job: dict[str, Any], rank: int) -> Placement:
    return w.rank_placements(job["name"])[rank]


def decode_split(
    w: RuntimeWeights,
    blob: bytes | memoryview,
    prior: Patch | None,
    limit: int,
    *,
    timings: dict[str, float] | None = None,
    blocks: bool = False,
) -> tuple[Patch, dict[str, SumState]]:
    """``blob`` decoded against ``w``'s words with ``prior`` (the chain's steps before it, or
    None) applied, each gathered tensor decoded by one rank (the module docstring). Also
    returns, per tensor decoded by an owner, the rp.sum128 change of its writes, measured by
    the owner over the words it decoded against (their old words checked there: the staging
    need not read them again, ``stage_patch(vouched=)``). A collective: every rank of ``w``'s
    group calls it with the same arguments. ``timings``: where the split's phases are added
    (ms: ``gather_ms``, ``own_decode_ms``, ``share_ms``). ``blocks``: each rank's patch
    holds, of each tensor an owner decoded, the changes in its own block only (where the
    ranks can send to each other: :func:`_deliver`); not for a step whose result later steps
    decode against (an owner there needs the whole change)."""
    header = inspect(blob)
    mv = memoryview(blob)
    source: Any = w if prior is None else Overlay(w, prior)
    out: dict[str, TensorPatch] = {}

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
        _check_layout(w, e["name"], e["kind"], e["shape"], source)  # on every rank alike
        split.append(e)
    sums = header.digest == "rp.sum128.v1"

    def owned(e: dict[str, Any], t: Tensor) -> tuple[TensorPatch, SumState | None]:
        """The owner's decode of ``e`` over its gathered tensor (with ``prior``'s change of
        it applied) and, for rp.sum128 digests, the change of its writes over those words
        (the old words checked in the same native pass: :func:`.sumchange.dry_change`)."""
        name = e["name"]
        if prior is not None and name in prior.tensors:
            t = Overlay(View({name: t}), prior)[name]
        tp = decode_entry(e, payload(e), View({name: t}), limit)
        pos, old, new = tp.changes()
        return tp, (dry_change(t.kind, t.data, pos, old, new, name) if sums else None)

    costs = [_cost(e, e["changed"]) for e in split]
    got, vouched = _rounds(w, split, costs, owned, timings, blocks)
    out.update(got)
    tensors = {e["name"]: out[e["name"]] for e in header.tensors}
    return Patch(header.base, header.target, tensors, header.meta, header.digest), vouched


def decode_chain_split(
    w: RuntimeWeights,
    steps: list[dict[str, Any]],
    blobs: list[list[bytes]],
    *,
    timings: dict[str, float] | None = None,
) -> tuple[Patch, dict[str, SumState]] | None:
    """A chain of several steps (each: ``base``, ``target``; ``blobs[k]``: its patch
    objects) decoded against ``w``'s words into one patch, per tensor by one rank: its owner
    gathers it once and decodes every step touching it into one copy (the in-place decoder),
    checks the summed state against the tensor's last target digest, and shares the composed
    change and its rp.sum128 change. None when an entry does not take the in-place decoder
    or the native core is missing (then step by step, :func:`decode_split`). A collective, as
    :func:`decode_split`; ``timings`` as there; each rank's patch holds the changes in its own
    blocks (``blocks=True`` there)."""
    from ... import native

    if native.core is None:  # the in-place decoder is native
        return None
    entries = step_entries(steps, blobs)  # every payload's checksum, on every rank
    if entries is None:
        return None
    chains: dict[str, list[StepEntry]] = {}
    for se in entries:
        chains.setdefault(se.name, []).append(se)
    names = sorted(chains)
    jobs: list[dict[str, Any]] = []
    for name in names:
        first, last = chains[name][0], chains[name][-1]
        _check_layout(w, name, first.kind, first.shape, w)  # on every rank alike
        job = {"name": name, "kind": first.kind, "shape": list(first.shape)}
        jobs.append({**job, "base": first.base, "target": last.target, "changed": None})
    held = {n: w.state_of(n) for n in names}  # a collective where not cached: every rank

    def owned(job: dict[str, Any], t: Tensor) -> tuple[TensorPatch, SumState | None]:
        name = job["name"]
        got = decode_in_place(
            View({name: t}), steps, blobs, lambda n: held[n], entries=chains[name]
        )
        assert got is not None  # every entry was checked to take the decoder
        patch, states = got
        s0, s1 = held[name]
        return patch.tensors[name], ((states[name][0] - s0) & _M64, (states[name][1] - s1) & _M64)

    costs = [_cost(j, sum(se.changed for se in chains[j["name"]])) for j in jobs]
    out, vouched = _rounds(w, jobs, costs, owned, timings, True)
    tensors = {n: out[n] for n in names}
    return Patch(steps[0]["base"], steps[-1]["target"], tensors, digest=DIGESTS[2]), vouched


def _check_layout(w: RuntimeWeights, name: str, kind: str, shape: Any, source: Any) -> None:
    if name not in source:
        raise BaseMismatchError("the base lacks a tensor the patch changes", tensor=name)
    held, at = w.kind_of(name), w.placement(name).shape
    if held.name != kind or tuple(at) != tuple(shape):
        raise BaseMismatchError(
            "base tensor layout differs from the patch", tensor=name, kind=held.name, shape=at
        )
