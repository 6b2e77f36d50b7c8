"""bench/vllm.py's publisher side of folded patches: what ``PublisherConfig.fold_every`` costs
the trainer per version, against step patches only and the default skip stride.

The run's versions (its checkpoints, BF16) are published again, synchronously, to one
``memory://`` board per configuration, the configurations alternated version by version (the
order reversed every other version) in this process: CPU time of each ``publish()`` (user +
system, all threads: ``time.process_time``), its ``encode_s`` (step, skip and folded patches)
and the bytes it put on the board. Configurations: step patches only; ``skip_strides=(8,)``
(the default); ``fold_every=8`` with no skip stride (the fold at a multiple of 8 is the skip
patch); both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _util import table

from rollpatch.io.safetensors import load_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store.memory import MemoryStore

CONFIGS: dict[str, dict[str, Any]] = {
    "step patches only": {"skip_strides": (), "fold_every": 0},
    "skip_strides (8,) (default)": {"skip_strides": (8,), "fold_every": 0},
    "fold_every 8": {"skip_strides": (), "fold_every": 8},
    "fold_every 8 + skip (8,)": {"skip_strides": (8,), "fold_every": 8},
}


def fold_costs(checkpoint: Callable[[int], Path], versions: int) -> dict[str, Any]:
    """Per configuration: CPU ms, encode ms and bytes of each version v1..v``versions``."""
    names = {k: f"bench-fold-{uuid.uuid4().hex[:8]}" for k in CONFIGS}
    pubs = {
        k: Publisher(
            f"memory://{names[k]}",
            "fold",
            PublisherConfig(keyframe_every=0, **cfg),
            asynchronous=False,
        )
        for k, cfg in CONFIGS.items()
    }
    cpu: dict[str, list[float]] = {k: [] for k in CONFIGS}
    try:
        for v in range(versions + 1):
            masters = {
                n: t.to_array() for n, t in load_view(checkpoint(v) / "model.safetensors").items()
            }
            order = list(CONFIGS) if v % 2 == 0 else list(reversed(CONFIGS))
            for k in order:
                t0 = time.process_time()
                pubs[k].publish(masters)
                cpu[k].append(time.process_time() - t0)
            del masters
        out = {}
        for k, pub in pubs.items():
            st = pub.stats.versions[1:]
            out[k] = {
                "cpu_ms": [1e3 * c for c in cpu[k][1:]],
                "encode_ms": [1e3 * s.encode_s for s in st],
                "bytes": [s.bytes for s in st],
            }
        return out
    finally:
        for k, pub in pubs.items():
            pub.close()
            MemoryStore.reset(names[k])


def render_fold(res: dict[str, Any]) -> str:
    if not res:
        return ""
    base = res["step patches only"]
    rows = []
    for k, r in res.items():
        cpu, enc, nb = sum(r["cpu_ms"]), sum(r["encode_ms"]), sum(r["bytes"])
        rows.append(
            [
                k,
                f"{cpu / len(r['cpu_ms']):.0f}",
                f"{cpu / sum(base['cpu_ms']):.2f}x",
                f"{enc / len(r['encode_ms']):.0f}",
                f"{nb / len(r['bytes']) / 1e3:,.0f} kB",
                f"{nb / sum(base['bytes']):.2f}x",
                f"{r['bytes'][-1] / 1e3:,.0f} kB",
            ]
        )
    n = len(base["cpu_ms"])
    return table(
        [
            f"publisher, v1..v{n}",
            "CPU ms/version",
            "/ steps",
            "encode ms/version",
            "bytes/version",
            "/ steps",
            f"bytes of v{n}",
        ],
        rows,
        [False] + [True] * 6,
    ) + (
        "\nthe run's versions published again per configuration (synchronous, memory:// board,"
        " configurations alternated), keyframe only at v0; CPU = process time of publish()"
        " (all threads; the trainer's publisher thread), means over the versions"
    )
