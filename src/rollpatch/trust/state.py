"""The rollback state a verifier keeps across restarts: a small JSON file.

::

    {"schema": "rollpatch.trust-state/1",
     "root": "<base64 of the newest verified root envelope>" | null,
     "latest": {"<run>": <highest LATEST version verified>, ...}}

Written to a temporary file in the same directory, flushed and renamed over the old one, so a
crash leaves the old state or the new one. A state file that cannot be read is an error, never
silently reset: deleting it (on purpose) is how an operator starts rollback protection over.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import jsonsafe
from ..errors import ConfigError
from ..types import MAX_VERSION, RUN_RE

__all__ = ["MAX_STATE_BYTES", "STATE_SCHEMA", "TrustState"]

STATE_SCHEMA = "rollpatch.trust-state/1"
MAX_STATE_BYTES = 8 * 1024 * 1024
MAX_RUNS = 100_000


@dataclass
class TrustState:
    """Newest verified root (envelope bytes) and the highest LATEST verified, per run."""

    root: bytes | None = None
    latest: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> TrustState:
        """The state in ``path`` (empty when the file does not exist yet)."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return cls()
        except OSError as e:
            raise ConfigError(
                f"cannot read the trust state file: {e.strerror or e}", path=str(path)
            ) from None
        hint = "the file is damaged; delete it to restart rollback protection from the trust root"
        d = jsonsafe.loads(
            raw,
            what="trust state file",
            error=ConfigError,
            max_bytes=MAX_STATE_BYTES,
            max_depth=3,
            path=str(path),
            hint=hint,
        )
        try:
            return cls._parse(d)
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise ConfigError("trust state file is malformed", path=str(path), hint=hint) from None

    @classmethod
    def _parse(cls, d: object) -> TrustState:
        if not isinstance(d, dict) or d.get("schema") != STATE_SCHEMA:
            raise ValueError("schema")
        root = d["root"]
        latest = d["latest"]
        if not isinstance(latest, dict) or len(latest) > MAX_RUNS:
            raise ValueError("latest")
        for run, n in latest.items():
            if (
                not RUN_RE.match(run)
                or isinstance(n, bool)
                or not isinstance(n, int)
                or not 0 <= n <= MAX_VERSION
            ):
                raise ValueError("latest entry")
        raw_root = None if root is None else base64.b64decode(root, validate=True)
        return cls(raw_root, dict(latest))

    def save(self, path: Path) -> None:
        """Replace ``path`` atomically with this state."""
        doc = {
            "schema": STATE_SCHEMA,
            "root": None if self.root is None else base64.b64encode(self.root).decode(),
            "latest": dict(sorted(self.latest.items())),
        }
        data = json.dumps(doc, sort_keys=True, indent=1).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".trust-state-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
