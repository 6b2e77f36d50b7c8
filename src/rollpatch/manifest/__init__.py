"""Version manifests: the JSON document that makes a version real (schema: docs/board.md).

A manifest lists the version's parent, format, target view digest and the objects that reach
it — patches from earlier versions (the step patch from the parent, optional skip patches from
further back) and, for keyframes, a full view — each with size and BLAKE3 hash. Parsing is
strict and bounded: a manifest that fails validation is never used.

Schema 2 (``rollpatch.manifest/2``) adds ``sliced``: tensors whose shards hold element ranges
of one tensor (FSDP-style slices) rather than whole tensors, with the whole tensor's digest
at this version; a manifest without slices is still written (and read) as schema 1.

On a signed board the stored bytes are an envelope (:mod:`rollpatch.trust`) whose payload is
:meth:`Manifest.to_bytes`: the signature binds run, version, parent, format, target digest
and every object's key, size, BLAKE3, base and base digest, so no field can be swapped for
another version's (:func:`open_manifest`).

Two modules: :mod:`.document` (the dataclasses and the bytes written) and :mod:`.parse`
(untrusted bytes → a checked :class:`Manifest`, envelopes verified).
"""

from __future__ import annotations

from .document import (
    MAX_ENVELOPE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    SCHEMA,
    KeyframeObject,
    Manifest,
    PatchObject,
    SlicedTensor,
    SliceEntry,
)
from .parse import open_manifest

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "SCHEMA",
    "KeyframeObject",
    "Manifest",
    "PatchObject",
    "SliceEntry",
    "SlicedTensor",
    "open_manifest",
]
