"""An engine's HTTP server as a child process: vLLM's or SGLang's OpenAI server started from
its launch command (:mod:`.vllm.launch`, :mod:`.sglang.launch`), for scripts, benches and tests.

The server runs in its own process group (vLLM's engine core and SGLang's scheduler are its
children), its output goes to a log file, it is ready once ``GET /health`` answers 200, and
:meth:`EngineProcess.stop` ends the whole group: SIGTERM, then SIGKILL if it lingers.
Failures to start raise :class:`~rollpatch.errors.EngineError` with the log's last lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import EngineError

__all__ = ["GRACE", "EngineProcess"]

#: Seconds the rest of a server's process group has to exit after the server did.
GRACE = 2.0


class EngineProcess:
    """``cmd`` started now with ``env``, its output in ``log`` (``cwd``: where it runs; not
    a directory holding a module named like the engine's package, which ``python -m`` would
    import instead); ``url``: where it answers; ``name``: for errors."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str],
        log: Path,
        url: str,
        name: str,
        cwd: Path | None = None,
    ) -> None:
        self.url, self.log, self.name = url, log, name
        self.started = time.monotonic()
        with open(log, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                list(cmd),
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
            )

    def tail(self, n: int = 40) -> str:
        """The log's last ``n`` lines."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Seconds from the start until ``/health`` answered 200; :class:`EngineError` (with
        the log's tail) if the process exits first or ``timeout`` passes."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise EngineError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group; after the server exits (at most ``timeout`` s), up to
        :data:`GRACE` s more for the rest of the group (an engine core, a scheduler: also
        when the server had exited before), then SIGKILL to whatever is left."""
        pgid = self.proc.pid  # start_new_session: the group's id is our child's pid
        if not _signal(pgid, signal.SIGTERM):
            self.proc.wait(10)
            return  # nothing of the group is left
        t0 = time.monotonic()
        while self.proc.poll() is None and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        t1 = time.monotonic()  # a zombie left by a PID 1 that reaps none still answers 0
        while _signal(pgid, 0) and time.monotonic() - t1 < GRACE:
            time.sleep(0.05)
        _signal(pgid, signal.SIGKILL)
        self.proc.wait(10)


def _signal(pgid: int, sig: int) -> bool:
    """``sig`` to the process group ``pgid`` (0: a check only); False if it has no process."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
