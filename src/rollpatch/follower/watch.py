"""The follower's background thread: poll, sync when LATEST moves, back off while failing.

:class:`Watcher` owns the thread and its stop and wake events; what one poll does is the
follower's (:meth:`rollpatch.follower.Follower.start`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Watcher"]

log = logging.getLogger("rollpatch.follower")

#: The longest wait between polls while polls keep failing (unless ``poll_s`` is longer).
MAX_BACKOFF_S = 30.0


class Watcher:
    """Calls ``poll`` every ``poll_s`` seconds in a daemon thread until :meth:`stop`.

    A failing ``poll`` is handed to ``on_failure`` and the wait doubles, up to
    :data:`MAX_BACKOFF_S` (or ``poll_s``); the thread outlives every failure. ``wake`` cuts a
    wait short (a caller wants LATEST polled now); ``abort`` is set while stopping, so retry
    sleeps inside ``poll`` end at once. ``join_s``: how long :meth:`stop` waits for a poll in
    progress (a commit completes first).
    """

    def __init__(
        self,
        name: str,
        poll: Callable[[], None],
        on_failure: Callable[[Exception], None],
        *,
        poll_s: float,
        join_s: float,
        wake: threading.Event,
        abort: threading.Event,
    ) -> None:
        self.name = name
        self._poll, self._on_failure = poll, on_failure
        self.poll_s, self.join_s = poll_s, join_s
        self.wake, self.abort = wake, abort
        self._stop: threading.Event | None = None
        self.thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        """Start the thread (no-op while it runs)."""
        if self.alive:
            return
        self.abort.clear()
        stop = self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(stop,), daemon=True, name=self.name)
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread; a poll in progress completes first (up to ``join_s``)."""
        thread, stop = self.thread, self._stop
        if thread is None or stop is None:
            return
        stop.set()
        self.abort.set()
        self.wake.set()
        thread.join(timeout=self.join_s)
        if thread.is_alive():
            log.warning("%s did not stop within %.0f s", self.name, self.join_s)
        self.thread = None
        self.abort.clear()

    def _loop(self, stop: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                self._poll()
                failures = 0
            # the thread must outlive any failure; on_failure records and logs it
            except Exception as e:  # noqa: BLE001
                self._on_failure(e)
                failures += 1
            poll = self.poll_s  # back off while failing, up to 30 s (or poll_s)
            delay = (
                min(poll * 2 ** min(failures, 6), max(poll, MAX_BACKOFF_S)) if failures else poll
            )
            self.wake.wait(delay)
            self.wake.clear()
