"""Whether the manifests a relay cached for a run are still that run's: the cached ones
dropped when LATEST or a new manifest contradicts them, and a run's LATEST read before a
cached manifest is served, at most once per :data:`LINEAGE_S` per run.

Manifests are immutable in the board layout, so the relay caches them for ever. A run
deleted upstream and published again under its name (docs/board.md forbids it, but it
happens) breaks that: its version keys are reused for other weights. The relay finds out
from LATEST (its manifest names another target than the cached one: :meth:`Lineage.pointer`)
or from a new manifest whose patch base contradicts the cache (``Verifier.on_lineage``); then
every cached manifest and keyframe marker of the run is dropped (:meth:`Lineage.forget`). Before
session 42 a fixed version asked for before anything read LATEST (``pull --version 3`` after
a restart, or right after the reuse) was served from the earlier run, verified against its
own manifest (an audit, session 41). Now a cached manifest of a run whose LATEST this relay
has not read in the last :data:`LINEAGE_S` is served only after one such read. What is
still not seen: a reused run whose LATEST names a version the relay never cached, asked for
a version it did cache, within :data:`LINEAGE_S` of its last read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import RollpatchError, StoreError
from ..layout import keyframes_prefix, manifest_version, versions_prefix

if TYPE_CHECKING:
    from .cache import CacheEntry, DiskCache
    from .verify import Verifier

__all__ = ["LINEAGE_S", "Lineage"]

#: Seconds a run's LATEST read vouches for its cached manifests.
LINEAGE_S = 5.0
#: Runs remembered at most (requests for made-up run names cannot grow it without bound).
MAX_RUNS = 4096
log = logging.getLogger("rollpatch.relay")


class Lineage:
    """When each run's LATEST was last read by this relay; thread-safe."""

    def __init__(
        self,
        cache: DiskCache,
        verifier: Verifier,
        *,
        read_latest: Callable[[str], object],
        read_cached: Callable[[CacheEntry], bytes],
        every_s: float = LINEAGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``read_latest(run)``: reads the run's LATEST upstream with every check (then
        :meth:`pointer`); ``read_cached``: a cache entry's bytes."""
        self.cache, self.verifier = cache, verifier
        self._read, self._read_cached = read_latest, read_cached
        self.every_s, self._clock = every_s, clock
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}

    def pointer(self, manifest: str, target: str) -> None:
        """A LATEST just read and checked names ``manifest`` with ``target``: drop the run's
        cached manifests if the cached one names another target (the run was published
        again under its name: immutable keys, reused; followers would refuse it, and it is
        fetched again instead)."""
        mv = manifest_version(manifest)
        if mv is None:
            return
        self.seen(mv[0])
        if self.cache.peek(manifest) is None:
            return
        cached = self.verifier.targets.get(manifest)  # known since it was checked: no read
        if cached is None:  # cached by an earlier process: read and parsed once
            entry = self.cache.verify(manifest)
            if entry is None:
                return
            try:
                cached = self.verifier.manifest_target(manifest, self._read_cached(entry))
            except StoreError:  # evicted meanwhile: nothing to drop
                return
        if cached is not None and cached != target:
            self.forget(mv[0], f"{manifest} names {cached[:16]}, LATEST names {target[:16]}")

    def forget(self, run: str, why: str) -> None:
        """The run was published again under its name (``why`` says how it showed): every
        cached manifest and keyframe marker of it is dropped and fetched again when asked
        for (its objects are named by their BLAKE3 and stay). Before session 41 only the
        manifest LATEST names was dropped, and an older version was served from the earlier
        run, verified against its own manifest (an audit)."""
        keys = self.cache.discard_prefixes(versions_prefix(run), keyframes_prefix(run))
        for k in keys:
            self.verifier.targets.forget(k)
        log.warning(
            "relay cache: run %s was published again under its name (%s): its %d cached "
            "manifest(s) and marker(s) are dropped, fetched again",
            run,
            why,
            len(keys),
        )

    def seen(self, run: str) -> None:
        """The run's LATEST was just read (and checked against the cache)."""
        with self._lock:
            self._remember(run)

    def fresh(self, run: str) -> bool:
        """Whether the run's cached manifests may be served without a read of LATEST."""
        at = self._at.get(run)
        return at is not None and self._clock() - at < self.every_s

    def check(self, run: str) -> None:
        """Read the run's LATEST unless it was read within :attr:`every_s` (one reader at a
        time: the others serve meanwhile); a failed read (no LATEST, a refusal, an outage)
        leaves the cache as it is until the next check, :attr:`every_s` later (an outage
        upstream must not hold up what the cache can serve)."""
        with self._lock:
            if self.fresh(run):
                return
            self._remember(run)  # claimed: requests arriving meanwhile do not read it too
        try:
            self._read(run)
        except RollpatchError:
            pass

    def _remember(self, run: str) -> None:
        if run not in self._at and len(self._at) >= MAX_RUNS:
            self._at.clear()
        self._at[run] = self._clock()
