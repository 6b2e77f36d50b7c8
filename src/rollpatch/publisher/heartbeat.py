"""Re-signing LATEST while a signing publisher is idle, so followers can tell alive from frozen.

A signed LATEST expires ``signer.latest_ttl_s`` after it was signed (docs/trust.md). Between
versions, a daemon thread re-signs the pointer for the version already there every
``ttl / 4`` (the board's compare-and-swap keeps it from ever moving LATEST back: when a newer
version landed meanwhile, the refresh leaves it alone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..board import Board
from ..errors import RollpatchError

__all__ = ["LatestHeartbeat"]

log = logging.getLogger("rollpatch.publisher")


class LatestHeartbeat:
    """Re-signs LATEST of ``run`` for ``version()`` every ``period_s`` until :meth:`stop`."""

    def __init__(self, board: Board, run: str, version: Callable[[], int | None],
                 period_s: float) -> None:
        self.board, self.run, self.version, self.period_s = board, run, version, period_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"rollpatch-heartbeat-{run}")
        self._thread.start()

    def beat(self) -> None:
        """Re-sign LATEST now (if the publisher has a durable version)."""
        n = self.version()
        if n is None:
            return
        self.board.advance(self.run, n, refresh=True)
        self.beats += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except RollpatchError as e:  # the store is down: try again next period
                log.warning("%s: re-signing LATEST failed: %s", self.run, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
