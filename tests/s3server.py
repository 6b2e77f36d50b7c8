"""Run moto's standalone S3 server as a real process on loopback, for the store tests.

This is a separate OS process speaking HTTP, not moto's in-process mock: the S3 backend talks
to it through botocore exactly as it would talk to AWS, R2 or MinIO.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["S3Server", "free_port", "moto_available", "run_moto_server"]

ACCESS_KEY = "rollpatch-test"
SECRET_KEY = "rollpatch-test-secret"


class S3Server:
    """A running S3-compatible endpoint: where it is and which credentials it takes."""

    def __init__(self, endpoint_url: str) -> None:
        self.endpoint_url = endpoint_url
        self.access_key_id = ACCESS_KEY
        self.secret_access_key = SECRET_KEY
        self.region = "us-east-1"

    def options(self, **extra: object) -> dict[str, object]:
        """``open_store`` options that point an ``s3://`` store at this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "region": self.region,
            **extra,
        }


def moto_available() -> bool:
    """True when ``moto.server`` (the ``moto[server]`` extra) can be imported."""
    return (
        importlib.util.find_spec("moto") is not None
        and importlib.util.find_spec("flask") is not None
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server another process
    binds. Picked below the kernel's ephemeral range: a port from ``bind(0)`` lies in that
    range, from which any process's outgoing connection may take it before the server binds
    it (a CI run's torch rendezvous failed with EADDRINUSE so, session 39, with five test jobs
    opening connections beside it)."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded host: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; else its default)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


@contextlib.contextmanager
def run_moto_server(timeout: float = 30.0) -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free loopback port; stop it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            _wait_ready(proc, url, timeout, log)
            yield S3Server(url)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}: {_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                return
        except urllib.error.HTTPError:  # any HTTP answer means the server is up
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer on {url} within {timeout}s: {_tail(log)}")


def _tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-2000:].decode(errors="replace")
