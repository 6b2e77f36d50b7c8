"""Planning a path between versions: the fewest bytes of patch chains, skip patches and
keyframes (Dijkstra over versions, ties broken by fewer objects). Pure: the board lists and
reads the manifests; :func:`cheapest_plan` only chooses (docs/board.md, "Planning").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .errors import NoPathError
from .manifest import Manifest
from .types import ObjectRef

__all__ = ["Plan", "PlanStep", "cheapest_plan"]


@dataclass(frozen=True)
class PlanStep:
    """One hop: a keyframe of ``to`` (``base`` None) or the patch objects ``base`` → ``to``."""

    base: int | None
    to: int
    objects: tuple[ObjectRef, ...]

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def is_keyframe(self) -> bool:
        return self.base is None


@dataclass(frozen=True)
class Plan:
    """The objects to fetch, in order, to go from ``have`` to ``want``."""

    run: str
    have: int | None
    want: int
    steps: tuple[PlanStep, ...]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def n_objects(self) -> int:
        return sum(len(s.objects) for s in self.steps)


def cheapest_plan(
    run: str,
    have: int | None,
    want: int,
    manifests: dict[int, Manifest],
    *,
    avoid: frozenset[str] = frozenset(),
) -> Plan:
    """The cheapest plan from ``have`` (None: nothing loaded) to ``want`` over ``manifests``
    (NoPathError when none reaches it), using no object whose key is in ``avoid``."""
    # edges into v: patches from base b (all shards), or a keyframe of v from the source (-1)
    src = -1 if have is None else have
    best: dict[int, tuple[int, int]] = {src: (0, 0)}
    prev: dict[int, PlanStep] = {}
    heap = [(0, 0, src)]
    incoming: dict[int, list[PlanStep]] = {}
    for v, m in manifests.items():
        if m.is_keyframe:
            refs = tuple(k.ref for k in sorted(m.keyframes, key=lambda k: k.shard))
            incoming.setdefault(-1, []).append(PlanStep(None, v, refs))
        for base in sorted({p.base for p in m.patches}):
            refs = tuple(p.ref for p in m.patches_from(base))
            incoming.setdefault(base, []).append(PlanStep(base, v, refs))
    if have is not None:  # a loaded replica may still reboot from a keyframe if cheaper
        for step in incoming.get(-1, []):
            incoming.setdefault(have, []).append(step)
    while heap:
        cost, nobj, u = heapq.heappop(heap)
        if (cost, nobj) > best.get(u, (cost, nobj)):
            continue
        if u == want:
            break
        for step in incoming.get(u, []):
            if step.to > want or (u >= 0 and step.to <= u):
                continue
            if avoid and any(o.key in avoid for o in step.objects):
                continue
            cand = (cost + step.bytes, nobj + len(step.objects))
            if cand < best.get(step.to, (1 << 62, 0)):
                best[step.to] = cand
                prev[step.to] = step
                heapq.heappush(heap, (*cand, step.to))
    if want not in prev:
        raise NoPathError(
            "no chain of patches or keyframe reaches the version", run=run, have=have, want=want
        )
    steps = []
    v = want
    while v != src:
        step = prev[v]
        steps.append(step)
        v = src if step.base is None else step.base
    return Plan(run, have, want, tuple(reversed(steps)))
