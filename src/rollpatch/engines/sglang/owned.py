"""Inside SGLang at TP > 1: a rank's part of decoding a chain of published steps (numpy and
the native core; the adapter's half is :mod:`.tpencoded`).

The decoder reads every base word of a tensor (its contexts) and a rank holds only its
blocks, so each touched tensor gets one *owner* rank that decodes it whole:

- ``export_blocks``: every rank copies its blocks of a batch of tensors into their places in
  the whole tensors the adapter mapped in shared memory (one copy per word, no
  serialization);
- ``decode_owned``: each owner maps the whole tensors it owns, decodes every step touching
  each into a private copy (:func:`rollpatch.engines.catchup.decode_in_place`: the
  decoder's own rp.sum128 change, added to the tensor's held state the adapter combined from
  the ranks' block sums, must give the step's target digest) and writes the composed change
  as one decoded-patch file per rank (:mod:`rollpatch.engines.vllm.transfer`, 12 bytes per
  BF16 change), each with the changes in that rank's blocks only
  (:func:`rollpatch.engines.vllm.tpshare.restrict`: a slice of the sorted positions for a
  row block, a mask for a column block; replicas get the same);
- every rank then stages its parts of the owners' files (``stage_decoded``, its own paths:
  :func:`read_decoded_all`), proving its moved sums from its *live* words: a wrong copy in
  shared memory, or a change left out of a part, cannot make a wrong update pass, it makes
  a mismatch.

Nothing of the model reaches the sidecar's process; the model crosses between SGLang's ranks
once per catch-up (to the owners, through shared memory), the change once more (the files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, PatchError
from ...patch import Patch, TensorPatch
from ...view import Tensor, View
from ..catchup import decode_in_place, step_entries
from ..vllm.tpshare import restrict
from ..vllm.transfer import read_decoded, write_decoded
from .ranked import RankWeights
from .staged import HeldWeights

__all__ = [
    "arena_words",
    "decode_owned",
    "export_blocks",
    "place_block",
    "read_decoded_all",
    "unmap_arena",
]

_M64 = (1 << 64) - 1


def _rank(w: HeldWeights) -> RankWeights:
    if not isinstance(w, RankWeights):
        raise EngineError("owned decoding is for TP > 1", hint="stage_encoded at TP = 1")
    return w


def export_blocks(w: HeldWeights, items: list[list[Any]]) -> dict[str, Any]:
    """Copy this rank's block of each ``[name, path]`` (or ``[name, path, offset]``: in the
    adapter's arena) into the whole tensor the adapter mapped there (rows x cols words); per
    name, where the block went."""
    rank = _rank(w)
    placed: dict[str, dict[str, int]] = {}
    nbytes = 0
    for name, path, *at in items:  # [name, path] or [name, arena path, offset]
        offset = int(at[0]) if at else None
        placed[str(name)], n = place_block(rank, str(name), str(path), offset)
        nbytes += n
    return {"placed": placed, "bytes": nbytes}


def place_block(
    rank: RankWeights, name: str, path: str, offset: int | None = None
) -> tuple[dict[str, int], int]:
    """Copy ``rank``'s block of ``name`` into its place in the whole tensor (rows x cols
    words) mapped at ``path`` (from byte ``offset`` of the adapter's arena, mapped once:
    :func:`arena_words`); where it went (``dim``, ``start``, ``length``) and its bytes."""
    block, pl = rank.block(name)
    where = {"dim": pl.dim, "start": pl.src_start, "length": pl.length}
    if pl.rows * pl.cols == 0:
        return where, 0  # nothing to map
    whole: np.ndarray
    if offset is None:
        whole = np.memmap(path, block.dtype, "r+", shape=(pl.rows, pl.cols))
    else:
        whole = arena_words(path, offset, block.dtype, pl.rows * pl.cols).reshape(pl.rows, -1)
    span = slice(pl.src_start, pl.src_start + pl.length)
    if pl.dim == 0:
        whole[span] = block
    else:
        whole[:, span] = block
    del whole
    return where, block.nbytes


def decode_owned(w: HeldWeights, req: dict[str, Any]) -> dict[str, Any]:
    """Decode the chain ``req["steps"]`` (each: ``paths``, ``base``, ``target``) for the
    tensors ``req["owners"]`` gives this rank, against the whole tensors at
    ``req["wholes"][name]``, from the held states ``req["states"][name]`` (``[s0, s1]``);
    the composed change goes to ``req["out"][rank]`` (no file when this rank owns none)."""
    rank = _rank(w)
    mine = sorted(str(n) for n, r in dict(req["owners"]).items() if int(r) == rank.rank)
    if not mine:
        return {"paths": [], "changed": 0, "tensors": 0}
    steps = list(req["steps"])
    spec = [{"base": str(s["base"]), "target": str(s["target"])} for s in steps]
    blobs, entries = _chain(steps, spec)
    wholes, states = dict(req["wholes"]), dict(req["states"])
    tensors: dict[str, Tensor] = {}
    for name in mine:
        if name not in rank:
            raise BaseMismatchError("the engine lacks a tensor the patch changes", tensor=name)
        kind, shape = rank.kind_of(name), tuple(rank.shape_of(name))
        n = int(np.prod(shape, dtype=np.int64))
        where = wholes[name]  # a path, or [arena path, offset]
        if not n:
            data = None
        elif isinstance(where, list):
            data = arena_words(str(where[0]), int(where[1]), kind.word_dtype, n)
        else:
            data = np.memmap(str(where), kind.word_dtype, "r", shape=(n,))
        tensors[name] = Tensor(kind, shape, np.zeros(0, kind.word_dtype) if data is None else data)

    def held(name: str) -> tuple[int, int]:
        s0, s1 = states[name]
        return int(s0) & _M64, int(s1) & _M64

    got = decode_in_place(
        View(tensors), spec, blobs, held, entries=[e for e in entries if e.name in tensors]
    )
    if got is None:
        raise PatchError("the native core is missing", hint="build rollpatch's native core")
    patch = got[0]
    outs = [str(p) for p in dict(req["out"])[str(rank.rank)]]  # one file per rank
    for r, out in enumerate(outs):  # each rank gets the changes in its own blocks only
        part = {n: restrict(tp, rank.placement_on(n, r)) for n, tp in patch.tensors.items()}
        write_decoded(Patch(patch.base, patch.target, part, dict(patch.meta)), out)
    changed = sum(tp.n_changed for tp in patch.tensors.values())
    return {"paths": outs, "changed": changed, "tensors": len(patch.tensors)}


#: The adapter's arena as this process mapped it (path, mapping): mapped once, so the pages of
#: shared memory are neither allocated nor faulted in again at each staging.
_ARENA: list[Any] = []


def arena_words(path: str, offset: int, dtype: Any, count: int) -> np.ndarray:
    """``count`` words of ``dtype`` from byte ``offset`` of the arena file at ``path``; a new
    path (the adapter grew or replaced its arena) drops the old mapping first."""
    if not _ARENA or _ARENA[0] != path:
        _ARENA.clear()
        _ARENA[:] = [path, np.memmap(path, np.uint8, "r+")]
    mm = _ARENA[1]
    nbytes = count * np.dtype(dtype).itemsize
    if offset < 0 or offset % np.dtype(dtype).itemsize or offset + nbytes > mm.size:
        raise EngineError("a tensor's place lies outside the arena", path=path, offset=offset)
    return mm[offset : offset + nbytes].view(dtype)


def unmap_arena() -> dict[str, Any]:
    """Drop the arena's mapping (the adapter closes: its file is unlinked)."""
    held = bool(_ARENA)
    _ARENA.clear()
    return {"unmapped": held}


#: The last chain read (its files' paths, its objects, their entries): a staging decodes
#: it in several batches, each of which would otherwise read and check every payload again.
_LAST: list[Any] = []


def _chain(steps: list[dict[str, Any]], spec: list[dict[str, str]]) -> tuple[Any, Any]:
    """The chain's objects and entries, every payload checked against its checksum once
    per staging (the adapter names fresh files for each)."""
    key = [[str(p) for p in s["paths"]] for s in steps], spec
    if _LAST and _LAST[0] == key:
        return _LAST[1], _LAST[2]
    blobs = [[Path(p).read_bytes() for p in paths] for paths in key[0]]
    entries = step_entries(spec, blobs)  # every payload's checksum
    if entries is None:
        raise PatchError("a step of the chain is not in the in-place codec")
    _LAST[:] = [key, blobs, entries]
    return blobs, entries


def read_decoded_all(paths: list[str]) -> Patch:
    """Several decoded-patch files of one update (the owners' parts) as one patch; they must
    bind the same digests and touch disjoint tensors."""
    if not paths:
        raise PatchError("no decoded patch to stage")
    parts = [read_decoded(str(p)) for p in paths]
    tensors: dict[str, TensorPatch] = {}
    for part in parts:
        if (part.base, part.target) != (parts[0].base, parts[0].target):
            raise PatchError("the decoded parts bind different digests")
        if set(part.tensors) & set(tensors):
            raise PatchError("two decoded parts touch the same tensor")
        tensors.update(part.tensors)
    return Patch(parts[0].base, parts[0].target, tensors, dict(parts[0].meta))
