"""Codec benchmark: rollpatch (native and numpy reference) against XOR+zstd baselines.

Run: ``python bench/codec.py`` (defaults below), or e.g.
``python bench/codec.py --sizes 20M --lrs 1e-6,1e-5 --formats bf16 --threads 1 --json out.json``.

**Data.** Consecutive FP32 master versions from :mod:`rollpatch.sim` (AdamW on synthetic
gradients, Adam state pre-warmed to step 1000; see that module for every modelling choice),
served through :func:`rollpatch.formats.cast_view` as BF16, FP8 E4M3 128×128 block and NVFP4
(``scales="bf16"``; embeddings, lm_head and norms stay BF16, as engines serve them). Each
(size, lr) starts a fresh simulator (seed 0) and measures ``steps`` consecutive transitions
for every format; one table row per (size, lr, format, threads) aggregates them.

**What is compared** (the same transition, the same process, the same thread count T):

- *rollpatch native*: ``encode_views(a, b)`` — the fused one-pass native encoder; it holds
  the base view's digests from the previous step, as a publisher does, and derives the new
  view's rp.sum128 from them plus the change of the words it found changed (it compared
  every word). Decode+apply: ``apply_encoded(view, blob)`` — each chunk decoded and written
  in place in one pass that also re-hashes (rp.sum128) every word of a touched tensor as it
  reads it, checked against its target digest, and the root; "rp inc": O(change) updates.
- *rollpatch numpy*: the executable reference (``rollpatch.native.core`` off): ``diff`` +
  ``encode`` and ``decode`` + ``apply`` in numpy; same bytes (checked). Timed at sizes below
  ``--numpy-max`` only (it is the slow reference; "-" above).
- *XOR+zstd-1* (the Stitch encoder's method, modal-projects/miles ``disk_delta.py``): per
  tensor, numpy XOR of old and new words, zstd level 1, xxh3-128 of the new tensor; receive:
  decompress, XOR into the base in place, check the xxh3-128.
- *XOR+zstd-3*: the same at zstd level 3 (what slime/rollpatch's dense fallback use).
- *memcpy*: copying the view into preallocated buffers with T threads (the yardstick).
- *the i.i.d. bound*: ``n·H(k/n) + k·H(d)`` bits (see rollpatch.analysis.bounds).

**MoE** (``--moe 32:4``: experts per MoE layer, top-k): every group simulates a Qwen3-MoE
layout instead (:mod:`rollpatch.sim.moe`: routed experts with skewed routing, a router per
layer), and quantised formats keep the routers (``*.mlp.gate.weight``) in BF16, as MoE
checkpoints quantised for vLLM do; rows are labelled ``SIZE-moeE/K``. Without ``--moe``
nothing changes. bench/moe.py breaks the MoE numbers down (experts vs dense, per expert).

T threads: baselines run tensors on a pool of T; rollpatch runs with ``ROLLPATCH_THREADS=T``
(tensors and chunks of large tensors on T threads). Times are wall clock, best of
``--repeats`` rounds (default 5) where a view is under 1 GB, of ``--big-repeats`` (default 1)
above. A round times every method once (rollpatch's encode, decode+apply and rp inc, XOR+zstd-1
and -3 both ways, memcpy), in an order rotated each round, so a slow spell of a shared machine
falls on the methods alike rather than on one method's repeats run back to back. Every
decode+apply of every method is checked bit-exact against the target view, and every encode
against the first one's bytes; any mismatch aborts the run.

**Memory.** ``enc mem`` is the peak RSS growth during a native encode made after the row's
timed encodes (what a publisher pays per version; VmHWM reset before it, no earlier patch
alive, the C heap trimmed first so that memory an earlier call freed is not reused unseen)
over the two views already resident, in units of the patch size (target ≤ 2). ``1st enc`` is
the same for the row's first encode, before the timed ones: it adds what the process sets up
for the row once — the header's zstd context grown when the row's header is the largest the
process has compressed (kept for the process afterwards), the C heap's first use of T threads.
What a process sets up once and keeps (the header's zstd context, the thread pool) is also
measured by a first encode of a small view before any row and printed in the footer. The
payloads are coded into one native buffer in the container's order, which is copied out after
the header while its pages are given back (``native.core.join_release``), so the payloads and
the patch are not both held whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from _codec_report import Row, render
from _codec_transition import first_encode_rss, transition
from _util import log, machine, parse_size, peak_rss

from rollpatch import native
from rollpatch.errors import RollpatchError
from rollpatch.formats import QuantPolicy, cast_view
from rollpatch.sim import AdamSim, MoEConfig, SimConfig, llama_dims, moe_dims

DEFAULT_FORMATS = "bf16,fp8-e4m3-block128,nvfp4"


def run_group(
    size: str,
    n_params: int,
    lr: float,
    formats: Sequence[str],
    steps: int,
    repeats: int,
    threads: Sequence[int],
    numpy_ref: bool,
    moe: MoEConfig | None = None,
    big_repeats: int = 1,
) -> tuple[list[Row], dict[str, Any]]:
    """Fresh simulator at (size, lr); ``steps`` transitions for every format."""

    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=n_params, lr=lr, seed=0, moe=moe))
    policy = QuantPolicy(exclude=("*.mlp.gate.weight",)) if moe else None
    info: dict[str, Any] = {
        "size": size,
        "lr": lr,
        "n_params": sim.n_params,
        "dims": asdict(sim.dims),
        "init_s": time.perf_counter() - t0,
        "step_s": [],
        "cast_s": {},
    }
    log(f"{size} lr={lr:g}: simulator {sim.n_params:,} params in {info['init_s']:.1f}s")
    rows = {f: {t: Row(size, sim.n_params, lr, f, t) for t in threads} for f in formats}
    base = {}
    for f in formats:
        t0 = time.perf_counter()
        base[f] = cast_view(sim.masters(), f, scales="bf16", policy=policy)
        info["cast_s"][f] = time.perf_counter() - t0
    for s in range(steps):
        t0 = time.perf_counter()
        sim.step()
        info["step_s"].append(time.perf_counter() - t0)
        log(f"{size} lr={lr:g}: step {s + 1} in {info['step_s'][-1]:.1f}s")
        for f in formats:
            target = cast_view(sim.masters(), f, scales="bf16", policy=policy)
            transition(base[f], target, rows[f], repeats, numpy_ref, big_repeats)
            base[f] = target
            r = rows[f][threads[0]]
            log(
                f"  {f}: {100 * r.changed / r.elements:.3f}% changed, patch "
                f"{100 * r.patch_bytes / r.view_bytes:.3f}% of the view"
            )
    peak = peak_rss()
    out = [r for f in formats for r in rows[f].values()]
    for r in out:
        r.peak_rss = peak
    del sim, base
    return out, info


# -- report -----------------------------------------------------------------------------------


def _steps_for(text: str | None, sizes: Sequence[str]) -> list[int]:
    """``--steps`` per size; without it, 2 transitions below 1B parameters and 1 from 1B on
    (the old default "2,1" was refused for any --sizes but two)."""
    n_sizes = len(sizes)
    if text is None:
        return [2 if parse_size(s) < 10**9 else 1 for s in sizes]
    steps = [int(s) for s in text.split(",")]
    if len(steps) == 1:
        steps *= n_sizes
    if len(steps) != n_sizes or any(s < 1 for s in steps):
        raise SystemExit("--steps: one positive int, or one per size")
    return steps


def _moe_arg(text: str | None) -> MoEConfig | None:
    if text is None:
        return None
    try:
        e, k = (int(x) for x in text.split(":"))
        return MoEConfig(experts=e, top_k=k)
    except ValueError as err:
        raise SystemExit(f"--moe: E:K, e.g. 32:4 ({err})") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100M,1B", help="parameter counts, e.g. 20M,100M,1B")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="AdamW learning rates")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="served formats")
    ap.add_argument(
        "--steps",
        default=None,
        help="transitions per (size, lr): one int, or one per size (default: 2 below 1B, 1 above)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timing rounds for views < 1 GB")
    ap.add_argument(
        "--big-repeats", type=int, default=1, help="timing repeats for views of 1 GB and more"
    )
    ap.add_argument("--threads", default="1,2", help="thread counts to measure")
    ap.add_argument("--numpy-max", default="200M", help="time the numpy reference up to this size")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--moe", default=None, metavar="E:K", help="simulate an MoE: E experts, top-K")
    args = ap.parse_args(argv)
    moe = _moe_arg(args.moe)

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    lrs = [float(x) for x in args.lrs.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    steps = _steps_for(args.steps, sizes)
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    rows: list[Row] = []
    sims: list[dict[str, Any]] = []
    threads = [int(t) for t in args.threads.split(",")]
    if native.core is None:
        raise SystemExit("the native core is not built: pip install -e .")
    for size in sizes:  # a size the simulator cannot lay out: refused before anything runs
        try:
            cfg = SimConfig(n_params=parse_size(size), lr=lrs[0], seed=0, moe=moe)
            moe_dims(cfg.n_params, cfg.vocab, moe) if moe else llama_dims(cfg.n_params, cfg.vocab)
        except (ValueError, RollpatchError) as e:
            ap.error(f"--sizes {size}: {e} (the smallest the simulator lays out is about 10M)")
    mach["first_encode_rss"] = first_encode_rss(threads)
    for size, n_steps in zip(sizes, steps):
        for lr in lrs:
            n = parse_size(size)
            got, info = run_group(
                f"{size}-moe{moe.experts}/{moe.top_k}" if moe else size,
                n,
                lr,
                formats,
                n_steps,
                args.repeats,
                threads,
                n <= parse_size(args.numpy_max),
                moe,
                max(1, args.big_repeats),
            )
            rows += got
            sims.append(info)
            log(
                "rows so far:\n" + render(rows, mach, time.perf_counter() - t_start, (load0, load0))
            )
            if args.json:  # written after every group: a long run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(
                        {
                            "args": vars(args),
                            "machine": mach,
                            "partial": True,
                            "rows": [asdict(r) for r in rows],
                        },
                        f,
                        indent=1,
                    )
    wall = time.perf_counter() - t_start
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(render(rows, mach, wall, (load0, load1)))
    if args.json:
        out = {
            "args": vars(args),
            "machine": mach,
            "wall_s": wall,
            "loadavg_end": load1,
            "simulators": sims,
            "rows": [asdict(r) for r in rows],
            "process_peak_rss": peak_rss(),
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
