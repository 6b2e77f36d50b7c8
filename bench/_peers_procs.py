"""The processes of ``bench/peers.py``: islands, link and middle node speaking JSON lines (``Child``), ``rollpatch relay`` (``Relay``), ports and peak RSS."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _util import cpu_of

HERE = Path(__file__).resolve().parent


class BenchError(SystemExit):
    """A process failed, an island timed out, or a replica is not bit-exact."""


class Child:
    """A subprocess speaking JSON lines on stdout (``bench/_peers_island.py``)."""

    def __init__(self, name: str, job: dict[str, Any], logdir: Path) -> None:
        self.name = name
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.serving: dict[int, float] = {}
        #: The whole ``serving`` event of each version (timeline traces, timings).
        self.served: dict[int, dict[str, Any]] = {}
        self._err = open(logdir / f"{name}.log", "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_peers_island.py"), json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev["event"] == "serving":
                self.serving[int(ev["version"])] = float(ev["t"])
                self.served[int(ev["version"])] = ev
            self.events.put(ev)
        self.events.put({"event": "exit", "rc": self.proc.wait()})

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(
                    f"{self.name}: no '{event}' within {timeout:.0f}s (log: {self._err.name})"
                ) from None
            if ev["event"] == event:
                return ev
            if ev["event"] == "exit":
                raise BenchError(
                    f"{self.name} exited with status {ev['rc']} (log: {self._err.name})"
                )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 120.0) -> dict[str, Any] | None:
        """Close stdin (the child stops) and return its ``done`` event."""
        done = None
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            done = self.expect("done", timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.wait(timeout=30)
            self._err.close()
        return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process (every thread) and ``pids``:
    the work a version costs, whatever else the machine runs meanwhile."""
    return cpu_of(pids)


def cpu_parts(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each group of processes (``trainer``: this process)."""
    return {name: cpu_of(pids, this=False) for name, pids in groups.items()}


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Relay:
    """``rollpatch relay`` in its own process."""

    def __init__(
        self,
        board: str,
        cache: Path,
        logdir: Path,
        name: str,
        pointer_ttl: float,
        list_ttl: float,
        watch_s: float | None = None,
        log_level: str = "warning",
        extra: tuple[str, ...] = (),
    ) -> None:
        self._err = open(logdir / f"{name}.log", "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollpatch",
                "relay",
                "--board",
                board,
                "--cache",
                str(cache),
                "--port",
                "0",
                "--pointer-ttl",
                str(pointer_ttl),
                "--list-ttl",
                str(list_ttl),
                "--log-level",
                log_level,
                *(() if watch_s is None else ("--watch", str(watch_s))),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " at http" not in line:
            raise BenchError(f"relay {name} did not start (log: {self._err.name})")
        self.url = line.split(" at ", 1)[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1].rstrip("/"))

    def close(self) -> int:
        peak = vm_hwm(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._err.close()
        return peak


def link_child(rtt_ms: float, mbps: float, upstream_port: int, logs: Path) -> tuple[Child, int]:
    """The emulated WAN (a ``link`` child: ``rtt_ms`` added, ``mbps`` shared) in front of
    ``upstream_port``, started, and its port; closed again if it does not start."""
    link = Child(
        "link",
        {
            "mode": "link",
            "upstream": ["127.0.0.1", upstream_port],
            "latency_ms": rtt_ms / 2,
            "mbps": mbps,
        },
        logs,
    )
    try:
        return link, link.expect("ready", 60)["port"]
    except BaseException:
        link.close()
        raise
