"""The adapter's half of tensor-parallel SGLang (``--tp-size`` > 1; stdlib and numpy).

Each TP rank runs rollpatch's control thread and holds blocks of the split tensors
(:mod:`.ranked`). Here, in the sidecar's process:

- :func:`held` adds every rank's block sums into the tensors' digests (:func:`.slices.combine`);
- :func:`export` gathers one tensor's blocks into the whole tensor, through shared memory or
  a file (the follower's :meth:`~.adapter.SglangEngine.words`, for a patch SGLang's ranks do
  not decode themselves: :mod:`.tpencoded`);
- :func:`stage_update` checks the engine's root against the patch's base, then :func:`stage`
  (:func:`stage_parts`: a decoded patch in one file or in the owner ranks' parts) sends it to
  every rank, adds the ranks' moved sums and checks them against the patch's target digests
  and root *before any rank writes*;
- :func:`commit` writes on every rank in one weight-update call (between two forward passes):
  scattered, or double-buffered (each rank exchanges its second buffers, O(1) per parameter);
  if a rank fails, the ranks that wrote undo their writes, so every rank is back on the base;
  :func:`release` then frees what double-buffered commits replaced (after the pause).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, TargetMismatchError, engine_error
from ...io.safetensors import load_view
from ...kinds import get_kind
from ...patch import Patch
from ...view import Tensor, root_digest
from .channel import SglangChannel
from .slices import combine
from .wire import result

if TYPE_CHECKING:
    from ..staged import StagedUpdate, WriteMode

__all__ = [
    "commit",
    "covered",
    "export",
    "held",
    "release",
    "stage",
    "stage_parts",
    "stage_update",
]


def held(
    ch: SglangChannel, tensors: Mapping[str, Any], *, fresh: bool
) -> tuple[dict[str, str], str]:
    """Per-tensor digests and root of what the ranks hold (``fresh``: every rank re-hashes)."""
    reports = [a["blocks"] for a in ch.controls("digest", fresh=fresh)]
    return combine(reports, tensors)


def export(
    ch: SglangChannel, name: str, kind_shape: Any, scratch: Path, *, shared: bool = True
) -> Tensor:
    """Tensor ``name`` gathered from every rank's block (replicated blocks read once).

    ``shared``: every rank copies its block straight into one shared-memory buffer of the
    whole tensor (:meth:`.channel.SglangChannel.shm` ``scratch``; one copy per word, no
    serialization), which the returned tensor's words then are. Else each rank writes its
    block to the file ``scratch`` (safetensors) and it is read and placed here."""
    kind, shape = get_kind(str(kind_shape[0])), tuple(int(d) for d in kind_shape[1])
    rows = shape[0] if shape else 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    placed: list[Mapping[str, Any]] = []
    out: np.ndarray
    shared = shared and rows * cols > 0  # nothing to map
    if shared:
        with open(scratch, "xb") as f:  # the ranks map it: sized first, mapped here too
            f.truncate(rows * cols * kind.word_dtype.itemsize)
        out = np.memmap(scratch, kind.word_dtype, "r+", shape=(rows, cols))
    else:
        out = np.zeros((rows, cols), kind.word_dtype)
    try:
        # shared: every rank copies its block into the one buffer at once; else each rank's
        # block goes through the one file ``scratch``, in turn
        infos = ch.controls("export", name=name, path=str(scratch), into=True) if shared else None
        for r in range(ch.tp):
            info = (
                infos[r]
                if infos is not None
                else ch.control("export", rank=r, name=name, path=str(scratch), into=False)
            )
            dim, start, length = int(info["dim"]), int(info["start"]), int(info["length"])
            placed.append(info)
            if not shared:
                block = load_view(scratch)[name].data
                scratch.unlink()
                if dim == 0:
                    out[start : start + length] = block.reshape(length, cols)
                else:
                    out[:, start : start + length] = block.reshape(rows, length)
    finally:
        scratch.unlink(missing_ok=True)  # a shared buffer stays mapped here until dropped
    covered(name, shape, placed)
    return Tensor(kind, shape, out.reshape(-1))


def covered(name: str, shape: Sequence[int], placed: Sequence[Mapping[str, Any]]) -> None:
    """The ranks' blocks of ``name`` (``dim``, ``start``, ``length`` each) tile one axis of it
    (replicas may overlap); EngineError otherwise."""
    rows = int(shape[0]) if len(shape) else 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    cover = np.zeros(rows, dtype=bool), np.zeros(cols, dtype=bool)
    for p in placed:
        dim, start, length = int(p["dim"]), int(p["start"]), int(p["length"])
        if dim not in (0, 1):
            raise EngineError("a rank placed its block on no known axis", tensor=name)
        cover[dim][start : start + length] = True
    if not (cover[0].all() or cover[1].all()):
        raise EngineError("the ranks' blocks do not cover the tensor", tensor=name)


def stage(
    ch: SglangChannel,
    patch: Patch,
    path: Path,
    digests: Mapping[str, str],
    tensors: Mapping[str, Any],
    mode: WriteMode = "in_place",
) -> tuple[list[str], dict[str, Any]]:
    """Stage the decoded patch written at ``path`` on every rank and prove it
    (:func:`stage_parts`)."""
    expect = {n: (tp.base_digest, tp.target_digest) for n, tp in patch.tensors.items()}
    return stage_parts(ch, expect, patch.target, [str(path)], digests, tensors, mode)


def stage_parts(
    ch: SglangChannel,
    expect: Mapping[str, tuple[str | None, str | None]],
    target: str,
    paths: Sequence[str | Path] | Mapping[int, Sequence[str | Path]],
    digests: Mapping[str, str],
    tensors: Mapping[str, Any],
    mode: WriteMode = "in_place",
) -> tuple[list[str], dict[str, Any]]:
    """Stage the decoded patch in the files ``paths`` (its parts, disjoint tensors; a mapping:
    each rank's own files, the changes in its blocks) on every rank and prove it: each tensor ``expect`` names must be held at its base digest now, the
    ranks' moved sums must give its target digest, and with the digests ``digests`` held now,
    the target root ``target`` (``double_buffer``: every rank also builds its second
    buffers). Returns every rank's token and rank 0's summary."""
    for name, (base, _) in expect.items():
        if digests.get(name) != base:
            raise BaseMismatchError("tensor is not the patch's base", tensor=name, engine="sglang")
    try:
        if isinstance(paths, Mapping):
            by_rank = {str(r): [str(p) for p in ps] for r, ps in paths.items()}
            answers = ch.controls("stage_decoded", paths=[], by_rank=by_rank, mode=mode)
        else:
            answers = ch.controls("stage_decoded", paths=[str(p) for p in paths], mode=mode)
        touched = {n: tensors[n] for n in expect}
        got, _ = combine([a["blocks"] for a in answers], touched)
        bad = sorted(n for n, (_, t) in expect.items() if got[n] != t)
        if bad:
            raise TargetMismatchError(
                "the staged update does not give the target tensor", tensor=bad[0], n=len(bad)
            )
        if root_digest({**digests, **got}) != target:
            raise TargetMismatchError("the staged update does not give the target root")
    except BaseException:
        ch.controls("drop")
        raise
    summary = {
        "changed": sum(int(a["changed"]) for a in answers),
        "nbytes": sum(int(a["nbytes"]) for a in answers),
        "digests": got,
        "phases": answers[0].get("phases") or {},
        "ms": max(float(a.get("ms", 0.0)) for a in answers),
    }
    return [str(a["token"]) for a in answers], summary


def stage_update(
    ch: SglangChannel,
    patch: Patch,
    path: Path,
    root: str | None,
    tensors: Mapping[str, Any],
    mode: WriteMode = "in_place",
) -> tuple[StagedUpdate, dict[str, Any]]:
    """The adapter's staging at TP > 1: the engine's verified ``root`` must be the patch's
    base, then :func:`stage` against the digests the ranks hold now. Returns the update and
    rank 0's summary."""
    from ..staged import StagedUpdate

    if root != patch.base:
        raise BaseMismatchError(
            "engine root digest is not the patch's base",
            engine="sglang",
            expected=patch.base[:16],
            actual=str(root)[:16],
        )
    digests, _ = held(ch, tensors, fresh=False)
    tokens, r = stage(ch, patch, path, digests, tensors, mode)
    payload = {"sglang_tokens": tokens, "changed": r["changed"], "nbytes": r["nbytes"]}
    return StagedUpdate(patch.base, patch.target, {}, dict(r["digests"]), payload), r


def release(ch: SglangChannel) -> None:
    """After a commit every rank made: the storage its double-buffered commit replaced is
    freed on every rank (the commit can no longer be undone)."""
    ch.controls("release")


def commit(ch: SglangChannel, tokens: list[str]) -> dict[str, Any]:
    """Commit every rank's staged part in one weight-update call; on any rank's failure the
    ranks that wrote undo it, and the first failure is raised."""
    answers = ch.commands([{"op": "commit", "token": t} for t in tokens], flush=True)
    failed = [i for i, a in enumerate(answers) if not a.get("ok")]
    if not failed:
        return {
            "changed": sum(int(a["changed"]) for a in answers),
            "exchanged": sum(int(a.get("exchanged", 0)) for a in answers),
            "ms": max(float(a.get("ms", 0.0)) for a in answers),
        }
    wrote = [i for i, a in enumerate(answers) if a.get("ok")]
    if wrote:
        undo = [
            {"op": "undo", "token": tokens[i]} if i in wrote else {"op": "noop"}
            for i in range(ch.tp)
        ]
        for i, a in enumerate(ch.commands(undo, flush=True)):
            if i in wrote:
                result(a)  # an undo that fails: the error says so; the adapter re-hashes
    report = dict(answers[failed[0]].get("error") or {"message": "a rank's commit failed"})
    ctx = {**dict(report.get("context") or {}), "rank": failed[0], "undone_ranks": str(wrote)}
    raise engine_error({**report, "context": ctx}, engine="sglang", what="SGLang extension")
