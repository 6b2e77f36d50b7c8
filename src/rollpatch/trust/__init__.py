"""Signatures and a root of trust for boards (docs/trust.md).

Publishers sign every manifest and every LATEST with Ed25519 keys (:class:`Signer`); a root
document names those keys and how many must sign (:class:`Root`), and rotates them (root n+1
signed by root n's keys). Followers, relays and ``pull`` given a trust root (:class:`Trust`)
refuse what is unsigned, badly signed, expired (a frozen LATEST) or older than what they
verified before (rollback, remembered across restarts in a small state file).
"""

from __future__ import annotations

from .envelope import (
    LATEST_TYPE,
    MANIFEST_TYPE,
    ROOT_TYPE,
    Envelope,
    PayloadType,
    load_envelope,
    looks_like_envelope,
    parse_envelope,
    seal,
    verify_threshold,
)
from .keys import PublicKey, SigningKey, read_public_key, read_signing_key, write_keypair
from .root import Root, sign_root, verify_initial_root, verify_next_root
from .signer import DEFAULT_LATEST_TTL_S, Signer
from .state import TrustState
from .verifier import Trust, default_state_path, warn_unverified

__all__ = [
    "DEFAULT_LATEST_TTL_S",
    "LATEST_TYPE",
    "MANIFEST_TYPE",
    "ROOT_TYPE",
    "Envelope",
    "PayloadType",
    "PublicKey",
    "Root",
    "Signer",
    "SigningKey",
    "Trust",
    "TrustState",
    "default_state_path",
    "load_envelope",
    "looks_like_envelope",
    "parse_envelope",
    "read_public_key",
    "read_signing_key",
    "seal",
    "sign_root",
    "verify_initial_root",
    "verify_next_root",
    "verify_threshold",
    "warn_unverified",
    "write_keypair",
]
