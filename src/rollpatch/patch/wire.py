"""The patch container: bytes ↔ :class:`Patch` (normative spec: docs/patch-format.md).

Parsing is bounded and validates in this order — magic, version, flags, lengths, header
checksum, JSON schema and limits — before any payload is touched; each payload's checksum is
verified before it is decoded. Hostile input raises :class:`PatchDecodeError` (or
:class:`CodecError`), never a numpy exception, never an allocation larger than the base view.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import zstandard

from .. import native
from ..errors import BaseMismatchError, CodecError, PatchDecodeError, RollpatchError
from ..kinds import KINDS
from ..view import DigestAlgo, View, WordSource, sum_add
from .codecs import DELTA_CODECS, bounded_decompress, decode_full, encode_full, get_delta_codec
from .model import OPS, Patch, TensorPatch

__all__ = [
    "DENSE",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MIN_FULL_BOUND",
    "PatchHeader",
    "assemble",
    "decode",
    "decode_entry",
    "encode",
    "encode_views",
    "entry",
    "inspect",
]

MAGIC = b"\x89RPATCH\n"
#: Format version written by default; 1 is still read (and written on request).
VERSION = 2
VERSIONS = (1, 2)
#: Per format version: the view digest algorithm and the delta codecs it allows.
DIGESTS: dict[int, DigestAlgo] = {1: "rp.blake3.v1", 2: "rp.sum128.v1"}
_DELTA_BY_VERSION = {
    1: ("rp.ctxgolomb.v1", "rp.xorzstd.v1"),
    2: ("rp.ctxgolomb.v2", "rp.xorzstd.v1"),
}
#: A ``full`` tensor may not decompress beyond max(base view bytes, this) unless allowed.
MIN_FULL_BOUND = 256 * 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_NAME_BYTES = 1024
MAX_DIMS = 16
MAX_ELEMENTS = 1 << 48
_PREFIX = struct.Struct("<8sHHI")
#: Flag bit 0: the header is a zstd frame (hex digests and names compress about 3×).
FLAG_ZSTD_HEADER = 1
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
#: Above this density the encoders also try XOR+zstd and keep the smaller payload.
DENSE = 0.25  # an encoder choice, not format: XOR+zstd wins only on near-random changes


def _pool() -> ThreadPoolExecutor:
    """Tensors are coded concurrently: the native core and numpy release the GIL."""
    return ThreadPoolExecutor(max_workers=max(1, min(4, native.threads())))


def _b3(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest()


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
    with _pool() as pool:
        coded = list(pool.map(lambda n: _encode_tensor(patch.tensors[n], base, version), names))
    parts = []
    for name, (codec, payload) in zip(names, coded):
        tp = patch.tensors[name]
        parts.append(
            (
                entry(
                    name,
                    tp.op,
                    tp.kind,
                    tp.shape,
                    tp.n_changed,
                    tp.base_digest,
                    tp.target_digest,
                    codec,
                ),
                payload,
            )
        )
    return assemble(patch.base, patch.target, patch.meta, patch.digest, parts, version)


def encode_views(a: View, b: View, *, meta: dict[str, str] | None = None) -> bytes:
    """``encode(diff(a, b), a)`` in one native pass per tensor, byte for byte.

    No decoded patch is built: memory beyond the two views is the patch plus one chunk's
    records per thread (and one XOR temporary for dense tensors, which may ship as XOR+zstd).
    """
    from .codec_v2 import CtxGolombV2
    from .codecs import XorZstd

    native.require()
    codec = CtxGolombV2()
    names = sorted(set(a) | set(b))

    def one(name: str) -> tuple[dict[str, Any], bytes] | None:
        if name not in b:
            ta = a[name]
            return entry(
                name, "drop", ta.kind, ta.shape, ta.n_elements, a.tensor_digest(name), None, "none"
            ), b""
        tb = b[name]
        if name not in a or a[name].kind != tb.kind or a[name].shape != tb.shape:
            codec_id, payload = encode_full(tb)
            base = a.tensor_digest(name) if name in a else None
            return entry(
                name,
                "full",
                tb.kind,
                tb.shape,
                tb.n_elements,
                base,
                b.tensor_digest(name),
                codec_id,
            ), payload
        ta = a[name]
        payload, k, change = codec.encode_dense_sum(ta, tb)
        if k == 0:
            return None
        st = a.cached_sum_state(name)
        if st is not None and b.cached_sum_state(name) is None:
            # every word was compared: b's state is a's plus the change of the changed words
            b.update_sum_state(name, sum_add(st, change))
        codec_id = codec.codec_id
        if k > DENSE * ta.n_elements:
            alt = zstandard.ZstdCompressor(level=XorZstd.level).compress(
                np.bitwise_xor(ta.data, tb.data).tobytes()
            )
            if len(alt) < len(payload):
                codec_id, payload = "rp.xorzstd.v1", alt
        return entry(
            name,
            "delta",
            ta.kind,
            ta.shape,
            k,
            a.tensor_digest(name),
            b.tensor_digest(name),
            codec_id,
        ), payload

    with _pool() as pool:
        coded = [x for x in pool.map(one, names) if x is not None]
    return assemble(a.digest(), b.digest(), meta or {}, "rp.sum128.v1", coded, VERSION)


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


_LOCAL = threading.local()


def _header_compressor() -> zstandard.ZstdCompressor:
    """One level-9 compressor per thread (its context costs more to set up than a header
    costs to compress; compressors are not thread-safe)."""
    c = getattr(_LOCAL, "cctx", None)
    if c is None:
        c = _LOCAL.cctx = zstandard.ZstdCompressor(level=9)
    return c


def assemble(
    base: str,
    target: str,
    meta: Any,
    digest: str,
    parts: list[tuple[dict[str, Any], bytes]],
    version: int,
) -> bytes:
    """The container (§1-§2) around per-tensor (entry, payload) parts in name order."""
    entries, offset = [], 0
    for e, payload in parts:
        e.update(
            {"offset": offset, "length": len(payload), "b3": blake3.blake3(payload).hexdigest()}
        )
        entries.append(e)
        offset += len(payload)
    header: dict[str, Any] = {"format": "rollpatch.patch", "version": version}
    if version >= 2:
        header["digest"] = digest
    header.update(
        {
            "base": base,
            "target": target,
            "payload_bytes": offset,
            "meta": dict(meta),
            "tensors": entries,
        }
    )
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise CodecError("patch header exceeds the format's limit", size=len(raw))
    packed = _header_compressor().compress(raw)
    prefix = _PREFIX.pack(MAGIC, version, FLAG_ZSTD_HEADER, len(packed)) + packed
    return b"".join([prefix, _b3(prefix), *(p for _, p in parts)])


def _encode_tensor(tp: TensorPatch, base: WordSource, version: int) -> tuple[str, bytes]:
    if tp.op == "drop":
        return "none", b""
    if tp.op == "full":
        assert tp.tensor is not None
        return encode_full(tp.tensor)
    assert tp.positions is not None and tp.old is not None and tp.new is not None
    t = base[tp.name]
    best = DELTA_CODECS[_DELTA_BY_VERSION[version][0]]
    payload = best.encode(t, tp.positions, tp.old, tp.new)
    if tp.positions.size > DENSE * tp.n_elements:
        alt = DELTA_CODECS["rp.xorzstd.v1"].encode(t, tp.positions, tp.old, tp.new)
        if len(alt) < len(payload):
            return "rp.xorzstd.v1", alt
    return best.codec_id, payload


@dataclass(frozen=True)
class PatchHeader:
    """A validated patch header (what ``inspect`` returns)."""

    base: str
    target: str
    meta: dict[str, str]
    tensors: list[dict[str, Any]]
    payload_start: int
    payload_bytes: int
    header_bytes: int
    version: int = VERSION

    @property
    def digest(self) -> DigestAlgo:
        """The view digest algorithm of every digest in the header."""
        return DIGESTS[self.version]

    @property
    def n_changed(self) -> int:
        return sum(e["changed"] for e in self.tensors if e["op"] == "delta")

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "base": self.base,
            "target": self.target,
            "meta": self.meta,
            "payload_bytes": self.payload_bytes,
            "header_bytes": self.header_bytes,
            "changed": self.n_changed,
            "tensors": self.tensors,
        }


def inspect(blob: bytes | memoryview) -> PatchHeader:
    """Validate the container and header (no base view needed)."""
    mv = memoryview(blob)
    if len(mv) < _PREFIX.size + 32:
        raise PatchDecodeError("too short to be a patch", size=len(mv))
    magic, version, flags, hlen = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PatchDecodeError("not a rollpatch patch (bad magic)")
    if version not in VERSIONS:
        raise PatchDecodeError(
            f"unsupported patch format version {version}", hint="upgrade rollpatch"
        )
    if flags & ~FLAG_ZSTD_HEADER:
        raise PatchDecodeError("unknown flags set", flags=flags)
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen + 32 > len(mv):
        raise PatchDecodeError("header length out of bounds", header_len=hlen)
    end = _PREFIX.size + hlen
    if _b3(mv[:end]) != bytes(mv[end : end + 32]):
        raise PatchDecodeError("header checksum mismatch: the patch is corrupt")
    raw = bytes(mv[_PREFIX.size : end])
    if flags & FLAG_ZSTD_HEADER:
        # headers compress ~3x: a frame that expands far beyond that is refused early
        raw = bounded_decompress(raw, min(MAX_HEADER_BYTES, max(1 << 20, 64 * hlen)), exact=False)
    try:
        header = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise PatchDecodeError(f"header is not valid JSON: {str(e)[:200]}") from None
    parsed = _validate_header(header, hlen, version)
    if parsed.payload_start + parsed.payload_bytes != len(mv):
        raise PatchDecodeError(
            "file length does not match the header",
            expected=parsed.payload_start + parsed.payload_bytes,
            actual=len(mv),
        )
    return parsed


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a patch header")


def _need(cond: bool, what: str, **ctx: Any) -> None:
    if not cond:
        raise PatchDecodeError(f"invalid patch header: {what}", **ctx)


def _is_int(x: Any, lo: int = 0, hi: int = 1 << 62) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _is_digest(x: Any, nullable: bool) -> bool:
    return (x is None and nullable) or (isinstance(x, str) and bool(_DIGEST_RE.match(x)))


def _validate_header(h: Any, hlen: int, version: int) -> PatchHeader:
    _need(isinstance(h, dict), "not an object")
    _need(
        h.get("format") == "rollpatch.patch" and h.get("version") == version,
        "format/version fields",
    )
    _need(version < 2 or h.get("digest") == DIGESTS[version], "digest algorithm")
    _need(_is_digest(h.get("base"), False) and _is_digest(h.get("target"), False), "root digests")
    meta = h.get("meta", {})
    _need(
        isinstance(meta, dict)
        and len(meta) <= 256
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()),
        "meta",
    )
    payload_bytes = h.get("payload_bytes")
    _need(_is_int(payload_bytes), "payload_bytes")
    tensors = h.get("tensors")
    _need(isinstance(tensors, list) and len(tensors) <= MAX_TENSORS, "tensors list")
    prev, spans = None, []
    for e in tensors:
        _validate_entry(e, payload_bytes, version)
        _need(prev is None or e["name"] > prev, "tensors not sorted/unique", tensor=e["name"])
        prev = e["name"]
        spans.append((e["offset"], e["offset"] + e["length"]))
    spans.sort()
    _need(all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "overlapping payloads")
    return PatchHeader(
        h["base"],
        h["target"],
        dict(meta),
        tensors,
        _PREFIX.size + hlen + 32,
        payload_bytes,
        hlen,
        version,
    )


def _validate_entry(e: Any, payload_bytes: int, version: int) -> None:
    _need(isinstance(e, dict), "tensor entry")
    name = e.get("name")
    _need(isinstance(name, str) and 0 < len(name.encode()) <= MAX_NAME_BYTES, "tensor name")
    op, kind = e.get("op"), KINDS.get(str(e.get("kind")))
    if op not in OPS or kind is None or e.get("dtype") != kind.dtype:
        raise PatchDecodeError("invalid patch header: op/kind/dtype", tensor=name)
    shape = e.get("shape")
    _need(
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(_is_int(d, 0, MAX_ELEMENTS) for d in shape),
        "shape",
        tensor=name,
    )
    count = math.prod(shape)
    _need(count < MAX_ELEMENTS, "element count", tensor=name)
    n = count * 2 if kind.packed else count
    changed = e.get("changed")
    _need(_is_int(changed, 0, n) and (op == "delta" or changed == n), "changed", tensor=name)
    _need(
        _is_digest(e.get("base"), op == "full")
        and _is_digest(e.get("target"), op == "drop")
        and (op != "drop" or e.get("target") is None),
        "tensor digests",
        tensor=name,
    )
    codec = e.get("codec")
    ok = {"delta": set(_DELTA_BY_VERSION[version]), "full": {"zstd", "raw"}, "drop": {"none"}}[op]
    _need(
        isinstance(codec, str) and codec in ok,
        f"codec {str(codec)[:40]!r} for op {op}",
        tensor=name,
    )
    off, length = e.get("offset"), e.get("length")
    _need(
        _is_int(off) and _is_int(length) and off + length <= payload_bytes,
        "payload span",
        tensor=name,
    )
    _need(op != "drop" or length == 0, "drop with payload", tensor=name)
    _need(
        isinstance(e.get("b3"), str) and bool(_DIGEST_RE.match(e["b3"])),
        "payload checksum",
        tensor=name,
    )


def decode(
    blob: bytes | memoryview,
    base: WordSource,
    *,
    check_base: bool = True,
    max_full_bytes: int | None = None,
) -> Patch:
    """Parse and decode a patch against its ``base`` view (or any word source).

    With ``check_base`` and a :class:`View` base, the root digest is compared first (cached
    digests make this cheap), so a wrong base fails fast with :class:`BaseMismatchError`.
    ``max_full_bytes`` bounds each ``full`` tensor before it is decompressed (default: the
    larger of the base view's size and 256 MiB; any other word source: 256 MiB).
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

    with _pool() as pool:
        decoded = list(pool.map(one, header.tensors))
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
        return TensorPatch(name, op, kind, shape, e["base"], None)
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
        return TensorPatch(name, op, kind, shape, e["base"], e["target"], tensor=t)
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
    return TensorPatch(name, op, kind, shape, e["base"], e["target"], positions, old, new)
