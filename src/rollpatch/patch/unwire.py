"""The reading side of the patch container (docs/patch-format.md §1-§2): a patch's payloads
checked against their BLAKE3 and decoded against a base view; :mod:`.wire` writes them."""

from __future__ import annotations

from typing import Any

import blake3
import numpy as np

from ..errors import BaseMismatchError, PatchDecodeError, RollpatchError
from ..kinds import KINDS
from ..view import View, WordSource
from .codecs import decode_full, get_delta_codec
from .header import MIN_FULL_BOUND, inspect
from .model import DeltaOp, DropOp, FullOp, Patch, TensorPatch
from .wire import _map

__all__ = ["decode", "decode_entry"]


def decode(
    blob: bytes | memoryview,
    base: WordSource,
    *,
    check_base: bool = True,
    max_full_bytes: int | None = None,
    parallel: bool = True,
) -> Patch:
    """Parse and decode a patch against its ``base`` view (or any word source).

    With ``check_base`` and a :class:`View` base, the root digest is compared first (cached
    digests make this cheap), so a wrong base fails fast with :class:`BaseMismatchError`.
    ``max_full_bytes`` bounds each ``full`` tensor before it is decompressed (default: the
    larger of the base view's size and 256 MiB; any other word source: 256 MiB).
    ``parallel=False``: one tensor after another, in the header's order, each base tensor
    read just before it is decoded (a word source that reads a tensor by a collective, or
    holds one tensor's words at a time).
    """
    header = inspect(blob)
    if check_base and isinstance(base, View) and base.digest(header.digest) != header.base:
        raise BaseMismatchError(
            "the view is not this patch's base",
            expected=header.base[:16],
            actual=base.digest(header.digest)[:16],
        )
    if max_full_bytes is None:
        max_full_bytes = max(MIN_FULL_BOUND, base.nbytes if isinstance(base, View) else 0)
    limit = max_full_bytes
    mv = memoryview(blob)

    def one(e: dict[str, Any]) -> TensorPatch:
        start = header.payload_start + e["offset"]
        payload = mv[start : start + e["length"]]
        if blake3.blake3(payload).hexdigest() != e["b3"]:
            raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
        return decode_entry(e, payload, base, limit)

    decoded = _map(one, header.tensors) if parallel else [one(e) for e in header.tensors]
    return Patch(
        header.base, header.target, {t.name: t for t in decoded}, header.meta, header.digest
    )


def decode_entry(
    e: dict[str, Any], payload: memoryview, base: WordSource, limit: int
) -> TensorPatch:
    """One header entry's payload (checksum already checked) decoded against ``base``."""
    name, op, kind = e["name"], e["op"], KINDS[e["kind"]]
    shape = tuple(e["shape"])
    if op == "drop":
        return TensorPatch(name, kind, shape, e["base"], None, DropOp())
    if op == "full":
        size = int(np.prod(shape, dtype=np.int64)) * kind.word_dtype.itemsize
        if size > limit:
            raise PatchDecodeError(
                "a full tensor is larger than the decoder's bound",
                tensor=name,
                size=size,
                bound=limit,
                hint="pass max_full_bytes= to allow larger new tensors",
            )
        t = decode_full(e["codec"], payload, kind, shape)
        return TensorPatch(name, kind, shape, e["base"], e["target"], FullOp(t))
    if name not in base:
        raise BaseMismatchError("the base lacks a tensor the patch changes", tensor=name)
    t = base[name]
    if t.kind != kind or t.shape != shape:
        raise BaseMismatchError(
            "base tensor layout differs from the patch",
            tensor=name,
            kind=t.kind.name,
            shape=t.shape,
        )
    codec = get_delta_codec(e["codec"])
    try:
        positions, old, new = codec.decode(payload, t, e["changed"])
    except RollpatchError as err:
        err.context.setdefault("tensor", name)
        raise
    return TensorPatch(name, kind, shape, e["base"], e["target"], DeltaOp(positions, old, new))
