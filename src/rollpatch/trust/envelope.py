"""Signed envelopes: DSSE (in-toto's Dead Simple Signing Envelope) over exact payload bytes.

An envelope is the JSON object ``{"payload": B64, "payloadType": T, "signatures": [{"keyid":
K, "sig": B64}, ...]}``. Each signature is Ed25519 over the pre-authentication encoding::

    PAE(T, P) = "DSSEv1" SP len(T) SP T SP len(P) SP P     (lengths: ASCII decimal bytes)

so a verifier checks the exact bytes it was given and parses them only afterwards; the payload
type binds what kind of document it is (a manifest's signature cannot pass as a LATEST's).
Parsing is bounded: size, nesting, number and length of signatures.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .. import jsonsafe
from ..errors import TrustError
from .keys import PublicKey, SigningKey

__all__ = [
    "LATEST_TYPE",
    "MANIFEST_TYPE",
    "ROOT_TYPE",
    "Envelope",
    "PayloadType",
    "Signature",
    "pae",
    "parse_envelope",
    "seal",
    "verify_threshold",
]

PayloadType = Literal[
    "application/vnd.rollpatch.manifest+json",
    "application/vnd.rollpatch.latest+json",
    "application/vnd.rollpatch.root+json",
]
MANIFEST_TYPE: PayloadType = "application/vnd.rollpatch.manifest+json"
LATEST_TYPE: PayloadType = "application/vnd.rollpatch.latest+json"
ROOT_TYPE: PayloadType = "application/vnd.rollpatch.root+json"
_TYPES: tuple[str, ...] = (MANIFEST_TYPE, LATEST_TYPE, ROOT_TYPE)
#: Signatures one envelope may carry.
MAX_SIGNATURES = 64
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Signature:
    keyid: str
    sig: bytes


@dataclass(frozen=True)
class Envelope:
    """A payload, its type and its signatures (not verified by construction)."""

    payload_type: str
    payload: bytes
    signatures: tuple[Signature, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "payload": base64.b64encode(self.payload).decode("ascii"),
            "payloadType": self.payload_type,
            "signatures": [
                {"keyid": s.keyid, "sig": base64.b64encode(s.sig).decode("ascii")}
                for s in self.signatures
            ],
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: the exact bytes every signature covers."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def seal(payload_type: PayloadType, payload: bytes, keys: Iterable[SigningKey]) -> Envelope:
    """An envelope of ``payload`` signed by every key in ``keys`` (at least one)."""
    message = pae(payload_type, payload)
    sigs = tuple(Signature(k.keyid, k.sign(message)) for k in keys)
    if not sigs:
        raise ValueError("seal needs at least one signing key")
    return Envelope(payload_type, payload, sigs)


def looks_like_envelope(doc: Any) -> bool:
    """Whether a parsed JSON document is an envelope (rather than a bare, unsigned one)."""
    return isinstance(doc, dict) and "payloadType" in doc


def parse_envelope(doc: Any, *, expect: PayloadType, max_payload: int, **context: Any) -> Envelope:
    """An :class:`Envelope` from a parsed JSON document; TrustError(malformed) otherwise."""

    def bad(what: str) -> TrustError:
        return TrustError(f"malformed signed envelope: {what}", reason="malformed", **context)

    if not isinstance(doc, dict) or set(doc) != {"payload", "payloadType", "signatures"}:
        raise bad("expected exactly payload, payloadType, signatures")
    ptype, payload, sigs = doc["payloadType"], doc["payload"], doc["signatures"]
    if ptype not in _TYPES:
        raise bad("unknown payloadType")
    if ptype != expect:
        raise TrustError(
            f"envelope holds a {ptype.split('.')[-1]}, not a {expect.split('.')[-1]}",
            reason="bad_signature",
            **context,
        )
    if not isinstance(payload, str) or len(payload) > (max_payload + 2) // 3 * 4:
        raise bad("payload is not a string or is too large")
    data = _b64(payload, bad)
    if not isinstance(sigs, list) or len(sigs) > MAX_SIGNATURES:
        raise bad(f"signatures must be a list of at most {MAX_SIGNATURES}")
    out = []
    for s in sigs:
        if not isinstance(s, dict) or set(s) != {"keyid", "sig"}:
            raise bad("a signature must have exactly keyid and sig")
        if not isinstance(s["keyid"], str) or not _HEX64.fullmatch(s["keyid"]):
            raise bad("keyid is not 64 hex digits")
        if not isinstance(s["sig"], str) or len(s["sig"]) > 128:
            raise bad("sig is not a short base64 string")
        out.append(Signature(s["keyid"], _b64(s["sig"], bad)))
    return Envelope(ptype, data, tuple(out))


def load_envelope(raw: bytes, *, expect: PayloadType, max_bytes: int, **context: Any) -> Envelope:
    """Parse envelope bytes (bounded strict JSON), without verifying any signature."""
    doc = jsonsafe.loads(
        raw,
        what="signed envelope",
        error=TrustError,
        max_bytes=max_bytes,
        max_depth=4,
        reason="malformed",
        **context,
    )
    return parse_envelope(doc, expect=expect, max_payload=max_bytes, **context)


def _b64(text: str, bad: Any) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise bad("not valid base64") from None


def verify_threshold(
    env: Envelope, keys: Mapping[str, PublicKey], threshold: int, **context: Any
) -> frozenset[str]:
    """The key ids of ``keys`` whose valid signature ``env`` carries; TrustError unless there
    are at least ``threshold`` of them (each key counts once, however often it signed)."""
    if not env.signatures:
        raise TrustError("the document is not signed", reason="unsigned", **context)
    message = pae(env.payload_type, env.payload)
    good = frozenset(
        s.keyid for s in env.signatures if s.keyid in keys and keys[s.keyid].verify(s.sig, message)
    )
    if len(good) < threshold:
        known = sum(1 for s in env.signatures if s.keyid in keys)
        raise TrustError(
            f"{len(good)} valid signature(s) from trusted keys, {threshold} needed",
            reason="bad_signature",
            signatures=len(env.signatures),
            from_trusted_keys=known,
            hint="signed by a key the trust root does not list, or forged",
            **context,
        )
    return good
