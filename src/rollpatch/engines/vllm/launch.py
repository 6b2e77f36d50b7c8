"""How to start vLLM's CPU server with rollpatch's extension: the command and the environment
(docs/vllm.md). Used by the tests' shared server and by bench/vllm.py and bench/sidecar.py."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "EXTENSION",
    "SCHEDULER",
    "TRANSFER_CONFIG",
    "cpu_binding",
    "server_command",
    "server_env",
]

#: The worker extension: rollpatch's operations inside every vLLM worker (:mod:`.worker`).
EXTENSION = "rollpatch.engines.vllm.WorkerExtension"
#: vLLM's own scheduler, named through :mod:`.core` so the EngineCore process installs the
#: one-call staged commit (no pause round trips around a commit).
SCHEDULER = "rollpatch.engines.vllm.core.Scheduler"
#: The official weight-update routes through rollpatch's backend (:mod:`.backend`).
TRANSFER_CONFIG = '{"backend": "rollpatch"}'


def server_command(
    python: Path | str,
    model: Path | str,
    port: int,
    *,
    weight_transfer: bool = True,
    atomic_commit: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1:``port``: BF16, eager,
    seed 0, 512 tokens of context, rollpatch's worker extension; ``weight_transfer``: the
    official weight-update routes (``/update_weights`` ...); ``atomic_commit``: the
    engine-core hook (:mod:`.core`)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--seed",
        "0",
        "--worker-extension-cls",
        EXTENSION,
        *(["--weight-transfer-config", TRANSFER_CONFIG] if weight_transfer else []),
        *(["--scheduler-cls", SCHEDULER] if atomic_commit else []),
        *extra,
    ]


def cpu_binding(tp: int, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers on one host: the usable cores
    (``cpus``, default this process's affinity) split into ``tp`` contiguous groups, ``|``
    between ranks (``"0-3|4-7"``); with fewer cores than ranks, ranks share cores round-robin.
    vLLM's ``auto`` binds one NUMA node per rank and refuses ``tp`` above the node count
    ("Not enough allowed NUMA nodes"), which a one-socket host always is."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, not {tp}")
    ids = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not ids:
        raise ValueError("no usable cores")
    if len(ids) < tp:
        return "|".join(str(ids[r % len(ids)]) for r in range(tp))
    per, extra = divmod(len(ids), tp)
    groups, at = [], 0
    for r in range(tp):
        n = per + (r < extra)
        groups.append(",".join(str(c) for c in ids[at : at + n]))
        at += n
    return "|".join(groups)


def server_env(
    src: Path | str, base: Mapping[str, str] | None = None, *, tp: int = 1
) -> dict[str, str]:
    """The server's environment: the CPU engine's settings (1 GiB of KV cache; OpenMP
    threads bound automatically at ``tp`` 1, to :func:`cpu_binding`'s cores above), offline,
    dev mode (``/collective_rpc``, ``/pause``: bind to 127.0.0.1 only), and rollpatch's
    ``src`` on the path (the venv's python is the interpreter, not activated)."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "auto" if tp == 1 else cpu_binding(tp),
            "HF_HUB_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(src),
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
    )
    return env
