"""Content-addressed objects on a board: BLAKE3-named, written once, verified on every read.

An object's key is :func:`rollpatch.layout.object_key` of its BLAKE3 hash; an
:class:`~rollpatch.types.ObjectRef` (key, size, hash) is what a manifest names. Reads check
size and hash before any byte is used (:class:`~rollpatch.errors.ObjectIntegrityError` when
corrupt); writes are idempotent for identical content. :class:`rollpatch.board.Board` calls
these with its store (docs/board.md).
"""

from __future__ import annotations

from typing import Any

import blake3

from .errors import (
    AlreadyExistsError,
    NotFoundError,
    ObjectIntegrityError,
    TooLargeError,
    ViewError,
)
from .layout import object_key
from .store import Store
from .types import ObjectRef
from .view import View

__all__ = ["fetch", "fetch_view", "put_object", "put_view_object"]


def fetch(store: Store, ref: ObjectRef) -> bytes:
    """Get an object and verify its size and BLAKE3 hash (ObjectIntegrityError if corrupt)."""
    try:  # a larger object is refused before it is read (a store writer picks its size)
        data = store.get(ref.key, max_bytes=ref.size)
    except TooLargeError as e:
        raise ObjectIntegrityError(
            "object does not match its manifest entry (larger than it names; not read)",
            key=ref.key,
            expected_bytes=ref.size,
            got_bytes=e.context.get("size"),
        ) from None
    if len(data) != ref.size or blake3.blake3(data).hexdigest() != ref.b3:
        raise ObjectIntegrityError(
            "object does not match its manifest entry (corrupt or truncated)",
            key=ref.key,
            expected_bytes=ref.size,
            got_bytes=len(data),
        )
    return data


def fetch_view(
    store: Store, ref: ObjectRef, *, chunk_bytes: int | None = None, into: Any = None
) -> View:
    """A safetensors object (a keyframe shard) read tensor by tensor through ranged reads:
    memory is the view plus one chunk. Size and BLAKE3 are checked over every byte before
    the view is returned (ObjectIntegrityError if corrupt); nothing of it is usable before.
    ``into``: where tensors are read to (``io.safetensors.read_view_ranges``); on an error
    the caller must discard those destinations."""
    from .io.safetensors import STREAM_CHUNK_BYTES, read_view_ranges

    info = store.head(ref.key)
    if info is None:
        raise NotFoundError("object not found", key=ref.key, store=store.uri)
    if info.size != ref.size:
        raise ObjectIntegrityError(
            "object does not match its manifest entry (corrupt or truncated)",
            key=ref.key,
            expected_bytes=ref.size,
            got_bytes=info.size,
        )
    h = blake3.blake3()
    try:
        view = read_view_ranges(
            lambda a, b: store.get_range(ref.key, a, b),
            ref.size,
            on_bytes=h.update,
            chunk_bytes=chunk_bytes or STREAM_CHUNK_BYTES,
            into=into,
        )
    except ViewError as e:
        raise ObjectIntegrityError(
            f"object is not a valid keyframe: {e.message}",
            key=ref.key,
            hint="the stored copy is corrupt: republish it",
        ) from e
    if h.hexdigest() != ref.b3:
        raise ObjectIntegrityError(
            "object does not match its manifest entry (corrupt or truncated)",
            key=ref.key,
            expected_bytes=ref.size,
        )
    return view


def put_object(store: Store, run: str, data: bytes, suffix: str) -> ObjectRef:
    """Store content-addressed bytes; re-putting identical content is a no-op."""
    b3 = blake3.blake3(data).hexdigest()
    ref = ObjectRef(object_key(run, b3, suffix), len(data), b3)
    try:
        store.put(ref.key, data)
    except AlreadyExistsError:
        info = store.head(ref.key)
        if info is None or info.size != len(data):
            raise
    return ref


def put_view_object(store: Store, run: str, view: View) -> ObjectRef:
    """Store ``view`` as a content-addressed safetensors object (a keyframe shard),
    streamed: hashed in one pass over the tensors, uploaded in a second (multipart on S3);
    never serialized whole in memory. Idempotent like :func:`put_object`."""
    from .io.safetensors import view_chunks

    size, pieces = view_chunks(view)
    h = blake3.blake3()
    for p in pieces():
        h.update(p)
    b3 = h.hexdigest()
    ref = ObjectRef(object_key(run, b3, "safetensors"), size, b3)
    try:
        store.put_stream(ref.key, pieces(), size=size)
    except AlreadyExistsError:
        info = store.head(ref.key)
        if info is None or info.size != size:
            raise
    return ref
