"""bench/vllm.py's vLLM server: start, stop, find the worker process, read its memory."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _server_proc import BenchError, ServerProc

VLLM_VERSION = "0.32.0"
MAX_TOKENS = 8


def vllm_python() -> Path:
    """The python of the venv ``scripts/vllm-env`` builds (same lookup as the tests)."""
    env = os.environ.get("ROLLPATCH_VLLM_VENV")
    venv = Path(env) if env else Path.home() / ".cache" / "rollpatch" / f"vllm-venv-{VLLM_VERSION}"
    python, stamp = venv / "bin" / "python", venv / ".stamp-vllm"
    if not python.exists() or not stamp.exists() or VLLM_VERSION not in stamp.read_text():
        raise BenchError(f"no vLLM venv at {venv}: build it with scripts/vllm-env")
    return python


class Server:
    """One vLLM OpenAI server with rollpatch's extension, in its own process group."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log_path: Path,
        *,
        extra: Sequence[str] = (),
        tp: int = 1,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        from rollpatch.engines.vllm.launch import server_command, server_env

        repo = Path(__file__).resolve().parents[1]
        tp_args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        cmd = server_command(python, model, port, extra=[*extra, *tp_args])
        self.url, self.model, self.log_path = f"http://127.0.0.1:{port}", model, log_path
        # cwd: not bench/, whose vllm.py would shadow the vllm package
        self.server = ServerProc(
            cmd,
            env=server_env(repo / "src", tp=tp),
            log=log_path,
            url=self.url,
            name="vLLM",
            cwd=log_path.parent,
        )
        self.proc = self.server.proc

    def wait_ready(self, timeout: float = 400.0) -> float:
        return self.server.wait_ready(timeout)

    def tail(self, n: int = 30) -> str:
        return self.server.tail(n)

    def stop(self) -> None:
        self.server.stop()

    def worker_pid(self) -> int:
        """The process holding the weights: vLLM 0.32 on CPU runs its worker in a child of
        the EngineCore (``VLLM::Worker``); else the EngineCore (a uniprocess executor), else
        the largest descendant."""
        kids = _descendants(self.proc.pid)
        for name in ("VLLM::Worker", "VLLM::EngineCor"):
            for pid in kids:
                if _read(f"/proc/{pid}/comm").startswith(name):
                    return pid
        if not kids:
            raise BenchError("the vLLM server has no child process")
        return max(kids, key=lambda p: status_kb(p, "VmRSS"))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parent[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def status_kb(pid: int, field: str) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise BenchError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> bool:
    """VmHWM := VmRSS (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def greedy(http: Any, model: Path, prompt_ids: list[int]) -> tuple[list[str], list[float]]:
    r = http.post(
        "/v1/completions",
        {
            "model": str(model),
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        },
    )
    lp = r["choices"][0]["logprobs"]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


def memory(pid: int) -> dict[str, int]:
    return {
        k: status_kb(pid, f)
        for k, f in (
            ("rss_kb", "VmRSS"),
            ("hwm_kb", "VmHWM"),
            ("anon_kb", "RssAnon"),
            ("file_kb", "RssFile"),
        )
    }
