"""bench/sidecar.py's engine in its own process: the built-in engine serving MODEL_DIR.

``python bench/_sidecar_engine.py MODEL_DIR`` prints ``URL`` on its first line of stdout,
then serves until stdin closes. The sidecar under test runs in the bench's process and proxies
to it over a real socket, as it does in front of vLLM.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from _sidecar_load import BenchError
from _util import proc_cpu_s

from rollpatch.engines.base import EngineAdapter


class PinnedEngine(EngineAdapter):
    """The adapter for an out-of-process built-in engine that stays on v0: checked once
    against the engine's own ``/rollpatch/state`` digest; commits are refused."""

    name = "reference-process"

    def __init__(self, url: str, digest: str) -> None:
        import httpx

        state = httpx.get(f"{url}/rollpatch/state", timeout=30).json()
        if state["digest"] != digest or state["version"] != 0:
            raise BenchError("the engine process does not hold v0")
        self._digest = digest

    @property
    def version(self) -> int | None:
        return 0

    @property
    def digest(self) -> str | None:
        return self._digest

    def load(self, view: Any, version: int) -> None:
        raise BenchError("the proxy part never commits")

    def words(self) -> Any:
        raise BenchError("the proxy part never commits")

    def apply(self, patch: Any, version: int) -> None:
        raise BenchError("the proxy part never commits")


def engine_process(world: Any, kind: str) -> tuple[Any, Any, str, int, Any]:
    """(adapter, model name, url, pid, stop) of an engine in its own process, on v0."""
    if kind == "vllm":
        from _vllm_server import Server, vllm_python

        from rollpatch.engines.vllm import VllmEngine

        srv = Server(vllm_python(), world.model, world.root / "vllm.log")
        srv.wait_ready()
        eng = VllmEngine(srv.url)
        eng.http.post(
            "/v1/completions",
            {"model": str(world.model), "prompt": "warm", "max_tokens": 2},
            timeout=600,
        )
        eng.adopt(0, world.digests[0])
        eng.release()  # the sidecar's own adapter drives it (one at a time: engines/ownership)
        return eng, str(world.model), srv.url, srv.worker_pid(), srv.stop
    here = Path(__file__).resolve().parent
    proc = subprocess.Popen(
        [sys.executable, str(here / "_sidecar_engine.py"), str(world.model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        raise BenchError("the engine process did not start")

    def stop() -> None:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)

    return PinnedEngine(url, world.digests[0]), "model", url, proc.pid, stop


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children, from /proc."""
    return proc_cpu_s(pid, children=True)


def main() -> int:
    from rollpatch.engines.reference import ReferenceEngine

    engine = ReferenceEngine.from_dir(sys.argv[1], threads=1)
    engine.load(engine.runtime.view.copy(), 0)  # verified: the booted weights are v0
    print(engine.url, flush=True)
    sys.stdin.read()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
