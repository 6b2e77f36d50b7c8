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

__all__ = ["EngineProcess"]


class EngineProcess:
    """``cmd`` started now with ``env``, its output in ``log`` (``cwd``: where it runs; not
    a directory holding a module named like the engine's package, which ``python -m`` would
    import instead); ``url``: where it answers; ``name``: for errors."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        url: str,
        name: str,
        *,
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
        """SIGTERM the process group, SIGKILL if it is still there after ``timeout`` s."""
        if self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group's id is our child's pid
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)
