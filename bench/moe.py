"""MoE benchmark: what rollpatch ships for a simulated mixture-of-experts run, experts vs dense.

Run: ``python bench/moe.py`` (100M, 32 experts, top-4), or e.g. ``python bench/moe.py --params 1B
--experts 32 --top-k 4 --steps 2 --formats bf16 --analyze /tmp/moe-ckpts``.

**Data.** Consecutive FP32 masters of :mod:`rollpatch.sim` with ``SimConfig.moe`` (Qwen3-MoE
names; routed experts whose per-step token counts follow a skewed law; see
:mod:`rollpatch.sim.moe`), cast by :func:`rollpatch.formats.cast_view` with the routers kept
BF16 (``*.mlp.gate.weight`` excluded from quantisation, as MoE checkpoints quantised for vLLM
do).

**Tables** (every number of one run; ratios against baselines measured on the same views):

1. *By tensor group*: changed %, rollpatch payload bytes (per-tensor lengths from the patch
   header), XOR+zstd-1 bytes of the same tensors (per tensor, zstd level 1 of old XOR new: the
   Stitch method), their ratio, and rollpatch bits per changed value.
2. *Experts by routing load*: experts binned by expected token-expert assignments per step;
   changed % pooled over the bin, and the spread over its experts.
3. *Expert layout and the codec's statistics*: the codec keeps change statistics per tensor,
   per 2^20-element chunk and per exponent context (docs/patch-format.md §4b). With one tensor
   per expert (checkpoint naming) every expert has statistics of its own; a fused layout
   (``[experts, ...]``, as vLLM's ``w13``/``w2`` and fused checkpoints hold them) shares them
   across the experts a chunk spans. Per MoE layer, the same transition is encoded both ways
   (each its own patch: container header once per layer in both) and summed. "expert ctx"
   is what contexts that also knew the expert would save on the fused layout, ideally: the
   position bits ``Σ n·H(k/n)`` over (chunk, exponent context) cells minus the same over
   (chunk, context, expert) cells, as a share of the fused payload, and the params the extra
   listed contexts would cost (≈ 5 bytes each: ``c, n_c, k_c, b_c, eg_c``).
4. ``--analyze DIR``: the checkpoints are written to DIR as FP32 safetensors and, once the
   simulator is freed, ``rollpatch analyze`` runs on them; its report is printed as is.

``python bench/moe.py --vllm [--hidden --layers --experts ...]``: expert patches in a live vLLM
on the CPU (its MoE kernel prepacks the experts) against ``reload_weights``: bench/_moe_vllm.py.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _baselines import xor_encode
from _util import fmt_size, log, machine, machine_line, parse_size, peak_rss, table

from rollpatch.analysis import tensor_group
from rollpatch.analysis.experts import expert_of, expert_step
from rollpatch.formats import QuantPolicy, cast_view
from rollpatch.io import save_view
from rollpatch.kinds import single_context
from rollpatch.patch import diff, encode, inspect
from rollpatch.sim import AdamSim, MoEConfig, SimConfig
from rollpatch.view import Tensor, View

GROUP_ORDER = ("embeddings", "attention", "mlp", "experts", "router", "norms", "lm_head")
LOAD_BINS = ((0.0, 1.0), (1.0, 100.0), (100.0, 10_000.0), (10_000.0, float("inf")))
ROUTERS_BF16 = QuantPolicy(exclude=("*.mlp.gate.weight",))
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


class Acc:
    """Sums of one format over the run."""

    def __init__(self) -> None:
        self.elements: dict[str, int] = defaultdict(int)
        self.changed: dict[str, int] = defaultdict(int)
        self.rp: dict[str, int] = defaultdict(int)
        self.xor1: dict[str, int] = defaultdict(int)
        self.header = 0
        self.patch = 0
        self.per_expert: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
        self.quantiles: list[dict[str, float]] = []
        self.router: list[float] = []
        self.split = [0, 0]  # per-expert tensors, encoded per layer: (bytes, payload bytes)
        self.fused = [0, 0]  # the same, fused [experts, ...] per layer and projection
        self.ctx_gain = [0.0, 0]  # expert-aware contexts on the fused layout: (bits, cells)


def fused(view: View, names: list[str]) -> View:
    """The tensors of ``names`` (one MoE layer's experts) stacked per projection, in order."""
    parts: dict[str, list[str]] = defaultdict(list)
    for n in names:
        parts[_EXPERT_INDEX.sub(".experts.", n)].append(n)
    out = {}
    for key, members in parts.items():
        members.sort(key=lambda n: expert_of(n)[1] or 0)  # type: ignore[index]
        first = view[members[0]]
        data = np.concatenate([view[n].data for n in members])
        out[key] = Tensor(first.kind, (len(members) * first.shape[0], *first.shape[1:]), data)
    return View(out)


def measure(a: View, b: View, acc: Acc, pool: ThreadPoolExecutor) -> None:
    """One transition under one format, into ``acc``."""
    patch = diff(a, b)
    blob = encode(patch, a)
    lengths = {e["name"]: int(e["length"]) for e in inspect(blob).tensors}
    acc.patch += len(blob)
    acc.header += len(blob) - sum(lengths.values())
    xor = {n: len(f) for n, (f, _) in xor_encode(a, b, pool, 1).items()}
    for name, t in a.items():
        g = tensor_group(name)
        acc.elements[g] += t.n_elements
        tp = patch.tensors.get(name)
        acc.changed[g] += tp.n_changed if tp is not None else 0
        acc.rp[g] += lengths.get(name, 0)
        acc.xor1[g] += xor[name]
    ex = expert_step(a, patch)
    assert ex is not None
    for e in ex.experts:
        cell = acc.per_expert[e.layer, e.expert]
        cell[0] += e.elements
        cell[1] += e.changed
    acc.quantiles.append(ex.quantiles())
    acc.router.append(sum(r.changed for r in ex.routers) / sum(r.elements for r in ex.routers))
    del patch
    by_layer: dict[int, list[str]] = defaultdict(list)
    for n in a:
        key = expert_of(n)
        if key is not None:
            by_layer[key[0]].append(n)
    for names in by_layer.values():
        sa, sb = View({n: a[n] for n in names}), View({n: b[n] for n in names})
        _sizes(sa, sb, acc.split)
        fa, fb = fused(a, names), fused(b, names)
        _sizes(fa, fb, acc.fused)
        fp = diff(fa, fb)
        for name, tp in fp.tensors.items():
            gain = _expert_ctx_gain(fa[name], tp.changes().positions, a_experts(names, name))
            acc.ctx_gain[0] += gain[0]
            acc.ctx_gain[1] += gain[1]


def a_experts(names: list[str], fused_name: str) -> int:
    """How many experts a fused tensor stacks."""
    return sum(_EXPERT_INDEX.sub(".experts.", n) == fused_name for n in names)


def _h2(n: np.ndarray, k: np.ndarray) -> float:
    """Σ n·H(k/n) in bits over cells with 0 < k < n."""
    m = (k > 0) & (k < n)
    p = k[m] / n[m]
    return float(np.sum(-n[m] * (p * np.log2(p) + (1 - p) * np.log2(1 - p))))


def _expert_ctx_gain(t: Tensor, positions: np.ndarray, n_exp: int) -> tuple[float, int]:
    """(position bits saved by splitting every (chunk, context) cell by expert, extra listed
    cells) for one fused tensor; the codec's chunks are 2^20 elements."""
    el = t.elements()
    n = el.size
    kind = t.kind
    bits = 0 if single_context(kind, n) else kind.ctx_bits
    ctx = ((el >> kind.ctx_shift) & ((1 << bits) - 1)).astype(np.int64) if bits else 0
    idx = np.arange(n, dtype=np.int64)
    pooled = (idx >> 20 << bits) + ctx
    split = pooled * n_exp + idx // (n // n_exp)
    del idx
    out = []
    for key in (pooled, split):
        size = int(key.max()) + 1
        cells_n = np.bincount(key, minlength=size)
        cells_k = np.bincount(key[positions], minlength=size)
        out.append((_h2(cells_n, cells_k), int(np.count_nonzero(cells_k))))
    return out[0][0] - out[1][0], out[1][1] - out[0][1]


def _sizes(a: View, b: View, into: list[int]) -> None:
    blob = encode(diff(a, b), a)
    into[0] += len(blob)
    into[1] += sum(int(e["length"]) for e in inspect(blob).tensors)


def _pct(x: float) -> str:
    return f"{100 * x:.3f}"


def render(accs: dict[str, Acc], loads: dict[tuple[int, int], float], steps: int) -> str:
    out = []
    rows = []
    for f, acc in accs.items():
        total_el = sum(acc.elements.values())
        for g in [*GROUP_ORDER, "all"]:
            el = total_el if g == "all" else acc.elements.get(g, 0)
            if not el:
                continue
            ch = sum(acc.changed.values()) if g == "all" else acc.changed[g]
            rp = acc.patch if g == "all" else acc.rp[g]
            x1 = sum(acc.xor1.values()) if g == "all" else acc.xor1[g]
            rows.append(
                [
                    f,
                    g,
                    f"{100 * el / total_el:.2f}",
                    _pct(ch / el),
                    fmt_size(rp // steps),
                    fmt_size(x1 // steps),
                    f"{x1 / rp:.2f}" if rp else "-",
                    f"{8 * rp / ch:.2f}" if ch else "-",
                ]
            )
    heads = ["format", "group", "elem %", "chg %", "rp/step", "xor1/step", "xor1/rp", "bits/chg"]
    out += ["By tensor group (per transition; all: whole patch, header included)"]
    out += [table(heads, rows, [False, False] + [True] * 6), ""]

    rows = []
    for f, acc in accs.items():
        for lo, hi in LOAD_BINS:
            keys = [k for k in acc.per_expert if lo <= loads[k] < hi]
            if not keys:
                continue
            el = sum(acc.per_expert[k][0] for k in keys)
            ch = sum(acc.per_expert[k][1] for k in keys)
            fr = np.array([acc.per_expert[k][1] / acc.per_expert[k][0] for k in keys])
            rows.append(
                [
                    f,
                    f"[{lo:g}, {hi:g})",
                    str(len(keys)),
                    f"{np.mean([loads[k] for k in keys]):.3g}",
                    _pct(ch / el),
                    _pct(float(fr.min())),
                    _pct(float(np.median(fr))),
                    _pct(float(fr.max())),
                ]
            )
        q = acc.quantiles
        qs = {k: float(np.mean([x[k] for x in q])) for k in q[0]}
        rows.append(
            [
                f,
                "all experts",
                str(len(acc.per_expert)),
                f"{np.mean(list(loads.values())):.3g}",
                _pct(acc.changed["experts"] / acc.elements["experts"]),
                _pct(qs["q0"]),
                _pct(qs["q50"]),
                _pct(qs["q100"]),
            ]
        )
        rows.append([f, "routers", "-", "-", _pct(float(np.mean(acc.router))), "-", "-", "-"])
    heads = ["format", "tokens/step", "experts", "mean load", "chg %", "min", "median", "max"]
    out += [
        "Experts by routing load (expected token-expert assignments per step); min/median/max",
        "over the bin's experts, over the whole run (all experts: per-step quantiles, mean)",
    ]
    out += [table(heads, rows, [False, False] + [True] * 6), ""]

    rows = [
        [
            f,
            fmt_size(acc.split[0] // steps),
            fmt_size(acc.split[1] // steps),
            fmt_size(acc.fused[0] // steps),
            fmt_size(acc.fused[1] // steps),
            f"{acc.fused[0] / acc.split[0]:.3f}",
            f"{acc.fused[1] / acc.split[1]:.3f}",
            f"{100 * acc.ctx_gain[0] / 8 / acc.fused[1]:.2f}%",
            fmt_size(5 * acc.ctx_gain[1] // steps),
            fmt_size(acc.xor1["experts"] // steps),
            f"{acc.xor1['experts'] / acc.split[0]:.2f}",
        ]
        for f, acc in accs.items()
    ]
    heads = [
        "format",
        "per-expert",
        "payload",
        "fused",
        "payload",
        "fused/per-expert",
        "payloads",
        "expert ctx",
        "its params",
        "xor1",
        "xor1/per-expert",
    ]
    out += [
        "Expert tensors only, per transition: one tensor per expert vs fused [experts, ...] per",
        "layer and projection (each MoE layer its own patch; payload: coded bytes without the",
        "container header and its per-tensor entries)",
    ]
    out += [table(heads, rows, [False] + [True] * 10)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--vllm" in argv:  # expert patches in a live vLLM: bench/_moe_vllm.py
        import _moe_vllm

        return _moe_vllm.main([a for a in argv if a != "--vllm"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="100M", help="total parameters (experts included)")
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=4, help="experts per token")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    ap.add_argument("--zipf", type=float, default=1.0, help="MoEConfig.zipf_exponent")
    ap.add_argument("--cold-factor", type=float, default=1e-5, help="MoEConfig.cold_factor")
    ap.add_argument("--steps", type=int, default=2, help="transitions to measure")
    ap.add_argument("--formats", default="bf16,fp8-e4m3-block128,nvfp4", help="served formats")
    ap.add_argument("--threads", type=int, default=2, help="simulator and baseline threads")
    ap.add_argument("--analyze", metavar="DIR", help="write checkpoints here, run analyze")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    mach = machine()
    t_start = time.perf_counter()
    moe = MoEConfig(
        experts=args.experts,
        top_k=args.top_k,
        zipf_exponent=args.zipf,
        cold_factor=args.cold_factor,
    )
    cfg = SimConfig(
        n_params=parse_size(args.params), lr=args.lr, seed=0, moe=moe, threads=args.threads
    )
    t0 = time.perf_counter()
    sim = AdamSim(cfg)
    info: dict[str, Any] = {"init_s": time.perf_counter() - t0, "step_s": []}
    log(f"simulator {sim.n_params:,} params ({sim.dims}) in {info['init_s']:.0f}s")
    loads = {
        (layer, e): float(x)
        for layer in range(sim.dims.layers)
        if sim.dims.is_moe(layer)
        for e, x in enumerate(sim.expert_load(layer))
    }
    ckpts: list[Path] = []
    out_dir = Path(args.analyze) if args.analyze else None

    def save(sim: AdamSim) -> None:
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpts.append(out_dir / f"step{len(ckpts)}.safetensors")
        ms = sim.masters()
        save_view(View({k: Tensor.from_array(v) for k, v in ms.items()}), ckpts[-1])

    save(sim)
    base = {f: cast_view(sim.masters(), f, policy=ROUTERS_BF16) for f in formats}
    accs = {f: Acc() for f in formats}
    with ThreadPoolExecutor(args.threads) as pool:
        for s in range(args.steps):
            t0 = time.perf_counter()
            sim.step()
            info["step_s"].append(time.perf_counter() - t0)
            save(sim)
            for f in formats:
                target = cast_view(sim.masters(), f, policy=ROUTERS_BF16)
                measure(base[f], target, accs[f], pool)
                base[f] = target
            log(f"step {s + 1}: sim {info['step_s'][-1]:.1f}s, measured")
    sim_rss = peak_rss()
    n_params, dims = sim.n_params, sim.dims
    del sim, base
    load1 = os.getloadavg()[0]
    print(render(accs, loads, args.steps))
    print()
    print(
        f"machine: {machine_line(mach)}; load avg {mach['loadavg_1m'] or 0:.1f} at start, {load1:.1f} at "
        f"end; {(time.perf_counter() - t_start) / 60:.1f} min wall"
    )
    print(
        f"sim: {n_params:,} params, hidden {dims.hidden}, {dims.layers} layers "
        f"({dims.layers - dims.dense_layers} MoE), {dims.experts} experts x {dims.top_k} "
        f"(expert width {dims.expert_intermediate}), routing zipf {args.zipf:g} cold factor "
        f"{args.cold_factor:g}, lr {args.lr:g}, {args.steps} transitions; "
        f"built {info['init_s']:.0f}s, step {np.median(info['step_s']):.1f}s median; peak RSS "
        f"{sim_rss / 2**30:.1f} GiB"
    )
    if ckpts:
        cmd = [sys.executable, "-m", "rollpatch", "analyze", *map(str, ckpts), "--no-progress"]
        cmd += [x for f in formats for x in ("--format", f)]
        cmd += ["--exclude", "*.mlp.gate.weight"]
        log("rollpatch analyze: " + " ".join(cmd[3:]))
        print("\n$ rollpatch " + " ".join(cmd[3:]), flush=True)
        return subprocess.run(cmd, check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
