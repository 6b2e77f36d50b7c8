"""Child processes of the demo: started, listened to, and always stopped.

Each child runs ``python -m rollpatch.demo.<module>`` in its own session (so a Ctrl-C in the
terminal reaches only the orchestrator, which then stops the children in order), with its
stdin a pipe from us (end of file tells it we are gone) and its stdout parsed for events.
Everything else it prints goes to ``logs/<name>.log``. :class:`ProcessGroup` stops every
child on exit — normal, error or interrupt — by asking, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import RollpatchError
from .events import parse_event

__all__ = ["Child", "ChildError", "ProcessGroup"]

_STOP_GRACE_S = 5.0
_TERM_GRACE_S = 3.0


class ChildError(RollpatchError):
    """A child process failed, exited early, or did not answer in time."""


class Child:
    """One running child process and the events it has sent."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        events: queue.Queue[tuple[str, dict[str, Any]]],
    ) -> None:
        self.name = name
        self._log: IO[str] = log.open("a", encoding="utf-8", buffering=1)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TQDM_DISABLE": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        self._events = events
        self._reader = threading.Thread(target=self._read, name=f"demo-read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = parse_event(line.rstrip("\n"))
            if ev is None:
                self._log.write(line)
            else:
                self._events.put((self.name, ev))
        self._events.put((self.name, {"ev": "exit", "status": self.proc.wait()}))

    def send(self, **command: Any) -> None:
        """Write one JSON command to the child's stdin (ignored if it has gone)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """Ask, then SIGTERM, then SIGKILL; returns the exit status (None if it would not die)."""
        if self.alive:
            self.send(cmd="stop")
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            for action, grace in (
                (None, _STOP_GRACE_S),
                (self.proc.terminate, _TERM_GRACE_S),
                (self.proc.kill, _TERM_GRACE_S),
            ):
                if action is not None:
                    action()
                try:
                    self.proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._reader.join(timeout=2.0)
        self._log.close()
        return self.proc.poll()


class ProcessGroup:
    """The demo's children: spawn, wait for events, stop all (also at interpreter exit)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: dict[str, Child] = {}
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._held: list[tuple[str, dict[str, Any]]] = []
        self._stopping = False
        atexit.register(self.stop_all)

    def spawn(self, name: str, module: str, *args: str) -> Child:
        """Start ``python -m rollpatch.demo.<module> args...``."""
        child = Child(
            name, ["-m", f"rollpatch.demo.{module}", *args], self.logs / f"{name}.log", self.events
        )
        self.children[name] = child
        return child

    def next_event(self, timeout: float) -> tuple[str, dict[str, Any]] | None:
        """The next event from any child (held ones first), or None after ``timeout``."""
        if self._held:
            return self._held.pop(0)
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_for(
        self, name: str, kind: str, timeout: float, on_other: Any = None
    ) -> dict[str, Any]:
        """Wait for event ``kind`` from child ``name``; other events are passed to
        ``on_other(child, event)``, or held for :meth:`next_event` and later waits when
        ``on_other`` is None or they are ``kind`` events of other children.

        Raises :class:`ChildError` if a child reports an error or fails, if ``name`` exits,
        or after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        held: list[tuple[str, dict[str, Any]]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildError(
                        f"{name} did not report {kind!r} in time",
                        timeout_s=timeout,
                        log=str(self.logs / f"{name}.log"),
                    )
                item = self.next_event(min(left, 0.5))
                if item is None:
                    continue
                who, ev = item
                self.check(who, ev)
                if who == name and ev["ev"] == kind:
                    return ev
                if who == name and ev["ev"] == "exit":
                    raise ChildError(
                        f"{name} exited before reporting {kind!r}",
                        log=str(self.logs / f"{name}.log"),
                    )
                if on_other is not None and ev["ev"] != kind:
                    on_other(who, ev)
                else:  # the same event from another child is someone else's to wait for
                    held.append(item)
        finally:
            self._held[:0] = held

    def check(self, who: str, ev: dict[str, Any]) -> None:
        """Raise :class:`ChildError` for an ``error`` event or an unexpected exit."""
        if ev["ev"] == "error":
            raise ChildError(
                f"{ev.get('where', who)} failed: {ev.get('message')}",
                log=str(self.logs / f"{who}.log"),
            )
        if ev["ev"] == "exit" and ev.get("status") not in (0, None) and not self._stopping:
            raise ChildError(
                f"{who} exited with status {ev.get('status')}", log=str(self.logs / f"{who}.log")
            )

    def stop_all(self) -> dict[str, int | None]:
        """Stop every child, newest first; returns their exit statuses."""
        self._stopping = True
        out = {}
        for name in reversed(list(self.children)):
            out[name] = self.children[name].stop()
        return out
