"""Planning a path between versions: the fewest bytes of patch chains, skip patches and
keyframes (Dijkstra over versions, ties broken by fewer objects) (docs/board.md, "Planning").

:func:`plan_between` decides which manifests a plan reads (the window from the newest keyframe,
older keyframes when objects must be avoided) through callables the board gives it (listing
and reading stay the board's); :func:`cheapest_plan` only chooses over the manifests it is
given.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import ConfigError, NoPathError, VersionNotFoundError
from .manifest import Manifest
from .types import MAX_VERSION, ObjectRef

log = logging.getLogger("rollpatch.board")

__all__ = ["Plan", "PlanStep", "cheapest_plan", "plan_between"]


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

    @property
    def start(self) -> int | None:
        """The version the first patch starts from: ``have``, or an older version the
        engine rebuilds from its records (a rewind source); None when the plan boots from a
        keyframe."""
        if not self.steps:
            return self.have
        return self.steps[0].base

    @property
    def rewinds(self) -> bool:
        """True when the plan starts at a rewind source, not at ``have``."""
        return self.have is not None and self.start is not None and self.start != self.have


def cheapest_plan(
    run: str,
    have: int | None,
    want: int,
    manifests: dict[int, Manifest],
    *,
    avoid: frozenset[str] = frozenset(),
    sources: Mapping[int, str] | None = None,
) -> Plan:
    """The cheapest plan from ``have`` (None: nothing loaded) to ``want`` over ``manifests``
    (NoPathError when none reaches it), using no object whose key is in ``avoid``.

    ``sources``: older versions (version -> root digest) the engine holding ``have`` can
    rebuild at no cost (:meth:`~rollpatch.engines.EngineAdapter.rewindable`); one is a
    start only where its manifest is given and names that digest as its target."""
    # edges into v: patches from base b (all shards), or a keyframe of v from the source (-1)
    src = -1 if have is None else have
    starts = {src} | _sources(have, want, manifests, sources)
    best: dict[int, tuple[int, int]] = {s: (0, 0) for s in starts}
    prev: dict[int, PlanStep] = {}
    heap = [(0, 0, s) for s in sorted(starts)]
    heapq.heapify(heap)
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
    while v not in starts:
        step = prev[v]
        steps.append(step)
        v = src if step.base is None else step.base
    return Plan(run, have, want, tuple(reversed(steps)))


def _sources(
    have: int | None, want: int, manifests: dict[int, Manifest], sources: Mapping[int, str] | None
) -> set[int]:
    """The rewind sources usable as starts: below ``have``, their manifest given and bound to
    the digest the engine rebuilds."""
    if have is None or not sources:
        return set()
    return {
        v
        for v, digest in sources.items()
        if v < have and v in manifests and manifests[v].target == digest and v < want
    }


def plan_between(
    run: str,
    have: int | None,
    want: int,
    *,
    versions: Callable[[], list[int]],
    keyframes: Callable[[], list[int]],
    manifest: Callable[[int], Manifest],
    max_versions: int,
    avoid: frozenset[str] = frozenset(),
    sources: Mapping[int, str] | None = None,
) -> Plan:
    """Fewest bytes from ``have`` (None: nothing loaded) to ``want`` on a run whose versions
    and keyframe versions ``versions()`` and ``keyframes()`` list (ascending) and whose
    manifests ``manifest(v)`` reads (VersionNotFoundError when gone).

    Reads only listed manifests, from the newest keyframe at or below ``want`` (or ``have``,
    if older) up to ``want``, at most the newest ``max_versions`` of them; with ``avoid``
    (objects that failed verification), up to three older keyframes too when needed. Nothing
    is listed when ``have == want``, nor one version behind when ``want``'s manifest names
    ``have`` as its parent (the common catch-up: LATEST, one manifest, its patch).
    ``sources`` (rewind sources, :func:`cheapest_plan`): the window reaches down to the
    oldest of them too.
    """
    for name, v in (("have", have), ("want", want)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_VERSION
        ):
            raise ConfigError(f"{name} must be a version number", run=run, value=v)
    if have is not None and have > want:
        raise NoPathError("patches only move forward", run=run, have=have, want=want)
    if have == want:
        return Plan(run, have, want, ())
    if have is not None and want == have + 1:  # one behind: no listing (see _from_parent)
        step = _from_parent(run, have, want, manifest, avoid)
        if step is not None:
            return step
    listed = [v for v in versions() if v <= want]
    found: dict[int, Manifest] = {}
    if not listed or listed[-1] != want:  # a listing older than the LATEST that named want
        found = _past_listing(want, listed[-1] if listed else -1, manifest, max_versions)
        if want not in found:
            raise VersionNotFoundError("no such version on the board", run=run, version=want)
        listed += sorted(found)
    kfs = sorted(
        {k for k in keyframes() if k <= want} | {v for v, m in found.items() if m.is_keyframe}
    )
    if not kfs and have is None:
        raise NoPathError("no keyframe to boot from", run=run, want=want)
    manifests: dict[int, Manifest] = dict(found)
    # from the newest keyframe; with objects to avoid, older keyframes too if needed
    floor = listed[-max_versions] if len(listed) >= max_versions else -1  # what a plan reads
    tries: list[int | None] = list(
        _keyframes(kfs, manifest, manifests, 4 if avoid else 1, floor=floor)
    )
    tries = tries or ([None] if have is not None else [])
    if not tries:
        raise NoPathError("no keyframe to boot from", run=run, want=want)
    for i, kf in enumerate(tries):
        lo = min(x for x in (kf, have, *(sources or {}).keys()) if x is not None)
        window = [v for v in listed if v >= lo][-max_versions:]
        for v in window:
            if v in manifests:
                continue
            try:
                manifests[v] = manifest(v)
            except VersionNotFoundError:  # listed, then deleted (retention): without it
                continue
        if want not in manifests:
            raise VersionNotFoundError("no such version on the board", run=run, version=want)
        try:
            return cheapest_plan(run, have, want, manifests, avoid=avoid, sources=sources)
        except NoPathError:
            if i == len(tries) - 1:
                raise
    raise AssertionError("unreachable")


#: Keyframe markers skipped at most in one plan (markers are unsigned hints).
MAX_BAD_MARKERS = 8


def _keyframes(
    kfs: list[int],
    manifest: Callable[[int], Manifest],
    manifests: dict[int, Manifest],
    n: int,
    *,
    floor: int,
) -> list[int]:
    """The newest ``n`` of the marked versions ``kfs`` whose manifest is a keyframe's (read
    into ``manifests``; one below ``floor``, outside what a plan may read, as marked). A marker is an unsigned hint anyone who can write to the store can
    leave: before session 42 the newest one alone was tried, so an empty object at
    ``keyframes/{n}`` of a version with no keyframe made every new follower and every pull
    fail until the next real keyframe (audit I). Those skipped are logged."""
    out: list[int] = []
    bad: list[int] = []
    for kf in reversed(kfs):
        if len(out) >= n or len(bad) >= MAX_BAD_MARKERS:
            break
        if kf < floor:
            out.append(kf)
            continue
        try:
            m = manifests[kf] if kf in manifests else manifest(kf)
        except VersionNotFoundError:
            bad.append(kf)
            continue
        manifests[kf] = m
        (out if m.is_keyframe else bad).append(kf)
    if bad:
        log.warning(
            "keyframe markers of versions with no keyframe (or no manifest) are ignored: %s",
            ", ".join(map(str, bad)),
        )
    return out


#: Versions past a stale listing read by key at most (a relay's listing lags its LATEST).
PAST_LISTING = 64


def _past_listing(
    want: int, top: int, manifest: Callable[[int], Manifest], max_versions: int
) -> dict[int, Manifest]:
    """The manifests of the versions after ``top`` (the listing's newest) up to ``want``, read
    by key, newest first, at most :data:`PAST_LISTING` and ``max_versions``: a listing may lag
    the LATEST that named ``want`` (through relays, listings are cached for ``list_ttl``,
    LATEST for ``pointer_ttl``; before session 42 a follower more than one version behind
    failed with "version N is not on the board" there: audit I). Empty when ``want`` itself
    is not there."""
    out: dict[int, Manifest] = {}
    for v in range(want, max(top, want - min(PAST_LISTING, max_versions)), -1):
        try:
            out[v] = manifest(v)
        except VersionNotFoundError:
            if v == want:
                return {}
    return out


def _from_parent(
    run: str,
    have: int,
    want: int,
    manifest: Callable[[int], Manifest],
    avoid: frozenset[str],
) -> Plan | None:
    """The plan when ``have`` is ``want``'s parent, from ``want``'s manifest alone (no
    listing): every path into ``want`` from there is its step patch from ``have`` or its
    keyframe (patches only move forward, and skip patches start below the parent), so the
    cheaper of the two (ties: the patch) is what :func:`cheapest_plan` would choose. None
    when ``have`` is not the parent, or the manifest or its objects cannot be used. Only
    tried one version behind: a LATEST far ahead (10^12) still costs one listing, not a read.
    """
    try:
        m = manifest(want)
    except VersionNotFoundError:
        return None  # the listing says what exists
    if m.parent != have:
        return None
    steps = [PlanStep(have, want, tuple(p.ref for p in m.patches_from(have)))]
    if m.is_keyframe:
        refs = tuple(k.ref for k in sorted(m.keyframes, key=lambda k: k.shard))
        steps.append(PlanStep(None, want, refs))
    usable = [s for s in steps if s.objects and not any(o.key in avoid for o in s.objects)]
    if not usable:
        return None
    best = min(usable, key=lambda s: (s.bytes, len(s.objects)))  # the first on ties
    return Plan(run, have, want, (best,))
