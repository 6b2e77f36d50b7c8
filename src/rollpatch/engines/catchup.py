"""A chain of published steps decoded inside the engine, one tensor copy at a time, in place.

Used where the engine holds its words (the vLLM worker, the built-in engine): nothing of the
model crosses processes, and the proof of the target digests comes from the decoder itself.

Step *k* of a chain must be decoded against the words after steps 1..k-1. Decoding each step
against an :class:`~rollpatch.patch.overlay.Overlay` makes, for every step, a fresh copy of
every touched tensor with the composed changes scattered in: at 1–3% density every tensor is
touched, so a catch-up of *n* steps copied the model *n − 1* times. Here each touched tensor
is copied once, and every step is decoded straight into that private copy by the native
decoder (``decode_into``: it reads the base words and writes the new ones in the same pass,
and returns the exact rp.sum128 change), so step *k* sees exactly the words after step
*k − 1*; the composed change is where the copy differs from the live words (one vectorized
compare, cheaper than composing n change lists), and the tensor's target state is the held
state plus the decoder's changes, checked against the published target digest. Memory: one
tensor copy per thread plus the composed change; the live weights are only read. A chain of
one step takes its changes from the decoder itself (no compare); it is decoded into a copy
too, because the decoder's rp.sum128 change comes with the words it writes: computing that
change from the changed words alone, in numpy, cost more than the copy and the decode
together (≈160 ns per change against ≈2 ns per element).

Only ``delta`` entries of the ``rp.ctxgolomb.v2`` codec take this path (the format every
publisher writes by default); :func:`decode_in_place` returns None for any other chain and
the caller uses the overlay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from ..errors import (
    BaseMismatchError,
    IncompatibleModelError,
    ManifestError,
    PatchDecodeError,
    RollpatchError,
    TargetMismatchError,
)
from ..kinds import KINDS
from ..patch import DeltaOp, Patch, TensorPatch, inspect
from ..patch.codec_v2 import CtxGolombV2
from ..patch.differ import changes
from ..patch.header import DIGESTS
from ..view import Tensor, WordSource, sum128_digest, sum_add
from .fit import FIXED_MODEL
from .rewind import Rewind, merge_positions

SumState = tuple[int, int]

__all__ = ["Changes", "StepEntry", "decode_in_place", "decodes_in_place", "step_entries"]

_V2 = CtxGolombV2()


@dataclass(frozen=True)
class StepEntry:
    """One tensor's delta in step ``step`` of a chain (its payload a view of the object)."""

    step: int
    name: str
    kind: str
    shape: tuple[int, ...]
    base: str | None
    target: str | None
    payload: memoryview
    changed: int


def decodes_in_place(entry: Mapping[str, Any]) -> bool:
    """Whether a patch header's tensor entry takes the in-place decoder: an
    ``rp.ctxgolomb.v2`` delta (a chain with any other entry goes through the overlay)."""
    return entry["op"] == "delta" and entry["codec"] == _V2.codec_id


def step_entries(steps: list[dict[str, Any]], blobs: list[list[bytes]]) -> list[StepEntry] | None:
    """Every tensor entry of the chain's patch objects (``blobs[k]``: step ``k``'s), each
    payload checked against its checksum; None when one is not an ``rp.ctxgolomb.v2`` delta
    (the in-place decoder does not take it)."""
    out: list[StepEntry] = []
    for k, (step, parts) in enumerate(zip(steps, blobs, strict=True)):
        seen: set[str] = set()
        for blob in parts:
            header = inspect(blob)
            if len(parts) == 1 and (header.base, header.target) != (step["base"], step["target"]):
                raise ManifestError("patch object binds other digests than its step")
            mv = memoryview(blob)
            for e in header.tensors:
                if not decodes_in_place(e):
                    return None
                if e["name"] in seen:
                    raise ManifestError("patch shards overlap")
                seen.add(e["name"])
                start = header.payload_start + e["offset"]
                payload = mv[start : start + e["length"]]
                if blake3.blake3(payload).hexdigest() != e["b3"]:
                    raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
                out.append(
                    StepEntry(
                        k,
                        e["name"],
                        e["kind"],
                        tuple(e["shape"]),
                        e["base"],
                        e["target"],
                        payload,
                        e["changed"],
                    )
                )
    return out


class _Arena:
    """Arrays bump-allocated from blocks of at least 64 MiB, for a catch-up's kept changes
    (one arena per thread, array role and catch-up: :class:`Changes`; every array a view
    that keeps its block alive).

    Fresh arrays of a few MB fault in 4 KiB pages (≈0.35 ms per MB here) while numpy asks
    for huge pages only for arrays of 4 MiB and more: from a block they fault in 2 MiB pages
    (≈0.07 ms per MB). At 103M, the rewind's composes into fresh arrays took 48 ms, into
    arena blocks 21 (15 into pages already faulted)."""

    BLOCK = 64 << 20

    def __init__(self) -> None:
        self.block = np.empty(0, np.uint8)
        self.off = self.last = 0  # the next array's offset in the block, the last one's

    def empty(self, n: int, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        need = n * dt.itemsize
        if self.off + need > self.block.size:
            self.block = np.empty(max(self.BLOCK, need + 64), np.uint8)
            self.off = -self.block.ctypes.data % 64  # every array on a cache line of its own
        self.last = self.off
        out = self.block[self.off : self.off + need].view(dt)
        self.off += need + -(self.block.ctypes.data + self.off + need) % 64
        return out

    def trim(self, arr: np.ndarray, n: int) -> np.ndarray:
        """``arr[:n]``, the last array this arena gave, with the room past it given back (an
        array reserved for the worst case: its untouched pages are never faulted in)."""
        if not 0 <= n <= arr.size:
            raise ValueError("trim: more than the array holds")
        self.off = self.last
        self.empty(n, arr.dtype)
        return arr[:n]


class Changes:
    """The arenas of a thread's kept changes, one per array (positions, old words, new
    words), so that each array takes exactly its length in its arena (a worst case reserved
    for a compare or a merge is trimmed) and what a rewind record keeps alive, the positions
    and old words (:mod:`rollpatch.engines.rewind`), is those arrays and no more."""

    def __init__(self) -> None:
        self.arenas = (_Arena(), _Arena(), _Arena())

    def empty(self, n: int, dtype: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p, o, w = self.arenas
        return p.empty(n, np.int64), o.empty(n, dtype), w.empty(n, dtype)

    def trim(self, arrs: tuple[np.ndarray, ...], n: int) -> tuple[np.ndarray, ...]:
        """The last arrays given, cut to ``n`` (:meth:`_Arena.trim`)."""
        return tuple(a.trim(x, n) for a, x in zip(self.arenas, arrs, strict=True))

    def keep(self, mask: np.ndarray, *arrs: np.ndarray) -> tuple[np.ndarray, ...]:
        """Positions, old and new words where ``mask`` holds, into the arenas."""
        n = int(np.count_nonzero(mask))
        return tuple(
            np.compress(mask, x, out=a.empty(n, x.dtype))
            for a, x in zip(self.arenas, arrs, strict=True)
        )


def _changed_at(
    live: Tensor, work: Tensor, pos: np.ndarray, core: Any, arena: Changes
) -> tuple[np.ndarray, ...]:
    """(positions, old, new) where ``work`` differs from ``live`` among ``pos`` (sorted): the
    only positions a rewind and the decode wrote."""
    from .. import native

    kt = native.kind_tuple(live.kind, live.n_elements)
    old = np.empty(pos.size, live.kind.elem_dtype)
    new = np.empty(pos.size, live.kind.elem_dtype)
    core.gather(kt, live.data, pos, old)
    core.gather(kt, work.data, pos, new)
    return arena.keep(old != new, pos, old, new)


def _rewound(
    rewind: Rewind,
    since: set[str],
    name: str,
    live: Tensor,
    work: Tensor,
    live_state: SumState,
    state: Callable[[str], SumState],
) -> tuple[SumState, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """``work`` (a copy of ``live``) turned into the rewound version's words, and proven so:
    the state measured while rebuilding must be the one recorded. Returns it and the
    rebuild as a change (positions written, live words, rewound words); None: untouched."""
    if name not in since:
        return live_state, None
    st, undo = rewind.prepare(name, live, work, live_state)
    if st != rewind.state(name, state):
        raise BaseMismatchError(
            "the rebuilt words are not the rewound version's (a record differs)",
            tensor=name,
            version=rewind.version,
        )
    return st, undo


def _compose(
    undo: tuple[np.ndarray, np.ndarray, np.ndarray],
    step: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    core: Any,
    arena: Changes,
) -> tuple[np.ndarray, ...]:
    """The rebuild (live -> rewound words) followed by one decoded step (rewound -> target
    words): the change live -> target, merged by the native ``compose`` (one linear pass
    over the two sorted lists, unchanged elements dropped)."""
    pos, old, new = undo
    if step is None:
        return arena.keep(old != new, pos, old, new)
    arrs = [np.ascontiguousarray(a) for a in (*undo, *step)]
    cap = pos.size + step[0].size
    got = arena.empty(cap, old.dtype)
    n = core.compose(old.dtype.itemsize, *arrs, *got)
    if n < 0:  # both read the same rebuilt words: cannot happen
        raise BaseMismatchError("the decoded step does not start at the rebuilt words")
    return arena.trim(got, n)


def decode_in_place(
    words: WordSource,
    steps: list[dict[str, Any]],
    blobs: list[list[bytes]],
    state: Callable[[str], SumState],
    *,
    rewind: Rewind | None = None,
    held: str | None = None,
    entries: list[StepEntry] | None = None,
) -> tuple[Patch, dict[str, SumState]] | None:
    """The chain ``steps`` (each: ``base``, ``target``; ``blobs[k]``: its patch objects; one
    step or many) decoded against ``words`` into one patch, with each touched tensor's proven rp.sum128
    target state (``state(name)``: the held state); None when a tensor's entry is not an
    ``rp.ctxgolomb.v2`` delta or the native core is missing (use the overlay then).

    Per tensor (on :func:`rollpatch.native.threads` threads): copy it, decode every step into
    the copy (the decoder returns each step's exact rp.sum128 change), check the summed state
    against the last step's target digest for that tensor, and take the composed change as
    the positions where the copy differs from the live words (one native compare, no
    per-step change lists kept; a tensor one step touches takes that step's changes from the
    decoder). The writes staged from it turn the live words into the copy, whose state is the
    one proven.

    ``rewind`` (with ``held``, the live root digest): the chain starts at an older version
    whose words the engine's records rebuild (:mod:`rollpatch.engines.rewind`). Each copy
    is first turned into that version's words (its state proven against the recorded one),
    every tensor changed since that version is staged too (a tensor the chain leaves alone
    goes back to the rewound words), and the composed change is the rebuild composed with the
    decoded step (a native linear merge; a longer chain: the words compared at the decoded
    and rebuilt positions only; no full compare). The patch returned is ``held`` -> target,
    each tensor from its live digest.

    ``entries``: the chain's entries to decode, as :func:`step_entries` gave them (checked
    by the caller; e.g. one tensor's, decoded by the TP rank that owns it,
    :mod:`.vllm.tpdecode`); default: every entry of ``blobs``."""
    from .. import native

    core = native.core
    if core is None or not steps:
        return None
    if entries is None:
        entries = step_entries(steps, blobs)
    if entries is None:
        return None
    by_name: dict[str, list[StepEntry]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)

    since = rewind.names() if rewind is not None else set()
    held_bufs = threading.local()  # one scratch buffer per thread, reused for every tensor

    def scratch(data: np.ndarray) -> np.ndarray:
        """A copy of ``data`` in this thread's scratch buffer (fresh pages cost ≈0.25 ms/MB to
        fault in: a new array per tensor paid that for the whole model on every catch-up)."""
        buf = getattr(held_bufs, "buf", None)
        if buf is None or buf.nbytes < data.nbytes:
            buf = held_bufs.buf = np.empty(data.nbytes, np.uint8)
        out = buf[: data.nbytes].view(data.dtype).reshape(data.shape)
        np.copyto(out, data)
        return out

    def arena() -> Changes:
        got: Changes | None = getattr(held_bufs, "arena", None)
        if got is None:
            got = held_bufs.arena = Changes()
        return got

    def outputs(n: int, dt: Any, reuse: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's position, old and new arrays for ``n`` changes: kept ones from the
        thread's arena; else in this thread's reused buffers (a chain's per-step changes are
        not kept: the composed change is taken by the compare), as fresh arrays for every
        step and tensor were fresh pages each time (11.3M changes, ~135 MB, for 5 steps at
        103M)."""
        if not reuse:
            return arena().empty(n, dt)
        bufs: dict[Any, np.ndarray] = held_bufs.__dict__.setdefault("out", {})
        got = []
        for key, d in (("pos", np.dtype(np.int64)), (("old", dt), dt), (("new", dt), dt)):
            b = bufs.get(key)
            if b is None or b.size < n:
                b = bufs[key] = np.empty(max(n, 1 << 16), d)
            got.append(b[:n])
        return got[0], got[1], got[2]

    def one(name: str) -> tuple[TensorPatch, SumState]:
        if name not in words:
            raise IncompatibleModelError(
                "the engine lacks a tensor the patch changes", tensor=name, hint=FIXED_MODEL
            )
        live = words[name]
        chain = by_name.get(name, [])  # in step order
        if any(KINDS[e.kind] != live.kind or e.shape != live.shape for e in chain):
            raise BaseMismatchError("base tensor layout differs from the patch", tensor=name)
        st = state(name)
        work = Tensor(live.kind, live.shape, scratch(live.data))
        found: list[np.ndarray] = []
        undo = None
        if rewind is not None:
            st, undo = _rewound(rewind, since, name, live, work, st, state)
            if undo is not None:
                found.append(undo[0])
            if chain and chain[0].base != sum128_digest(live.dtype, live.shape, live.nbytes, st):
                raise BaseMismatchError("the rewound tensor is not the patch's base", tensor=name)
        # the steps' own changes are not kept where only the compare's change is (a chain),
        # or the compose's (one step after a rebuild: the merge copies them out)
        reuse = (len(chain) > 1 and rewind is None) or (len(chain) == 1 and undo is not None)
        for e in chain:
            out = outputs(e.changed, live.kind.elem_dtype, reuse)
            try:
                pos, old, new, change = _V2.decode_into(e.payload, work, e.changed, out)
            except RollpatchError as err:
                err.context.setdefault("tensor", name)
                err.context.setdefault("step", e.step)
                raise
            st = sum_add(st, change)
            found.append(pos)
        target = sum128_digest(live.dtype, live.shape, live.nbytes, st)
        if chain and target != chain[-1].target:
            raise TargetMismatchError(
                "the decoded chain does not reach the tensor's target", tensor=name
            )
        base = chain[0].base if chain else None
        if rewind is not None:  # the change from the live words: only where words were written
            base = sum128_digest(live.dtype, live.shape, live.nbytes, state(name))
            if len(chain) > 1:
                pos, old, new = _changed_at(live, work, merge_positions(found), core, arena())
            elif undo is not None:
                pos, old, new = _compose(undo, (pos, old, new) if chain else None, core, arena())
        elif len(chain) > 1:  # the composed change: where the copy now differs from the live words
            a = arena()
            pos, old, new = changes(live, work, empty=a.empty, trim=a.trim)
        tp = TensorPatch(name, live.kind, live.shape, base, target, DeltaOp(pos, old, new))
        return tp, st

    names = sorted(by_name.keys() | since)
    done = native.parallel_map(one, names)
    tensors = {n: tp for n, (tp, _) in zip(names, done, strict=True)}
    states = {n: st for n, (_, st) in zip(names, done, strict=True)}
    base = str(steps[0]["base"]) if rewind is None else str(held)
    return Patch(base, str(steps[-1]["target"]), tensors, digest=DIGESTS[2]), states
