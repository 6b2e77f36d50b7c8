"""Reading a stored manifest: strict, bounded parsing of untrusted bytes and, on a signed
board, the envelope and its signatures (:func:`open_manifest`). A manifest that fails any
check here is never used.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .. import jsonsafe
from ..errors import ManifestError, TrustError
from ..trust import MANIFEST_TYPE, Trust, looks_like_envelope, parse_envelope
from ..types import MAX_VERSION, ObjectRef, check_run
from .document import (
    MAX_ENVELOPE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    MAX_OBJECTS,
    MAX_SLICES,
    SCHEMA_V1,
    SCHEMA_V2,
    KeyframeObject,
    Manifest,
    PatchObject,
    SlicedTensor,
    SliceEntry,
)

__all__ = ["manifest_from_bytes", "manifest_from_json", "open_manifest"]

_SCHEMAS = (SCHEMA_V1, SCHEMA_V2)
_DTYPE = re.compile(r"^[A-Z0-9_]{1,16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEY = re.compile(r"^[A-Za-z0-9._/-]{1,1024}$")


def manifest_from_bytes(raw: bytes) -> Manifest:
    """The manifest in unsigned JSON ``raw`` (bounded: size, depth, object counts)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError("manifest too large", size=len(raw))
    d = jsonsafe.loads(
        raw,
        what="manifest",
        error=ManifestError,
        max_bytes=MAX_MANIFEST_BYTES,
        max_depth=MAX_MANIFEST_DEPTH,
    )
    return manifest_from_json(d)


def manifest_from_json(d: Any) -> Manifest:
    """The manifest in a decoded JSON document; ``ManifestError`` names what is invalid."""
    try:
        return _parse(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"malformed manifest: {e!r}") from None


def open_manifest(
    raw: bytes,
    run: str,
    version: int,
    trust: Trust | None,
    refresh_root: Callable[[], object] | None = None,
) -> Manifest:
    """The manifest stored for ``run``@``version``: verified under ``trust`` when given
    (TrustError if unsigned or not signed by the root's threshold), checked to name exactly
    that run and version (a manifest moved to another version's key is refused).

    ``refresh_root`` is called once when no trusted key signed it (the root may have rotated).
    """
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise ManifestError("manifest too large", size=len(raw))
    doc = jsonsafe.loads(
        raw,
        what="manifest",
        error=ManifestError,
        max_bytes=MAX_ENVELOPE_BYTES,
        max_depth=MAX_MANIFEST_DEPTH,
        run=run,
        version=version,
    )
    if looks_like_envelope(doc):
        env = parse_envelope(
            doc,
            expect=MANIFEST_TYPE,
            max_payload=MAX_MANIFEST_BYTES,
            run=run,
            version=version,
            what_doc="manifest",
        )
        if trust is not None:
            try:
                trust.verify(env, run=run, version=version, what_doc="manifest")
            except TrustError as e:
                if e.reason != "bad_signature" or refresh_root is None:
                    raise
                refresh_root()
                trust.verify(env, run=run, version=version, what_doc="manifest")
        m = manifest_from_bytes(env.payload)
    elif trust is not None:
        raise TrustError(
            "manifest is not signed",
            reason="unsigned",
            run=run,
            version=version,
            hint="the trust root requires signed boards: publish with --signing-key",
        )
    else:
        m = manifest_from_json(doc)
    if (m.run, m.version) != (run, version):
        other = "run" if m.run != run else "version"  # (it said "version" for both: an audit)
        raise ManifestError(
            f"manifest names another {other}",
            run=run,
            version=version,
            names=f"{m.run}@{m.version}",
        )
    return m


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ManifestError(f"invalid manifest: {what}")


def _int(x: Any, lo: int = 0, hi: int = MAX_VERSION) -> int:
    _need(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi, f"integer {x!r}")
    return int(x)


def _ref(o: Any) -> ObjectRef:
    _need(isinstance(o, dict), "object entry")
    key, b3 = o["key"], o["b3"]
    _need(isinstance(key, str) and bool(_KEY.match(key)) and ".." not in key, "object key")
    _need(isinstance(b3, str) and bool(_HEX64.match(b3)), "object hash")
    return ObjectRef(key, _int(o["bytes"], 0, 1 << 50), b3)


def _parse(d: Any) -> Manifest:
    _need(isinstance(d, dict) and d.get("schema") in _SCHEMAS, "schema")
    run = check_run(d["run"])
    version = _int(d["version"])
    parent = None if d["parent"] is None else _int(d["parent"])
    _need(parent is None or parent < version, "parent must precede the version")
    _need(isinstance(d["format"], str) and 0 < len(d["format"]) <= 64, "format")
    _need(isinstance(d["target"], str) and bool(_HEX64.match(d["target"])), "target digest")
    _need(isinstance(d["publisher"], str) and len(d["publisher"]) <= 256, "publisher")
    _need(isinstance(d["created"], (int, float)), "created")
    shards = _int(d.get("shards", 1), 1, 4096)
    patches, keyframes = d.get("patches", []), d.get("keyframes", [])
    _need(
        isinstance(patches, list)
        and isinstance(keyframes, list)
        and len(patches) + len(keyframes) <= MAX_OBJECTS,
        "object lists",
    )
    pats = tuple(
        PatchObject(
            _ref(p),
            _int(p["base"], 0, version - 1),
            _digest(p["base_digest"]),
            _int(p.get("shard", 0), 0, shards - 1),
        )
        for p in patches
    )
    kfs = tuple(KeyframeObject(_ref(k), _int(k.get("shard", 0), 0, shards - 1)) for k in keyframes)
    _need(bool(pats) or bool(kfs), "a version needs a patch or a keyframe")
    _need(not kfs or len({k.shard for k in kfs}) == shards == len(kfs), "keyframe shards")
    for base in {p.base for p in pats}:
        _need(
            sorted(p.shard for p in pats if p.base == base) == list(range(shards)),
            f"patch shards from {base}",
        )
    meta = d.get("meta", {})
    _need(
        isinstance(meta, dict)
        and len(meta) <= 256
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()),
        "meta",
    )
    raw_sliced = d.get("sliced", [])
    _need(d["schema"] == SCHEMA_V2 or "sliced" not in d, "sliced tensors need schema 2")
    sliced = _parse_sliced(raw_sliced, shards)
    # a "signature" field (HMAC, before signed envelopes) is ignored: only envelopes verify
    return Manifest(
        run=run,
        version=version,
        parent=parent,
        format=d["format"],
        target=d["target"],
        view_bytes=_int(d["view_bytes"], 0, 1 << 50),
        created=float(d["created"]),
        publisher=d["publisher"],
        patches=pats,
        keyframes=kfs,
        shards=shards,
        meta=dict(meta),
        sliced=sliced,
    )


def _shape(x: Any) -> tuple[int, ...]:
    _need(isinstance(x, list) and len(x) <= 8, "shape")
    return tuple(_int(n, 0, 1 << 50) for n in x)


def _parse_sliced(raw: Any, shards: int) -> tuple[SlicedTensor, ...]:
    """Sliced tensors: unique names, each tiled exactly by its slices in offset order."""
    _need(isinstance(raw, list) and len(raw) <= MAX_SLICES, "sliced")
    out: list[SlicedTensor] = []
    total = 0
    for t in raw:
        _need(isinstance(t, dict) and isinstance(t["slices"], list), "sliced entry")
        name, dtype = t["tensor"], t["dtype"]
        _need(isinstance(name, str) and 0 < len(name) <= 1024, "sliced tensor name")
        _need(isinstance(dtype, str) and bool(_DTYPE.match(dtype)), "sliced dtype")
        shape = _shape(t["shape"])
        total += len(t["slices"])
        _need(0 < len(t["slices"]) <= shards and total <= MAX_SLICES, f"slices of {name}")
        entries = []
        for e in t["slices"]:
            _need(isinstance(e, dict), "slice entry")
            entries.append(
                SliceEntry(
                    _int(e["shard"], 0, shards - 1),
                    _int(e["offset"], 0, 1 << 50),
                    _shape(e["shape"]),
                )
            )
        out.append(SlicedTensor(name, dtype, shape, _digest(t["digest"]), tuple(entries)))
        numel = SliceEntry(0, 0, shape).length
        at = 0
        for e in entries:
            _need(e.offset == at and e.length > 0, f"slices of {name} must tile it in order")
            at += e.length
        _need(at == numel, f"slices of {name} must cover it")
        _need(len({e.shard for e in entries}) == len(entries), f"one slice per shard ({name})")
    _need(len({t.name for t in out}) == len(out), "sliced tensor listed twice")
    return tuple(out)


def _digest(x: Any) -> str:
    _need(isinstance(x, str) and bool(_HEX64.match(x)), "digest")
    return str(x)
