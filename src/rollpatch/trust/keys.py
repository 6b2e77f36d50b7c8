"""Ed25519 keys: generate, read and write key files, sign, verify (docs/trust.md).

A key's id is the SHA-256 (hex) of its 32 raw public bytes. Files:

- private key: PEM, PKCS#8, unencrypted (``-----BEGIN PRIVATE KEY-----``), mode 0600;
- public key: one line ``ed25519:<64 hex digits>`` (a private key file is accepted too).

Both are read the same way by every command (surrounding whitespace is not part of a key).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ..errors import ConfigError

__all__ = [
    "KEYTYPE",
    "PublicKey",
    "SigningKey",
    "read_public_key",
    "read_signing_key",
    "write_keypair",
]

KEYTYPE = "ed25519"
#: Key files are small; anything larger is the wrong file.
MAX_KEY_FILE_BYTES = 16 * 1024
_PUBLIC_LINE = re.compile(r"ed25519:([0-9a-f]{64})")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key (32 raw bytes)."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != 32:
            raise ConfigError("an Ed25519 public key is 32 bytes")

    @property
    def keyid(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def hex(self) -> str:
        return self.raw.hex()

    def line(self) -> str:
        """The public key file's line: ``ed25519:<hex>``."""
        return f"{KEYTYPE}:{self.hex}"

    @classmethod
    def from_hex(cls, text: str) -> PublicKey:
        if not isinstance(text, str) or not _HEX64.fullmatch(text):
            raise ConfigError("an Ed25519 public key is 64 lowercase hex digits")
        return cls(bytes.fromhex(text))

    def verify(self, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` is this key's signature of ``message``."""
        if len(signature) != 64:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except InvalidSignature:
            return False
        return True


class SigningKey:
    """An Ed25519 private key. Its ``repr`` never shows the secret."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public = PublicKey(raw)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def keyid(self) -> str:
        return self.public.keyid

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def to_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @classmethod
    def from_pem(cls, data: bytes, *, path: str | None = None) -> SigningKey:
        try:
            key = serialization.load_pem_private_key(data.strip() + b"\n", password=None)
        except (ValueError, TypeError):
            raise ConfigError(
                "not an unencrypted PEM private key",
                path=path,
                hint="make one with `rollpatch keygen`",
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(
                "the private key is not an Ed25519 key",
                path=path,
                hint="make one with `rollpatch keygen`",
            )
        return cls(key)

    def __repr__(self) -> str:
        return f"SigningKey(keyid={self.keyid[:16]}…)"


def _read_small(path: str | Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the {what}: {e.strerror or e}", path=str(path)) from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"the {what} is larger than {MAX_KEY_FILE_BYTES:,} bytes", path=str(path))
    if not raw.strip():
        raise ConfigError(f"the {what} is empty", path=str(path))
    return raw


def read_signing_key(path: str | Path) -> SigningKey:
    """The private key in a PEM file (ConfigError, one line, when it is not one)."""
    return SigningKey.from_pem(_read_small(path, "signing key file"), path=str(path))


def read_public_key(path: str | Path) -> PublicKey:
    """The public key in a ``.pub`` file (``ed25519:<hex>``), or of a private key file."""
    raw = _read_small(path, "public key file")
    if raw.lstrip().startswith(b"-----BEGIN"):
        return SigningKey.from_pem(raw, path=str(path)).public
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    match = _PUBLIC_LINE.fullmatch(text)
    if match is None:
        raise ConfigError(
            "not a public key file (expected one line `ed25519:<64 hex>`)",
            path=str(path),
            hint="make one with `rollpatch keygen`",
        )
    return PublicKey(bytes.fromhex(match.group(1)))


def write_keypair(prefix: str | Path) -> tuple[Path, Path, SigningKey]:
    """Generate a key; write ``PREFIX.key`` (mode 0600) and ``PREFIX.pub``; never overwrite."""
    key = SigningKey.generate()
    private, public = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (private, public):
        if p.exists() or p.is_symlink():
            raise ConfigError(
                "refusing to overwrite an existing key file",
                path=str(p),
                hint="choose another name, or delete the old key first",
            )
    _write_new(private, key.to_pem(), 0o600)
    _write_new(public, (key.public.line() + "\n").encode(), 0o644)
    return private, public, key


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as e:
        raise ConfigError(
            f"cannot create the key file: {e.strerror or e}", path=str(path)
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
