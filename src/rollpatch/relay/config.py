"""Relay vocabulary: how keys are treated (:class:`KeyKind`) and the relay's configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from ..config import check_fields, parse_size, setting
from ..latest import MAX_POINTER_BYTES
from ..layout import is_keyframe_marker, manifest_version, object_hash, pointer_run, root_version
from ..manifest import MAX_ENVELOPE_BYTES
from ..trust.root import MAX_ROOT_BYTES

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

    @property
    def max_bytes(self) -> int | None:
        """What a document of this kind may be (its parser's bound; a marker is empty on the
        board), read no further; None: objects (their size is a manifest's) and others."""
        return {
            KeyKind.MANIFEST: MAX_ENVELOPE_BYTES,
            KeyKind.ROOT: MAX_ROOT_BYTES,
            KeyKind.POINTER: MAX_POINTER_BYTES,
            KeyKind.MARKER: 1024,
        }.get(self)


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


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """What a relay caches, for how long, and how hard it pulls upstream."""

    #: Created if missing; reused, and re-indexed, on restart.
    cache_dir: Path = setting(
        flag="--cache", help="cache directory (kept across restarts)", metavar="DIR"
    )
    #: Least recently used entries go first; one object larger than the bound is still
    #: cached, alone, until the next insertion.
    cache_bytes: int = setting(
        10 * GiB,
        lo=1,
        parse=parse_size,
        metavar="SIZE",
        help="disk cache bound in bytes of cache files, e.g. 200G",
    )
    recheck_s: float = setting(
        600.0,
        lo=0.0,
        lo_open=True,
        hi=1e7,
        help="seconds after which a cached object is re-hashed before it is served again "
        "(disk rot under a running relay is found within it)",
    )
    #: Any key outside the board layout too.
    pointer_ttl: float = setting(0.5, lo=0.0, help="seconds LATEST may be reused (0: never)")
    #: Manifests and keyframe markers are found by listing.
    list_ttl: float = setting(1.0, lo=0.0, help="seconds a listing may be reused")
    #: docs/relay.md, "Long-poll".
    hold_s: float = setting(
        30.0,
        lo=0.0,
        help="longest a long-poll of LATEST (?after=N&wait=S) is held (0: answered at once)",
    )
    #: A relay upstream is long-polled instead.
    watch_s: float = setting(
        0.05,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds between two reads of LATEST while long-polls wait, when the upstream "
        "is a directory or S3 board",
    )
    prefetch: bool = setting(
        True,
        help="on learning a new version, fetch its manifest and step patch objects before "
        "anyone asks",
    )
    #: docs/relay.md, "Push": with a relay upstream, the new version's bytes come in the answer
    #: that announces it instead of one round trip after it.
    push_bytes: int = setting(
        64 * MiB,
        lo=0,
        hi=1 << 30,
        parse=lambda text: 0 if text.strip() == "0" else parse_size(text),
        metavar="SIZE",
        help="bytes of a new version's manifest and step patch objects this relay accepts "
        "pushed in its upstream relay's long-poll answer (0: fetch them after the answer)",
    )
    #: While the upstream's ETag for it is unchanged, a request costs a HEAD instead of pulling
    #: the bad bytes again (a repaired object has a new ETag and is fetched at once).
    corrupt_ttl: float = setting(
        60.0,
        lo=0.0,
        help="seconds an object found corrupt upstream is remembered (0: never)",
    )
    upstream_workers: int = setting(
        16,
        lo=1,
        flag="--workers",
        help="concurrent upstream fetches of objects and markers (large, slow transfers)",
    )
    #: A separate pool, so LATEST never queues behind multi-GB keyframes.
    meta_workers: int = setting(
        8,
        lo=1,
        help="concurrent upstream reads of pointers, manifests, listings and HEADs",
    )
    #: The client follows ``next``.
    list_page: int = setting(10_000, lo=1, help="keys per page of a /v1/list answer")
    max_volatile_bytes: int = setting(
        16 * MiB,
        lo=1,
        parse=parse_size,
        metavar="SIZE",
        help="largest volatile object (LATEST, unknown keys) kept in memory; larger: refused",
    )
    stream_chunk_bytes: int = setting(
        32 * MiB,
        lo=1,
        parse=parse_size,
        metavar="SIZE",
        help="an upstream object larger than this is fetched in ranges of this size straight "
        "to the cache file, hashed as it arrives (memory per fetch: one range, not the object)",
    )
    #: docs/relay.md, "Cache": an object the cache disk refuses is served from memory.
    uncached_bytes: int = setting(
        1 * GiB,
        lo=0,
        parse=lambda text: 0 if text.strip() == "0" else parse_size(text),
        metavar="SIZE",
        help="memory for objects over --stream-chunk-bytes that the cache disk refuses (full, "
        "read only), served from memory while any answer sends them; one that does not fit: "
        "503 (its clients retry)",
    )
    chunk_bytes: int = setting(
        1 * MiB,
        lo=1,
        parse=parse_size,
        metavar="SIZE",
        help="bytes read from a cache file per chunk of a streamed answer (an answer of at "
        "most this many bytes is read at once and sent as one body)",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
