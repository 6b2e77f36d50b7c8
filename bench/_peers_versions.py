"""The versions of ``bench/peers.py``: simulated once (cached in the work directory), loaded back as FP32 masters."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from _util import log

from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view, save_view
from rollpatch.sim import AdamSim, SimConfig


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """v0..vN views on disk and their digests (reused when ``work`` already holds them)."""
    key = {"params": args.params, "lr": args.lr, "versions": args.versions, "seed": 0}
    meta_path = work / "versions.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["key"] == key and all(
            (work / f"v{v}.safetensors").exists() for v in range(args.versions + 1)
        ):
            log(f"reusing versions in {work}")
            return dict(meta)
    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=args.params, lr=args.lr, seed=0))
    log(f"simulator: {sim.n_params:,} params ({time.perf_counter() - t0:.0f}s)")
    prev, digests, changed = None, {}, {}
    for v in range(args.versions + 1):
        if v:
            sim.step()
        view = cast_view(sim.masters(), "bf16")
        save_view(view, work / f"v{v}.safetensors")
        digests[str(v)] = view.digest()
        if prev is not None:
            changed[str(v)] = sum(
                int(np.count_nonzero(prev[n].data != view[n].data)) for n in view
            ) / sum(t.n_elements for t in view.values())
            log(f"v{v}: {100 * changed[str(v)]:.2f}% of BF16 values changed")
        prev = view
    meta = {
        "key": key,
        "n_params": sim.n_params,
        "view_bytes": prev.nbytes if prev else 0,
        "digests": digests,
        "changed": changed,
    }
    meta_path.write_text(json.dumps(meta))
    return meta


def load_masters(work: Path, v: int) -> dict[str, np.ndarray]:
    """FP32 masters whose BF16 cast is exactly version ``v``'s view."""
    view = load_view(work / f"v{v}.safetensors")
    return {
        n: (t.data.astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        for n, t in view.items()
    }


def as_torch(masters: dict[str, np.ndarray]) -> dict[str, Any]:
    """The masters as a torch trainer holds them: CPU float32 tensors (views of the same
    memory, made before the timed call)."""
    import torch

    return {k: torch.from_numpy(m) for k, m in masters.items()}
