"""The bulletin board: versions laid out in a store, the LATEST pointer, and planning.

Layout (docs/board.md)::

    runs/{run}/LATEST                      pointer JSON (compare-and-swap, never backwards)
    runs/{run}/versions/{n:012d}.json      manifest (put-if-absent: immutable)
    runs/{run}/keyframes/{n:012d}          marker: version n has a keyframe (cheap listing)
    runs/{run}/objects/{b3}.{rpatch|safetensors}   content-addressed objects

Publishing order is objects → manifest (→ keyframe marker) → pointer, so anything a pointer or
manifest names is already durable. :meth:`Board.plan` picks the fewest bytes among patch
chains, skip patches and keyframe + chain (Dijkstra over versions, tie → fewer objects).
"""

from __future__ import annotations

import heapq
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import blake3

from . import jsonsafe
from .errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    ManifestError,
    NoPathError,
    NotFoundError,
    VersionNotFoundError,
)
from .manifest import Manifest
from .store import Store, open_store
from .types import MAX_VERSION, ObjectRef, Pointer, check_run, pointer_may_advance

__all__ = ["Board", "Plan", "PlanStep", "pointer_key", "version_key"]

_CAS_RETRIES = 64
#: A LATEST pointer is a few hundred bytes; anything much larger is not one.
MAX_POINTER_BYTES = 64 * 1024
#: Default bound on the manifests one plan reads (the newest ones up to the wanted version).
MAX_PLAN_VERSIONS = 10_000
_VERSION_STEM = re.compile(r"[0-9]{1,16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _run_prefix(run: str) -> str:
    return f"runs/{check_run(run)}/"


def version_key(run: str, n: int) -> str:
    return f"{_run_prefix(run)}versions/{n:012d}.json"


def pointer_key(run: str) -> str:
    return f"{_run_prefix(run)}LATEST"


def _keyframe_marker(run: str, n: int) -> str:
    return f"{_run_prefix(run)}keyframes/{n:012d}"


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


class Board:
    """Versions of runs in a store. Thread-safe; manifests are cached (they are immutable).

    ``max_plan_versions`` bounds the manifests one :meth:`plan` reads: planning looks only at
    versions that exist (one listing), and at most at the newest ``max_plan_versions`` of them
    up to the wanted version, so no pointer value can make it walk version numbers.
    """

    def __init__(self, store: Store | str, *, cache_manifests: int = 4096,
                 max_plan_versions: int = MAX_PLAN_VERSIONS) -> None:
        if isinstance(max_plan_versions, bool) or not isinstance(max_plan_versions, int) \
                or max_plan_versions < 2:
            raise ConfigError("max_plan_versions must be an integer >= 2",
                              field="max_plan_versions", value=max_plan_versions)
        self.store = open_store(store) if isinstance(store, str) else store
        self._cache: OrderedDict[tuple[str, int], Manifest] = OrderedDict()
        self._cache_size = cache_manifests
        self.max_plan_versions = max_plan_versions
        self._lock = threading.Lock()

    # -- reading -----------------------------------------------------------------------------

    def runs(self) -> list[str]:
        """Runs that have a LATEST pointer."""
        keys = self.store.list("runs/")
        return sorted({k.split("/")[1] for k in keys if k.endswith("/LATEST")})

    def versions(self, run: str) -> list[int]:
        """Published manifests of ``run`` (ascending)."""
        prefix = f"{_run_prefix(run)}versions/"
        return _numbered(self.store.list(prefix), prefix, ".json")

    def keyframes(self, run: str) -> list[int]:
        """Versions of ``run`` that have a keyframe marker (ascending)."""
        prefix = f"{_run_prefix(run)}keyframes/"
        return _numbered(self.store.list(prefix), prefix, "")

    def latest(self, run: str) -> Pointer | None:
        """The LATEST pointer, or None before the first publish."""
        raw = self._pointer_raw(run)
        return None if raw is None else _parse_pointer(raw, run)

    def manifest(self, run: str, n: int) -> Manifest:
        """The manifest of version ``n`` (validated; cached)."""
        with self._lock:
            m = self._cache.get((run, n))
            if m is not None:
                self._cache.move_to_end((run, n))
                return m
        try:
            raw = self.store.get(version_key(run, n))
        except NotFoundError:
            raise VersionNotFoundError("no such version on the board", run=run,
                                       version=n) from None
        m = Manifest.from_bytes(raw)
        if (m.run, m.version) != (run, n):
            raise ManifestError("manifest names another version", run=run, version=n,
                                names=f"{m.run}@{m.version}")
        with self._lock:
            self._cache[(run, n)] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    def fetch(self, ref: ObjectRef) -> bytes:
        """Get an object and verify its size and BLAKE3 hash (ManifestError if corrupt)."""
        data = self.store.get(ref.key)
        if len(data) != ref.size or blake3.blake3(data).hexdigest() != ref.b3:
            raise ManifestError("object does not match its manifest entry (corrupt or "
                                "truncated)", key=ref.key, expected_bytes=ref.size,
                                got_bytes=len(data))
        return data

    # -- writing (publisher side) ------------------------------------------------------------

    def put_object(self, run: str, data: bytes, suffix: str) -> ObjectRef:
        """Store content-addressed bytes; re-putting identical content is a no-op."""
        b3 = blake3.blake3(data).hexdigest()
        ref = ObjectRef(f"{_run_prefix(run)}objects/{b3}.{suffix}", len(data), b3)
        try:
            self.store.put(ref.key, data)
        except AlreadyExistsError:
            info = self.store.head(ref.key)
            if info is None or info.size != len(data):
                raise
        return ref

    def put_manifest(self, m: Manifest) -> None:
        """Publish a manifest (immutable). Idempotent for the identical manifest."""
        for ref in m.objects():
            info = self.store.head(ref.key)
            if info is None or info.size != ref.size:
                raise ManifestError("manifest names an object that is not durable",
                                    key=ref.key, hint="upload objects before the manifest")
        raw = m.to_bytes()
        try:
            self.store.put(version_key(m.run, m.version), raw)
        except AlreadyExistsError:
            if self.store.get(version_key(m.run, m.version)) != raw:
                raise AlreadyExistsError("version already published with other content",
                                         run=m.run, version=m.version,
                                         hint="versions are immutable; publish a new one")
        if m.is_keyframe:
            try:
                self.store.put(_keyframe_marker(m.run, m.version), b"")
            except AlreadyExistsError:
                pass

    def advance(self, run: str, n: int) -> Pointer:
        """Move LATEST to version ``n`` if that is forward; returns the pointer now in force.

        The manifest must exist. Racing publishers cannot move it backwards: a lost
        compare-and-swap re-reads and retries; an older ``n`` leaves LATEST as it is.
        """
        m = self.manifest(run, n)
        new = Pointer(run, n, version_key(run, n), m.target)
        raw_new = json.dumps({"run": run, "version": n, "manifest": new.manifest,
                              "target": m.target}, sort_keys=True).encode()
        for _ in range(_CAS_RETRIES):
            raw = self._pointer_raw(run)
            cur = None if raw is None else _parse_pointer(raw, run)
            if not pointer_may_advance(cur, new):
                assert cur is not None
                return cur
            try:
                self.store.cas(pointer_key(run), raw_new, expected=raw)
                return new
            except ConflictError:
                continue
        raise ConflictError("LATEST kept moving; gave up", run=run, version=n)

    def _pointer_raw(self, run: str) -> bytes | None:
        try:
            return self.store.get(pointer_key(run))
        except NotFoundError:
            return None

    # -- planning ----------------------------------------------------------------------------

    def plan(self, run: str, have: int | None, want: int) -> Plan:
        """Fewest bytes from ``have`` (None: nothing loaded) to ``want``.

        Reads only manifests that exist (listed), from the newest keyframe at or below
        ``want`` (or ``have``, if older) up to ``want``, and at most the newest
        ``max_plan_versions`` of those.
        """
        for name, v in (("have", have), ("want", want)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or not 0 <= v <= MAX_VERSION):
                raise ConfigError(f"{name} must be a version number", run=run, value=v)
        if have is not None and have > want:
            raise NoPathError("patches only move forward", run=run, have=have, want=want)
        if have == want:
            return Plan(run, have, want, ())
        listed = [v for v in self.versions(run) if v <= want]
        if not listed or listed[-1] != want:
            raise VersionNotFoundError("no such version on the board", run=run, version=want)
        kfs = [k for k in self.keyframes(run) if k <= want]
        lo_candidates = kfs[-1:] + ([have] if have is not None else [])
        if not lo_candidates:
            raise NoPathError("no keyframe to boot from", run=run, want=want)
        lo = min(lo_candidates)
        window = [v for v in listed if v >= lo][-self.max_plan_versions:]
        manifests = {}
        for v in window:
            try:
                manifests[v] = self.manifest(run, v)
            except VersionNotFoundError:  # listed, then deleted (retention): plan without it
                continue
        if want not in manifests:
            raise VersionNotFoundError("no such version on the board", run=run, version=want)
        return _dijkstra(run, have, want, manifests)


def _numbered(keys: list[str], prefix: str, suffix: str) -> list[int]:
    """The version numbers in ``prefix{n}{suffix}`` keys (anything else is ignored)."""
    out = []
    for k in keys:
        stem = k[len(prefix):]
        if suffix:
            if not stem.endswith(suffix):
                continue
            stem = stem[:-len(suffix)]
        if _VERSION_STEM.fullmatch(stem):
            out.append(int(stem))
    return sorted(out)


def _dijkstra(run: str, have: int | None, want: int, manifests: dict[int, Manifest]) -> Plan:
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
            cand = (cost + step.bytes, nobj + len(step.objects))
            if cand < best.get(step.to, (1 << 62, 0)):
                best[step.to] = cand
                prev[step.to] = step
                heapq.heappush(heap, (*cand, step.to))
    if want not in prev:
        raise NoPathError("no chain of patches or keyframe reaches the version", run=run,
                          have=have, want=want)
    steps = []
    v = want
    while v != src:
        step = prev[v]
        steps.append(step)
        v = src if step.base is None else step.base
    return Plan(run, have, want, tuple(reversed(steps)))


def _parse_pointer(raw: bytes, run: str) -> Pointer:
    """A LATEST pointer, strictly: bounded JSON, a version number in range, naming this run's
    manifest key for that version; ManifestError otherwise (never a traceback)."""
    d = jsonsafe.loads(raw, what="LATEST pointer", error=ManifestError,
                       max_bytes=MAX_POINTER_BYTES, max_depth=2, run=run,
                       hint="repair it: LATEST must name a published version")
    if not isinstance(d, dict):
        raise ManifestError("LATEST pointer is malformed: not a JSON object", run=run)
    version, manifest, target = d.get("version"), d.get("manifest"), d.get("target")
    if d.get("run") != run:
        raise ManifestError("LATEST pointer names another run", run=run)
    if isinstance(version, bool) or not isinstance(version, int) \
            or not 0 <= version <= MAX_VERSION:
        raise ManifestError("LATEST pointer is malformed: version is not a version number",
                            run=run, version=_short(version),
                            hint="repair it: LATEST must name a published version")
    if manifest != version_key(run, version):
        raise ManifestError("LATEST pointer is malformed: manifest is not the version's key",
                            run=run, version=version, manifest=_short(manifest))
    if not isinstance(target, str) or not _HEX64.fullmatch(target):
        raise ManifestError("LATEST pointer is malformed: target is not a digest", run=run,
                            version=version)
    return Pointer(run, version, manifest, target)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
