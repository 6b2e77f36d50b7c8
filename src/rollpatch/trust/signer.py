"""The publisher side: the keys that sign manifests and LATEST, and how long a LATEST lives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RollpatchError
from .envelope import PayloadType, load_envelope, seal, verify_threshold
from .keys import PublicKey, SigningKey, read_signing_key
from .root import Root, sign_root
from .verifier import Trust

__all__ = ["DEFAULT_LATEST_TTL_S", "Signer"]

#: How long a signed LATEST stays valid unless re-signed (the publisher re-signs it while it
#: runs, at half this interval when idle): the longest a frozen pointer goes unnoticed.
DEFAULT_LATEST_TTL_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class Signer:
    """Publisher keys (one per signature a root's threshold asks for) and LATEST's lifetime."""

    #: Ed25519 private keys; each signs every manifest and LATEST.
    keys: tuple[SigningKey, ...]
    #: Seconds a signed LATEST is valid for (> 0); followers refuse it afterwards.
    latest_ttl_s: float = DEFAULT_LATEST_TTL_S

    def __post_init__(self) -> None:
        keys = tuple(self.keys)
        if not keys or not all(isinstance(k, SigningKey) for k in keys):
            raise ConfigError("Signer.keys must be one or more SigningKey", field="keys")
        if len({k.keyid for k in keys}) != len(keys):
            raise ConfigError("Signer.keys holds the same key twice", field="keys")
        object.__setattr__(self, "keys", keys)
        ttl = self.latest_ttl_s
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, (int, float))
            or not math.isfinite(ttl)
            or not 1.0 <= ttl <= 366 * 86400
        ):
            raise ConfigError(
                "Signer.latest_ttl_s must be between 1 s and a year",
                field="latest_ttl_s",
                value=ttl,
            )

    @classmethod
    def from_files(
        cls, paths: Sequence[str | Path], *, latest_ttl_s: float = DEFAULT_LATEST_TTL_S
    ) -> Signer:
        """A signer with the private keys in ``paths`` (PEM files from ``rollpatch keygen``)."""
        return cls(keys=tuple(read_signing_key(p) for p in paths), latest_ttl_s=latest_ttl_s)

    @property
    def public_keys(self) -> tuple[PublicKey, ...]:
        return tuple(k.public for k in self.keys)

    def self_trust(self) -> Trust:
        """A verifier that accepts what any one of these keys signed (no rotation, no state):
        what a resuming publisher builds on."""
        root = Root.new(self.public_keys, threshold=1)
        return Trust(sign_root(root, self.keys), follow_rotation=False)

    def signed(self, raw: bytes, payload_type: PayloadType) -> bool:
        """Whether ``raw`` is an envelope of ``payload_type`` one of these keys signed."""
        try:
            env = load_envelope(raw, expect=payload_type, max_bytes=1 << 26)
            verify_threshold(env, {k.keyid: k for k in self.public_keys}, 1)
        except RollpatchError:
            return False
        return True

    def seal(self, payload_type: PayloadType, payload: bytes) -> bytes:
        """The envelope bytes of ``payload`` signed by every key."""
        return seal(payload_type, payload, self.keys).to_bytes()

    def __repr__(self) -> str:
        ids = ", ".join(k.keyid[:16] for k in self.keys)
        return f"Signer(keys=[{ids}], latest_ttl_s={self.latest_ttl_s})"
