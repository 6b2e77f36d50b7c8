"""An engine's server process for the benches (vLLM's, SGLang's): started in its own process
group with its output in a log file, polled on ``/health`` until ready, stopped with the whole
group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


class BenchError(SystemExit):
    """A commit, a reload or the server is not what it must be."""


class ServerProc:
    """``cmd`` with ``env``, its output in ``log_path`` (``cwd``: where it runs); ``url``:
    where it answers; ``name``: for errors."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        url: str,
        name: str,
        *,
        cwd: Path | None = None,
    ) -> None:
        self.url, self.log_path, self.name, self.t0 = url, log_path, name, time.monotonic()
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
            )

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the start until ``/health`` answered 200."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise BenchError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
