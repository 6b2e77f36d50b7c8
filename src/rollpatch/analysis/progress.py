"""A progress bar on stderr: tqdm when it is installed, else a one-line fallback.

Shown only when ``enabled`` is True, or (``enabled=None``) when stderr is a terminal, so logs
and pipes stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO, TypeVar

__all__ = ["Progress"]

_P = TypeVar("_P", bound="Progress")


class Progress:
    """``with Progress(total, "analyze") as bar: bar.stage("what"); ...; bar.update()``."""

    def __init__(
        self, total: int, desc: str, *, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self._tqdm: Any = None
        self._note = ""
        self._t0 = time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(
                    total=total,
                    desc=desc,
                    file=self.stream,
                    unit="step",
                    dynamic_ncols=True,
                    leave=False,
                )

    def __enter__(self: _P) -> _P:  # noqa: PYI019 (typing.Self needs 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stage(self, note: str) -> None:
        """Say what the work now starting is (shown next to the bar)."""
        self._note = note
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(note)
        elif self.enabled:
            self._draw()

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` finished units."""
        self.done += n
        if self._tqdm is not None:
            self._tqdm.update(n)
        elif self.enabled:
            self._draw()

    def _draw(self) -> None:
        width = 24
        filled = width * min(self.done, self.total) // max(self.total, 1)
        elapsed = time.monotonic() - self._t0
        self.stream.write(
            f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} {elapsed:5.0f}s {self._note[:40]:<40}"
        )
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        else:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
        self.enabled = False
