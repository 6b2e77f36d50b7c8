"""Relay vocabulary: how keys are treated (:class:`KeyKind`) and the relay's configuration."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["GiB", "KeyKind", "MiB", "RelayConfig", "classify", "manifest_version",
           "object_hash", "pointer_run", "root_version"]

MiB = 1 << 20
GiB = 1 << 30

_OBJECT = re.compile(r"runs/[^/]+/objects/([0-9a-f]{64})\.[A-Za-z0-9_-]+")
_MANIFEST = re.compile(r"runs/([^/]+)/versions/([0-9]{12})\.json")
_MARKER = re.compile(r"runs/[^/]+/keyframes/[0-9]+")
_POINTER = re.compile(r"runs/([^/]+)/LATEST")
_ROOT = re.compile(r"root/([0-9]{12})\.json")


class KeyKind(enum.Enum):
    """How the relay treats a key of the board layout (docs/board.md).

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
    for pattern, kind in ((_OBJECT, KeyKind.OBJECT), (_MANIFEST, KeyKind.MANIFEST),
                          (_MARKER, KeyKind.MARKER), (_POINTER, KeyKind.POINTER),
                          (_ROOT, KeyKind.ROOT)):
        if pattern.fullmatch(key):
            return kind
    return KeyKind.OTHER


def object_hash(key: str) -> str | None:
    """The BLAKE3 hex named by a content-addressed object key, else ``None``."""
    match = _OBJECT.fullmatch(key)
    return match.group(1) if match else None


def manifest_version(key: str) -> tuple[str, int] | None:
    """``(run, n)`` named by a manifest key, else ``None``."""
    match = _MANIFEST.fullmatch(key)
    return (match.group(1), int(match.group(2))) if match else None


def pointer_run(key: str) -> str | None:
    """The run named by a LATEST key, else ``None``."""
    match = _POINTER.fullmatch(key)
    return match.group(1) if match else None


def root_version(key: str) -> int | None:
    """The version named by a root-of-trust key, else ``None``."""
    match = _ROOT.fullmatch(key)
    return int(match.group(1)) if match else None


def _seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ConfigError(f"RelayConfig.{name} must be a finite number of seconds >= 0",
                          field=name, value=value)


def _integer(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"RelayConfig.{name} must be an integer >= {lo}", field=name,
                          value=value)


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
            raise ConfigError("RelayConfig.cache_dir must be a directory path",
                              field="cache_dir", value=self.cache_dir)
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        _integer("cache_bytes", self.cache_bytes, 1)
        _seconds("pointer_ttl", self.pointer_ttl)
        _seconds("list_ttl", self.list_ttl)
        for name in ("upstream_workers", "meta_workers", "list_page", "max_volatile_bytes",
                     "chunk_bytes"):
            _integer(name, getattr(self, name), 1)
