"""Checkpoint expert tensors ↔ vLLM's fused MoE parameters: the arithmetic (numpy only).

vLLM holds a sparse block's experts as two stacked parameters per layer:

- ``w13_weight`` ``[E_local, 2·I/t, H]``: for each local expert slot, its gate rows
  (``experts.{e}.gate_proj.weight``, shard ``w1``) then its up rows (``up_proj``, ``w3``);
- ``w2_weight`` ``[E_local, H, I/t]``: each slot's down projection (``down_proj``, ``w2``).

Tensor parallelism without expert parallelism (``t = tp``): every rank holds every expert,
gate and up split by rows and down by columns, rank ``r`` taking block ``r`` of ``I/t``.
Expert parallelism (``t = 1``): experts are spread over the ranks (vLLM's ``expert_map``:
global expert → local slot, -1 when elsewhere) and each is whole where it lives. This is
exactly what vLLM's own ``RoutedExperts.weight_loader`` does (``_load_w13``/``_load_w2``), and
the tests check it against that loader. The vLLM side (:mod:`.describe`) reads the expert
names, the map and the split from the loaded layer; unknown layouts are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import EngineError
from .layout import ParamSpec, Placement, Shard

__all__ = ["check_expert_coverage", "expert_param_shape", "expert_placements", "expert_spec"]


def expert_spec(
    param: str,
    names: Sequence[Sequence[str]],
    shape: tuple[int, int],
    expert_map: Sequence[Sequence[int]],
    *,
    expert_tp: int,
    dim: int,
) -> ParamSpec:
    """A fused expert parameter: ``names[e]`` the checkpoint tensors of global expert ``e``
    in stacking order (gate, up; or down), each of ``shape``; ``expert_map[rank][e]`` its
    local slot on ``rank`` (-1: elsewhere); ``dim`` the checkpoint dimension split over
    ``expert_tp`` ranks (0 gate/up rows, 1 down columns)."""
    if dim not in (0, 1) or len(shape) != 2:
        raise EngineError(
            "expert tensors must be 2-D, split on dim 0 or 1", param=param, shape=shape, dim=dim
        )
    parts = {len(n) for n in names}
    if len(parts) != 1 or not names or any(len(m) != len(names) for m in expert_map):
        raise EngineError("every expert needs the same tensors and a map entry", param=param)
    shards = tuple(Shard(n, shape) for per in names for n in per)
    spec = ParamSpec(
        param,
        "experts",
        shards,
        expert_map=tuple(tuple(int(s) for s in m) for m in expert_map),
        expert_tp=int(expert_tp),
        expert_dim=dim,
    )
    check_expert_coverage(spec, len(spec.expert_map))
    return spec


def _parts(spec: ParamSpec) -> int:
    return len(spec.shards) // len(spec.expert_map[0])


def _slots(spec: ParamSpec, rank: int) -> int:
    return sum(1 for s in spec.expert_map[rank] if s >= 0)


def _split(spec: ParamSpec, tp: int) -> tuple[int, int]:
    """(ranks the intermediate dimension is split over, rows or columns per rank)."""
    t = spec.expert_tp
    if t not in (1, tp):
        raise EngineError(
            "experts are split over all ranks (TP) or none (EP)",
            param=spec.param,
            expert_tp=t,
            tp=tp,
        )
    sh = spec.shards[0]
    size = sh.rows if spec.expert_dim == 0 else sh.cols
    if size % t:
        raise EngineError(
            "expert intermediate size does not divide by the ranks",
            param=spec.param,
            size=size,
            ranks=t,
        )
    return t, size // t


def expert_param_shape(spec: ParamSpec, tp: int) -> tuple[int, int]:
    """The parameter as 2-D ``(local slots, elements per slot)``, the same on every rank."""
    slots = {_slots(spec, r) for r in range(tp)}
    if len(slots) != 1:
        raise EngineError(
            "ranks hold different numbers of experts (uneven expert parallelism is not supported)",
            param=spec.param,
        )
    _, n = _split(spec, tp)
    sh = spec.shards[0]
    per = _parts(spec) * n * (sh.cols if spec.expert_dim == 0 else sh.rows)
    return slots.pop(), per


def expert_placements(spec: ParamSpec, rank: int, tp: int) -> list[Placement]:
    """One placement per checkpoint tensor (every global expert, in shard order) on
    ``rank``; an expert held elsewhere gets ``length == 0`` and ``slot == -1``."""
    pshape = expert_param_shape(spec, tp)
    t, n = _split(spec, tp)
    r = rank if t > 1 else 0
    parts = _parts(spec)
    out: list[Placement] = []
    for e, slot in enumerate(spec.expert_map[rank]):
        for j in range(parts):
            sh = spec.shards[e * parts + j]
            if spec.expert_dim == 0:  # gate/up rows, stacked in the slot
                sub, dst = (parts * n, sh.cols), j * n
            else:  # down columns
                sub, dst = (sh.rows, n), 0
            here = slot >= 0
            out.append(
                Placement(
                    sh.name,
                    spec.param,
                    sh.shape,
                    pshape,
                    spec.expert_dim,
                    r * n if here else 0,
                    dst if here else 0,
                    n if here else 0,
                    slot if here else -1,
                    sub,
                )
            )
    return out


def check_expert_coverage(spec: ParamSpec, tp: int) -> None:
    """Every expert lives on some rank (on every rank when split); slots are distinct."""
    if len(spec.expert_map) != tp:
        raise EngineError(
            "the expert map names a different number of ranks",
            param=spec.param,
            ranks=len(spec.expert_map),
            tp=tp,
        )
    if len(spec.shards) % len(spec.expert_map[0]):
        raise EngineError("shards do not divide evenly over the experts", param=spec.param)
    t, _ = _split(spec, tp)
    experts = len(spec.expert_map[0])
    for rank, m in enumerate(spec.expert_map):
        held = [s for s in m if s >= 0]
        if sorted(held) != list(range(len(held))):
            raise EngineError(
                "local expert slots are not 0..n-1, each once", param=spec.param, rank=rank
            )
    for e in range(experts):
        owners = sum(1 for m in spec.expert_map if m[e] >= 0)
        if owners == 0 or (t > 1 and owners != tp) or (t == 1 and tp > 1 and owners > 1):
            raise EngineError(
                "expert placement does not cover the expert exactly",
                param=spec.param,
                expert=e,
                ranks_holding=owners,
            )
