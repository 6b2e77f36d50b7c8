"""vLLM's CPU prebuild in one process: the weight copy each touched module's kernel is packed
from, then vLLM's own oneDNN handler (``create_onednn_mm``), three ways alternated.

- *3 steps*: what the prebuild did first: ``clone()``, a native checked scatter of the staged
  words, numpy's read-back;
- *one pass*: ``copy_with_writes`` into a fresh tensor per module;
- *reused*: ``copy_with_writes`` into one buffer reused module by module (what the prebuild
  now does for kernel-only modules: their kernels keep their own packed words).

Shapes: the 441M model of ``bench/vllm.py --sizes 2048x9`` (per layer qkv, o, gate_up, down;
and the LM head), BF16, one torch thread like vLLM's CPU worker; change densities of one step
(2.7%) and of a 5-step composed change (7%). Each round runs the three ways in turn (order
reversed every other round); the table gives medians over rounds. Every copy is checked.

Run: ``python bench/vllm_prebuild.py [--rounds 6] [--scale 1] [--json PATH]`` (it re-runs
itself with the vLLM venv's python, ``scripts/vllm-env``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

LAYERS = 9
SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
HEAD = (4096, 2048)
DENSITIES = (0.027, 0.07)
WAYS = ("3 steps", "one pass", "reused")


def _reexec() -> None:
    """Run again under the vLLM venv's python (vllm is not in the project's venv)."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from _vllm_server import vllm_python

    env = dict(os.environ, OMP_NUM_THREADS="1", ROLLPATCH_PREBUILD_CHILD="1")
    env["PYTHONPATH"] = str(here.parent / "src")
    os.execve(str(vllm_python()), [str(vllm_python()), __file__, *sys.argv[1:]], env)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from vllm import _custom_ops as ops

    from rollpatch.engines.writing import check_and_write, copy_with_writes

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shapes = [s for _ in range(LAYERS) for s in SHAPES.values()] + [HEAD]
    shapes = [(max(1, n // args.scale), k) for n, k in shapes]
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    try:  # vLLM itself falls back to torch's linear (no handler to build) where this fails
        ops.create_onednn_mm(weights[0][:8].clone().t(), 32)
        onednn: str | None = None
    except RuntimeError as e:  # e.g. a CPU without AVX-512: no oneDNN BF16 matmul
        onednn = str(e).splitlines()[0][:200]

    def words(t: Any) -> Any:
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)

    out: dict[str, Any] = {"modules": len(shapes), "rows": [], "onednn_unavailable": onednn}
    for density in DENSITIES:
        ups = []
        for w in weights:
            flat = words(w)
            pos = np.sort(rng.choice(flat.size, int(flat.size * density), replace=False))
            old = flat[pos].copy()
            ups.append((pos.astype(np.int64), old, old ^ np.uint16(1)))
        scratch = torch.empty(max(w.numel() for w in weights), dtype=torch.bfloat16)

        def copy(way: str, w: Any, pos: Any, old: Any, new: Any) -> Any:
            if way == "3 steps":
                c = w.detach().clone()
                check_and_write(words(c), pos, old, new, "w")
                if not np.array_equal(words(c)[pos], new):
                    raise AssertionError("read-back")
                return c
            c = torch.empty_like(w) if way == "one pass" else scratch[: w.numel()].view(w.shape)  # noqa: B023
            copy_with_writes(words(w), words(c), pos, old, new, "w")
            return c

        times: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                t_copy = t_handler = 0.0
                handlers = []
                for w, (pos, old, new) in zip(weights, ups, strict=True):
                    t0 = time.perf_counter()
                    c = copy(way, w, pos, old, new)
                    t1 = time.perf_counter()
                    if onednn is None:
                        handlers.append(ops.create_onednn_mm(c.t(), 32))
                    t_copy, t_handler = t_copy + t1 - t0, t_handler + time.perf_counter() - t1
                    want = words(w).copy()
                    want[pos] = new
                    if not np.array_equal(words(c), want):
                        raise AssertionError(f"{way}: the copy is not the weight with its writes")
                del handlers
                times[way].append((t_copy * 1e3, t_handler * 1e3))
        out["rows"].append(
            {
                "density": density,
                "ms": {
                    way: {
                        "copies": statistics.median(c for c, _ in v),
                        "handlers": statistics.median(h for _, h in v),
                        "total": statistics.median(c + h for c, h in v),
                    }
                    for way, v in times.items()
                },
                "samples": times,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows by this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not os.environ.get("ROLLPATCH_PREBUILD_CHILD"):
        _reexec()
    from _util import machine, table

    here = str(Path(__file__).resolve().parent)  # bench/vllm.py would shadow the vllm package
    sys.path[:] = [p for p in sys.path if p not in ("", here) and Path(p).resolve() != Path(here)]
    got = _measure(args)
    rows = []
    for r in got["rows"]:
        ms = r["ms"]
        rows.append(
            [f"{100 * r['density']:.1f}"]
            + [f"{ms[w]['copies']:.0f}" for w in WAYS]
            + [f"{ms[w]['handlers']:.0f}" for w in WAYS]
            + [f"{ms[w]['total']:.0f}" for w in WAYS]
            + [f"{ms['reused']['total'] / ms['3 steps']['total']:.2f}"]
        )
    headers = ["chg %"] + [f"copies: {w}" for w in WAYS] + [f"handlers: {w}" for w in WAYS]
    headers += [f"prebuild: {w}" for w in WAYS] + ["reused / 3 steps"]
    print(table(headers, rows))
    if got["onednn_unavailable"]:
        print(
            "handlers: 0 ms, none built: vLLM's oneDNN BF16 matmul is not available on this CPU "
            f"({got['onednn_unavailable']}); vLLM serves these linears with torch's "
            "linear from the plain weights, and nothing is prebuilt"
        )
    m = machine()
    print(
        f"{got['modules']} modules (the 441M model's linear layers, rows / {args.scale}), BF16, "
        f"one torch thread; ms, medians of {args.rounds} alternated rounds; "
        f"machine: {m['usable_cores']} usable cores ({m['cpu_model']}), load {m['loadavg_1m']:.1f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, **got}, indent=1))


if __name__ == "__main__":
    main()
