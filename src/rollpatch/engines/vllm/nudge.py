"""Nudging vLLM's API server while a call to it is in flight (stdlib only).

vLLM's API server passes every control call (``/collective_rpc``, ``/pause``, ...) to its
engine core and back over ZeroMQ sockets driven by ``zmq.asyncio`` on uvloop. On this
project's 2-core CPU box such a call now and then sat ≈ 1.0 s (once 2.0 s) in the API server
with nothing else to do. Timed at each hop (the adapter, the engine core's ``collective_rpc``,
its output thread, the workers; docs/vllm.md, *The API server's missed wake-ups*): the engine
core had answered in 1–3 ms and its output thread had taken the answer 0.2 ms later, and the
HTTP answer came 999 ms after that; in other calls the request reached the engine core
≈ 990 ms after the adapter sent it. That is a wake-up the API server's event loop missed
until some later event (zeromq/pyzmq#2173 reports multi-second ``zmq.asyncio`` receive stalls
of this kind; the cause here is not proven). Such a stall in the commit call made a 6 ms
pause 1,002 ms, and in a staging poll added a second to a catch-up.

:class:`Nudger` gives the server later events on purpose: while a call has been in flight
for longer than ``period_s``, another thread sends a cheap request that makes its own round
trip through the engine core (``GET /is_sleeping``, read-only) every ``period_s``. A call
that completes within ``period_s`` (nearly all of them) costs nothing; a long one (a commit,
a reload) one small request per period. Measured over four benchmark runs each (103M, TP 2):
pauses over 0.5 s 3 → 1 (the largest 1,002 → 517 ms), staging polls over 0.3 s 4 → 1, and
samples with a stage over 0.9 s or a pause over 0.5 s 15 → 4 of 92. It shortens the stalls;
it does not remove every one. Failures of a nudge are ignored: it is a hint, not part of any
call's outcome.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from ...errors import ConfigError

__all__ = ["ENV", "PATH", "Nudger", "period_s"]

#: The setting: milliseconds between nudges (default :data:`DEFAULT_MS`; 0 turns them off).
ENV = "ROLLPATCH_VLLM_NUDGE_MS"
DEFAULT_MS = 50
#: What a nudge asks the server: read-only, a round trip through the engine core.
PATH = "/is_sleeping"


def period_s(environ: Mapping[str, str] | None = None) -> float | None:
    """``ROLLPATCH_VLLM_NUDGE_MS`` as seconds (unset or empty: the default), None when 0."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV, "").strip()
    try:
        ms = int(raw) if raw else DEFAULT_MS
    except ValueError:
        raise ConfigError(f"{ENV} must be a whole number of milliseconds", value=raw) from None
    if ms < 0:
        raise ConfigError(f"{ENV} must be 0 (off) or more", value=raw)
    return ms / 1e3 if ms else None


class Nudger:
    """Calls ``send`` every ``period_s`` while any :meth:`watch`-ed call has been in flight
    for at least ``period_s`` (one daemon thread, started with the first call)."""

    def __init__(self, send: Callable[[], object], *, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self._send = send
        self.period_s = period_s
        self._cv = threading.Condition()
        self._since: dict[int, float] = {}  # call id -> start (monotonic)
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        #: nudges sent (for tests and benches)
        self.sent = 0

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around one call: nudges start ``period_s`` after it does and stop when it ends."""
        with self._cv:
            key = self._next_id
            self._next_id += 1
            self._since[key] = time.monotonic()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="rollpatch-vllm-nudge", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                del self._since[key]

    def close(self) -> None:
        """Stop the thread (calls watched later are not nudged)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def _due(self) -> float | None:
        """Seconds until a nudge is due (0: now), None with no call in flight."""
        if not self._since:
            return None
        return max(0.0, min(self._since.values()) + self.period_s - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    due = self._due()
                    if due == 0.0:
                        break
                    self._cv.wait(timeout=due)
                if self._closed:
                    return
            with contextlib.suppress(Exception):  # a hint only (module docstring)
                self._send()
            self.sent += 1
            with self._cv:  # then one period before the next, while the call lasts
                self._cv.wait(timeout=self.period_s)
