"""The board's key layout: the one module that spells the keys of a board (docs/board.md).

::

    runs/{run}/LATEST                      pointer JSON (compare-and-swap, never backwards)
    runs/{run}/PUBLISHER                   the publisher's lease JSON (compare-and-swap)
    runs/{run}/versions/{n:012d}.json      manifest (put-if-absent: immutable)
    runs/{run}/keyframes/{n:012d}          marker: version n has a keyframe (cheap listing)
    runs/{run}/objects/{b3}.{rpatch|safetensors}   content-addressed objects
    root/{n:012d}.json                     root of trust, version n (signed boards; immutable)

Builders (``*_key``, ``*_prefix``) make keys; parsers (``object_hash``, ``manifest_version``,
``pointer_run``, ``root_version``, ``is_keyframe_marker``, ``numbered``) read them back.
The board writes and lists through the builders, the relay classifies what it caches through
the parsers, retention deletes through both; nothing else spells a key. Pure: no I/O, and no
import of ours but the run-name rule.
"""

from __future__ import annotations

import re

from .types import check_run

__all__ = [
    "ROOT_PREFIX",
    "RUNS_PREFIX",
    "is_keyframe_marker",
    "keyframe_marker_key",
    "keyframes_prefix",
    "manifest_version",
    "numbered",
    "object_hash",
    "object_key",
    "objects_prefix",
    "pointer_key",
    "pointer_run",
    "publisher_lease_key",
    "root_key",
    "root_version",
    "run_prefix",
    "runs_with_pointer",
    "version_key",
    "versions_prefix",
]

RUNS_PREFIX = "runs/"
ROOT_PREFIX = "root/"
_POINTER_NAME = "LATEST"

_OBJECT = re.compile(r"runs/[^/]+/objects/([0-9a-f]{64})\.[A-Za-z0-9_-]+")
_MANIFEST = re.compile(r"runs/([^/]+)/versions/([0-9]{12})\.json")
_MARKER = re.compile(r"runs/[^/]+/keyframes/[0-9]+")
_POINTER = re.compile(r"runs/([^/]+)/LATEST")
_ROOT = re.compile(r"root/([0-9]{12})\.json")
_VERSION_STEM = re.compile(r"[0-9]{1,16}")


# -- builders ----------------------------------------------------------------------------------


def run_prefix(run: str) -> str:
    """``runs/{run}/``: everything of one run (the run name is checked)."""
    return f"{RUNS_PREFIX}{check_run(run)}/"


def pointer_key(run: str) -> str:
    """The LATEST pointer of ``run``."""
    return f"{run_prefix(run)}{_POINTER_NAME}"


def publisher_lease_key(run: str) -> str:
    """The lease of the publisher writing ``run`` (one publisher per run)."""
    return f"{run_prefix(run)}PUBLISHER"


def versions_prefix(run: str) -> str:
    """The prefix listing ``run``'s manifests."""
    return f"{run_prefix(run)}versions/"


def version_key(run: str, n: int) -> str:
    """The manifest of version ``n`` of ``run``."""
    return f"{versions_prefix(run)}{n:012d}.json"


def keyframes_prefix(run: str) -> str:
    """The prefix listing ``run``'s keyframe markers."""
    return f"{run_prefix(run)}keyframes/"


def keyframe_marker_key(run: str, n: int) -> str:
    """The empty marker saying version ``n`` of ``run`` has a keyframe."""
    return f"{keyframes_prefix(run)}{n:012d}"


def objects_prefix(run: str) -> str:
    """The prefix listing ``run``'s content-addressed objects."""
    return f"{run_prefix(run)}objects/"


def object_key(run: str, b3: str, suffix: str) -> str:
    """The content-addressed object with BLAKE3 ``b3`` (hex) and ``suffix`` (no dot)."""
    return f"{objects_prefix(run)}{b3}.{suffix}"


def root_key(n: int) -> str:
    """The key of root-of-trust version ``n`` (board-wide: every run shares the root)."""
    return f"{ROOT_PREFIX}{n:012d}.json"


# -- parsers -----------------------------------------------------------------------------------


def object_hash(key: str) -> str | None:
    """The BLAKE3 hex named by a content-addressed object key, else ``None``."""
    match = _OBJECT.fullmatch(key)
    return match.group(1) if match else None


def manifest_version(key: str) -> tuple[str, int] | None:
    """``(run, n)`` named by a manifest key, else ``None``."""
    match = _MANIFEST.fullmatch(key)
    return (match.group(1), int(match.group(2))) if match else None


def is_keyframe_marker(key: str) -> bool:
    """Whether ``key`` is a keyframe marker."""
    return _MARKER.fullmatch(key) is not None


def pointer_run(key: str) -> str | None:
    """The run named by a LATEST key, else ``None``."""
    match = _POINTER.fullmatch(key)
    return match.group(1) if match else None


def root_version(key: str) -> int | None:
    """The version named by a root-of-trust key, else ``None``."""
    match = _ROOT.fullmatch(key)
    return int(match.group(1)) if match else None


def runs_with_pointer(keys: list[str]) -> list[str]:
    """The runs that have a LATEST pointer among listed ``runs/`` keys (sorted)."""
    return sorted({k.split("/")[1] for k in keys if k.endswith(f"/{_POINTER_NAME}")})


def numbered(keys: list[str], prefix: str, suffix: str) -> list[int]:
    """The version numbers in ``prefix{n}{suffix}`` keys, ascending (others are ignored)."""
    out = []
    for k in keys:
        stem = k[len(prefix) :]
        if suffix:
            if not stem.endswith(suffix):
                continue
            stem = stem[: -len(suffix)]
        if _VERSION_STEM.fullmatch(stem):
            out.append(int(stem))
    return sorted(out)
