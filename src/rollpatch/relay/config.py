"""Relay vocabulary: how keys are treated (:class:`KeyKind`) and the relay's configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..layout import is_keyframe_marker, manifest_version, object_hash, pointer_run, root_version
from ..validate import check_int, check_number

__all__ = [
    "GiB",
    "KeyKind",
    "MiB",
    "RelayConfig",
    "classify",
    "manifest_version",
    "object_hash",
    "pointer_run",
    "root_version",
]

MiB = 1 << 20
GiB = 1 << 30


class KeyKind(enum.Enum):
    """How the relay treats a key of the board layout (:mod:`rollpatch.layout`).

    Immutable kinds are cached on disk forever; volatile kinds are kept in memory for a short
    TTL only, because they may change upstream.
    """

    #: ``runs/R/objects/{b3}.{ext}``: content-addressed, checked against the BLAKE3 in its key.
    OBJECT = "object"
    #: ``runs/R/versions/{n:012d}.json``: parsed as a manifest naming ``(R, n)`` before caching.
    MANIFEST = "manifest"
    #: ``runs/R/keyframes/{n}``: an empty marker, immutable once written.
    MARKER = "marker"
    #: ``runs/R/LATEST``: the pointer moves; short TTL only.
    POINTER = "pointer"
    #: ``root/{n:012d}.json``: a root of trust, immutable; verified as a chain with a trust root.
    ROOT = "root"
    #: Anything else: unknown, so assumed mutable; short TTL, size-capped.
    OTHER = "other"

    @property
    def immutable(self) -> bool:
        return self in (KeyKind.OBJECT, KeyKind.MANIFEST, KeyKind.MARKER, KeyKind.ROOT)


def classify(key: str) -> KeyKind:
    """The :class:`KeyKind` of a (valid) store key."""
    if object_hash(key) is not None:
        return KeyKind.OBJECT
    if manifest_version(key) is not None:
        return KeyKind.MANIFEST
    if is_keyframe_marker(key):
        return KeyKind.MARKER
    if pointer_run(key) is not None:
        return KeyKind.POINTER
    if root_version(key) is not None:
        return KeyKind.ROOT
    return KeyKind.OTHER


def _seconds(name: str, value: object) -> None:
    check_number("RelayConfig", name, value, 0.0)


def _integer(name: str, value: object, lo: int) -> None:
    check_int("RelayConfig", name, value, lo)


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """What a relay caches, for how long, and how hard it pulls upstream."""

    #: Directory of the disk cache (created if missing; reused, and re-indexed, on restart).
    cache_dir: Path
    #: Bound on the disk cache, in bytes of cache files; least recently used entries go first.
    #: One object larger than the bound is still cached, alone, until the next insertion.
    cache_bytes: int = 10 * GiB
    #: Seconds a LATEST pointer (and any key outside the board layout) is reused; 0: never.
    pointer_ttl: float = 0.5
    #: Seconds a listing is reused; manifests and keyframe markers are found by listing.
    list_ttl: float = 1.0
    #: Seconds an object found corrupt upstream is remembered: while the upstream's ETag for it
    #: is unchanged, a request costs a HEAD instead of pulling the bad bytes again (a repaired
    #: object has a new ETag and is fetched at once); 0: never remembered.
    corrupt_ttl: float = 60.0
    #: Concurrent upstream fetches of objects and markers (large, slow transfers).
    upstream_workers: int = 16
    #: Concurrent upstream reads of pointers, manifests, listings and HEADs (small, urgent);
    #: a separate pool, so LATEST never queues behind multi-GB keyframes.
    meta_workers: int = 8
    #: Keys per page of a ``/v1/list`` answer (the client follows ``next``).
    list_page: int = 10_000
    #: Largest volatile object (LATEST, unknown keys) kept in memory; larger ones are refused.
    max_volatile_bytes: int = 16 * MiB
    #: Bytes read from a cache file per chunk of a streamed answer.
    chunk_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        if not isinstance(self.cache_dir, (str, Path)) or not str(self.cache_dir):
            raise ConfigError(
                "RelayConfig.cache_dir must be a directory path",
                field="cache_dir",
                value=self.cache_dir,
            )
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        _integer("cache_bytes", self.cache_bytes, 1)
        _seconds("pointer_ttl", self.pointer_ttl)
        _seconds("list_ttl", self.list_ttl)
        _seconds("corrupt_ttl", self.corrupt_ttl)
        for name in (
            "upstream_workers",
            "meta_workers",
            "list_page",
            "max_volatile_bytes",
            "chunk_bytes",
        ):
            _integer(name, getattr(self, name), 1)
