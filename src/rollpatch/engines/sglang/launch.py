"""How to start SGLang's CPU server with rollpatch's weight loader: the command and the
environment (docs/sglang.md). Used by the tests' shared server and by bench/sglang.py."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["LOADER", "server_command", "server_env"]

#: The ``--custom-weight-loader`` that gives rollpatch the model's parameters in place.
LOADER = "rollpatch.engines.sglang.loader.rollpatch_weight_loader"


def server_command(
    python: Path | str,
    model: Path | str,
    port: int,
    *,
    mem_fraction: float,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server`` on 127.0.0.1:``port``, CPU, BF16, rollpatch's loader."""
    return [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--skip-server-warmup",
        "--mem-fraction-static",
        str(mem_fraction),
        "--max-total-tokens",
        "4096",
        "--context-length",
        "512",
        "--custom-weight-loader",
        LOADER,
        # idle, the scheduler waits on its sockets instead of polling them in a loop that
        # holds the GIL, which the control thread needs to stage a patch (at 441M a stage
        # took 6.7 s beside the polling loop, 0.5 s without: docs/sglang.md)
        "--sleep-on-idle",
        *extra,
    ]


def server_env(
    venv: Path, src: Path, shim_log: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: CPU engine, offline, the sgl_kernel shim from ``venv`` and
    rollpatch's ``src`` on the path (the venv itself is the interpreter, not activated)."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "ROLLPATCH_SGL_SHIM_LOG": str(shim_log),
            "PYTHONPATH": f"{venv / 'sgl-kernel-shim'}{os.pathsep}{src}",
        }
    )
    return env
