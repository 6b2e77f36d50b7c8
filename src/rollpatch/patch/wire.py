"""The patch container: bytes ↔ :class:`Patch` (normative spec: docs/patch-format.md).

Parsing is bounded and validates in this order — magic, version, flags, lengths, header
checksum, JSON schema and limits — before any payload is touched; each payload's checksum is
verified before it is decoded. Hostile input raises :class:`PatchDecodeError` (or
:class:`CodecError`), never a numpy exception, never an allocation larger than the base view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np

from .. import native
from ..errors import CodecError
from ..view import View, WordSource, sum_add
from .codecs import DELTA_CODECS, encode_full
from .header import (
    _DELTA_BY_VERSION,
    DIGESTS,
    MAGIC,
    MAX_HEADER_BYTES,
    MIN_FULL_BOUND,
    VERSION,
    VERSIONS,
    PatchHeader,
    _b3,
    inspect,
    pack_header,
)
from .model import DeltaOp, DropOp, FullOp, Patch, TensorPatch
from .ops import same_layout

__all__ = [
    "DENSE",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MIN_FULL_BOUND",
    "PatchHeader",
    "assemble",
    "assemble_patch",
    "encode",
    "encode_views",
    "entry",
    "inspect",
]

#: Above this density the encoders also try XOR+zstd and keep the smaller payload.
DENSE = 0.25  # an encoder choice, not format: XOR+zstd wins only on near-random changes


def _pool() -> ThreadPoolExecutor:
    """Tensors are coded concurrently: the native core and numpy release the GIL."""
    return ThreadPoolExecutor(max_workers=max(1, min(4, native.threads())))


def _map(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, tensors at once on :func:`_pool` (inline on one thread:
    no hand-off to a worker per tensor)."""
    if native.threads() == 1:
        return [fn(x) for x in items]
    with _pool() as pool:
        return list(pool.map(fn, items))


def encode(patch: Patch, base: WordSource, *, version: int = VERSION) -> bytes:
    """Serialize ``patch``; ``base`` (the patch's base view) drives the context model.

    ``version`` 2 (default) needs ``rp.sum128.v1`` digests, version 1 ``rp.blake3.v1``.
    """
    if version not in VERSIONS or patch.digest != DIGESTS[version]:
        raise CodecError(
            f"patch format {version} carries {DIGESTS.get(version)} digests",
            digest=patch.digest,
            hint="diff(a, b, digest=...) to match",
        )
    names = sorted(patch.tensors)
    coded = _map(lambda n: _encode_tensor(patch.tensors[n], base, version), names)
    return assemble_patch(patch, dict(zip(names, coded, strict=True)), version)


def assemble_patch(
    patch: Patch, coded: Mapping[str, tuple[str, bytes]], version: int = VERSION
) -> bytes:
    """The container around ``patch``'s tensors, each already coded as (codec id, payload)."""
    parts: list[tuple[dict[str, Any], bytes | memoryview]] = [
        (
            entry(
                name,
                tp.op,
                tp.kind,
                tp.shape,
                tp.n_changed,
                tp.base_digest,
                tp.target_digest,
                coded[name][0],
            ),
            coded[name][1],
        )
        for name, tp in sorted(patch.tensors.items())
    ]
    return assemble(patch.base, patch.target, patch.meta, patch.digest, parts, version)


def encode_views(a: View, b: View, *, meta: dict[str, str] | None = None) -> bytes:
    """``encode(diff(a, b), a)`` in one native pass per tensor, byte for byte.

    No decoded patch is built: memory beyond the two views is the patch plus one chunk's
    records per thread (and one XOR temporary for dense tensors, which may ship as XOR+zstd).
    The payloads are coded into one native buffer in name order, which becomes the patch's
    payload section (copied out whole, its pages given back as the patch fills), so the
    payloads and the patch are not both held; a full tensor or an XOR+zstd payload makes the
    patch be joined from separate payloads instead.
    """
    return _encode_views(a, b, meta, keep=False)[0]


def encode_views_patch(
    a: View, b: View, *, meta: dict[str, str] | None = None
) -> tuple[bytes, Patch]:
    """:func:`encode_views` and ``diff(a, b)`` (equal, tensor for tensor) from the same pass:
    the changes the encoder found are kept instead of compared again (a publisher composing
    skip patches needs the step's changes)."""
    blob, patch = _encode_views(a, b, meta, keep=True)
    assert patch is not None
    return blob, patch


def _encode_views(
    a: View, b: View, meta: dict[str, str] | None, *, keep: bool
) -> tuple[bytes, Patch | None]:
    from .codec_v2 import CtxGolombV2
    from .codecs import XorZstd

    native.require()
    codec = CtxGolombV2()
    names = sorted(set(a) | set(b))
    same = sorted(n for n in a if n in b and same_layout(a[n], b[n]))
    dense = {}  # every tensor's chunk ranges at once, on the core's T threads
    arena = None  # their payloads, in name order, in one native buffer (views of it in dense)
    if not keep:
        arena, coded = codec.encode_dense_arena([(a[n], b[n]) for n in same])
        dense = dict(zip(same, coded))
        del coded
    light = _light(a, b, dense, codec.codec_id)

    def one(name: str) -> tuple[dict[str, Any], bytes | memoryview, TensorPatch | None] | None:
        if name not in b:
            ta = a[name]
            dropped = a.tensor_digest(name)
            tp = TensorPatch(name, ta.kind, ta.shape, dropped, None, DropOp()) if keep else None
            return (
                entry(name, "drop", ta.kind, ta.shape, ta.n_elements, dropped, None, "none"),
                b"",
                tp,
            )
        tb = b[name]
        if name not in a or not same_layout(a[name], tb):
            codec_id, full = encode_full(tb)
            added = a.tensor_digest(name) if name in a else None
            target = b.tensor_digest(name)
            tp = None
            if keep:
                tp = TensorPatch(name, tb.kind, tb.shape, added, target, FullOp(tb.copy()))
            return (
                entry(name, "full", tb.kind, tb.shape, tb.n_elements, added, target, codec_id),
                full,
                tp,
            )
        ta = a[name]
        tp = None
        payload: bytes | memoryview
        if keep:
            payload, change, pos, old, new = codec.encode_dense_changes(ta, tb)
            k = int(pos.size)
        else:
            payload, k, change = dense.pop(name)
        st = a.cached_sum_state(name)
        if st is not None and b.cached_sum_state(name) is None:
            # every word was compared: b's state is a's plus the change of the changed words
            # (none changed: a's state), so the root digest hashes no tensor again
            b.update_sum_state(name, sum_add(st, change))
        if k == 0:
            return None
        codec_id = codec.codec_id
        if _dense_alt(k, ta):
            alt = XorZstd().compress(np.bitwise_xor(ta.data, tb.data))
            if len(alt) < len(payload):
                codec_id, payload = "rp.xorzstd.v1", alt
        base, target = a.tensor_digest(name), b.tensor_digest(name)
        if keep:
            tp = TensorPatch(name, ta.kind, ta.shape, base, target, DeltaOp(pos, old, new))
        return entry(name, "delta", ta.kind, ta.shape, k, base, target, codec_id), payload, tp

    # what is left per tensor is a few dict and digest operations (Python, under the GIL): on
    # a pool they only contend for it, so they run here; a pool is for real work (a full
    # tensor's zstd, a pass with kept changes, a dense tensor's XOR+zstd alternative, the
    # digests of a base whose sums are not known yet)
    heavy = [n for n in names if n in b and n not in light]
    ahead = dict(zip(heavy, _map(one, heavy)))
    done = [
        x
        for x in (
            light.pop(n) if n in light else ahead.pop(n) if n in ahead else one(n) for n in names
        )
        if x is not None
    ]
    parts = [(e, p) for e, p, _ in done]
    tensors = {tp.name: tp for _, _, tp in done if tp is not None}
    del done  # parts holds the only references to the payloads: assemble releases each
    # the arena is the payload section when every payload shipped is its bytes, all of them
    # (no full tensor, no XOR+zstd alternative taken): then it is copied out whole
    whole = [arena] if arena is not None and _is_arena(parts, arena) else None
    del arena
    blob = assemble(a.digest(), b.digest(), meta or {}, "rp.sum128.v1", parts, VERSION, whole)
    if not keep:
        return blob, None
    return blob, Patch(a.digest(), b.digest(), tensors, meta=dict(meta or {}))


_Part = tuple[dict[str, Any], bytes | memoryview, TensorPatch | None]


def _is_arena(parts: list[tuple[dict[str, Any], bytes | memoryview]], arena: Any) -> bool:
    """Whether the parts' payloads, in order, are exactly ``arena``'s bytes: each non-empty
    one a view of it (the views partition it, in the parts' order) and together all of it."""
    total = 0
    for _, p in parts:
        if len(p):
            if not isinstance(p, memoryview) or p.obj is not arena:
                return False
            total += len(p)
    return total == len(arena)


def _light(
    a: View, b: View, dense: dict[str, tuple[memoryview, int, tuple[int, int]]], codec_id: str
) -> dict[str, _Part | None]:
    """The parts of the common tensors, taken out of ``dense``: coded payloads that ship as
    they are (not dense enough for XOR+zstd) over a base whose sums are known (None: no
    change). ``b``'s states (and unchanged tensors' digests) are carried over from ``a``'s
    first, so the root digest hashes no tensor again. One loop, no closure or pool: this is
    the per-tensor Python of an encode, and it runs serially after the native pass."""
    b.carry_sums(a, {name: d[2] for name, d in dense.items()})
    out: dict[str, _Part | None] = {}
    for name, (payload, k, _) in dense.items():
        if a.cached_sum_state(name) is None:
            continue
        if k == 0:
            out[name] = None
            continue
        ta = a[name]
        if _dense_alt(k, ta):
            continue
        base, target = a.tensor_digest(name), b.tensor_digest(name)
        e = entry(name, "delta", ta.kind, ta.shape, k, base, target, codec_id)
        out[name] = (e, payload, None)
    for name in out:
        del dense[name]
    return out


def _dense_alt(changed: int, t: Any) -> bool:
    """Whether a delta is dense enough that XOR+zstd may be the smaller payload."""
    return changed > DENSE * t.n_elements


def entry(
    name: str,
    op: str,
    kind: Any,
    shape: tuple[int, ...],
    changed: int,
    base: str | None,
    target: str | None,
    codec: str,
) -> dict[str, Any]:
    """One tensor's header entry (offset, length and checksum are added by assemble)."""
    return {
        "name": name,
        "op": op,
        "kind": kind.name,
        "dtype": kind.dtype,
        "shape": list(shape),
        "changed": changed,
        "base": base,
        "target": target,
        "codec": codec,
    }


def assemble(
    base: str,
    target: str,
    meta: Any,
    digest: str,
    parts: list[tuple[dict[str, Any], bytes | memoryview]],
    version: int,
    arena: list[Any] | None = None,
) -> bytes:
    """The container (§1-§2) around per-tensor (entry, payload) parts in name order.

    Consumes ``parts`` (cleared): the patch is built while the payloads are released, so
    the payloads and the patch are never both held whole. ``arena``: a list holding one
    native buffer whose bytes are exactly the payloads in order (the parts' payloads are views
    of it: :func:`encode_views`); it is taken out of the list and, once the views are
    released, copied out whole with its pages given back as they are copied.
    """
    entries, offset = _entries(parts)
    header: dict[str, Any] = {"format": "rollpatch.patch", "version": version}
    if version >= 2:
        header["digest"] = digest
    header.update({"base": base, "target": target, "payload_bytes": offset, "meta": dict(meta)})
    prefix = pack_header(header, entries, version)
    del entries, header  # the list (the entries themselves go with parts, cleared below)
    if arena:
        parts.clear()  # the views of the arena released: the pieces list holds it alone
        pieces: list[Any] = [prefix, _b3(prefix), arena.pop()]
    else:
        pieces = [prefix, _b3(prefix), *(p for _, p in parts)]
        parts.clear()  # the pieces list holds the only references to the payloads now
    if native.core is not None:  # each payload freed as soon as it is copied
        out: bytes = native.core.join_release(pieces)
        return out
    return b"".join(pieces)


def _entries(
    parts: list[tuple[dict[str, Any], bytes | memoryview]],
) -> tuple[list[dict[str, Any]], int]:
    """The parts' entries completed with offset, length and checksum, and the payload bytes
    (no payload is left referenced here)."""
    entries, offset = [], 0
    for e, payload in parts:
        e.update(
            {"offset": offset, "length": len(payload), "b3": blake3.blake3(payload).hexdigest()}
        )
        entries.append(e)
        offset += len(payload)
    return entries, offset


def _encode_tensor(tp: TensorPatch, base: WordSource, version: int) -> tuple[str, bytes]:
    match tp.change:
        case DropOp():
            return "none", b""
        case FullOp(tensor):
            return encode_full(tensor)
        case DeltaOp(positions, old, new):
            pass
    t = base[tp.name]
    best = DELTA_CODECS[_DELTA_BY_VERSION[version][0]]
    payload = best.encode(t, positions, old, new)
    if positions.size > DENSE * tp.n_elements:
        alt = DELTA_CODECS["rp.xorzstd.v1"].encode(t, positions, old, new)
        if len(alt) < len(payload):
            return "rp.xorzstd.v1", alt
    return best.codec_id, payload
