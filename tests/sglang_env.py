"""Helpers of the SGLang tests: the separate SGLang venv and an SGLang server.

The venv is built by ``scripts/sglang-env`` (cached at ``$ROLLPATCH_SGLANG_VENV`` or
``~/.cache/rollpatch/sglang-venv-0.5.23``). A server runs this checkout's rollpatch
(``PYTHONPATH=<repo>/src``) with SGLang's CPU engine, the ``sgl_kernel`` import shim and
rollpatch's custom weight loader, bound to 127.0.0.1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rollpatch.engines.sglang.launch import server_command, server_env
from tests import vllm_env

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"
BUILD_HINT = "build it with `scripts/sglang-env` (≈2 min, ≈2.8 GB; cached)"


def venv_dir() -> Path:
    env = os.environ.get("ROLLPATCH_SGLANG_VENV")
    if env is not None and env != "":
        return Path(env)
    return Path.home() / ".cache" / "rollpatch" / f"sglang-venv-{SGLANG_VERSION}"


def sglang_python() -> Path | None:
    """The SGLang venv's python, or None when scripts/sglang-env has not completed there."""
    venv = venv_dir()
    python, stamp = venv / "bin" / "python", venv / ".stamp-sglang"
    if (
        not python.exists()
        or not stamp.exists()
        or SGLANG_VERSION not in stamp.read_text()
        or not (venv / "sgl-kernel-shim" / "sgl_kernel" / "__init__.py").exists()
    ):
        return None
    return python


def start_server(
    python: Path,
    model: Path,
    log: Path,
    shim_log: Path,
    *,
    tp: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> vllm_env.Server:
    """SGLang's CPU engine on 127.0.0.1 with rollpatch's loader and the sgl_kernel shim
    (``tp`` > 1: that many ranks, one core each; SGLang's CPU engine asks for an explicit
    core per rank when there are more ranks than NUMA nodes; ``extra_env``: added to the
    server's environment, e.g. ``ROLLPATCH_FAULT_INJECTION=1``)."""
    port = vllm_env.free_port()
    env = vllm_env.write_bytecode(server_env(venv_dir(), REPO / "src", shim_log))
    env.update(extra_env or {})
    env["TOKENIZERS_PARALLELISM"] = "false"
    # server_command passes --sleep-on-idle: idle, the scheduler waits on its sockets instead
    # of spinning a core (a session's server idles through most of the suite: live_servers)
    extra = ["--random-seed", "0"]
    if tp > 1:
        extra += ["--tp-size", str(tp)]
        cores = os.sched_getaffinity(0)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            str(sorted(cores)[r % len(cores)]) for r in range(tp)
        )
    # SGLang sizes its KV pool as the memory free after loading less (1 - fraction) of what was
    # free before: any other process that grows by more than `fraction` of free memory while
    # the model loads (the suite's other jobs, a vLLM server starting) fails the start with
    # "Loaded weights leave no GPU memory for the KV cache" (seen at 0.05 in a CI run beside
    # benches). --max-total-tokens caps the pool, so a larger fraction allocates no more.
    cmd = server_command(python, model, port, mem_fraction=0.3 / tp, extra=extra)
    return vllm_env.Server(
        cmd, env=env, log=log, url=f"http://127.0.0.1:{port}", name="SGLang", cwd=log.parent
    )


def greedy(
    srv: vllm_env.Server, prompt_ids: list[list[int]], max_tokens: int
) -> tuple[list[tuple[list[int], list[float]]], set[str]]:
    """Greedy tokens and logprobs per prompt (SGLang's native route), and the weight versions
    SGLang tagged them with."""
    outs, tags = [], set()
    for ids in prompt_ids:
        r = srv.post(
            "/generate",
            {
                "input_ids": ids,
                "return_logprob": True,
                "sampling_params": {
                    "max_new_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            },
        )
        outs.append(
            (list(r["output_ids"]), [float(x[0]) for x in r["meta_info"]["output_token_logprobs"]])
        )
        tags.add(str(r["meta_info"]["weight_version"]))
    return outs, tags
