"""The directory an adapter shares with its engine's server: bulk data crosses as files there.

One owner for the vLLM and SGLang adapters (same host: the server reads and writes the
files). :meth:`SharedDir.files` hands out fresh names and removes the files after the block,
on every way out, so no adapter call keeps its own try/unlink.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SharedDir"]


class SharedDir:
    """``path``: a directory the server can read and write; None: a fresh private one (named
    ``prefix``…) under ``under`` (default: the system's temporary directory; ``/dev/shm`` for
    files both sides map and no disk should see), removed by :meth:`close`."""

    def __init__(
        self, path: str | Path | None, *, prefix: str, under: str | Path | None = None
    ) -> None:
        self.own = path is None
        self.path = (
            Path(path) if path is not None else Path(tempfile.mkdtemp(prefix=prefix, dir=under))
        )

    def name(self, what: str) -> Path:
        """A fresh file name in the directory (nothing created); the caller removes it."""
        return self.path / f"{what}-{secrets.token_hex(8)}.bin"

    @contextlib.contextmanager
    def files(self, what: str, n: int = 1) -> Iterator[list[Path]]:
        """``n`` fresh file names (:meth:`name`), each file removed after the block if it
        was made."""
        paths = [self.name(what) for _ in range(n)]
        try:
            yield paths
        finally:
            for path in paths:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the directory if it is this object's own (a caller's is left alone)."""
        if self.own:
            shutil.rmtree(self.path, ignore_errors=True)
