"""Phase 1 and 2 data of ``bench/board.py``: the simulator's versions (phase 1) and FP32 masters
replayed from them (phase 2); see that module's docstring."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from _util import (
    current_rss,
    log,
)

from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view, save_view
from rollpatch.sim import AdamSim, SimConfig

#: The served format of every version the bench publishes.
FORMAT = "bf16"
GiB = 2**30


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def simulate(
    args: argparse.Namespace, n_params: int, work: Path, n: int, bases: dict[int, Path]
) -> tuple[dict[str, Any], dict[int, str]]:
    """Phase 1: run the simulator; write v0's view, the changed words of every step and the
    views of ``bases``; return simulator facts and every version's view digest.

    One view is kept and updated tensor by tensor, so phase 1 holds the simulator, one view
    and one tensor.
    """
    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=n_params, lr=args.lr, seed=0))
    info: dict[str, Any] = {
        "n_params": sim.n_params,
        "dims": asdict(sim.dims),
        "init_s": time.perf_counter() - t0,
        "rss": current_rss(),
        "steps_s": [],
        "changed": [],
    }
    log(f"simulator: {sim.n_params:,} params, {gib(info['rss'])} RSS, {info['init_s']:.0f}s")
    digests: dict[int, str] = {}
    view = cast_view(sim.masters(), FORMAT)
    save_view(view, work / "v0.safetensors")
    info["view_bytes"] = view.nbytes
    names = sorted(view)
    for v in range(n):
        if v:
            t0 = time.perf_counter()
            sim.step()
            info["steps_s"].append(time.perf_counter() - t0)
            masters = sim.masters()
            arrays: dict[str, np.ndarray] = {}
            for i, name in enumerate(names):
                new = cast_view({name: masters[name]}, FORMAT)[name]
                pos = np.flatnonzero(view[name].data != new.data)
                arrays[f"p{i}"], arrays[f"w{i}"] = pos, new.data[pos]
                view[name] = new
            np.savez(work / f"d{v}.npz", **arrays)
            info["changed"].append(sum(a.size for k, a in arrays.items() if k[0] == "p"))
            log(
                f"sim v{v}: step {info['steps_s'][-1]:.1f}s, {info['changed'][-1]:,} values changed"
            )
        digests[v] = view.digest()
        if v in bases:
            save_view(view, bases[v])
    with open(work / "phase1.json", "w") as f:
        json.dump({"sim": info, "digests": digests}, f)
    return info, digests


class Replay:
    """FP32 masters whose BF16 cast is the simulator's version ``v`` (phase 2's input).

    They live in a file-backed map, as a trainer's weights live on its GPUs: the publisher
    copies them into host memory (its snapshot) and the kernel may page them out.
    """

    def __init__(self, work: Path) -> None:
        self.work = work
        view = load_view(work / "v0.safetensors", mmap=True)
        self.names = sorted(view)
        total = sum(view[n].n_elements for n in self.names)
        self._file = np.memmap(work / "masters.f32", dtype=np.float32, mode="w+", shape=(total,))
        self.masters: dict[str, np.ndarray] = {}
        start = 0
        for name in self.names:
            t = view[name]
            flat = self._file[start : start + t.n_elements]
            flat[:] = _widen(t.data)
            self.masters[name] = flat.reshape(t.shape)
            start += t.n_elements
        del view
        self.version = 0

    def advance(self) -> None:
        """Apply the next step's changed words."""
        self.version += 1
        with np.load(self.work / f"d{self.version}.npz") as d:
            for i, name in enumerate(self.names):
                self.masters[name].reshape(-1)[d[f"p{i}"]] = _widen(d[f"w{i}"])


def _widen(words: np.ndarray) -> np.ndarray:
    """BF16 words → the FP32 values they denote (exact)."""
    return (words.astype(np.uint32) << 16).view(np.float32)
