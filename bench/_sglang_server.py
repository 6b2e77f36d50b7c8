"""bench/sglang.py's SGLang server (also bench/serving_load.py's): start, wait, stop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from _server_proc import ServerProc
from _sglang_report import SGLANG_VERSION
from _vllm_server import BenchError

from rollpatch.engines.sglang.launch import server_command, server_env

REPO = Path(__file__).resolve().parents[1]


def venv() -> Path:
    env = os.environ.get("ROLLPATCH_SGLANG_VENV")
    return (
        Path(env) if env else Path.home() / ".cache" / "rollpatch" / f"sglang-venv-{SGLANG_VERSION}"
    )


class Server:
    """SGLang's CPU server on 127.0.0.1 (our child, its own process group)."""

    def __init__(self, model: Path, log_path: Path, port: int = 31977, tp: int = 1) -> None:
        python = venv() / "bin" / "python"
        if not (venv() / ".stamp-sglang").exists():
            raise BenchError(f"no SGLang venv at {venv()}: run scripts/sglang-env")
        self.shim_log = log_path.with_suffix(".shim")
        env = server_env(venv(), REPO / "src", self.shim_log)
        extra: list[str] = []
        if tp > 1:  # one core per rank (SGLang's CPU engine wants them named)
            cores = sorted(os.sched_getaffinity(0))
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(cores[r % len(cores)]) for r in range(tp)
            )
            extra = ["--tp-size", str(tp)]
        cmd = server_command(python, model, port, mem_fraction=0.3 / tp, extra=extra)
        # cwd: not bench/, whose sglang.py would shadow the sglang package
        url = f"http://127.0.0.1:{port}"
        self.server = ServerProc(
            cmd, env=env, log=log_path, url=url, name="SGLang", cwd=log_path.parent
        )
        self.url, self.log_path, self.proc = url, log_path, self.server.proc

    def wait_ready(self, timeout: float = 600.0) -> float:
        return self.server.wait_ready(timeout)

    def stop(self) -> None:
        self.server.stop()
        calls = self.shim_log.read_text() if self.shim_log.exists() else ""
        if calls:
            raise BenchError(f"SGLang called the sgl_kernel import shim:\n{calls}")


def reload_paused(engine: Any, ckpt: Path, tag: str) -> None:
    """SGLang's own full update: its pause, ``/update_weights_from_disk`` of the checkpoint
    directory ``ckpt`` tagged ``tag``, continue (the callers read ``ckpt`` first, untimed:
    page cache warm)."""
    engine.pause()
    try:
        r = engine._http(
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(ckpt), "weight_version": tag},
            check=False,
        )
    finally:
        engine.resume()
    if not r.get("success"):
        raise BenchError(f"SGLang's reload of {ckpt.name} failed: {r}")
