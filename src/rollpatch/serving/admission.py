"""Admission at the edge: a held slot, released exactly once on every way out.

A request that holds something (the sidecar's place in its commit gate, the gateway's
in-flight count at an island) must give it back whatever happens: the handler returns, raises,
the client goes away while it waits, or a stream outlives the handler. Counting by hand leaked
a slot on the one path nobody wrote; here the pairing is a context manager:

- :class:`Slot`: the context manager around one release callable (idempotent
  :meth:`Slot.release`, :meth:`Slot.hand_off` to a stream that releases when it ends);
- :func:`admit_async`: run a blocking admission in a worker thread without blocking the event
  loop; a caller cancelled while it waits still has its slot released when admission lands.

Anything with an idempotent ``release()`` is :class:`Releasable` (the sidecar's
``Admission`` from the commit gate is one), so :class:`~.streaming.OwnedStream` takes either.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs 3.11; only the checker reads it

__all__ = ["Releasable", "Slot", "admit_async", "wait_drained"]


class Releasable(Protocol):
    """Something held that :meth:`release` gives back (idempotent)."""

    def release(self) -> Any: ...


class Slot:
    """One held slot: ``release`` runs ``on_release`` once (thread-safe) and returns what it
    returned then. Leaving the ``with`` block releases unless :meth:`hand_off` was called (an
    exception releases regardless)."""

    def __init__(self, on_release: Callable[[], Any]) -> None:
        self._on_release = on_release
        self._lock = threading.Lock()
        self._released = False
        self._handed_off = False
        self._result: Any = None

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> Any:
        """Give the slot back (once)."""
        with self._lock:
            if not self._released:
                self._released = True
                self._result = self._on_release()
            return self._result

    def hand_off(self) -> Self:
        """Leaving the ``with`` block no longer releases: the new owner must :meth:`release`."""
        self._handed_off = True
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None or not self._handed_off:
            self.release()


_R = TypeVar("_R", bound=Releasable)


async def admit_async(admit: Callable[[], _R]) -> _R:
    """``admit()`` (blocking) in the default executor. A caller that goes away while it
    waits (cancellation) still gets the slot released once admission completes."""
    fut = asyncio.get_running_loop().run_in_executor(None, admit)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_release_late)
        raise


def _release_late(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()


def wait_drained(
    inflight: Callable[[], int], grace_s: float, stop: threading.Event | None = None
) -> bool:
    """Wait up to ``grace_s`` for ``inflight()`` to reach 0 (a shutting-down service's
    requests and streams finishing); ``stop`` set cuts the wait short. True when none is
    left."""
    deadline = time.monotonic() + grace_s
    while inflight() and time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            break
        time.sleep(0.05)
    return inflight() == 0
