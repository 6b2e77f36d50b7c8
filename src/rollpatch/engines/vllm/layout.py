"""Checkpoint coordinates ↔ vLLM runtime parameters: the pure arithmetic (numpy, no torch).

A served view names tensors as the checkpoint does (``...q_proj.weight``); vLLM holds them
fused and sharded (``...qkv_proj.weight`` on each tensor-parallel rank). A
:class:`ParamSpec` describes one runtime parameter in rank-independent terms — which
checkpoint tensors it is made of and how they are split over ``tp`` ranks — and
:func:`placements` turns it into the :class:`Placement` of each checkpoint tensor on one rank:
a block of rows (or, for row-parallel layers, of columns) copied to a block of the parameter.

Split kinds, as vLLM's parallel layers load them:

- ``replicated``: every rank holds the whole tensor (norms, ``ReplicatedLinear``, the bias of
  a row-parallel layer).
- ``column``: rows split; a fused parameter stacks several checkpoint tensors (q, k, v or
  gate, up), each contributing ``per_rank`` rows from row ``(rank // replicas) · per_rank``
  (``replicas > 1`` when there are fewer KV heads than ranks: ranks share a head).
- ``row``: columns split, ``cols / tp`` per rank.
- ``vocab``: rows split over the vocabulary padded to ``padded`` rows; rank ``r`` holds
  checkpoint rows ``[min(r·p, V), min((r+1)·p, V))`` at parameter rows ``0..``, ``p = padded/tp``
  (the remaining parameter rows are padding, outside the checkpoint).

- ``experts``: a fused MoE parameter (``w13_weight`` ``[E_local, 2·I/t, H]`` stacking each
  expert's gate and up rows, ``w2_weight`` ``[E_local, H, I/t]``): each checkpoint tensor lands
  in its expert's slot, column- (gate, up) or row- (down) split over ``t`` ranks, or whole on
  the rank that holds the expert under expert parallelism (:mod:`.moe`).

Positions are row-major element indices (the view's flat order). Tensors of any rank are read
as 2-D ``(shape[0], prod(shape[1:]))``; a 0-d tensor as ``(1, 1)``. An expert's placement
addresses its slot (row ``slot`` of the parameter read as 2-D) as a ``sub`` 2-D block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import EngineError

__all__ = [
    "KINDS",
    "ParamSpec",
    "Placement",
    "Shard",
    "blocks",
    "check_coverage",
    "locate",
    "locate_rows",
    "param_shape",
    "placements",
    "row_span",
    "storage_offsets",
]

#: The split kinds a :class:`ParamSpec` may have.
KINDS = ("replicated", "column", "row", "vocab", "experts")


@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor inside a runtime parameter.

    ``per_rank``: rows it contributes to each rank's parameter (``column`` only; 0 means
    ``rows // tp``). ``replicas``: ranks that hold the same rows (``column`` only).
    """

    name: str
    shape: tuple[int, ...]
    per_rank: int = 0
    replicas: int = 1

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def cols(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1


@dataclass(frozen=True)
class ParamSpec:
    """A runtime parameter, rank-independently: its name, split kind and checkpoint shards.

    ``padded``: the padded vocabulary size (``vocab`` only). ``experts`` only: ``expert_map``
    (per rank, global expert → local slot or -1), ``expert_tp`` (ranks the intermediate
    dimension is split over: ``tp``, or 1 under expert parallelism), ``expert_dim`` (the
    checkpoint dimension split: 0 gate/up rows, 1 down columns); shards are each expert's
    tensors in order (gate, up for ``w13``; down for ``w2``).
    """

    param: str
    kind: str
    shards: tuple[Shard, ...]
    padded: int = 0
    expert_map: tuple[tuple[int, ...], ...] = ()
    expert_tp: int = 1
    expert_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise EngineError(f"unknown split kind {self.kind!r}", param=self.param)
        if not self.shards or (self.kind not in ("column", "experts") and len(self.shards) != 1):
            raise EngineError(
                "only column-parallel parameters fuse several tensors",
                param=self.param,
                kind=self.kind,
            )
        if len({s.cols for s in self.shards}) != 1:
            raise EngineError("fused shards differ in columns", param=self.param)


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor's elements live in one rank's runtime parameter.

    Checkpoint indices ``[src_start, src_start + length)`` along ``dim`` (0 rows, 1 columns
    of the 2-D reading) are parameter indices ``[dst_start, dst_start + length)``; the other
    dimension is whole. ``length`` may be 0 (a rank that holds no row of the tensor).
    """

    name: str
    param: str
    shape: tuple[int, ...]
    param_shape: tuple[int, int]
    dim: int
    src_start: int
    dst_start: int
    length: int
    #: Experts: the local slot (row of ``param_shape``) and the slot's 2-D shape, in which
    #: ``dim``/``dst_start`` are read; ``slot == -1``: no slot (the tensor is not here).
    slot: int = -1
    sub: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def cols(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def n_elements(self) -> int:
        return self.rows * self.cols

    @property
    def whole(self) -> bool:
        """True when this rank holds every element of the tensor."""
        return self.length == (self.rows if self.dim == 0 else self.cols)


def _div(a: int, b: int, what: str, param: str) -> int:
    if b <= 0 or a % b:
        raise EngineError(f"{what} ({a}) does not divide by {b}", param=param)
    return a // b


def _check_rank(rank: int, tp: int) -> None:
    if tp < 1 or not 0 <= rank < tp:
        raise EngineError("bad tensor-parallel rank", rank=rank, tp=tp)


def _column_rows(spec: ParamSpec, shard: Shard, tp: int) -> int:
    if shard.per_rank:
        if shard.per_rank * tp != shard.rows * shard.replicas:
            raise EngineError(
                "per-rank rows × tp != rows × replicas",
                param=spec.param,
                tensor=shard.name,
                per_rank=shard.per_rank,
                tp=tp,
                replicas=shard.replicas,
            )
        return shard.per_rank
    if shard.replicas != 1:
        raise EngineError("replicated shards need an explicit per_rank", tensor=shard.name)
    return _div(shard.rows, tp, "rows", spec.param)


def param_shape(spec: ParamSpec, tp: int) -> tuple[int, int]:
    """The 2-D shape of the parameter on every rank (the same on all of them)."""
    if spec.kind == "experts":
        from .moe import expert_param_shape

        return expert_param_shape(spec, tp)
    s = spec.shards[0]
    if spec.kind == "replicated":
        return (s.rows, s.cols)
    if spec.kind == "column":
        return (sum(_column_rows(spec, sh, tp) for sh in spec.shards), s.cols)
    if spec.kind == "row":
        return (s.rows, _div(s.cols, tp, "columns", spec.param))
    if spec.padded < s.rows:
        raise EngineError(
            "padded vocabulary is smaller than the vocabulary",
            param=spec.param,
            padded=spec.padded,
            rows=s.rows,
        )
    return (_div(spec.padded, tp, "padded vocabulary", spec.param), s.cols)


def placements(spec: ParamSpec, rank: int, tp: int) -> list[Placement]:
    """The placement of each shard of ``spec`` on ``rank`` of ``tp`` ranks."""
    _check_rank(rank, tp)
    if spec.kind == "experts":
        from .moe import expert_placements

        return expert_placements(spec, rank, tp)
    pshape = param_shape(spec, tp)
    out: list[Placement] = []
    if spec.kind == "column":
        dst = 0
        for sh in spec.shards:
            n = _column_rows(spec, sh, tp)
            out.append(
                Placement(
                    sh.name, spec.param, sh.shape, pshape, 0, (rank // sh.replicas) * n, dst, n
                )
            )
            dst += n
        return out
    sh = spec.shards[0]
    if spec.kind == "replicated":
        return [Placement(sh.name, spec.param, sh.shape, pshape, 0, 0, 0, sh.rows)]
    if spec.kind == "row":
        n = pshape[1]
        return [Placement(sh.name, spec.param, sh.shape, pshape, 1, rank * n, 0, n)]
    per = pshape[0]
    start, end = min(rank * per, sh.rows), min((rank + 1) * per, sh.rows)
    return [Placement(sh.name, spec.param, sh.shape, pshape, 0, start, 0, end - start)]


def locate(pl: Placement, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For checkpoint ``positions``: which this rank holds, and their parameter offsets.

    Returns ``(held, offsets)``: a boolean mask over ``positions`` and, for the held ones,
    row-major flat offsets into the parameter's logical 2-D shape.
    """
    pos = np.asarray(positions, dtype=np.int64)
    r, c = np.divmod(pos, pl.cols)
    idx = r if pl.dim == 0 else c
    held = (idx >= pl.src_start) & (idx < pl.src_start + pl.length)
    moved = idx[held] - pl.src_start + pl.dst_start
    width = pl.param_shape[1] if pl.sub is None else pl.sub[1]
    if pl.dim == 0:
        offsets = moved * width + c[held]
    else:
        offsets = r[held] * width + moved
    if pl.sub is not None:
        offsets = offsets + max(pl.slot, 0) * pl.param_shape[1]
    return held, offsets


def row_span(pl: Placement, positions: np.ndarray) -> slice | None:
    """Where this rank holds a block of whole rows (``dim`` 0, no expert slot): the slice of
    the increasing ``positions`` that fall in it, one binary search at each end; None for
    any other placement (use :func:`locate`)."""
    if pl.dim != 0 or pl.sub is not None:
        return None
    lo, hi = np.searchsorted(
        positions, [pl.src_start * pl.cols, (pl.src_start + pl.length) * pl.cols]
    )
    return slice(int(lo), int(hi))


def locate_rows(pl: Placement, positions: np.ndarray) -> tuple[slice, np.ndarray] | None:
    """:func:`locate` without its temporaries (no division, no mask) where this rank holds a
    block of whole rows at the parameter's full width (a column-parallel layer's block, a
    replicated tensor): for increasing int64 ``positions``, the slice of them the rank holds
    (one binary search at each end) and their parameter offsets, one shift of them
    (``positions`` itself when nothing moves); None for any other placement.
    """
    keep = row_span(pl, positions) if pl.param_shape[1] == pl.cols else None
    if keep is None or positions.dtype != np.int64:
        return None
    shift = (pl.dst_start - pl.src_start) * pl.cols
    held = positions[keep]
    return keep, (held if shift == 0 else held + shift)


def storage_offsets(flat: np.ndarray, shape: Sequence[int], strides: Sequence[int]) -> np.ndarray:
    """Row-major logical offsets → storage offsets (in elements) of a strided tensor (the
    same array for a row-major one)."""
    row_major = [1]
    for n in reversed(tuple(shape)[1:]):
        row_major.insert(0, row_major[0] * n)
    if list(strides) == row_major or len(tuple(shape)) == 0:
        return np.asarray(flat, dtype=np.int64)
    rem = np.asarray(flat, dtype=np.int64)
    out = np.zeros_like(rem)
    for n, s in zip(reversed(tuple(shape)), reversed(tuple(strides))):
        rem, i = np.divmod(rem, n)
        out += i * s
    return out


def blocks(pl: Placement) -> tuple[tuple[slice, slice], tuple[slice, slice]]:
    """(checkpoint 2-D slices, parameter 2-D slices) of the block this rank holds."""
    src = slice(pl.src_start, pl.src_start + pl.length)
    dst = slice(pl.dst_start, pl.dst_start + pl.length)
    if pl.dim == 0:
        return (src, slice(None)), (dst, slice(None))
    return (slice(None), src), (slice(None), dst)


def check_coverage(specs: Sequence[ParamSpec], tp: int) -> dict[str, tuple[int, ...]]:
    """Check that every checkpoint element lives on some rank and no two blocks of one
    parameter overlap; returns checkpoint name → shape."""
    names: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        for sh in spec.shards:
            if sh.name in names:
                raise EngineError("checkpoint tensor mapped twice", tensor=sh.name)
            names[sh.name] = sh.shape
        if spec.kind == "experts":
            from .moe import check_expert_coverage

            check_expert_coverage(spec, tp)
            continue
        for rank in range(tp):
            used = np.zeros(param_shape(spec, tp), dtype=np.int8)
            for pl in placements(spec, rank, tp):
                used[blocks(pl)[1]] += 1
            if (used > 1).any():
                raise EngineError("fused blocks overlap", param=spec.param, rank=rank)
        for sh in spec.shards:
            seen = np.zeros((sh.rows, sh.cols), dtype=bool)
            for rank in range(tp):
                pl = next(p for p in placements(spec, rank, tp) if p.name == sh.name)
                seen[blocks(pl)[0]] = True
            if not seen.all():
                raise EngineError("ranks do not cover the tensor", tensor=sh.name, tp=tp)
    return names
