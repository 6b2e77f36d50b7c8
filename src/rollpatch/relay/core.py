"""The relay without HTTP: verified, coalesced, cached reads of an upstream store.

Every read goes through one *flight* per key (:mod:`.flights`): the first request for an
uncached key starts one upstream fetch in a worker pool and later requests wait on the same
:class:`Future`, so N islands asking at once cost one WAN transfer. Results are plain
futures, so the HTTP layer awaits them without holding a thread per waiting client.

Upstream bytes are checked before they are cached or served (:mod:`.verify`): with a trust
root, manifests must be signed under the root, LATEST must be signed, fresh and not older
than what it verified before (its rollback state lies next to the cache), and roots must
chain from its trust root. Manifests and roots a previous run left in the cache are verified
again before they are served.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import blake3

from ..errors import ManifestError, ObjectIntegrityError, StoreError, TooLargeError, TrustError
from ..layout import manifest_version, pointer_key
from ..logs import Throttle, event
from ..store import ObjectInfo, Store
from ..store.base import Keys
from ..trust import Trust, warn_unverified
from .cache import CacheEntry, DiskCache
from .config import KeyKind, RelayConfig, classify, object_hash
from .corrupt import CorruptCopies
from .flights import Flights
from .lineage import Lineage
from .metrics import Metrics
from .stream import upstream_ranges
from .ttl import TtlTable
from .uncached import MemoryBudget
from .upstream import Op, UpstreamCalls
from .verify import StalePointer, Verifier

if TYPE_CHECKING:
    from .watch import PointerWatch

__all__ = ["Blob", "Relay"]

T = TypeVar("T")
log = logging.getLogger("rollpatch.relay")


@dataclass(frozen=True)
class Blob:
    """What the relay serves for a key: bytes in memory (volatile keys) or a cache entry."""

    key: str
    kind: KeyKind
    size: int
    etag: str
    data: bytes | None = None
    entry: CacheEntry | None = None

    @classmethod
    def cached(cls, entry: CacheEntry) -> Blob:
        return cls(entry.key, classify(entry.key), entry.size, entry.etag, entry=entry)


class Relay:
    """Reads of ``upstream`` through a verified disk cache (immutable keys) and short-TTL
    memory caches (LATEST, listings), with request coalescing. Thread-safe.
    """

    def __init__(
        self,
        upstream: Store,
        config: RelayConfig,
        *,
        metrics: Metrics | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.upstream = upstream
        self.config = config
        if trust is None:
            warn_unverified("relay")
        self.metrics = metrics or Metrics()
        #: Every call to ``upstream`` goes through it: counted, and an outage logged once.
        self.calls = UpstreamCalls(upstream.uri, self.metrics)
        #: Checks upstream answers before they are cached or served; owns the trust root.
        self.verifier = Verifier(self._get, trust, self.metrics)
        #: Copies found corrupt upstream, refused by ETag without fetching them again.
        self.corrupt = CorruptCopies(
            lambda k: self._call("head", self.upstream.head, k), self.verifier, config.corrupt_ttl
        )
        self.cache = DiskCache(
            config.cache_dir, config.cache_bytes, self.metrics, recheck_s=config.recheck_s
        )
        #: Whether the cached manifests of a run are still its own (:mod:`.lineage`).
        self.lineage = Lineage(
            self.cache,
            self.verifier,
            read_latest=lambda run: self._fetch_volatile(pointer_key(run), KeyKind.POINTER),
            read_cached=lambda entry: self.read(Blob.cached(entry)),
        )
        self.verifier.on_lineage = self.lineage.forget
        self.metrics.gauge("rollpatch_relay_cache_bytes", lambda: self.cache.total_bytes)
        self.metrics.gauge("rollpatch_relay_cache_entries", lambda: len(self.cache))
        #: Large objects the cache disk refused, served from memory (:mod:`.uncached`).
        self.uncached = MemoryBudget(config.uncached_bytes)
        self.metrics.gauge("rollpatch_relay_uncached_bytes", lambda: self.uncached.held)
        self.metrics.gauge("rollpatch_relay_upstream_latest_age_seconds", self._latest_age)
        self._flights = Flights(self.metrics)
        self._bulk = ThreadPoolExecutor(config.upstream_workers, "relay-bulk")
        self._meta = ThreadPoolExecutor(config.meta_workers, "relay-meta")
        self._volatile: TtlTable[Blob] = TtlTable()
        self._lists: TtlTable[Keys] = TtlTable()
        self._said = Throttle(log, every_s=60.0)  # cache writes the disk refused

    # -- reads --------------------------------------------------------------------------------

    def resolve(self, key: str) -> Future[Blob]:
        """A future of what to serve for a valid ``key``; fails with the store's errors
        (``NotFoundError``, ``TransientStoreError``...), ``ObjectIntegrityError`` for an object
        whose upstream bytes do not match the BLAKE3 in its key, or ``ManifestError`` for
        metadata refused.
        """
        kind = classify(key)
        if kind.immutable:

            def lookup() -> Blob | None:
                if kind is KeyKind.MANIFEST and not self._lineage_fresh(key):
                    return None  # fetched after a read of the run's LATEST (.lineage)
                entry = self.cache.lookup(key)
                return None if entry is None else Blob.cached(entry)

            pool = self._bulk if kind is KeyKind.OBJECT else self._meta
            return self._flights.join(
                ("get", key), kind.value, lookup, lambda: self._fetch_immutable(key, kind), pool
            )
        return self._flights.join(
            ("get", key),
            kind.value,
            lambda: self._volatile.get(key),
            lambda: self._fetch_volatile(key, kind),
            self._meta,
        )

    def accept(self, key: str, data: bytes) -> bool:
        """Cache ``data`` pushed upstream for the object or manifest ``key`` after the very
        checks a fetch of it gets (:meth:`Verifier.check`); whether it is cached now. A
        refusal is counted and logged by the verifier, and the key is then fetched as usual."""
        kind = classify(key)
        if kind not in (KeyKind.OBJECT, KeyKind.MANIFEST):
            return False
        self.metrics.inc("rollpatch_relay_upstream_bytes_total", len(data))
        if self.cache.lookup(key) is not None:
            self.metrics.inc("rollpatch_relay_pushed_total", outcome="present")
            return True
        try:
            b3 = self.verifier.check(key, kind, data)
        except (ObjectIntegrityError, ManifestError):
            self.metrics.inc("rollpatch_relay_pushed_total", outcome="refused")
            return False
        except StoreError:  # a root needed to check it could not be read: fetch as usual
            return False
        self.cache.insert(key, data, b3)
        self.metrics.inc("rollpatch_relay_pushed_total", outcome="cached")
        event(log, "pushed", key=key, kind=kind.value, bytes=len(data))
        return True

    def stat(self, key: str) -> Future[ObjectInfo | None]:
        """Size and ETag of an immutable key: from the cache, else a HEAD upstream (which does
        not pull the object across the WAN). Volatile keys: use :meth:`resolve`.
        """

        def lookup() -> ObjectInfo | None:
            entry = self.cache.lookup(key)
            return None if entry is None else ObjectInfo(key, entry.size, entry.etag)

        return self._flights.join(
            ("head", key),
            "head",
            lookup,
            lambda: self._call("head", self.upstream.head, key),
            self._meta,
        )

    def list(self, prefix: str) -> Future[Keys]:
        """A future of the sorted upstream keys under ``prefix``, at most ``list_ttl`` old."""
        return self._flights.join(
            ("list", prefix),
            "list",
            lambda: self._lists.get(prefix),
            lambda: self._fetch_list(prefix),
            self._meta,
        )

    def open(self, blob: Blob) -> tuple[BinaryIO, CacheEntry] | None:
        """Open a cached blob's file (the object starts at ``entry.offset``) and the entry it
        holds; None when it was evicted since it was resolved (resolve it again).
        """
        if blob.entry is None:
            raise ValueError("blob is held in memory; use blob.data")
        return self.cache.open(blob.key)

    @functools.cached_property
    def watch(self) -> PointerWatch:
        """The long-polls of LATEST waiting on this relay (:mod:`.watch`)."""
        from .watch import PointerWatch

        return PointerWatch(self)

    def close(self) -> None:
        """Stop the worker pools (fetches in progress finish in the background)."""
        if "watch" in self.__dict__:
            self.watch.close()
        self._bulk.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)

    # -- fetches (run in the pools) -----------------------------------------------------------

    def _lineage_fresh(self, key: str) -> bool:
        mv = manifest_version(key)
        return mv is None or self.lineage.fresh(mv[0])

    def _fetch_immutable(self, key: str, kind: KeyKind) -> Blob:
        if kind is KeyKind.MANIFEST and (mv := manifest_version(key)) is not None:
            self.lineage.check(mv[0])  # a reused run's cached manifests dropped first
        if self.cache.peek(key) is not None:  # left by a previous run: re-hash before serving
            entry = self.cache.verify(key)
            if entry is not None and self._still_valid(entry, kind):
                return Blob.cached(entry)
        self.corrupt.refuse_known(key)
        started = time.monotonic()
        size, bound = None, None
        if kind is KeyKind.OBJECT:  # a size a checked manifest names, else as stored (HEAD)
            size = self.verifier.sizes.get(key)
            if size is None and (info := self._call("head", self.upstream.head, key)):
                size, bound = info.size, self.config.stream_chunk_bytes
        if size is not None and size > self.config.stream_chunk_bytes:
            try:  # in ranges, to disk; the disk refused: from memory, within uncached_bytes
                blob = self._streamed(key, size)
            except OSError as e:
                self._cache_refused(key, e)
                fetch = functools.partial(self._fetch_whole, key, kind, size, cache=False)
                blob = self.uncached.held_while(key, size, fetch)  # over the bound: a 503
        else:
            blob = self._fetch_whole(key, kind, bound)
        seconds = round(time.monotonic() - started, 4)
        event(log, "fetched", key=key, kind=kind.value, bytes=blob.size, seconds=seconds)
        return blob

    def _fetch_whole(self, key: str, kind: KeyKind, bound: int | None, cache: bool = True) -> Blob:
        data = self._get(key, bound)  # over its manifest's size: refused, not read (no memory)
        try:
            b3 = self.verifier.check(key, kind, data)
        except ObjectIntegrityError:
            self.corrupt.remember(key)
            raise
        if cache:
            try:
                return Blob.cached(self.cache.insert(key, data, b3))
            except OSError as e:  # a full or read-only cache disk: the verified bytes, uncached
                self._cache_refused(key, e)
        return Blob(key, kind, len(data), f'"{b3}"', data=data)

    def _cache_refused(self, key: str, e: OSError) -> None:
        self.metrics.inc("rollpatch_relay_cache_write_errors_total")
        self._said.event(  # the same failure once a minute, with how many were held back
            "cache_write_failed", str(e.errno), logging.WARNING, object=key, error=str(e)
        )

    def _streamed(self, key: str, size: int) -> Blob:
        """``key``, named by a checked manifest as ``size`` bytes, fetched in ranges into the
        cache (:mod:`.stream`); ``OSError`` when the cache disk cannot take it."""

        def read(start: int, end: int) -> bytes:
            return self._call("get", lambda k: self.upstream.get_range(k, start, end), key)

        def chunks() -> Iterator[bytes]:
            bump = functools.partial(self.metrics.inc, "rollpatch_relay_upstream_bytes_total")
            return upstream_ranges(read, key, size, self.config.stream_chunk_bytes, bump)

        b3 = object_hash(key)
        assert b3 is not None  # an object key (its size is known)
        try:
            return Blob.cached(self.cache.insert_chunks(key, size, b3, chunks))
        except ObjectIntegrityError:
            self.verifier.refuse("hash_mismatch", key=key, size=size)
            self.corrupt.remember(key)
            raise

    def _fetch_volatile(self, key: str, kind: KeyKind) -> Blob:
        for last in (False, True):  # a LATEST overtaken while read is asked for once more
            started = time.monotonic()
            try:  # refused before its body is read
                data = self._get(key, self.config.max_volatile_bytes)
            except TooLargeError as e:
                size = e.context.get("size")
                self.verifier.refuse("too_large", key=key, size=size)
                if kind is KeyKind.POINTER:  # a few hundred bytes when it is one (an audit)
                    raise ManifestError(
                        "upstream LATEST is too large to be a LATEST pointer: refused",
                        key=key,
                        size=size,
                        hint="not written by a publisher: remove it, or publish again",
                    ) from None
                what = "upstream object is mutable (not in the board layout) and too large"
                hint = "raise RelayConfig.max_volatile_bytes, or read the board directly"
                raise StoreError(f"{what} to relay", key=key, size=size, hint=hint) from None
            if kind is KeyKind.POINTER:
                try:
                    p = self.verifier.check_pointer(key, data, started=started)
                except StalePointer:
                    if last:
                        raise
                    continue
                if p is not None:
                    self.lineage.pointer(p.manifest, p.target)
            blob = Blob(key, kind, len(data), f'"{blake3.blake3(data).hexdigest()}"', data=data)
            self._volatile.put(key, blob, started + self.config.pointer_ttl)
            return blob
        raise AssertionError("unreachable")  # the second pass returns or raises

    def remember_pointer(self, key: str, data: bytes, read_at: float) -> Blob:
        """LATEST bytes the long-poll watch read upstream and already checked
        (``verifier.check_pointer``): served for ``pointer_ttl`` from ``read_at``
        (monotonic) like one read on request."""
        blob = Blob(
            key, KeyKind.POINTER, len(data), f'"{blake3.blake3(data).hexdigest()}"', data=data
        )
        self._volatile.put(key, blob, read_at + self.config.pointer_ttl)
        return blob

    def read(self, blob: Blob) -> bytes:
        """The bytes of a blob (from memory, or its cache file); ``StoreError`` if it was
        evicted since it was resolved."""
        if blob.data is not None:
            return blob.data
        opened = self.open(blob)
        if opened is None:
            raise StoreError("evicted from the relay cache while read", key=blob.key)
        f, entry = opened
        with f:
            f.seek(entry.offset)
            return f.read(entry.size)

    def _fetch_list(self, prefix: str) -> Keys:
        started = time.monotonic()
        keys = sorted(self._call("list", self.upstream.list, prefix))
        self._lists.put(prefix, keys, started + self.config.list_ttl)
        return keys

    def _get(self, key: str, max_bytes: int | None = None) -> bytes:
        """Upstream's bytes of ``key``, refused before their body is read when over
        :meth:`Verifier.bound` (``max_bytes`` too); an object over it is corrupt."""
        bound = self.verifier.bound(key)
        if max_bytes is not None:
            bound = max_bytes if bound is None else min(bound, max_bytes)
        try:
            data = self._call("get", lambda k: self.upstream.get(k, max_bytes=bound), key)
        except TooLargeError as e:
            raise self.verifier.oversized(key, e) from None
        except TrustError as e:  # refused by a verifying relay upstream: counted here too
            self.verifier.refuse("trust", key=key, error=e)
            raise
        self.metrics.inc("rollpatch_relay_upstream_bytes_total", len(data))
        return data

    def _call(self, op: Op, fn: Callable[[str], T], arg: str) -> T:
        return self.calls.call(op, fn, arg)

    def _latest_age(self) -> float:
        """The watch's :meth:`~.watch.PointerWatch.latest_age` (0 before any long-poll)."""
        return self.watch.latest_age() if "watch" in self.__dict__ else 0.0

    def _still_valid(self, entry: CacheEntry, kind: KeyKind) -> bool:
        """Whether a manifest or root found in the cache at start-up passes today's checks
        (a relay restarted with a trust root must not serve what it cached without one)."""
        if kind not in (KeyKind.MANIFEST, KeyKind.ROOT):
            return True
        opened = self.cache.open(entry.key)
        if opened is None:
            return False
        f, _ = opened
        with f:
            f.seek(entry.offset)
            data = f.read(entry.size)
        try:
            self.verifier.check(entry.key, kind, data)
        except ManifestError as e:
            log.warning("relay cache: dropping %s: %s", entry.key, e)
            self.cache.discard(entry.key)
            return False
        return True
