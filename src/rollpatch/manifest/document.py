"""The manifest document: what a version lists and the bytes written for it (schema:
docs/board.md). Reading untrusted bytes back is :mod:`.parse`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..trust import MANIFEST_TYPE, Signer
from ..types import ObjectRef

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_OBJECTS",
    "MAX_SLICES",
    "SCHEMA",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "KeyframeObject",
    "Manifest",
    "PatchObject",
    "SliceEntry",
    "SlicedTensor",
]

SCHEMA_V1 = "rollpatch.manifest/1"
#: Schema 2 adds ``sliced`` (docs/board.md); written only when a version has slices.
SCHEMA_V2 = "rollpatch.manifest/2"
SCHEMA = SCHEMA_V2
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
#: A signed manifest: base64 of the payload (4/3) plus signatures.
MAX_ENVELOPE_BYTES = MAX_MANIFEST_BYTES * 4 // 3 + 64 * 1024
#: A manifest nests 3 deep (document → object list → entry); anything far deeper is hostile.
MAX_MANIFEST_DEPTH = 8
MAX_OBJECTS = 4096
#: Slice entries of all sliced tensors together (each names a shard and an element range).
MAX_SLICES = 1 << 20


@dataclass(frozen=True)
class PatchObject:
    """A patch object from version ``base`` (its root digest ``base_digest``) to this one."""

    ref: ObjectRef
    base: int
    base_digest: str
    shard: int = 0


@dataclass(frozen=True)
class KeyframeObject:
    """A full view of this version (safetensors), one object per shard."""

    ref: ObjectRef
    shard: int = 0


@dataclass(frozen=True)
class SliceEntry:
    """Shard ``shard`` holds elements ``[offset, offset + length)`` of a tensor's flat
    (row-major) elements, published as a tensor of ``shape`` (``length`` = its product)."""

    shard: int
    offset: int
    shape: tuple[int, ...]

    @property
    def length(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SlicedTensor:
    """A tensor published as slices, one shard each; the slices tile its elements exactly.
    ``digest`` is the whole tensor's digest at this version (what a follower holds)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    slices: tuple[SliceEntry, ...]

    def layout(self) -> tuple[object, ...]:
        """Everything but the digest: equal layouts cut a view the same way."""
        return (self.name, self.dtype, self.shape, self.slices)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a follower needs to know about one version (built by keyword only: twelve
    fields, several of the same type, must never be matched by position)."""

    run: str
    version: int
    parent: int | None
    format: str
    target: str
    view_bytes: int
    created: float
    publisher: str
    patches: tuple[PatchObject, ...] = ()
    keyframes: tuple[KeyframeObject, ...] = ()
    shards: int = 1
    meta: dict[str, str] = field(default_factory=dict)
    sliced: tuple[SlicedTensor, ...] = ()

    @property
    def is_keyframe(self) -> bool:
        return bool(self.keyframes)

    def slices_of(self, shard: int) -> dict[str, SliceEntry]:
        """Tensor name → the slice ``shard`` holds of it (sliced tensors only)."""
        return {t.name: e for t in self.sliced for e in t.slices if e.shard == shard}

    def objects(self) -> list[ObjectRef]:
        return [p.ref for p in self.patches] + [k.ref for k in self.keyframes]

    def patches_from(self, base: int) -> list[PatchObject]:
        """The patch objects (one per shard) from version ``base``, sorted by shard."""
        return sorted((p for p in self.patches if p.base == base), key=lambda p: p.shard)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA_V2 if self.sliced else SCHEMA_V1,
            "run": self.run,
            "version": self.version,
            "parent": self.parent,
            "format": self.format,
            "target": self.target,
            "view_bytes": self.view_bytes,
            "created": self.created,
            "publisher": self.publisher,
            "shards": self.shards,
            "patches": [
                {
                    "key": p.ref.key,
                    "bytes": p.ref.size,
                    "b3": p.ref.b3,
                    "base": p.base,
                    "base_digest": p.base_digest,
                    "shard": p.shard,
                }
                for p in self.patches
            ],
            "keyframes": [
                {"key": k.ref.key, "bytes": k.ref.size, "b3": k.ref.b3, "shard": k.shard}
                for k in self.keyframes
            ],
            "meta": dict(self.meta),
        }
        if self.sliced:
            d["sliced"] = [
                {
                    "tensor": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "digest": t.digest,
                    "slices": [
                        {"shard": e.shard, "offset": e.offset, "shape": list(e.shape)}
                        for e in t.slices
                    ],
                }
                for t in self.sliced
            ]
        return d

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the bytes a signature covers."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    def stored_bytes(self, signer: Signer | None) -> bytes:
        """What the board stores: the envelope signed by ``signer``, or the bare JSON."""
        payload = self.to_bytes()
        return payload if signer is None else signer.seal(MANIFEST_TYPE, payload)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """The manifest in unsigned JSON ``raw``, parsed strictly (:mod:`.parse`)."""
        from .parse import manifest_from_bytes  # the parser builds this class

        return manifest_from_bytes(raw)

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """The manifest in a decoded JSON document ``d``, checked field by field."""
        from .parse import manifest_from_json

        return manifest_from_json(d)
