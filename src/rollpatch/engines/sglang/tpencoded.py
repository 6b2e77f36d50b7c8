"""The adapter's half of decoding at TP > 1 inside SGLang (stdlib and numpy; the ranks' half
is :mod:`.owned`): a chain of published steps (one step or many) staged without the model
entering the sidecar's process.

1. the plan, from the patch headers alone: every entry must take the in-place decoder (an
   ``rp.ctxgolomb.v2`` delta; else None, and the follower decodes against the gathered
   :meth:`~.adapter.SglangEngine.words` as before); the engine's verified root must be the
   chain's base and each touched tensor's digest, combined from the ranks' block sums, its
   first entry's base; each tensor gets one owner rank, largest estimated cost first to the
   least loaded rank (elements + 16 × changes, as :mod:`rollpatch.engines.vllm.tpdecode`);
2. in batches of at most :data:`BATCH_BYTES` of whole tensors (at least one tensor):
   every rank copies its blocks into the batch's tensors in shared memory (``export_blocks``;
   the blocks must tile each tensor), then every owner decodes its tensors of the batch at
   the same time (``decode_owned``) into one decoded-patch file per rank, each holding the
   changes in that rank's blocks. The batch's tensors lie in an :class:`.arena.Arena`, one
   shared-memory file the adapter keeps from one staging to the next and the ranks map
   once: fresh pages of shared memory (allocated, zeroed and faulted in by every rank at
   every staging) took 1.3 GB/s of the gather; what a staging leaves in the arena is never
   read by the next, whose blocks tile every tensor again;
3. every rank stages its own parts of the owners' files and the adapter proves the ranks'
   moved sums against each tensor's last target digest and the chain's target root before
   any rank writes (:func:`.tp.stage_parts`), as for a patch the follower decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BaseMismatchError
from ...kinds import get_kind
from ...patch import inspect
from ..catchup import decodes_in_place
from . import tp as tp_ops
from .arena import Arena
from .channel import SglangChannel
from .slices import combine, combine_state
from .wire import step_files

if TYPE_CHECKING:
    from ..staged import EncodedStep, StagedUpdate, WriteMode

__all__ = ["BATCH_BYTES", "owners", "stage_encoded"]

#: Whole tensors held in shared memory at a time while the owners decode (one tensor above it).
BATCH_BYTES = 256 << 20
#: A change record's decode cost in words' worth (:mod:`rollpatch.engines.vllm.tpdecode`).
CHANGE_COST = 16


def owners(costs: Mapping[str, int], tp: int) -> dict[str, int]:
    """Each tensor's owner rank: largest cost first, to the least loaded rank (ties: lowest)."""
    load = [0] * tp
    out: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        r = min(range(tp), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += costs[name]
    return out


def stage_encoded(
    ch: SglangChannel,
    steps: Sequence[EncodedStep],
    root: str | None,
    tensors: Mapping[str, Any],
    mode: WriteMode,
    fresh: Callable[[str], Path],
    arena: Arena | None = None,
) -> tuple[StagedUpdate, dict[str, Any]] | None:
    """Stage the chain ``steps`` on SGLang's ranks (module docstring); ``root``: the engine's
    verified root; ``tensors``: name → ``[kind, shape]``; ``fresh(what)``: a new file name in
    a directory both sides map (shared memory); ``arena``: the adapter's, kept after (None:
    one for this staging only). None when an entry is not an in-place delta."""
    from ..staged import StagedUpdate

    entries = [e for s in steps for b in s.blobs for e in inspect(b).tensors]
    if not steps or not entries or not all(decodes_in_place(e) for e in entries):
        return None
    if root != steps[0].base:
        raise BaseMismatchError(
            "engine root digest is not the patch's base",
            engine="sglang",
            expected=steps[0].base[:16],
            actual=str(root)[:16],
        )
    first: dict[str, dict[str, Any]] = {}
    last: dict[str, dict[str, Any]] = {}
    changed: dict[str, int] = {}
    for e in entries:
        name = str(e["name"])
        first.setdefault(name, e)
        last[name] = e
        changed[name] = changed.get(name, 0) + int(e["changed"])
        if name not in tensors:
            raise BaseMismatchError("the engine lacks a tensor the patch changes", tensor=name)
        kind, shape = tensors[name]
        if str(e["kind"]) != str(kind) or [int(d) for d in e["shape"]] != list(shape):
            raise BaseMismatchError(
                "base tensor layout differs from the patch", tensor=name, kind=str(kind)
            )
    t0 = time.perf_counter()
    reports = [a["blocks"] for a in ch.controls("digest", fresh=False)]
    digests, _ = combine(reports, tensors)
    for name, e in first.items():
        if digests[name] != e["base"]:
            raise BaseMismatchError("tensor is not the patch's base", tensor=name, engine="sglang")
    size = {n: int(np.prod(tensors[n][1], dtype=np.int64)) for n in first}
    plan = owners({n: size[n] + CHANGE_COST * changed[n] for n in first}, ch.tp)
    states = {
        n: list(combine_state(n, [r[n] for r in reports if n in r], tuple(tensors[n][1])))
        for n in first
    }
    made: list[Path] = []

    def new(what: str) -> Path:
        made.append(fresh(what))
        return made[-1]

    own = arena is None
    held = arena if arena is not None else Arena(fresh)
    try:
        spec = step_files(steps, iter(lambda: new("blob"), None))
        parts: dict[int, list[str]] = {r: [] for r in range(ch.tp)}
        gather_ms = decode_ms = 0.0
        batches = [_places(b, size, tensors) for b in _batches(first, size, tensors)]
        path = str(held.fit(max(end for _, end in batches)))
        for places, _ in batches:
            batch = list(places)
            t1 = time.perf_counter()
            placed = ch.controls("export_blocks", items=[[n, path, at] for n, at in places.items()])
            for n in batch:
                tp_ops.covered(n, tensors[n][1], [a["placed"][n] for a in placed])
            t2 = time.perf_counter()
            outs = {str(o): [str(new("decoded")) for _ in range(ch.tp)] for o in range(ch.tp)}
            answers = ch.controls(
                "decode_owned",
                steps=spec,
                owners={n: plan[n] for n in batch},
                wholes={n: [path, at] for n, at in places.items()},
                states={n: states[n] for n in batch},
                out=outs,
            )
            for a in answers:  # each owner's part for rank r: the changes in r's blocks
                for rank, p in enumerate(a.get("paths") or ()):
                    parts[rank].append(str(p))
            gather_ms += (t2 - t1) * 1e3
            decode_ms += (time.perf_counter() - t2) * 1e3
        expect = {n: (str(first[n]["base"]), str(last[n]["target"])) for n in first}
        target = steps[-1].target
        tokens, r = tp_ops.stage_parts(ch, expect, target, parts, digests, tensors, mode)
    finally:
        for p in made:
            p.unlink(missing_ok=True)
        if own:
            held.close()
    r["phases"] = {"gather": round(gather_ms, 3), "decode": round(decode_ms, 3), **r["phases"]}
    r["ms"] = (time.perf_counter() - t0) * 1e3
    payload = {"sglang_tokens": tokens, "changed": r["changed"], "nbytes": r["nbytes"]}
    return StagedUpdate(steps[0].base, target, {}, dict(r["digests"]), payload), r


def _places(
    batch: list[str], size: Mapping[str, int], tensors: Mapping[str, Any]
) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in the arena (aligned), and the bytes the batch spans."""
    places, end = {}, 0
    for n in batch:
        places[n] = end
        nbytes = size[n] * get_kind(str(tensors[n][0])).word_dtype.itemsize
        end += -(-nbytes // Arena.ALIGN) * Arena.ALIGN
    return places, max(end, Arena.ALIGN)


def _batches(
    names: Mapping[str, Any], size: Mapping[str, int], tensors: Mapping[str, Any]
) -> list[list[str]]:
    """The tensors in batches of at most :data:`BATCH_BYTES` (a larger tensor alone)."""
    out: list[list[str]] = []
    held = 0
    for n in sorted(names):
        nbytes = size[n] * get_kind(str(tensors[n][0])).word_dtype.itemsize
        if not out or held + nbytes > BATCH_BYTES:
            out.append([])
            held = 0
        out[-1].append(n)
        held += nbytes
    return out
