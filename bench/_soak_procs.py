"""The moving parts of ``bench/soak.py``: an S3-compatible board behind a fault proxy, the
service processes (publisher, relay, sidecars, gateway) and the publisher's own loop.

Every service is a real OS process (``python -m rollpatch ...``, or this module's publisher
role), so ``kill -9`` is a real crash; the board is moto's S3 server process reached through
:class:`FaultProxy`, a TCP proxy whose :meth:`~FaultProxy.down` is a store outage (connections
refused and cut) without losing the store's contents.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

RUN = "soak"
BUCKET = "soak-board"
PROMPT = "12 + 7 ="
MAX_TOKENS = 4
#: Per-version noise on layer 0 (about a rounding gap's tenth: ~10% of its BF16 values change,
#: as RL steps change few served values, and every version's output differs bit for bit).
NOISE = 2e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def masters_for(base: dict[str, np.ndarray], v: int) -> dict[str, np.ndarray]:
    """The trainer's weights at version ``v``: a deterministic function of ``v`` (so the
    checker can recompute what any version must generate, and a restarted publisher goes
    on exactly)."""
    rng = np.random.default_rng(v)
    out = {}
    for name in sorted(base):
        a = base[name]
        if a.ndim == 2 and ".layers.0." in name:
            a = a + (NOISE * rng.standard_normal(a.shape)).astype(np.float32)
        out[name] = a
    return out


def base_masters(model: Path) -> dict[str, np.ndarray]:
    """The checkpoint's BF16 weights as float32 masters: the bits the built-in engine loads
    and serves, read from the file (the publisher never imports torch; each of its 3 starts
    saved ~5 s of CPU)."""
    from rollpatch.io.safetensors import load_view

    view = load_view(model / "model.safetensors")
    return {n: t.to_array().astype(np.float32) for n, t in view.items()}


# -- the store and its outage ------------------------------------------------------------------


class FaultProxy:
    """A TCP proxy on a fixed loopback port; ``down()`` refuses and cuts every connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy").start()
        self.up()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def up(self) -> None:
        async def start() -> None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

        self._call(start())

    def down(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for w in list(self._conns):
                w.transport.abort()

        self._call(stop())

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*self.upstream)
        except OSError:
            w.transport.abort()
            return
        self._conns.update((w, uw))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))
        self._conns.difference_update((w, uw))


class S3Board:
    """moto's S3 server (a process) and a bucket, reached through a :class:`FaultProxy`."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.log = open(workdir / "moto.log", "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        wait_http(f"http://127.0.0.1:{self.port}/moto-api/", 60, self.proc)
        self.proxy = FaultProxy(("127.0.0.1", self.port))
        self.uri = f"s3://{BUCKET}/board/"
        self.env = {
            "ROLLPATCH_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
            "ROLLPATCH_S3_ACCESS_KEY_ID": "soak",
            "ROLLPATCH_S3_SECRET_ACCESS_KEY": "soak",
            "ROLLPATCH_S3_REGION": "us-east-1",
        }
        self.client().create_bucket(Bucket=BUCKET)

    def client(self) -> Any:
        """An attacker's (or operator's) direct S3 client: no rollpatch rules apply."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            aws_access_key_id="soak",
            aws_secret_access_key="soak",
            region_name="us-east-1",
        )

    def stop(self) -> None:
        self.proxy.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # any HTTP answer: it is up
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: the process exited ({proc.returncode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout:.0f} s") from None
            time.sleep(0.1)


# -- service processes -------------------------------------------------------------------------


class Proc:
    """One service process, restartable on the same command line (and port)."""

    def __init__(
        self, name: str, argv: list[str], workdir: Path, env: dict[str, str], health: str | None
    ) -> None:
        self.name, self.argv, self.workdir, self.env, self.health = name, argv, workdir, env, health
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        #: when the current process answered its health check (set by the fleet without one)
        self.ready_at: float | None = None

    def start(self, wait_s: float = 120.0) -> None:
        """Spawn the process and wait until it answers its health check."""
        self.spawn()
        self.wait_ready(wait_s)

    def spawn(self) -> None:
        """Spawn the process without waiting (several boot at once: :meth:`wait_ready`)."""
        self.starts += 1
        log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.workdir,
        )
        log.close()
        self.ready_at = None

    def wait_ready(self, wait_s: float = 120.0) -> None:
        """Wait until the spawned process answers its health check (if it has one)."""
        if self.health is not None:
            assert self.proc is not None
            wait_http(self.health, wait_s, self.proc)
            self.ready_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM, not waited for (a fleet stops at once: then :meth:`stop` each)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def sample(self) -> tuple[int, int] | None:
        """``(RSS bytes, open file descriptors)`` of the running process."""
        pid = self.pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
            return rss, len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return None


def rollpatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollpatch", *args]


# -- the publisher role ------------------------------------------------------------------------


def publisher_main(board: str, model: Path, key: Path, every: float) -> None:
    """Publish version v = last durable + 1 (weights :func:`masters_for`) every ``every``
    seconds, forever; a failure (store outage) is logged, and publishing resumes from the
    board (a new :class:`Publisher` resumes after the newest version it signed)."""
    from rollpatch.errors import RollpatchError
    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.trust import Signer

    base = base_masters(model)
    config = PublisherConfig(signer=Signer.from_files([key], latest_ttl_s=3600), keyframe_every=10)
    pub: Publisher | None = None
    next_at = time.monotonic()
    while True:
        next_at += every
        try:
            if pub is None:
                pub = Publisher(board, RUN, config, asynchronous=False)
            last = pub.last_durable
            v = 0 if last is None else last + 1
            pub.publish(masters_for(base, v), version=v)
            print(f"{time.time():.3f} published {v}", flush=True)
        except (RollpatchError, OSError) as e:
            print(f"{time.time():.3f} publish failed: {type(e).__name__}: {e}", flush=True)
            pub = None
        time.sleep(max(0.0, next_at - time.monotonic()))


if __name__ == "__main__":
    publisher_main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
