"""Reading key and token files for the CLI, the same way in every command.

A secret file's surrounding whitespace (the newline an editor or ``echo`` leaves) is not part
of the secret: ``publish`` and ``pull`` must derive the same key from the same file.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

__all__ = ["MAX_SECRET_BYTES", "read_secret", "read_token"]

#: Key and token files are small; anything larger is the wrong file.
MAX_SECRET_BYTES = 64 * 1024


def read_secret(path: str, what: str = "key file") -> bytes:
    """The file's bytes without surrounding whitespace; ConfigError if unreadable or empty."""
    try:
        with open(Path(path), "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the {what}: {e.strerror or e}", path=path) from None
    if len(raw) > MAX_SECRET_BYTES:
        raise ConfigError(f"the {what} is larger than {MAX_SECRET_BYTES:,} bytes", path=path)
    secret = raw.strip()
    if not secret:
        raise ConfigError(f"the {what} is empty", path=path)
    return secret


def read_token(path: str, what: str = "token file") -> str:
    """A bearer token: :func:`read_secret`, which must be printable ASCII (an HTTP header)."""
    raw = read_secret(path, what)
    if not raw.isascii() or not raw.decode("ascii").isprintable():
        raise ConfigError(
            f"the {what} must hold printable ASCII (it is sent in a header)", path=path
        )
    return raw.decode("ascii")
