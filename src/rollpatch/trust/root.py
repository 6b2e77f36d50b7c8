"""The root of trust: which publisher keys may sign a board's metadata, and how many must.

A root document (payload type ``application/vnd.rollpatch.root+json``) is::

    {"schema": "rollpatch.root/1", "version": n, "threshold": t, "created": ts,
     "expires": ts | null, "keys": {keyid: {"keytype": "ed25519", "public": hex}, ...}}

Root 1 is trusted because it was handed over out of band (a file) and must be signed by
``threshold`` of its own keys. Root n+1 is trusted only when signed by ``threshold`` of root
n's keys *and* by its own threshold (TUF's rule), so rotation never needs a new file on the
followers and a stolen key can be revoked by the others.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import jsonsafe
from ..errors import ConfigError, TrustError
from ..types import MAX_VERSION
from .envelope import ROOT_TYPE, Envelope, load_envelope, seal, verify_threshold
from .keys import KEYTYPE, PublicKey, SigningKey

__all__ = [
    "MAX_ROOT_BYTES",
    "ROOT_SCHEMA",
    "Root",
    "sign_root",
    "verify_initial_root",
    "verify_next_root",
]

ROOT_SCHEMA = "rollpatch.root/1"
MAX_ROOT_BYTES = 256 * 1024
MAX_KEYS = 64


@dataclass(frozen=True)
class Root:
    """A root document's content: version, publisher keys by id, threshold, expiry."""

    version: int
    keys: Mapping[str, PublicKey]
    threshold: int
    created: float
    expires: float | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.version, bool)
            or not isinstance(self.version, int)
            or not 1 <= self.version <= MAX_VERSION
        ):
            raise ConfigError("a root's version is an integer >= 1", value=self.version)
        if not 1 <= len(self.keys) <= MAX_KEYS:
            raise ConfigError(f"a root names 1 to {MAX_KEYS} keys", keys=len(self.keys))
        if any(k != pk.keyid for k, pk in self.keys.items()):
            raise ConfigError("a root's key ids must be the keys' SHA-256")
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int)
            or not 1 <= self.threshold <= len(self.keys)
        ):
            raise ConfigError(
                "a root's threshold is between 1 and its number of keys",
                threshold=self.threshold,
                keys=len(self.keys),
            )
        for name in ("created", "expires"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            ):
                raise ConfigError(f"a root's {name} is a finite timestamp", value=v)

    @classmethod
    def new(
        cls,
        keys: Iterable[PublicKey],
        *,
        threshold: int = 1,
        version: int = 1,
        expires: float | None = None,
    ) -> Root:
        return cls(version, {k.keyid: k for k in keys}, threshold, float(int(time.time())), expires)

    def expired(self, now: float) -> bool:
        return self.expires is not None and now > self.expires

    def to_payload(self) -> bytes:
        doc = {
            "schema": ROOT_SCHEMA,
            "version": self.version,
            "threshold": self.threshold,
            "created": self.created,
            "expires": self.expires,
            "keys": {
                k: {"keytype": KEYTYPE, "public": pk.hex} for k, pk in sorted(self.keys.items())
            },
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_payload(cls, raw: bytes) -> Root:
        d = jsonsafe.loads(
            raw,
            what="root document",
            error=TrustError,
            max_bytes=MAX_ROOT_BYTES,
            max_depth=4,
            reason="malformed",
        )
        try:
            return _parse(d)
        except (KeyError, TypeError, ValueError) as e:
            msg = e.message if isinstance(e, ConfigError) else repr(e)
            raise TrustError(f"malformed root document: {msg}", reason="malformed") from None


def _parse(d: Any) -> Root:
    if not isinstance(d, dict) or d.get("schema") != ROOT_SCHEMA:
        raise ValueError("schema is not rollpatch.root/1")
    if set(d) != {"schema", "version", "threshold", "created", "expires", "keys"}:
        raise ValueError("unexpected or missing fields")
    keys_doc = d["keys"]
    if not isinstance(keys_doc, dict) or len(keys_doc) > MAX_KEYS:
        raise ValueError("keys")
    keys = {}
    for keyid, entry in keys_doc.items():
        if (
            not isinstance(entry, dict)
            or entry.get("keytype") != KEYTYPE
            or set(entry) != {"keytype", "public"}
        ):
            raise ValueError(f"key {str(keyid)[:16]} is not an ed25519 key")
        keys[keyid] = PublicKey.from_hex(entry["public"])
    return Root(d["version"], keys, d["threshold"], d["created"], d["expires"])


def sign_root(root: Root, signers: Iterable[SigningKey]) -> bytes:
    """The root's envelope bytes, signed by ``signers``."""
    return seal(ROOT_TYPE, root.to_payload(), signers).to_bytes()


def _open(raw: bytes) -> tuple[Envelope, Root]:
    env = load_envelope(raw, expect=ROOT_TYPE, max_bytes=MAX_ROOT_BYTES, what_doc="root")
    return env, Root.from_payload(env.payload)


def verify_initial_root(raw: bytes) -> Root:
    """The root in a trust file: well formed and signed by its own threshold."""
    env, root = _open(raw)
    verify_threshold(env, root.keys, root.threshold, root_version=root.version)
    return root


def verify_next_root(trusted: Root, raw: bytes) -> Root:
    """Root ``trusted.version + 1`` from its envelope bytes, or TrustError(root)."""
    env, root = _open(raw)
    if root.version != trusted.version + 1:
        raise TrustError(
            "root version does not follow the trusted root",
            reason="root",
            trusted=trusted.version,
            got=root.version,
        )
    hint = "a new root must be signed by the previous root's threshold and its own"
    for keys, threshold, whose in (
        (trusted.keys, trusted.threshold, "the previous root's"),
        (root.keys, root.threshold, "its own"),
    ):
        try:
            verify_threshold(env, keys, threshold)
        except TrustError as e:
            raise TrustError(
                f"root {root.version} is not signed by {whose} keys: {e.message}",
                reason="root",
                hint=hint,
            ) from None
    return root
