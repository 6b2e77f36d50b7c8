"""What the relay checks in an upstream answer before it caches or serves it.

Objects must match the BLAKE3 in their key; with a trust root, manifests must be signed under
it, LATEST must be signed, fresh and not older than what was verified before, and roots must
chain from it. Every refusal is counted by reason and logged with its key (:meth:`refuse`),
so that a refusal in the counters can be named from the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import blake3

from ..errors import (
    ManifestError,
    NotFoundError,
    ObjectIntegrityError,
    RollpatchError,
    TooLargeError,
    TrustError,
)
from ..latest import read_latest
from ..layout import root_key, version_key
from ..logs import event
from ..manifest import open_manifest
from ..manifest.retired import retired_by
from ..trust import Trust, verify_initial_root
from ..types import Pointer
from .config import (
    KeyKind,
    classify,
    manifest_version,
    object_hash,
    pointer_run,
    root_version,
)
from .metrics import Metrics

__all__ = ["StalePointer", "Verifier"]

log = logging.getLogger("rollpatch.relay")


class StalePointer(ManifestError):
    """An upstream LATEST older than one this relay verified *while that read was in flight*
    (two reads of LATEST crossed: the older answer arrived last). Not a rollback: the relay
    had no newer version when it asked. Never served or cached; counted in
    ``rollpatch_relay_stale_pointers_total``. A LATEST older than one verified before the read
    started is a rollback and refused (``trust_rollback``)."""


V = TypeVar("V")


class _Noted(Generic[V]):
    """Key -> what a checked manifest said of it: a manifest's target digest, an object's
    size (at most :data:`_MAX_TARGETS`; forgotten all at once past it: read again when
    needed)."""

    def __init__(self) -> None:
        self._by_key: dict[str, V] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            return self._by_key.get(key)

    def note(self, key: str, target: V) -> None:
        with self._lock:
            if len(self._by_key) >= _MAX_TARGETS:
                self._by_key.clear()
            self._by_key[key] = target

    def forget(self, key: str) -> None:
        with self._lock:
            self._by_key.pop(key, None)


_MAX_TARGETS = 65536


class Verifier:
    """The relay's checks of upstream bytes. ``get`` reads a key upstream (counted by the
    relay); it fetches newer roots when a signature names a key the trust root lacks."""

    def __init__(self, get: Callable[[str], bytes], trust: Trust | None, metrics: Metrics) -> None:
        self._get = get
        #: The root of trust (None: only object hashes and strict parsing are checked).
        self.trust = trust
        self._metrics = metrics
        #: run -> (highest LATEST version this process verified, monotonic time it was first
        #: verified): tells an overtaken read from a rollback (:class:`StalePointer`).
        self._verified_at: dict[str, tuple[int, float]] = {}
        #: One pointer check at a time: the trust root's highest version and ``_verified_at``
        #: move together, so a crossing read that the trust root already calls a rollback
        #: always finds the newer version's time here (and is stale, not refused).
        self._pointer_lock = threading.Lock()
        #: Manifest key -> the target digest it names (checked manifests, bounded).
        self.targets: _Noted[str] = _Noted()
        #: Object key -> its size, as a checked manifest names it: the relay reads no more
        #: of it upstream (a store writer's giant object is refused unread; session 40).
        self.sizes: _Noted[int] = _Noted()
        #: Called with (run, why) when a checked manifest's patch names another digest for
        #: its base version than the manifest this relay checked for it: the run was
        #: published again under its name (set by the relay: its cached manifests go).
        self.on_lineage: Callable[[str, str], None] | None = None
        #: Roots of the verified chain by version, as read upstream (immutable once verified).
        self._roots: dict[int, bytes] = {}

    def bound(self, key: str) -> int | None:
        """How much of ``key`` the relay reads upstream: a document's bound, an object's size
        as a checked manifest names it (None: not named yet, unbounded)."""
        kind = classify(key)
        return self.sizes.get(key) if kind is KeyKind.OBJECT else kind.max_bytes

    def oversized(self, key: str, e: TooLargeError) -> RollpatchError:
        """What upstream's ``key`` over :meth:`bound` is: an object, corrupt (counted
        ``too_large``); anything else, the store's refusal as it is."""
        if classify(key) is not KeyKind.OBJECT:
            return e
        self.refuse("too_large", key=key, size=e.context.get("size"))
        return ObjectIntegrityError(
            "upstream object is larger than its manifest names; refused unread",
            key=key,
            size=e.context.get("size"),
            expected=e.context.get("max_bytes"),
        )

    def check(self, key: str, kind: KeyKind, data: bytes) -> str:
        """Verify upstream bytes of ``key`` before they are cached; return their BLAKE3 (hex).
        Raises ``ObjectIntegrityError`` (an object's hash) or ``ManifestError`` (a manifest
        or root refused), each refusal counted and logged."""
        b3 = blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
        if kind is KeyKind.OBJECT and b3 != object_hash(key):
            self.refuse("hash_mismatch", key=key, size=len(data))
            raise ObjectIntegrityError(
                "upstream object does not match the BLAKE3 in its key; refused, not cached",
                key=key,
                size=len(data),
                hint="the upstream copy is corrupt or truncated: republish it",
            )
        named = manifest_version(key)
        if kind is KeyKind.MANIFEST and named is not None:
            try:
                m = open_manifest(data, named[0], named[1], self.trust, self._refresh_root)
                self.targets.note(key, m.target)
                for ref in m.objects():
                    self.sizes.note(ref.key, ref.size)
                for p in m.patches:
                    known = self.targets.get(version_key(named[0], p.base))
                    if known is not None and known != p.base_digest and self.on_lineage:
                        self.on_lineage(
                            named[0],
                            f"version {named[1]}'s patch from {p.base} starts at "
                            f"{p.base_digest[:16]}, the cached version {p.base} ends at "
                            f"{known[:16]}",
                        )
                        break
            except ManifestError as e:
                by = self._retired(data, named, e)
                self.refuse("invalid_manifest" if by is None else "trust_retired", key=key, error=e)
                raise _refused("manifest", e, key, retired_root=by) from None
        n = root_version(key)
        if kind is KeyKind.ROOT and n is not None:
            try:
                self._check_root(n, data, b3)
            except ManifestError as e:
                self.refuse("invalid_root", key=key, error=e)
                raise _refused("root", e, key) from None
        return b3

    def manifest_target(self, key: str, raw: bytes) -> str | None:
        """The target digest the manifest bytes ``raw`` (cached under ``key``) name, parsed
        once and remembered; None when they do not parse (they were checked when cached)."""
        got = self.targets.get(key)
        named = manifest_version(key)
        if got is None and named is not None:
            try:
                got = open_manifest(raw, named[0], named[1], None).target
            except ManifestError:
                return None
            self.targets.note(key, got)
        return got

    def _retired(self, data: bytes, named: tuple[str, int], e: ManifestError) -> int | None:
        """The earlier root of this relay's verified chain whose keys signed the manifest it
        refuses (a planned rotation retired them), else None (docs/trust.md)."""
        try:
            return retired_by(data, named[0], named[1], self.trust, e, self._chain_root)
        except RollpatchError:  # a root unreadable upstream now: a plain refusal
            return None

    def refuse(
        self, reason: str, *, key: str, error: ManifestError | None = None, **info: Any
    ) -> None:
        """Every refusal of an upstream answer: counted by reason and logged with its reason,
        key and error, so that a refusal in the counters can be named from the log (a trust
        refusal by its reason, ``trust_retired`` for a manifest a rotation retired)."""
        if isinstance(error, TrustError) and not reason.startswith("trust_"):
            reason = f"trust_{error.reason}"
        self._metrics.inc("rollpatch_relay_refused_total", reason=reason)
        if error is not None:
            info["error"] = error.message
        # a manifest a planned rotation retired is no attack: counted, said at INFO
        level = logging.INFO if reason == "trust_retired" else logging.WARNING
        event(log, "refused", level, reason=reason, key=key, **info)

    def _chain_root(self, n: int) -> bytes | None:
        """Root ``n``'s bytes, read upstream once: kept when they are the root this relay's
        chain verified as ``n`` (each refusal of a retired manifest read every earlier root
        upstream again)."""
        kept = self._roots.get(n)
        if kept is None:
            kept = self._upstream_root(n)
            trust = self.trust
            if kept and trust and blake3.blake3(kept).hexdigest() == trust.verified_root(n):
                self._roots[n] = kept
        return kept

    def _upstream_root(self, n: int) -> bytes | None:
        try:
            return self._get(root_key(n))
        except NotFoundError:
            return None

    def _refresh_root(self) -> None:
        if self.trust is not None:
            self.trust.update_root(self._upstream_root)

    def _check_root(self, n: int, data: bytes, b3: str) -> None:
        """A root is cached only when it is the one this relay's chain verified as ``n``."""
        if verify_initial_root(data).version != n:
            raise ManifestError("root names another version", version=n)
        if self.trust is None:
            return
        if n > self.trust.root.version:
            self._refresh_root()
        if self.trust.verified_root(n) != b3:
            raise TrustError(
                "root is not in the chain this relay verified from its trust root",
                reason="root",
                version=n,
            )

    def check_pointer(
        self, key: str, data: bytes, *, started: float | None = None
    ) -> Pointer | None:
        """Refuse (``ManifestError``) LATEST bytes that fail its checks under the trust root;
        :class:`StalePointer` when they are older than a version verified after ``started``
        (monotonic: when the read that returned them was sent). The pointer, when ``key`` is
        a run's LATEST."""
        run = pointer_run(key)
        if run is None:
            return None
        with self._pointer_lock:
            return self._check_pointer(key, run, data, started)

    def _check_pointer(self, key: str, run: str, data: bytes, started: float | None) -> Pointer:
        try:
            if self.trust is not None and self.trust.roots_due():
                self._refresh_root()
            p, _ = read_latest(data, run, self.trust, self._refresh_root)
            if p.manifest != version_key(run, p.version):
                raise ManifestError(
                    "LATEST names another key than its version's manifest",
                    run=run,
                    version=p.version,
                )
            seen = self._verified_at.get(run)
            if seen is None or p.version > seen[0]:
                self._verified_at[run] = (p.version, time.monotonic())
            return p
        except TrustError as e:
            seen = self._verified_at.get(run)
            if e.reason == "rollback" and started is not None and seen and seen[1] > started:
                self._metrics.inc("rollpatch_relay_stale_pointers_total")
                event(log, "stale_pointer", logging.INFO, key=key, error=e.message)
                raise StalePointer(
                    "upstream LATEST was overtaken by a newer one verified while it was read",
                    key=key,
                    verified=seen[0],
                ) from None
            self.refuse("invalid_pointer", key=key, error=e)
            raise _refused("LATEST", e, key) from None
        except ManifestError as e:
            self.refuse("invalid_pointer", key=key, error=e)
            raise _refused("LATEST", e, key) from None


def _refused(
    what: str, e: ManifestError, key: str, *, retired_root: int | None = None
) -> ManifestError:
    """What the relay answers for ``what`` (manifest, root, LATEST) it refused: a trust
    refusal stays a :class:`TrustError` with its reason, which reaches the relay's clients
    (``trust_reason`` in its 502) and the relays after it in a chain (audit I, session 42:
    followers behind a relay saw a StoreError with no reason); with ``retired_root`` for a
    manifest signed only by keys of that earlier root (``status --trust`` lists it retired)."""
    message = f"upstream {what} refused: {e.message}"
    if isinstance(e, TrustError):
        extra = {} if retired_root is None else {"retired_root": retired_root}
        return TrustError(message, reason=e.reason, key=key, hint=e.hint, **extra)
    return ManifestError(message, key=key, hint=e.hint)
