"""bench/sidecar.py's sidecar in its own process, as ``rollpatch sidecar --engine-url`` runs
it in front of an engine process (nothing of the bench's heap — torch, the model, the masters —
in it, so its CPU per request is the sidecar's alone).

``python bench/_sidecar_proc.py JOB`` (JSON: ``board``, ``run``, ``kind`` reference|vllm,
``url`` of the engine, ``digest`` of v0, optionally ``loop`` and ``http``: the server's
:data:`~rollpatch.serving.server.LoopKind` and :data:`~rollpatch.serving.server.HttpKind`,
default ``fast`` each; ``tap``: :attr:`ProxyFront.tap_streams`) prints the sidecar's URL on its first line of stdout
once it serves v0, then serves until stdin closes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _sidecar_load import BenchError


def main(job_json: str) -> int:
    from rollpatch.follower import FollowerConfig
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    job = json.loads(job_json)
    if "tap" in job:  # bench/_sidecar_fake.py: the relay before (False) or now (True)
        from rollpatch.sidecar.proxy import ProxyFront

        ProxyFront.tap_streams = bool(job["tap"])
    adapter: Any
    if job["kind"] == "vllm":
        from rollpatch.engines.vllm import VllmEngine

        adapter = VllmEngine(job["url"])
        adapter.adopt(0, job["digest"])  # booted from the model directory: verified as v0
    else:
        from _sidecar_engine import PinnedEngine

        adapter = PinnedEngine(job["url"], job["digest"])
    sc = start_sidecar(
        job["board"],
        job["run"],
        adapter,
        job["url"],
        loop=job.get("loop", "fast"),
        http=job.get("http", "fast"),
        config=SidecarConfig(
            commit_mode="drain", follower=FollowerConfig(poll_s=0.5, audit_bytes_per_s=None)
        ),
    )
    try:
        if not sc.sidecar.follower.wait_for(0, 120):
            raise BenchError("the sidecar never became ready on v0")
        print(sc.url, flush=True)
        sys.stdin.read()
    finally:
        sc.stop()
    return 0


class SidecarProcess:
    """The sidecar of ``job`` in a subprocess: :attr:`url`, :attr:`pid`, :meth:`stop`."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.stop()
            raise BenchError("the sidecar process did not start")
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
