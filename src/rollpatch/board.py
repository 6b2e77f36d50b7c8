"""The bulletin board: versions laid out in a store, the LATEST pointer, and planning.

The key layout (LATEST, manifests, keyframe markers, objects, roots) is spelled in
:mod:`rollpatch.layout` only (docs/board.md); content-addressed objects are read and written
by :mod:`rollpatch.objects`.

Publishing order is objects → manifest (→ keyframe marker) → pointer, so anything a pointer or
manifest names is already durable. :meth:`Board.plan` picks the fewest bytes among patch
chains, skip patches and keyframe + chain (Dijkstra over versions, tie → fewer objects).

A board given a :class:`~rollpatch.trust.Trust` verifies every manifest and LATEST it reads
(signatures under the root, LATEST's expiry and rollback) and follows root rotations; one
given a :class:`~rollpatch.trust.Signer` writes signed manifests and LATEST (docs/trust.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from . import jsonsafe, objects
from .errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    ManifestError,
    NotAnObjectError,
    NotFoundError,
    TooLargeError,
    TrustError,
    VersionNotFoundError,
)
from .latest import MAX_POINTER_BYTES, encode_latest, read_latest
from .layout import (
    ROOT_PREFIX,
    RUNS_PREFIX,
    keyframe_marker_key,
    keyframes_prefix,
    numbered,
    pointer_key,
    root_key,
    runs_with_pointer,
    version_key,
    versions_prefix,
)
from .manifest import MAX_ENVELOPE_BYTES, MAX_MANIFEST_DEPTH, Manifest, open_manifest
from .manifest.cache import ManifestCache
from .planning import Plan, PlanStep, plan_between
from .store import Store, open_store
from .trust import (
    LATEST_TYPE,
    MANIFEST_TYPE,
    Root,
    Signer,
    Trust,
    looks_like_envelope,
    verify_initial_root,
)
from .trust.root import MAX_ROOT_BYTES
from .types import ObjectRef, Pointer, pointer_may_advance
from .view import View

__all__ = [
    "MAX_POINTER_BYTES",
    "Board",
    "Plan",
    "PlanStep",
    "pointer_key",
    "root_key",
    "version_key",
]

_CAS_RETRIES = 64
log = logging.getLogger("rollpatch.board")
#: Default bound on the manifests one plan reads (the newest ones up to the wanted version).
MAX_PLAN_VERSIONS = 10_000


class Board:
    """Versions of runs in a store. Thread-safe; manifests are cached (they are immutable).

    ``max_plan_versions`` bounds the manifests one :meth:`plan` reads: planning looks only at
    versions that exist (one listing), and at most at the newest ``max_plan_versions`` of them
    up to the wanted version, so no pointer value can make it walk version numbers.
    """

    def __init__(
        self,
        store: Store | str,
        *,
        cache_manifests: int = 4096,
        max_plan_versions: int = MAX_PLAN_VERSIONS,
        trust: Trust | None = None,
        signer: Signer | None = None,
    ) -> None:
        if (
            isinstance(max_plan_versions, bool)
            or not isinstance(max_plan_versions, int)
            or max_plan_versions < 2
        ):
            raise ConfigError(
                "max_plan_versions must be an integer >= 2",
                field="max_plan_versions",
                value=max_plan_versions,
            )
        self.store = open_store(store) if isinstance(store, str) else store
        self._cache = ManifestCache(cache_manifests)
        self.max_plan_versions = max_plan_versions
        #: Verifies what is read (None: verification off, unsigned boards readable).
        self.trust = trust
        #: Signs what is written (None: bare manifests and LATEST).
        self.signer = signer

    # -- reading -----------------------------------------------------------------------------

    def runs(self) -> list[str]:
        """Runs that have a LATEST pointer."""
        return runs_with_pointer(self.store.list(RUNS_PREFIX))

    def versions(self, run: str) -> list[int]:
        """Published manifests of ``run`` (ascending)."""
        prefix = versions_prefix(run)
        return numbered(self.store.list(prefix), prefix, ".json")

    def keyframes(self, run: str) -> list[int]:
        """Versions of ``run`` that have a keyframe marker (ascending)."""
        prefix = keyframes_prefix(run)
        return numbered(self.store.list(prefix), prefix, "")

    def latest(self, run: str) -> Pointer | None:
        """The LATEST pointer, or None before the first publish (verified under the trust
        root, if the board has one: TrustError when unsigned, forged, expired or older)."""
        if self.trust is not None and self.trust.roots_due():
            self.refresh_root()
        raw = self._pointer_raw(run)
        return None if raw is None else self._open_pointer(raw, run, self.trust)[0]

    def _open_pointer(
        self, raw: bytes, run: str, trust: Trust | None
    ) -> tuple[Pointer, float | None]:
        p, expires = read_latest(raw, run, trust, self.refresh_root)
        if p.manifest != version_key(run, p.version):
            raise ManifestError(
                "LATEST pointer is malformed: manifest is not the version's key",
                run=run,
                version=p.version,
            )
        return p, expires

    # -- the root of trust --------------------------------------------------------------------

    def _doc(
        self, key: str, bound: int, what: str, error: type[ManifestError], **ctx: Any
    ) -> bytes:
        """A document's bytes (a manifest, LATEST, a root), refused unread when over its
        parser's bound (a store writer would otherwise pick what every reader allocates)."""
        try:
            return self.store.get(key, max_bytes=bound)
        except TooLargeError as e:
            raise error(
                f"the {what} is larger than a {what} may be ({bound} bytes): not read",
                key=key,
                size=e.context.get("size"),
                **ctx,
            ) from None

    def roots(self) -> list[int]:
        """Root-of-trust versions on the board (ascending)."""
        return numbered(self.store.list(ROOT_PREFIX), ROOT_PREFIX, ".json")

    def root_raw(self, n: int) -> bytes | None:
        """The envelope bytes of root ``n``, or None when there is none."""
        try:
            return self._doc(root_key(n), MAX_ROOT_BYTES, "root", TrustError, reason="malformed")
        except NotFoundError:
            return None

    def put_root(self, raw: bytes) -> Root:
        """Publish a root envelope (immutable) at its version; it must be self-signed.

        Chaining to the previous root is checked by whoever verifies (and by ``rollpatch
        root`` before it calls this)."""
        root = verify_initial_root(raw)
        try:
            self.store.put(root_key(root.version), raw)
        except AlreadyExistsError:
            if self.store.get(root_key(root.version), max_bytes=MAX_ROOT_BYTES) != raw:
                raise AlreadyExistsError(
                    "another root has this version",
                    version=root.version,
                    hint="roots are immutable; make the next version",
                )
        return root

    def refresh_root(self) -> Root | None:
        """Follow root rotations on the board (each verified by the one before)."""
        return None if self.trust is None else self.trust.update_root(self.root_raw)

    def manifest(self, run: str, n: int) -> Manifest:
        """The manifest of version ``n`` (validated; cached)."""
        m = self._cache.get(run, n)
        if m is not None:
            return m
        try:
            raw = self._doc(version_key(run, n), MAX_ENVELOPE_BYTES, "manifest", ManifestError)
        except NotFoundError:
            raise VersionNotFoundError("no such version on the board", run=run, version=n) from None
        m = open_manifest(raw, run, n, self.trust, self.refresh_root)
        self._cache.put(m, run, n)
        return m

    def forget(self, run: str) -> dict[int, Manifest]:
        """Drop the run's cached manifests (they changed under the cache); what was cached."""
        return self._cache.forget(run)

    def signed(self, run: str, n: int) -> bool:
        """Whether version ``n``'s manifest is stored as a signed envelope (not verified)."""
        try:
            raw = self._doc(version_key(run, n), MAX_ENVELOPE_BYTES, "manifest", ManifestError)
        except NotFoundError:
            raise VersionNotFoundError("no such version on the board", run=run, version=n) from None
        return raw[:1] == b"{" and looks_like_envelope(
            jsonsafe.loads(
                raw,
                what="manifest",
                error=ManifestError,
                run=run,
                version=n,
                max_bytes=MAX_ENVELOPE_BYTES,
                max_depth=MAX_MANIFEST_DEPTH,
            )
        )

    def fetch(self, ref: ObjectRef) -> bytes:
        """Get an object and verify its size and BLAKE3 hash (ObjectIntegrityError if corrupt)."""
        return objects.fetch(self.store, ref)

    def fetch_view(
        self, ref: ObjectRef, *, chunk_bytes: int | None = None, into: Any = None
    ) -> View:
        """A keyframe shard read through ranged reads, verified before it is returned
        (:func:`rollpatch.objects.fetch_view`: memory is the view plus one chunk; ``into``:
        where its tensors are read to)."""
        return objects.fetch_view(self.store, ref, chunk_bytes=chunk_bytes, into=into)

    # -- writing (publisher side) ------------------------------------------------------------

    def put_object(self, run: str, data: bytes, suffix: str) -> ObjectRef:
        """Store content-addressed bytes; re-putting identical content is a no-op."""
        return objects.put_object(self.store, run, data, suffix)

    def put_view_object(self, run: str, view: View) -> ObjectRef:
        """Store ``view`` as a content-addressed safetensors object (a keyframe shard),
        streamed, never serialized whole in memory (:func:`rollpatch.objects.put_view_object`)."""
        return objects.put_view_object(self.store, run, view)

    def put_manifest(self, m: Manifest) -> None:
        """Publish a manifest (immutable). Idempotent for the identical manifest.

        A signing board replaces what is not its own manifest of this version at that key
        (:meth:`_foreign`), and logs that it did."""
        for ref in m.objects():
            info = self.store.head(ref.key)
            if info is None or info.size != ref.size:
                raise ManifestError(
                    "manifest names an object that is not durable",
                    key=ref.key,
                    hint="upload objects before the manifest; or something deleted them since "
                    "(a gc with an --orphan-grace shorter than a publish takes?)",
                )
        raw = m.stored_bytes(self.signer)
        try:
            self.store.put(version_key(m.run, m.version), raw)
        except AlreadyExistsError:
            there = self.store.get(version_key(m.run, m.version), max_bytes=MAX_ENVELOPE_BYTES)
            stored = _stored(there, m)
            foreign = None if there == raw else self._foreign(there, stored)
            if foreign is not None:  # replaced (verifying readers never took it), and said
                log.warning("%s@%d: replacing %s at its key", m.run, m.version, foreign)
                self.store.put(version_key(m.run, m.version), raw, if_absent=False)
                self._cache.drop(m.run, m.version)
            elif there != raw and (stored is None or stored.to_bytes() != m.to_bytes()):
                other = "an unreadable manifest" if stored is None else repr(stored.publisher)
                raise AlreadyExistsError(
                    f"version already published with other content, by {other} (this "
                    f"publisher is {m.publisher}): is another publisher writing this run?",
                    run=m.run,
                    version=m.version,
                    hint="one publisher per run: stop the other one (versions are immutable), "
                    "or publish under another run name",
                )
        self._mark_keyframe(m)

    def _foreign(self, there: bytes, stored: Manifest | None) -> str | None:
        """What a signing board replaces at a manifest's key (None: nothing): not this
        version's manifest (garbage, or one of its own copied from another run or version:
        sound signature, wrong names; before session 42 it blocked the publisher), or one
        none of its keys signed (the number squatted)."""
        if self.signer is None:
            return None
        if stored is None:
            return "what is not this version's manifest"
        if not self.signer.signed(there, MANIFEST_TYPE):
            return "a manifest none of the publisher's keys signed"
        return None

    def _mark_keyframe(self, m: Manifest) -> None:
        if m.is_keyframe:
            with contextlib.suppress(AlreadyExistsError):
                self.store.put(keyframe_marker_key(m.run, m.version), b"")

    def advance(self, run: str, n: int, *, refresh: bool = False) -> Pointer:
        """Move LATEST to version ``n`` if that is forward; returns the pointer now in force.

        The manifest must exist. Racing publishers cannot move it backwards: a lost
        compare-and-swap re-reads and retries; an older ``n`` leaves LATEST as it is. With a
        signer, LATEST is signed and valid for ``signer.latest_ttl_s``; ``refresh`` re-signs
        it when it already names ``n`` (a heartbeat, so followers can tell it is not frozen).
        """
        m = self.manifest(run, n)
        new = Pointer(run, n, version_key(run, n), m.target)
        for _ in range(_CAS_RETRIES):
            raw = self._pointer_raw(run)
            cur = None if raw is None else self._own_pointer(raw, run)
            same = refresh and cur is not None and cur == new
            if not same and not pointer_may_advance(cur, new):
                assert cur is not None
                return cur
            raw_new = encode_latest(new, self.signer, time.time())
            try:
                self.store.cas(pointer_key(run), raw_new, expected=raw)
                return new
            except ConflictError:
                continue
        raise ConflictError("LATEST kept moving; gave up", run=run, version=n)

    def _own_pointer(self, raw: bytes, run: str) -> Pointer | None:
        """LATEST as a writer sees it: with a signer, a pointer none of its keys signed is
        someone else's (a forgery, or garbage) and is replaced, so it cannot hold LATEST."""
        try:
            p = self._open_pointer(raw, run, None)[0]
        except ManifestError:
            if self.signer is None:
                raise
            return None
        if self.signer is not None and not self.signer.signed(raw, LATEST_TYPE):
            log.warning("%s: replacing a LATEST none of the publisher's keys signed", run)
            return None
        return p

    def _pointer_raw(self, run: str) -> bytes | None:
        try:
            return self._doc(pointer_key(run), MAX_POINTER_BYTES, "LATEST pointer", ManifestError)
        except NotAnObjectError as e:  # not "nothing published yet" (an audit, session 40)
            raise ManifestError(f"LATEST is unreadable: {e.message}", run=run) from None
        except NotFoundError:
            return None

    # -- planning ----------------------------------------------------------------------------

    def plan(
        self,
        run: str,
        have: int | None,
        want: int,
        *,
        avoid: frozenset[str] = frozenset(),
        sources: Mapping[int, str] | None = None,
    ) -> Plan:
        """Fewest bytes from ``have`` (None: nothing loaded) to ``want``.

        Reads only manifests that exist (listed), from the newest keyframe at or below
        ``want`` (or ``have``, if older) up to ``want``, and at most the newest
        ``max_plan_versions`` of those. No step uses an object whose key is in ``avoid``
        (objects that failed verification). ``sources``: older versions the engine can
        rebuild (version -> root digest), zero-cost starts checked against their manifests
        (:func:`~rollpatch.planning.cheapest_plan`).
        """
        return plan_between(
            run,
            have,
            want,
            versions=lambda: self.versions(run),
            keyframes=lambda: self.keyframes(run),
            manifest=lambda v: self.manifest(run, v),
            max_versions=self.max_plan_versions,
            avoid=avoid,
            sources=sources,
        )


def _stored(raw: bytes, m: Manifest) -> Manifest | None:
    """The manifest in stored bytes (signed or bare), unverified; None if unreadable."""
    try:
        return open_manifest(raw, m.run, m.version, None)
    except ManifestError:
        return None
