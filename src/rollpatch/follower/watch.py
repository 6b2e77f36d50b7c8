"""The follower's background thread: poll, sync when LATEST moves, back off while failing.

:class:`Watcher` owns the thread and its stop and wake events; what one poll does is the
follower's (:meth:`rollpatch.follower.Follower.start`). Between two polls it waits on a
:class:`LatestHint`: through a relay, a long-poll of LATEST that the relay answers as soon as
it knows a newer version (docs/relay.md, "Long-poll"); on other boards, ``poll_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import StoreError
from ..layout import pointer_key
from ..store import Store
from ..store.http_client import HttpStore
from ..store.http_pool import Held

__all__ = ["HOLD_S", "LatestHint", "WakeEvent", "Watcher"]

log = logging.getLogger("rollpatch.follower")

#: The longest wait between polls while polls keep failing (unless ``poll_s`` is longer).
MAX_BACKOFF_S = 30.0
#: Seconds a relay is asked to hold a long-poll of LATEST (it may hold it for less).
HOLD_S = 20.0


class WakeEvent(threading.Event):
    """An event whose :meth:`set` also runs callbacks (it cancels a held long-poll)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_set: list[Callable[[], None]] = []

    def set(self) -> None:
        super().set()
        for callback in list(self.on_set):
            callback()


class LatestHint:
    """Waits until LATEST may have moved past a version: a long-poll when ``store`` reads
    through a relay that holds them, else ``poll_s`` on the wake event.

    The relay's answer is a hint only (it may come early, late, or lie): the follower then
    reads LATEST and the signed manifest as always. A relay that predates long-polls is
    polled from then on; one whose hints do not move LATEST is waited on for ``poll_s``
    between two hints, so it cannot make the follower spin.
    """

    def __init__(
        self, store: Store, run: str, hold_s: float = HOLD_S, *, push_bytes: int = 0
    ) -> None:
        inner = store
        while not isinstance(inner, HttpStore) and isinstance(getattr(inner, "inner", None), Store):
            inner = inner.inner  # type: ignore[attr-defined]  # retrying or tracing wrappers
        self._relay = inner if isinstance(inner, HttpStore) else None
        self._key = pointer_key(run)
        self.hold_s = hold_s
        #: Bytes of a new version's manifest and step patch accepted in the answer
        #: (``FollowerConfig.push_bytes``); the relay client holds them for the reads.
        self.push_bytes = push_bytes
        self._held: Held | None = None if self._relay is None else self._relay.held()
        self._hinted: int | None = None  # ``after`` of the last early answer

    @property
    def holds(self) -> bool:
        """Whether waits are long-polls (a relay that holds them)."""
        return self._relay is not None

    def wait(self, after: int | None, poll_s: float, wake: threading.Event) -> None:
        """Return when LATEST may name a version above ``after`` (None: unknown, so just
        ``poll_s``), when ``wake`` is set, or after the relay's hold (nothing new)."""
        relay, held = self._relay, self._held
        if relay is None or held is None or after is None or after == self._hinted:
            self._hinted = None
            wake.wait(poll_s)
            return
        if wake.is_set():
            return
        try:
            pushed: list[tuple[str, bytes]] = []
            answer = relay.wait_newer(
                self._key,
                after,
                self.hold_s,
                held,
                push_bytes=self.push_bytes,
                pushed_out=pushed,
            )
        except NotImplementedError:
            log.info("%s does not hold long-polls of LATEST; polling every %g s", relay, poll_s)
            self._relay = None
            wake.wait(poll_s)
            return
        except StoreError as e:  # the next poll reads LATEST and reports what fails
            log.debug("long-poll of LATEST failed: %s", e)
            wake.wait(poll_s)
            return
        if answer is not None:
            self._hinted = after
            if pushed:  # the reads that follow take LATEST and these from the answer
                relay.hold_pushed(self._key, answer, pushed)

    def cancel(self) -> None:
        """End a wait in progress at once (or the next one)."""
        if self._held is not None:
            self._held.cancel()

    def close(self) -> None:
        if self._held is not None:
            self._held.close()


class Watcher:
    """Calls ``poll`` every ``poll_s`` seconds (or when ``hint`` says LATEST moved) in a
    daemon thread until :meth:`stop`.

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
        hint: LatestHint | None = None,
        seen: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.name = name
        self._poll, self._on_failure = poll, on_failure
        self.poll_s, self.join_s = poll_s, join_s
        self.wake, self.abort = wake, abort
        #: Waits between polls (long-polls through a relay); ``seen``: the newest LATEST read.
        self.hint, self._seen = hint, seen
        if hint is not None and isinstance(wake, WakeEvent):
            wake.on_set.append(hint.cancel)
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
        if self.hint is not None:
            self.hint.cancel()
        thread.join(timeout=self.join_s)
        if thread.is_alive():
            log.warning("%s did not stop within %.0f s", self.name, self.join_s)
        elif self.hint is not None:
            self.hint.close()
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
                if stop.is_set():  # stop() abandoned the poll: no failure to report
                    log.debug("%s: poll abandoned at stop: %s", self.name, e)
                    break
                self._on_failure(e)
                failures += 1
            poll = self.poll_s  # back off while failing, up to 30 s (or poll_s)
            delay = (
                min(poll * 2 ** min(failures, 6), max(poll, MAX_BACKOFF_S)) if failures else poll
            )
            if self.hint is not None and not failures and not stop.is_set():
                self.hint.wait(self._seen(), delay, self.wake)
            else:
                self.wake.wait(delay)
            self.wake.clear()
