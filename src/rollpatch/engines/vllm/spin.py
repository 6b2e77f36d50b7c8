"""vLLM's shared-memory message queue readers, polling instead of spinning (opt in:
``ROLLPATCH_VLLM_POLL_MS``; docs/vllm.md).

On the CPU platform vLLM always runs the multiprocess executor: the engine core and each worker
exchange every step and every ``collective_rpc`` through ``shm_broadcast.MessageQueue``. Its
reader waits in ``SpinCondition.wait``: for 1 s after each message it reads (``busy_loop_s``,
not configurable), it calls ``sched_yield()`` in a loop, a whole core each for the worker and
the engine core; only after that does it sleep on the writer's zmq notification. On a small CPU
host (a 2-core CI box) that second of spinning after every message competes with the model's
own threads and with everything else on the machine.

With ``ROLLPATCH_VLLM_POLL_MS=N`` (a positive whole number), inside that busy window, once
:data:`SPIN_S` (20 ms) has passed since the last read, the reader waits on vLLM's own poller (the writer's notify socket and the cancel socket) for at most ``N``
ms instead of yielding: the writer notifies after every message it writes
(``MessageQueue.enqueue``), so a notify wakes the reader at once, and the timeout bounds the
one case where the notify does not arrive (the PUB socket has a high-water mark of 1 and drops
a notify while the previous one is still in flight; turning the busy window off instead left
such a reader asleep until vLLM's own recheck, up to 5 s — 60 s in a warning-free read). A
stale notify (sent while the reader was busy reading) only makes one check early; it is
consumed, as vLLM does outside the window. The first 20 ms still spin: a running generation's
next message (the next step, its result) comes within them, and waking a sleeping reader
through zmq's I/O threads cost each step a few ms on a loaded 2-core host (without the spin a
16-token completion took 68 ms against vLLM's 50; with it, 58 against 65; docs/vllm.md).
Outside the window vLLM's behaviour is unchanged; unset, nothing is patched.

Why a monkeypatch (STYLE 8): the wait is a method of a vLLM class with no setting or hook;
rollpatch code runs in both reader processes anyway (the worker extension, :mod:`.worker`; the
engine-core scheduler name, :mod:`.core`), so it is installed there, once per process, and only
where ``SpinCondition`` has the shape this was written against (vLLM 0.32.0: ``wait(self,
timeout_ms=None)``, ``is_reader``, ``last_read``, ``busy_loop_s``, ``poller``,
``local_notify_socket``); otherwise vLLM's default stays, with a warning.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ENV", "SPIN_S", "install", "patched_wait", "poll_ms"]

log = logging.getLogger(__name__)

#: The environment variable: the longest wait, in ms, on the notify socket inside the busy window.
ENV = "ROLLPATCH_VLLM_POLL_MS"
#: What the patched ``wait`` reads on a reader (checked before patching).
_READER_ATTRS = ("is_reader", "last_read", "busy_loop_s", "poller", "local_notify_socket")
_PATCHED = "_rollpatch_poll_ms"
#: For this long after a read the reader still spins (vLLM's ``sched_yield``): the next
#: message of a running generation comes within it (see the module's docstring).
SPIN_S = 0.02

Wait = Callable[[Any, "int | None"], None]


def poll_ms(environ: Mapping[str, str] | None = None) -> int | None:
    """``ROLLPATCH_VLLM_POLL_MS`` as milliseconds, or None when unset or empty (vLLM's default).
    Raises ``ValueError`` naming the variable for anything but a positive whole number."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"{ENV}={raw!r}: expected a positive whole number of milliseconds (e.g. 1), "
            "or unset for vLLM's default busy loop"
        )
    return value


def patched_wait(original: Wait, ms: int, noblock: int) -> Wait:
    """``SpinCondition.wait`` that, inside the busy window but past :data:`SPIN_S`, waits on the
    reader's poller for at most ``ms`` (and at most the caller's ``timeout_ms``) instead of ``sched_yield()``, and
    consumes a notify it woke on (``noblock``: zmq's NOBLOCK flag); outside the window it is
    ``original``."""

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        idle = time.monotonic() - self.last_read
        if not self.is_reader or idle > self.busy_loop_s or idle <= SPIN_S:
            original(self, timeout_ms)
            return
        bound = ms if timeout_ms is None else max(0, min(ms, timeout_ms))
        events = dict(self.poller.poll(timeout=bound))
        if self.local_notify_socket in events:
            # the notify socket is CONFLATE: at most one message waits there
            self.local_notify_socket.recv(flags=noblock, copy=False)

    setattr(wait, _PATCHED, ms)
    wait.__doc__ = original.__doc__
    return wait


def _shape_problem(cls: Any) -> str | None:
    """Why ``cls`` is not the ``SpinCondition`` this patch knows, or None."""
    wait = getattr(cls, "wait", None)
    if not callable(wait):
        return "no SpinCondition.wait"
    params = list(inspect.signature(wait).parameters)
    if params != ["self", "timeout_ms"]:
        return f"SpinCondition.wait{tuple(params)}, expected ('self', 'timeout_ms')"
    code = getattr(getattr(cls, "__init__", None), "__code__", None)  # the names it sets
    names = set(code.co_names) if code is not None else set()
    missing = [a for a in _READER_ATTRS if a not in names]
    if missing:
        return f"SpinCondition.__init__ sets no {', '.join(missing)}"
    return None


def install(cls: type | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Patch ``SpinCondition.wait`` (vLLM's, or ``cls``) when ``ROLLPATCH_VLLM_POLL_MS`` is set;
    once per class. Returns whether the patched wait is in place."""
    ms = poll_ms(environ)
    if ms is None:
        return False
    noblock = 1  # zmq.NOBLOCK; the real value is read from zmq where vLLM's class is patched
    if cls is None:
        import zmq
        from vllm.distributed.device_communicators import shm_broadcast

        cls = getattr(shm_broadcast, "SpinCondition", None)
        noblock = int(zmq.NOBLOCK)
        if cls is None:
            log.warning("%s ignored: this vLLM has no shm_broadcast.SpinCondition", ENV)
            return False
    target: Any = cls
    current: Any = getattr(target, "wait", None)
    if getattr(current, _PATCHED, None) is not None:
        return True
    problem = _shape_problem(target)
    if problem is not None:
        log.warning("%s ignored, vLLM's busy loop kept: %s", ENV, problem)
        return False
    target.wait = patched_wait(current, ms, noblock)
    log.info("%s=%d: vLLM's shm readers poll instead of spinning", ENV, ms)
    return True
